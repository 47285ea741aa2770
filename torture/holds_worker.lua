-- The child process of torture/holds.lua (holds, issue 44):
--
--   holds_worker.lua work <uri> <db> <seed>
--       until killed: holds (ids h<seed>-<k>, from the hot account H two
--       times in three, expiring in 1, 2, 3 or 600 s), captures of all
--       or part, voids (of its own recent holds, or one time in two of
--       another worker's), transfers between H and the others (min = 0),
--       and a recovery pass now and then, which expires holds.  One line
--       per answer, flushed at once (a kill loses nothing printed):
--         hold <id> ok | hold <id> err <code>
--         capture <id> <amount|all> ok <captured>
--         capture <id> <amount|all> err <code> <status> <captured>
--         void <id> ok <status> | void <id> err <code> <status>
--         transfer <id> done | transfer <id> failed <code>
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"

local mode, uri, dbname, seed = arg[1], arg[2], arg[3], tonumber(arg[4])
assert(mode == "work", "unknown mode " .. tostring(mode))
math.randomseed(seed * 7919 + os.time())
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = "holds-" .. seed, lease = 1, stale_after = 1 })

local OTHERS = { "X1", "X2", "X3" }
local EXPIRES = { 1, 2, 3, 600 }

local function say(...)
  local parts = { ... }
  for i, v in ipairs(parts) do parts[i] = tostring(v) end
  io.stdout:write(table.concat(parts, " "), "\n")
  io.stdout:flush()
end

local k = 0
-- A hold to decide: one of its last few, or one time in two another
-- worker's (seeds are given in order: the last few are alive or were),
-- so that decisions of several processes meet on one hold
local function pick()
  local s = seed
  if math.random(2) == 1 then s = math.random(math.max(1, seed - 3), seed) end
  return ("h%d-%d"):format(s, math.random(math.max(1, k - 6), math.max(1, k)))
end

while true do
  local r = math.random(20)
  if r <= 6 then
    k = k + 1
    local id = ("h%d-%d"):format(seed, k)
    local from, to = "H", OTHERS[math.random(3)]
    if math.random(3) == 1 then from, to = to, "H" end
    local H, err = tm:hold("accounts", from, to, math.random(1, 20),
      { min = 0, id = id, expires = EXPIRES[math.random(#EXPIRES)] })
    if H then say("hold", id, "ok") else say("hold", id, "err", err.code) end
  elseif r <= 10 then
    local id, amount = pick(), math.random(2) == 1 and math.random(1, 40) or nil
    local T, err = tm:capture(id, amount)
    if T then say("capture", id, amount or "all", "ok", T.hold.captured)
    else say("capture", id, amount or "all", "err", err.code, err.status, err.captured) end
  elseif r <= 13 then
    local id = pick()
    local T, err = tm:void(id)
    if T then say("void", id, "ok", T.hold.status) else say("void", id, "err", err.code, err.status) end
  elseif r <= 19 then
    local x = OTHERS[math.random(3)]
    local from, to = "H", x
    if math.random(2) == 1 then from, to = x, "H" end
    k = k + 1
    local id = ("t%d-%d"):format(seed, k)
    local T, err = tm:transfer("accounts", from, to, math.random(1, 40), { min = 0, id = id })
    if T then say("transfer", id, "done") else say("transfer", id, "failed", err.code) end
  else
    tm:recover()
  end
end

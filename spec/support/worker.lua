-- A separate process for the multi-process specs:
--
--   worker.lua stall <uri> <db> <ready-file> <seconds> <from> <to> <amount>
--     one transfer (begin + commit) that pauses <seconds> right after its first apply,
--     having written <ready-file>, so the spec can SIGSTOP it there
--   worker.lua transfers <uri> <db> <n> <accounts> <seed> [<collection> <marker>]
--     n random transfers among the accounts (comma separated), with the
--     manager's transactions collection and marker when given
--   worker.lua recoverer <uri> <db> <seconds>
--     recover() over and over for <seconds>, taking over everything at once
--
-- Prints one line per outcome ("done", "cancelled <code>", "error <msg>")
-- and a final "exit" line.

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local mongotx = require "mongotx"
local core = mongotx.core

local mode, uri, dbname = arg[1], arg[2], arg[3]
local db = assert(mongotx.connect(uri, { database = dbname }))

local function report(t, err)
  if t then print("done") else print("cancelled " .. tostring(err and err.code)) end
  io.stdout:flush()
end

if mode == "stall" then
  local ready, seconds = arg[4], tonumber(arg[5])
  local paused = false
  local tm = assert(db:manager {
    application = "stalling", lease = 1, stale_after = 1,
    on_event = function(name)
      if name == "apply" and not paused then
        paused = true
        local f = assert(io.open(ready, "w")); f:write("ready\n"); f:close()
        core.sleep(seconds)
      end
    end,
  })
  -- begin + commit, not transfer: the one-at-a-time steps apply op by op,
  -- so the pause falls between two applies (spec/20-fencing_spec.lua)
  local amount = tonumber(arg[8])
  local t = assert(tm:begin {
    { collection = "accounts", id = arg[6], update = { ["$inc"] = { balance = -amount } } },
    { collection = "accounts", id = arg[7], update = { ["$inc"] = { balance = amount } } },
  })
  report(tm:commit(t))
elseif mode == "transfers" then
  local n, seed = tonumber(arg[4]), tonumber(arg[6])
  local accounts = {}
  for a in arg[5]:gmatch("[^,]+") do accounts[#accounts + 1] = a end
  math.randomseed(seed)
  local tm = assert(db:manager { application = "worker-" .. seed, collection = arg[7],
                                 marker = arg[8] })
  for _ = 1, n do
    local from = accounts[math.random(#accounts)]
    local to
    repeat to = accounts[math.random(#accounts)] until to ~= from
    report(tm:transfer("accounts", from, to, math.random(1, 50), { min = 0 }))
  end
elseif mode == "recoverer" then
  local tm = assert(db:manager { application = "recoverer", stale_after = 0, lease = 0 })
  local stop = core.monotonic_ms() + tonumber(arg[4]) * 1000
  local taken = 0
  while core.monotonic_ms() < stop do
    local r = tm:recover()
    if r then taken = taken + r.done + r.cancelled end
    core.sleep(0.01)
  end
  print("recovered " .. taken)
end
print("exit")

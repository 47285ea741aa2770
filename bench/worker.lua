-- bench/worker.lua: one process of the concurrent mode (started by
-- bench/concurrent.lua, not by hand).
--
--   lua bench/worker.lua <uri> <db> <accounts> <n> <seed> <go-file> <fencing> [<min>|- [<seconds>]]
--
-- Connects, prints "ready", waits for <go-file> so that every process
-- starts at once, makes n tm:transfer calls between random accounts (with
-- the floor guard `min` when given; the manager's fencing as given), or
-- with <seconds> tm:run calls that
-- `$set` a field of two random accounts for that long (exclusive ops:
-- docs/guards.md, "Isolation"), and prints its measurements, one
-- "key value..." line each:
--   span <start ms> <end ms>        (CLOCK_MONOTONIC, shared by processes)
--   counts <ok> <failed> <cpu s> <commands> <writes> <busy or contention>
--   lat <ms> <ms> ...               per transfer
--   moved <account> <delta> ...     balance changes of completed transfers

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local mongotx = require "mongotx"
local helpers = require "spec.helpers"
local bank = require "bench.bank"

local uri, dbname, accounts, n, seed, go, fencing, min, seconds =
  arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5]), arg[6], arg[7],
  tonumber(arg[8]), tonumber(arg[9])
local now = mongotx.core.monotonic_ms

math.randomseed(seed)
local db = assert(mongotx.connect(uri, { database = dbname, write_concern = bank.WRITE_CONCERN }))
local tm = assert(db:manager { application = "worker-" .. seed, fencing = fencing })
local from, to = bank.plan(accounts, n, 1)
print("ready")
io.stdout:flush()
assert(helpers.wait_file(go, 60), "no go file")

local lat, moved, ok, busy = {}, {}, 0, 0
local guard = min and { min = min }
db.client:reset_counters()
local cpu0, t0 = os.clock(), now()
local stop = seconds and t0 + seconds * 1000

-- A $set of field v on two random accounts (undone by a $set back to 0).
local function set_pair(i)
  local a = math.random(accounts)
  local b
  repeat b = math.random(accounts) until b ~= a
  local function set(id)
    return { collection = bank.COLLECTION, id = id, update = { ["$set"] = { v = seed * 1e6 + i } },
             undo = { ["$set"] = { v = 0 } } }
  end
  return tm:run({ set(a), set(b) })
end

local i = 0
while (stop and now() < stop) or (not stop and i < n) do
  i = i + 1
  local t = now()
  local res, err
  if stop then
    res, err = set_pair(i)
  else
    res, err = tm:transfer(bank.COLLECTION, from[i], to[i], 1, guard)
  end
  lat[i] = string.format("%.3f", now() - t)
  if res then
    ok = ok + 1
    if not stop then
      moved[from[i]] = (moved[from[i]] or 0) - 1
      moved[to[i]] = (moved[to[i]] or 0) + 1
    end
  elseif err.code == "busy" or err.code == "contention" then
    busy = busy + 1
  end
end
local t1, cpu = now(), os.clock() - cpu0
local c = db.client:counters()

print(string.format("span %.3f %.3f", t0, t1))
print(string.format("counts %d %d %.6f %d %d %d", ok, i - ok, cpu, c.commands, c.writes, busy))
print("lat " .. table.concat(lat, " "))
local m = {}
for account, delta in pairs(moved) do m[#m + 1] = account .. " " .. delta end
print("moved " .. table.concat(m, " "))
db:close()

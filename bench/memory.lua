-- bench/memory.lua: does the client's memory stay flat over many
-- transfers?  `make bench-memory` runs 1 000 000 and checks the resident
-- set size; `make bench-valgrind` runs 10 000 under valgrind, which finds
-- the leaks RSS cannot show.
--
--   lua5.4 bench/memory.lua <transfers> [--check-rss]
--
-- Transfers go in batches of 100 through tm:commit_many when the engine
-- has it, else one at a time through tm:transfer, among 200 accounts (a
-- batch never touches an account twice).  Finished transactions are
-- pruned every 10 000 transfers, as a long-running service would, so the
-- server's memory stays bounded too.  Prints the RSS (VmRSS) and Lua heap
-- after the first 10 000 transfers ("start", once every code path and
-- buffer has been used) and every tenth of the way; with --check-rss,
-- exits 1 when the end is more than max(8 MiB, 10%) above the start.
-- Checks the accounts at the end like every mode of bench/run.lua.

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local bank = require "bench.bank"

local total = assert(tonumber(arg[1]), "usage: bench/memory.lua <transfers> [--check-rss]")
local check_rss = arg[2] == "--check-rss"
local ACCOUNTS, BATCH, WARM, PRUNE = 200, 100, 10000, 10000

local function rss_kib()
  local f = assert(io.open("/proc/self/status"))
  local s = f:read("*a")
  f:close()
  return tonumber(s:match("VmRSS:%s*(%d+)"))
end

local db = bank.open(assert(os.getenv("MONGOTX_TEST_URI"), "MONGOTX_TEST_URI is not set"),
  "memory", ACCOUNTS)
local tm = assert(db:manager { application = "bench-memory" })
local batched = type(tm.commit_many) == "function"
print(("memory: %d transfers via %s among %d accounts"):format(total,
  batched and "tm:commit_many (batch " .. BATCH .. ")" or "tm:transfer (no tm:commit_many yet)",
  ACCOUNTS))

local moved, done = {}, 0
local function move(from, to)
  moved[from] = (moved[from] or 0) - 1
  moved[to] = (moved[to] or 0) + 1
  done = done + 1
end

local function report(tag)
  collectgarbage()
  local rss = rss_kib()
  print(("memory: %-6s after %8d transfers: RSS %7d KiB, Lua heap %6d KiB"):format(tag, done, rss,
    math.floor(collectgarbage("count"))))
  io.stdout:flush()
  return rss
end

local start_rss
local step = math.max(BATCH, math.floor(total / 10))
local count = 0
while count < total do
  local n = math.min(BATCH, total - count)
  local from, to = bank.plan(ACCOUNTS, n, n)
  if batched then
    local list = {}
    for i = 1, n do list[i] = bank.ops(from[i], to[i], 1) end
    local results = assert(tm:commit_many(list))
    for i = 1, n do if results[i] then move(from[i], to[i]) end end
  else
    for i = 1, n do
      if tm:transfer(bank.COLLECTION, from[i], to[i], 1) then move(from[i], to[i]) end
    end
  end
  local before = count
  count = count + n
  local floor = math.floor
  if floor(count / PRUNE) > floor(before / PRUNE) then assert(tm:prune { older_than = 0 }) end
  if not start_rss and count >= math.min(WARM, total) then start_rss = report("start") end
  if floor(count / step) > floor(before / step) and count < total then report("at") end
end
local end_rss = report("end")
assert(done == total, ("%d of %d transfers completed"):format(done, total))
bank.check_accounts(db, ACCOUNTS, moved)
bank.drop(db)

local growth = end_rss - start_rss
print(("memory: RSS start %d KiB, end %d KiB, growth %+d KiB (%+.1f%%)"):format(start_rss, end_rss,
  growth, 100 * growth / start_rss))
if check_rss and growth > math.max(8192, start_rss / 10) then
  io.stderr:write("memory: RSS grew more than max(8 MiB, 10%): a leak?\n")
  os.exit(1)
end

-- bench/profile.lua: a small run of one mode for a profiler (callgrind,
-- bench/README.md "Client CPU"): `n` transfers of tm:transfer (batch 1)
-- or tm:commit_many at `batch`, after a warm-up, on the server in
-- MONGOTX_TEST_URI.  Prints the client CPU per transfer of the timed part.
--
--   lua5.4 bench/profile.lua <batch> <n>

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local bank = require "bench.bank"

local batch, n = tonumber(arg[1] or 100), tonumber(arg[2] or 2000)
local uri = assert(os.getenv("MONGOTX_TEST_URI"), "MONGOTX_TEST_URI")
local accounts = math.max(2 * batch, 1000)
local db = bank.open(uri, "profile", accounts)
local tm = assert(db:manager { application = "profile" })
local from, to = bank.plan(accounts, n + batch, batch)

local function run(first, last) bank.drive(tm, from, to, first, last, batch) end

run(1, batch) -- warm-up: the server's clock, the collections' handles
local cpu = os.clock()
run(batch + 1, batch + n)
print(string.format("batch %d: %.1f us client CPU per transfer", batch,
  (os.clock() - cpu) * 1e6 / n))
bank.drop(db)

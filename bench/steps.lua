-- bench/steps.lua: where a batched transfer's time goes, step by step:
-- wall time, client CPU and the server's CPU (bench/servercpu.lua) of each
-- of the batch's steps (create, apply, commit, finish, done), per
-- transfer, for tm:commit_many at `batch` (tm:transfer at batch 1) on the
-- server spec/support/with-server started.  `rounds` rounds of `n`
-- transfers each, the first ones warming the server's JIT up; every
-- round is printed, so the warm-up shows.
--
--   spec/support/with-server memory -- env MONGOTX_CPATH="$PWD/build/lua54/?.so" \
--     lua5.4 bench/steps.lua <batch> <n> <rounds>

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local bank = require "bench.bank"
local servercpu = require "bench.servercpu"
local now = require("mongotx").core.monotonic_ms
local clock = os.clock

local batch, n, rounds = tonumber(arg[1] or 100), tonumber(arg[2] or 5000), tonumber(arg[3] or 4)
local uri = assert(os.getenv("MONGOTX_TEST_URI"), "MONGOTX_TEST_URI")
assert(servercpu.read(), "the server's pid is unknown: run through spec/support/with-server")
local STEPS = { "create", "apply", "commit", "finish", "done" }

local accounts = math.max(2 * batch, 10000)
local db = bank.open(uri, "steps", accounts)
local tm = assert(db:manager { application = "steps" })
local from, to = bank.plan(accounts, n * rounds, batch)

-- Every batched step goes through the engine's `many`: time each call.
local spent
do
  local Engine = getmetatable(tm.engine).__index
  local many = Engine.many
  function Engine.many(self, name, ...)
    local t0, c0, s0 = now(), clock(), servercpu.read()
    local a, b = many(self, name, ...)
    local s = spent[name] or { 0, 0, 0 }
    s[1], s[2], s[3] = s[1] + now() - t0, s[2] + (clock() - c0) * 1e3, s[3] + servercpu.since(s0) * 1e3
    spent[name] = s
    return a, b
  end
end

local function run(first, last) bank.drive(tm, from, to, first, last, batch) end

local function us(ms) return ("%7.1f"):format(ms * 1e3 / n) end
print(("batch %d, %d transfers a round; µs per transfer: wall / client CPU / server CPU"):format(batch, n))
for r = 1, rounds do
  spent = {}
  local t0, c0, s0 = now(), clock(), servercpu.read()
  run((r - 1) * n + 1, r * n)
  local line = { ("round %d: all %s %s %s"):format(r, us(now() - t0), us((clock() - c0) * 1e3),
    us(servercpu.since(s0) * 1e3)) }
  for _, step in ipairs(STEPS) do
    local s = spent[step]
    if s then line[#line + 1] = ("%s %s %s %s"):format(step, us(s[1]), us(s[2]), us(s[3])) end
  end
  print(table.concat(line, " |"))
end
bank.drop(db)

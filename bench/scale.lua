-- bench/scale.lua: recovery at scale (bench/README.md, "Recovery at
-- scale").  For each backlog size, a database left as a crashed process
-- leaves it: N stale transactions (half `initial`, the rest `applied`
-- but every twentieth `pending` with its debit applied), written in bulk
-- as the exact documents the engine writes (templates made by the engine
-- itself, cloned with new ids, accounts and times), and the accounts
-- with the balances, markers, holders and versions those transactions
-- left.  Then a child process recovers it by one of the modes:
--
--   default   tm:recover() until a pass finds nothing (passes of 1 000,
--             batches of 100: the defaults)
--   command   bin/mongotx recover (its sweep: passes of 200)
--   pass200   tm:recover{ limit = 200 } until a pass finds nothing
--   stream    one tm:recover{ limit = N }: the pass streams
--   once      one tm:recover(): what one default pass costs at this
--             backlog (the rest is left as it was, and checked so)
--
-- and reports its time, round trips, documents read, and its peak RSS
-- (VmHWM); the server's CPU seconds come from bench/servercpu.lua.
-- After each run the database is checked: every transaction done, no
-- account keeps a marker or a holder, every balance exact.  Figures, not
-- a test: a wrong database fails the run.
--
--   lua bench/scale.lua [--sizes 1000,10000] [--modes default,command,pass200,stream]
--                       [--big 100000] [--big-modes stream] [--write]
--
-- --big: above this size only the --big-modes run (every pass of the
-- others sorts the whole backlog on a server without secondary indexes;
-- see the README).  Before anything is timed, a backlog of 2 000 is
-- recovered untimed, so that the server's JIT has compiled its paths.  --write puts the table into
-- bench/README.md and plots bench/scale.png.  BENCH_SCALE_SIZES and
-- BENCH_SCALE_MODES set the defaults of --sizes and --modes.

package.path = "./lua/?.lua;./lua/?/init.lua;./bench/?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local mongotx = require "mongotx"
local core = require "mongotx.core"
local servercpu = require "servercpu"

local format = string.format
local START = 1000000000
local ACCOUNTS = "accounts"

-- The peak RSS of this process, in KiB.
local function peak_kb()
  local f = assert(io.open("/proc/self/status"))
  local s = f:read("a")
  f:close()
  return tonumber(s:match("VmHWM:%s*(%d+)"))
end

-- Child: recover database `name` by `mode`; prints one line of figures.
local function recover(mode, uri, name, n)
  local db, counted
  local start_kb = peak_kb()
  local t0 = core.monotonic_ms()
  if mode == "command" then
    -- the command's own connection: its counters are read before it closes
    local connect = mongotx.connect
    mongotx.connect = function(...)
      local d, err = connect(...)
      if d then
        local close = d.close
        d.close = function(self)
          counted = { self.client:counters().commands, self.client:returned() }
          return close(self)
        end
      end
      return d, err
    end
    local cli = require "mongotx.cli"
    local devnull = assert(io.open("/dev/null", "w"))
    io.output(devnull)
    local code = cli.main { "--uri", uri, "--database", name, "--json", "recover" }
    assert(code == 0, "mongotx recover exited with " .. tostring(code))
  else
    db = assert(mongotx.connect(uri, { database = name }))
    local tm = assert(db:manager { application = "recoverer" })
    db.client:reset_counters()
    local opts = ({ default = {}, once = {}, pass200 = { limit = 200 }, stream = { limit = n } })[mode]
    assert(opts, "unknown mode " .. mode)
    repeat
      local r = assert(tm:recover(opts))
      assert(r.failed == 0 and r.parked == 0 and r.malformed == 0, "a pass failed or parked")
    until r.examined == 0 or mode == "stream" or mode == "once"
    counted = { db.client:counters().commands, db.client:returned() }
    db:close()
  end
  io.stdout:write(format("RESULT ms=%.1f commands=%d returned=%d peak_kb=%d start_kb=%d\n",
    core.monotonic_ms() - t0, counted[1], counted[2], peak_kb(), start_kb))
end

if arg[1] == "--recover" then
  recover(arg[2], arg[3], arg[4], tonumber(arg[5]))
  os.exit(0)
end

-- Parent ---------------------------------------------------------------------

local function option(name, default)
  for i = 1, #arg do
    if arg[i] == name then return arg[i + 1] end
  end
  return default
end

local function list(s, convert)
  local out = {}
  for w in s:gmatch("[^,]+") do out[#out + 1] = convert and assert(convert(w), w) or w end
  return out
end

local URI = assert(os.getenv("MONGOTX_TEST_URI"), "run under spec/support/with-server")
local SIZES = list(option("--sizes", os.getenv("BENCH_SCALE_SIZES") or "1000,10000"), tonumber)
local MODES = list(option("--modes", os.getenv("BENCH_SCALE_MODES") or "default,command,pass200,stream"))
local BIG = tonumber(option("--big", "100000"))
local BIG_MODES = {}
for _, m in ipairs(list(option("--big-modes", "stream"))) do BIG_MODES[m] = true end
local WRITE = false
for _, a in ipairs(arg) do WRITE = WRITE or a == "--write" end

-- The documents the engine writes for one transaction of each kind, made
-- by the engine in a scratch database: { initial, applied, pending }.
local function templates()
  local db = assert(mongotx.connect(URI, { database = "scale_templates" }))
  assert(db:collection(ACCOUNTS):insert_many({ { _id = 1, balance = START }, { _id = 2, balance = START } }, {}))
  local gone = assert(db:manager { application = "gone", lease = 0, finish = "deferred",
                                   finish_batch = 100000 })
  local function ops()
    return { { collection = ACCOUNTS, id = 1, update = { ["$inc"] = { balance = -1 } } },
             { collection = ACCOUNTS, id = 2, update = { ["$inc"] = { balance = 1 } } } }
  end
  local out = {}
  assert(gone:begin(ops()))
  local res, errs = gone:commit_many({ ops() })
  assert(res and res[1], tostring(errs and errs[1]))
  local t = assert(gone:begin(ops()))
  assert(gone:step("claim", t))
  assert(gone:step("apply", t, 1))
  local txs = db:collection("transactions")
  for _, T in ipairs(assert(txs:find_all({}, { sort = { _id = 1 } }))) do
    if T.state == "applied" then out.applied = T
    elseif T.state == "pending" then out.pending = T
    else out.initial = T end
  end
  assert(db.client:command(db.name, { dropDatabase = 1 }))
  db:close()
  return out
end

local TEMPLATES

-- The effect the engine recorded for op k of the applied template
-- ("lowers", "escrow" or nil: docs/guards.md, "Guards").
local function effect_of(k)
  return TEMPLATES.applied.ops[k].effect
end

-- Transaction i: its kind, its debited and its credited account.
local function plan(i, accounts)
  local kind = i % 20 == 0 and "pending" or i % 2 == 1 and "initial" or "applied"
  return kind, (2 * i - 2) % accounts + 1, (2 * i - 1) % accounts + 1
end

local function clone(T, i, from, to, base)
  local c = {}
  for k, v in pairs(T) do c[k] = v end
  c._id = mongotx.ObjectId()
  c.lastModified = mongotx.Date(base + i)
  local ops = {}
  for k, op in ipairs(T.ops) do
    local o = {}
    for f, v in pairs(op) do o[f] = v end
    o.id = k == 1 and from or to
    ops[k] = o
  end
  c.ops = ops
  return c
end

-- A fresh database holding the backlog of n transactions; returns it and
-- the number of accounts.
local function build(n)
  local name = format("scale_%d_%d", n, os.time() % 100000)
  local db = assert(mongotx.connect(URI, { database = name }))
  local accounts = math.max(1000, math.floor(n / 2))
  local base = math.floor(assert(db:manager {}):server_now()) - 86400000 -- a day ago
  local acc = {}
  for a = 1, accounts do acc[a] = { _id = a, balance = START } end
  local txs, chunk = db:collection("transactions"), {}
  -- op k of T applied to account a, as the engine applies it (the op's
  -- effect, docs/guards.md): a debit in place, an escrowed credit under
  -- txPending, any other effect in place and held
  local function mark(a, T, k, delta)
    local d, effect = acc[a], effect_of(k)
    if effect == "escrow" then
      d.txPending = d.txPending or { balance = 0 }
      d.txPending.balance = d.txPending.balance + delta
    else
      d.balance = d.balance + delta
    end
    d.txVersion = (d.txVersion or 0) + 1
    d.pendingTransactions = d.pendingTransactions or {}
    d.pendingTransactions[#d.pendingTransactions + 1] = T._id
    if effect ~= "escrow" and effect ~= "lowers" then
      d.txHeld = d.txHeld or {}
      d.txHeld[#d.txHeld + 1] = T._id
    end
  end
  for i = 1, n do
    local kind, from, to = plan(i, accounts)
    local T = clone(TEMPLATES[kind], i, from, to, base)
    if kind ~= "initial" then mark(from, T, 1, -1) end
    if kind == "applied" then mark(to, T, 2, 1) end
    chunk[#chunk + 1] = T
    if #chunk == 5000 or i == n then
      assert(txs:insert_many(chunk, { ordered = false }))
      chunk = {}
    end
  end
  local coll = db:collection(ACCOUNTS)
  for first = 1, accounts, 5000 do
    assert(coll:insert_many(table.move(acc, first, math.min(first + 4999, accounts), 1, {}), {}))
  end
  return db, accounts
end

-- The database after recovery drove the `done` oldest transactions: those
-- done, the others as they were left; no account keeps a marker or a
-- holder of a done one, each account's balance START - the debits + the
-- credits applied (all of a done transaction, what an open one applied:
-- its escrowed credit still in txPending).
local function check(db, n, accounts, done)
  local tm = assert(db:manager {})
  local stats = assert(tm:stats())
  local left = { initial = 0, applied = 0, pending = 0 }
  local want = {}
  -- op k of transaction i (delta), finished or still marked
  local function add(a, k, delta, marked)
    local w = want[a] or { delta = 0, pending = 0, marked = 0, held = 0 }
    want[a] = w
    local effect = effect_of(k)
    if marked and effect == "escrow" then
      w.pending = w.pending + delta
    else
      w.delta = w.delta + delta
    end
    if marked then
      w.marked = w.marked + 1
      if effect ~= "escrow" and effect ~= "lowers" then w.held = w.held + 1 end
    end
  end
  for i = 1, n do
    local kind, from, to = plan(i, accounts)
    if i <= done then
      add(from, 1, -1); add(to, 2, 1)
    else
      left[kind] = left[kind] + 1
      if kind ~= "initial" then add(from, 1, -1, true) end
      if kind == "applied" then add(to, 2, 1, true) end
    end
  end
  assert(stats.done == done and stats.initial == left.initial and stats.applied == left.applied
    and stats.pending == left.pending and stats.canceling + stats.cancelled + stats.parked == 0,
    format("%d done of %d, %d initial, %d applied, %d pending left", stats.done, done,
      stats.initial, stats.applied, stats.pending))
  local seen, cursor = 0, db:collection(ACCOUNTS):find({}, { sort = { _id = 1 }, batch_size = 5000 })
  while true do
    local d = cursor:next()
    if not d then break end
    seen = seen + 1
    local w = want[d._id] or { delta = 0, pending = 0, marked = 0, held = 0 }
    assert(d.balance == START + w.delta, format("account %s: %s", d._id, d.balance))
    local pending = d.txPending and d.txPending.balance or 0
    assert(pending == w.pending, format("account %s: %s in txPending", d._id, pending))
    assert(#(d.pendingTransactions or {}) == w.marked and #(d.txHeld or {}) == w.held,
      format("account %s: %d markers, %d holders", d._id, #(d.pendingTransactions or {}),
        #(d.txHeld or {})))
  end
  cursor:close()
  assert(seen == accounts, format("%d accounts of %d", seen, accounts))
end

local function run_child(mode, name, n)
  local cmd = format("%s bench/scale.lua --recover %s '%s' %s %d 2>&1",
    os.getenv("LUA") or "lua5.4", mode, URI, name, n)
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  p:close()
  local ms, commands, returned, peak = out:match(
    "RESULT ms=([%d.]+) commands=(%d+) returned=(%d+) peak_kb=(%d+)")
  assert(ms, "the recovering process failed:\n" .. out)
  return tonumber(ms), tonumber(commands), tonumber(returned), tonumber(peak)
end

TEMPLATES = templates()
do -- the warm-up
  local db, accounts = build(2000)
  run_child("stream", db.name, 2000)
  check(db, 2000, accounts, 2000)
  assert(db.client:command(db.name, { dropDatabase = 1 }))
  db:close()
end
-- The table and the plot in bench/README.md and bench/scale.png, with
-- the growth exponent of the time from the size before of each mode
-- (written after every size: a run stopped midway leaves what it had).
local function write(results)
  local rows = { "| mode | backlog | time | tx/s | exponent | round trips / 100 | read / 100 | peak RSS | server CPU |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" }
  for _, r in ipairs(results) do
    rows[#rows + 1] = format("| %s | %d | %.1f s | %.0f | %s | %.2f | %.1f | %.1f MiB | %s |",
      r.mode, r.n, r.secs, r.tps, r.exponent and format("%.2f", r.exponent) or "",
      r.rt, r.read, r.peak, r.server and format("%.1f s", r.server) or "?")
  end
  local f = assert(io.open("bench/README.md"))
  local text = f:read("a")
  f:close()
  local BEGIN, END = "<!-- scale: begin -->", "<!-- scale: end -->"
  local a = text:find(BEGIN, 1, true)
  local _, b = text:find(END, a or 1, true)
  assert(a and b, "bench/README.md has no scale markers")
  text = text:sub(1, a - 1) .. BEGIN .. "\n" .. table.concat(rows, "\n") .. "\n" .. END .. text:sub(b + 1)
  f = assert(io.open("bench/README.md", "w"))
  f:write(text)
  f:close()
  local data = os.tmpname()
  f = assert(io.open(data, "w"))
  for _, r in ipairs(results) do
    f:write(format("%s %d %.3f %.3f\n", r.mode, r.n, r.tps, r.peak))
  end
  f:close()
  local rc = os.execute(format("gnuplot -e \"data='%s'; out='bench/scale.png'; modes='%s'\" bench/scale.gp",
    data, table.concat(MODES, " ")))
  os.remove(data)
  assert(rc, "gnuplot failed")
end

local results, last = {}, {}
print(format("%-8s %9s %9s %9s %9s %9s %10s %9s %9s", "mode", "backlog", "secs", "tx/s", "exponent",
  "rt/100", "read/100", "peak MiB", "server s"))
for _, n in ipairs(SIZES) do
  for _, mode in ipairs(MODES) do
    if n <= BIG or BIG_MODES[mode] then
      local db, accounts = build(n)
      local cpu0 = servercpu.read()
      local ms, commands, returned, peak = run_child(mode, db.name, n)
      local server = servercpu.since(cpu0)
      local done = mode == "once" and math.min(n, 1000) or n
      check(db, n, accounts, done)
      assert(db.client:command(db.name, { dropDatabase = 1 }))
      db:close()
      local r = { mode = mode, n = n, secs = ms / 1000, tps = done / (ms / 1000),
                  rt = commands * 100 / done, read = returned * 100 / done, peak = peak / 1024,
                  server = server }
      local p = last[mode]
      if p then r.exponent = math.log(r.secs / p.secs) / math.log(r.n / p.n) end
      results[#results + 1], last[mode] = r, r
      print(format("%-8s %9d %9.1f %9.0f %9s %9.2f %10.1f %9.1f %9s", mode, n, r.secs, r.tps,
        r.exponent and format("%.2f", r.exponent) or "", r.rt, r.read, r.peak,
        server and format("%.1f", server) or "?"))
      io.stdout:flush()
    end
  end
  if WRITE then write(results) end
end
if WRITE then print("\nscale: wrote the table to bench/README.md and the plot to bench/scale.png") end

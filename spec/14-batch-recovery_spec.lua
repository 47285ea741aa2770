-- Batched recovery (lua/mongotx/recovery.lua): a backlog of stale
-- transactions of every kind recovered with one round trip per step for
-- the whole batch, the ones that cannot go that way falling back to one at
-- a time; several recoverers on one backlog; a recoverer stopped between
-- its claims and its writes, taken over, then woken up.
--
-- The backlog is made by hand with tm:step by "app-1" (lease 0, so others
-- may take over at once); each transaction moves `amount` between its own
-- two accounts, so the balances tell exactly what each one did.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local core = mongotx.core

-- lastModified must be strictly older than the server's clock.
local function age() core.sleep(0.01) end

local KINDS = { "initial", "pending", "applied", "canceling" }

-- A transaction of `kind` left behind by tm moving `amount` from account
-- `from` to `to` (its debit guarded by a floor of 0).
local function leave(tm, kind, from, to, amount)
  local t = assert(tm:begin({
    { collection = "accounts", id = from, update = { ["$inc"] = { balance = -amount } },
      where = { balance = { ["$gte"] = amount } } },
    { collection = "accounts", id = to, update = { ["$inc"] = { balance = amount } } },
  }))
  if kind == "initial" then return t end
  assert(tm:step("claim", t))
  assert(tm:step("apply", t, 1))
  if kind == "pending" then return t end
  if kind == "canceling" then
    assert(tm:step("cancel", t))
    return t
  end
  assert(tm:step("apply", t, 2))
  assert(tm:step("commit", t))
  return t
end

-- Accounts a<i> and b<i> (1000 each) for i = 1..n, in `accounts`.
local function open_accounts(accounts, n)
  local docs = {}
  for i = 1, n do
    docs[#docs + 1] = { _id = "a" .. i, balance = 1000, pendingTransactions = mongotx.array() }
    docs[#docs + 1] = { _id = "b" .. i, balance = 1000, pendingTransactions = mongotx.array() }
  end
  assert(accounts:insert_many(docs))
end

-- No account carries a marker or a txHeld entry.
local function assert_released(accounts)
  for _, d in ipairs(helpers.dump(accounts)) do
    assert.are.equal(0, #d.pendingTransactions, d._id .. " still marked")
    assert.is_true(d.txHeld == nil or #d.txHeld == 0, d._id .. " still held")
  end
end

-- `per` transactions of each kind on accounts a<i>/b<i>, 10 each; returns
-- them by kind and the balances recovery must leave (canceling ones end
-- cancelled, every other one done).
local function backlog(tm, per)
  local by_kind, want, i = {}, {}, 0
  for _, kind in ipairs(KINDS) do
    by_kind[kind] = {}
    for _ = 1, per do
      i = i + 1
      by_kind[kind][#by_kind[kind] + 1] = leave(tm, kind, "a" .. i, "b" .. i, 10)
      local moved = kind ~= "canceling"
      want["a" .. i], want["b" .. i] = moved and 990 or 1000, moved and 1010 or 1000
    end
  end
  age()
  return by_kind, want
end

describe("#server batched recovery", function()
  local db, tm, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager{ application = "app-1", lease = 0 })
    accounts, txs = db:collection("accounts"), db:collection("transactions")
  end)

  local function recoverer(opts)
    local o = { application = "recoverer", stale_after = 0, lease = 5 }
    for k, v in pairs(opts or {}) do o[k] = v end
    return assert(db:manager(o))
  end

  local function state(t) return assert(tm:get(t._id)).state end

  it("drives a mixed backlog of every kind to done or cancelled", function()
    open_accounts(accounts, 20)
    local by_kind, want = backlog(tm, 5)
    local r = assert(recoverer():recover())
    assert.are.same({ examined = 20, done = 15, cancelled = 5, skipped = 0, parked = 0,
                      failed = 0, malformed = 0, errors = {} }, r)
    for _, kind in ipairs(KINDS) do
      for _, t in ipairs(by_kind[kind]) do
        local T = assert(tm:get(t._id))
        assert.are.equal(kind == "canceling" and "cancelled" or "done", T.state)
        assert.are.equal("recoverer", T.application)
      end
    end
    assert.are.same(want, helpers.balances(accounts))
    assert_released(accounts)
    -- nothing is left for another pass
    assert.are.equal(0, assert(recoverer():recover()).examined)
  end)

  it("takes as many round trips for 40 transactions as for 8", function()
    -- one round trip per step for the whole batch: the count does not
    -- grow with the batch (a batch of 8 and of 40 both fit in one)
    local function round_trips(per)
      local name = helpers.db_name()
      local d = assert(mongotx.connect(helpers.uri(), { database = name }))
      local m = assert(d:manager{ application = "app-1", lease = 0 })
      open_accounts(d:collection("accounts"), 4 * per)
      local _, want = backlog(m, per)
      local rec = assert(d:manager{ application = "recoverer", stale_after = 0, lease = 5 })
      d.client:reset_counters()
      local r = assert(rec:recover())
      local c = d.client:counters()
      assert.are.equal(4 * per, r.done + r.cancelled)
      assert.are.same(want, helpers.balances(d:collection("accounts")))
      return c.commands
    end
    -- (FerretDB v1 takes 25 statements a command, engine.commands: there
    -- the larger batch is 16 transactions, whose 24 finishes fit in one)
    local small, large = round_trips(2), round_trips(helpers.server_kind() == "ferretdb" and 4 or 10)
    assert.are.equal(small, large)
    -- the stale list, versions, the clock and the $$NOW probe (two
    -- updates, once per manager), claim, 2 applies (guarded ops first), 1
    -- commit (of two epochs: claimed from initial and from pending),
    -- finish, done, undo, fence, cancelled
    assert.are.equal(14, large)
  end)

  it("counts the one-at-a-time way with batch = 1", function()
    open_accounts(accounts, 4)
    local _, want = backlog(tm, 1)
    local rec = recoverer()
    db.client:reset_counters()
    local r = assert(rec:recover{ batch = 1 })
    assert.are.equal(4, r.done + r.cancelled)
    assert.are.same(want, helpers.balances(accounts))
    assert.is_true(db.client:counters().commands > 20)
  end)

  it("refuses a batch that is not a whole number from 1, and writes nothing", function()
    open_accounts(accounts, 4)
    backlog(tm, 1)
    local before = helpers.db_dump(db.client, db.name)
    for _, bad in ipairs { 0, -1, 1.5, 100001, 0 / 0 } do
      local r, err = recoverer():recover{ batch = bad }
      assert.is_nil(r)
      assert.are.equal("invalid", err.code)
      assert.matches("batch", err.message)
    end
    assert.has_error(function() recoverer():recover{ batch = "10" } end)
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end)

  it("cancels or retries the ones that cannot apply, and finishes the others", function()
    open_accounts(accounts, 8)
    assert(accounts:insert_one{ _id = "held", balance = 100, pendingTransactions = mongotx.array() })
    local ok1 = leave(tm, "pending", "a1", "b1", 10)
    local ok2 = leave(tm, "initial", "a2", "b2", 10)
    -- the debit of a document that does not exist
    local missing = assert(tm:begin({
      { collection = "accounts", id = "a3", update = { ["$inc"] = { balance = 10 } } },
      { collection = "accounts", id = "ghost", update = { ["$inc"] = { balance = -10 } } },
    }))
    -- a guard that is false
    local guard = leave(tm, "initial", "a4", "b4", 5000)
    -- a guard on a document another open transaction holds (its credit
    -- applied in place, escrow off, by a live owner whose lease has not
    -- expired): busy, retried, then cancelled
    local owner = assert(db:manager{ application = "owner", lease = 60, escrow = false })
    local holder = assert(owner:begin({
      { collection = "accounts", id = "held", update = { ["$inc"] = { balance = 50 } } },
    }))
    assert(owner:step("claim", holder))
    assert(owner:step("apply", holder, 1))
    local busy = leave(tm, "initial", "held", "b5", 10)
    local ok3 = leave(tm, "applied", "a6", "b6", 10)
    age()
    local r = assert(recoverer{ retries = 1, backoff = function() return 0 end }:recover())
    assert.are.same({ examined = 7, done = 3, cancelled = 3, skipped = 1, parked = 0,
                      failed = 0, malformed = 0, errors = {} }, r)
    for _, t in ipairs { ok1, ok2, ok3 } do assert.are.equal("done", state(t)) end
    for _, t in ipairs { missing, guard, busy } do
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.matches(t == busy and "holds" or (t == guard and "where" or "does not exist"),
        T.reason)
    end
    assert.are.equal("pending", state(holder))
    local b = {} -- (helpers.balances would refuse the holder's marker)
    for _, d in ipairs(helpers.dump(accounts)) do b[d._id] = d.balance end
    assert.are.same({ 990, 1010, 990, 1010, 990, 1010 },
      { b.a1, b.b1, b.a2, b.b2, b.a6, b.b6 })
    assert.are.same({ 1000, 1000, 1000, 150, 1000 }, { b.a3, b.a4, b.b4, b.held, b.b5 })
    assert.is_nil(accounts:find_one{ _id = "ghost" })
    -- only the live owner's marker is left
    local held = assert(accounts:find_one{ _id = "held" })
    assert.are.same({ holder._id }, held.pendingTransactions)
  end)

  it("commits transactions claimed at different epochs in one round trip, none whose " ..
     "epoch moved on", function()
    assert(txs:insert_many({ { _id = "x1", state = "pending", epoch = 1 },
      { _id = "x2", state = "pending", epoch = 2 }, { _id = "x3", state = "pending", epoch = 3 },
      { _id = "x4", state = "pending", epoch = 1 } }, {}))
    local steps = recoverer().engine.steps
    db.client:reset_counters()
    -- x3 was claimed again since (epoch 3, not 2)
    local res = assert(steps:commit_many(txs, { "x1", "x2", "x3", "x4" }, { 1, 2, 2, 1 }))
    assert.are.equal(1, db.client:counters().commands)
    assert.are.equal(3, res.moved)
    local states = {}
    for _, T in ipairs(helpers.dump(txs)) do states[T._id] = T.state end
    assert.are.same({ x1 = "applied", x2 = "applied", x3 = "pending", x4 = "applied" }, states)
    assert.has_error(function() steps:commit_many(txs, { "x1", "x2" }, { 1 }) end)
  end)

  it("claims a transaction listed twice in one batch once (a cursor may return a " ..
     "document that moved twice)", function()
    open_accounts(accounts, 2)
    local t = leave(tm, "pending", "a1", "b1", 10)
    local u = leave(tm, "canceling", "a2", "b2", 10)
    age()
    local eng = recoverer().engine
    local T, U = assert(tm:get(t._id)), assert(tm:get(u._id))
    local deadline = eng:new_deadline() -- (nil where versions fence: FerretDB)
    local out = assert(eng:claim_many({ { T = T }, { T = U }, { T = T } },
      assert(eng:server_now()), deadline))
    assert.are.equal(T.epoch + 1, out[1].epoch)
    assert.are.equal(U.epoch + 1, out[2].epoch)
    assert.is_false(out[3]) -- its claim matched nothing: the first moved it
    local after = assert(tm:get(t._id))
    assert.are.equal(T.epoch + 1, after.epoch)
    assert.are.equal(T.attempts + 1, after.attempts)
    assert.are.equal("recoverer", after.application)
  end)

  it("fails only the transaction whose on_op_failure raises, not its batch", function()
    open_accounts(accounts, 4)
    local ok1 = leave(tm, "pending", "a1", "b1", 10)
    local ok2 = leave(tm, "initial", "a2", "b2", 10)
    local bad = leave(tm, "pending", "a3", "b3", 10)
    local ok3 = leave(tm, "canceling", "a4", "b4", 10)
    assert(accounts:delete_one({ _id = "b3" })) -- its credit cannot apply
    age()
    local r = assert(recoverer{ on_op_failure = function() error("policy bug") end }:recover())
    assert.are.equal(4, r.examined)
    assert.are.equal(2, r.done)
    assert.are.equal(1, r.cancelled)
    assert.are.equal(1, r.failed)
    assert.are.equal(bad._id, r.errors[1].id)
    assert.are.equal("policy", r.errors[1].error.code)
    for _, t in ipairs { ok1, ok2 } do assert.are.equal("done", state(t)) end
    assert.are.equal("cancelled", state(ok3))
    local B = assert(tm:get(bad._id))
    assert.are.equal("pending", B.state)
    assert.truthy(B.reason:find("policy bug", 1, true), B.reason)
    local b = {}
    for _, d in ipairs(helpers.dump(accounts)) do b[d._id] = d.balance end
    assert.are.same({ a1 = 990, b1 = 1010, a2 = 990, b2 = 1010, a3 = 990, a4 = 1000, b4 = 1000 }, b)
  end)

  it("keeps a floor when transactions of one batch debit the same account", function()
    open_accounts(accounts, 1)
    assert(accounts:update_one({ _id = "a1" }, { ["$set"] = { balance = 25 } }))
    local ts = {
      leave(tm, "initial", "a1", "b1", 10), leave(tm, "pending", "a1", "b1", 10),
      leave(tm, "initial", "a1", "b1", 10), leave(tm, "initial", "a1", "b1", 10),
    }
    age()
    local r = assert(recoverer{ retries = 1, backoff = function() return 0 end }:recover())
    assert.are.same({ examined = 4, done = 2, cancelled = 2, skipped = 0, parked = 0,
                      failed = 0, malformed = 0, errors = {} }, r)
    local done = 0
    for _, t in ipairs(ts) do
      local T = assert(tm:get(t._id))
      if T.state == "done" then done = done + 1
      else assert.matches("where", T.reason) end
    end
    assert.are.equal(2, done)
    assert.are.same({ a1 = 5, b1 = 1020 }, helpers.balances(accounts))
    assert_released(accounts)
  end)

  it("rolls back a batch where a document is missing (the fence matches fewer)", function()
    open_accounts(accounts, 3)
    local a = leave(tm, "canceling", "a1", "b1", 10)
    local b = leave(tm, "canceling", "a2", "b2", 10)
    -- its credit's document is gone: nothing to undo or fence there
    local ghost = assert(tm:begin({
      { collection = "accounts", id = "a3", update = { ["$inc"] = { balance = -10 } } },
      { collection = "accounts", id = "ghost", update = { ["$inc"] = { balance = 10 } } },
    }))
    assert(tm:step("claim", ghost))
    assert(tm:step("apply", ghost, 1))
    assert(tm:step("cancel", ghost))
    local back = leave(tm, "pending", "b3", "a1", 10)
    age()
    local r = assert(recoverer{ stale_pending = function() return "back" end }:recover())
    assert.are.same({ examined = 4, done = 0, cancelled = 4, skipped = 0, parked = 0,
                      failed = 0, malformed = 0, errors = {} }, r)
    for _, t in ipairs { a, b, ghost, back } do assert.are.equal("cancelled", state(t)) end
    assert.are.same({ a1 = 1000, b1 = 1000, a2 = 1000, b2 = 1000, a3 = 1000, b3 = 1000 },
      helpers.balances(accounts))
    assert.is_nil(accounts:find_one{ _id = "ghost" })
    -- every document of a rolled-back takeover was fenced (its version
    -- moved by a band, csrc/txn.c "Fencing"): b1 and b2 only by the
    -- fence, their ops never applied
    local v = {}
    for _, d in ipairs(helpers.dump(accounts)) do v[d._id] = d.txVersion end
    assert.are.same({ core.VERSION_BAND, core.VERSION_BAND }, { v.b1, v.b2 })
    for id, n in pairs(v) do assert.is_true(n >= 1, id .. " not fenced") end
  end)

  describe("#concurrency", function()
    local concurrency = helpers.no_concurrency()

    -- recover{ batch = 5 } until nothing is left, then print the totals
    -- what the workers below start with: this tree's mongotx
    local PREAMBLE = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
]]

    local RECOVERER = PREAMBLE .. [[
local uri, dbname, name = arg[1], arg[2], arg[3]
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = name, stale_after = 0, lease = 5 })
local done, cancelled, failed = 0, 0, 0
for _ = 1, 200 do
  local r = assert(tm:recover { batch = 5 })
  done, cancelled, failed = done + r.done, cancelled + r.cancelled, failed + r.failed
  if r.examined == 0 then break end
end
print(("done=%d cancelled=%d failed=%d"):format(done, cancelled, failed))
]]

    it("three recoverers on one backlog recover each transaction once", function()
      if concurrency then return pending(concurrency) end
      local dbname = db.name
      open_accounts(accounts, 60)
      local _, want = backlog(tm, 15)
      local procs = {}
      for i = 1, 3 do
        local pid, out, script = helpers.spawn_script(RECOVERER, helpers.uri(), dbname, "rec-" .. i)
        procs[i] = { pid = pid, out = out, script = script }
      end
      -- poll while they run: no floor breached, no account ever below
      -- what its transaction can leave
      local polls, lowest = 0, math.huge
      local stop = core.monotonic_ms() + 120000
      repeat
        local running = false
        for _, p in ipairs(procs) do running = running or helpers.alive(p.pid) end
        if not running then break end
        for _, d in ipairs(assert(accounts:find_all({}, { projection = { balance = 1 } }))) do
          if d.balance < lowest then lowest = d.balance end
        end
        polls = polls + 1
      until core.monotonic_ms() > stop
      local done, cancelled = 0, 0
      for _, p in ipairs(procs) do
        assert.is_true(helpers.wait_exit(p.pid, 10), "a recoverer did not finish")
        local said = helpers.read_file(p.out)
        os.remove(p.out)
        os.remove(p.script)
        local d, c, f = said:match("done=(%d+) cancelled=(%d+) failed=(%d+)")
        assert.is_not_nil(d, said)
        assert.are.equal("0", f, said)
        done, cancelled = done + tonumber(d), cancelled + tonumber(c)
      end
      -- each one recovered by exactly one of them
      assert.are.same({ 45, 15 }, { done, cancelled })
      assert.is_true(lowest >= 990, "a balance went to " .. lowest)
      assert.are.same(want, helpers.balances(accounts))
      assert_released(accounts)
      assert.are.equal(0, txs:count({ state = { ["$nin"] = { "done", "cancelled" } } }))
      print(("  batch recovery: 3 recoverers, 60 transactions, %d polls"):format(polls))
    end)

    -- claims a batch, then signals it is between its claims and its
    -- first write (on_event "claim") and sleeps there
    local STALLER = PREAMBLE .. [[
local uri, dbname, ready = arg[1], arg[2], arg[3]
local db = assert(mongotx.connect(uri, { database = dbname }))
local signalled = false
local tm = assert(db:manager { application = "staller", stale_after = 0, lease = 1,
  on_event = function(name)
    if name == "claim" and not signalled then
      signalled = true
      assert(io.open(ready, "w")):close()
      mongotx.core.sleep(1)
    end
  end })
local r = assert(tm:recover())
print(("done=%d cancelled=%d failed=%d"):format(r.done, r.cancelled, r.failed))
]]

    it("a recoverer stopped mid-batch and taken over changes nothing when it wakes", function()
      if concurrency then return pending(concurrency) end
      open_accounts(accounts, 8)
      local list = {}
      for i = 1, 4 do list[#list + 1] = leave(tm, "pending", "a" .. i, "b" .. i, 10) end
      for i = 5, 8 do list[#list + 1] = leave(tm, "initial", "a" .. i, "b" .. i, 10) end
      age()
      local ready = os.tmpname()
      os.remove(ready)
      local pid, out, script = helpers.spawn_script(STALLER, helpers.uri(), db.name, ready)
      assert.is_true(helpers.wait_file(ready, 20), "the recoverer never claimed")
      helpers.signal(pid, "STOP")
      -- all eight claimed by the staller, none driven
      for _, t in ipairs(list) do
        local T = assert(tm:get(t._id))
        assert.are.same({ "pending", "staller" }, { T.state, T.application })
      end
      core.sleep(1.5) -- past its 1 s lease
      local r = assert(recoverer():recover())
      assert.are.same({ 8, 0 }, { r.done, r.failed })
      local before = helpers.dump(accounts)
      helpers.signal(pid, "CONT")
      assert.is_true(helpers.wait_exit(pid, 20), "the recoverer did not finish")
      local said = helpers.read_file(out)
      os.remove(out)
      os.remove(script)
      os.remove(ready)
      assert.matches("done=%d+", said)
      -- its later applies, commits and finishes were all fenced
      assert.are.same(before, helpers.dump(accounts))
      local b = helpers.balances(accounts)
      for i = 1, 8 do assert.are.same({ 990, 1010 }, { b["a" .. i], b["b" .. i] }) end
      for _, t in ipairs(list) do assert.are.equal("done", state(t)) end
      assert_released(accounts)
    end)
  end)
end)

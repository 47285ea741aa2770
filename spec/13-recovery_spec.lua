-- Recovery of transactions left behind in every state, parking of those
-- that keep failing, pruning, and the index recovery relies on.
--
-- The transactions are driven by hand with tm:step by "app-1" (whose
-- lease, recorded on each transaction it claims, is 0 so another
-- application may take over at once) and recovered by a second manager,
-- "recoverer", that counts everything as stale at once.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

-- lastModified must be strictly older than the server's clock.
local function age() mongotx.core.sleep(0.01) end

local function report(t)
  local out = { examined = 0, done = 0, cancelled = 0, skipped = 0, parked = 0,
                failed = 0, malformed = 0, errors = {} }
  for k, v in pairs(t) do out[k] = v end
  return out
end

describe("#server recovery", function()
  local db, tm, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager{ application = "app-1", lease = 0 })
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "C", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "D", balance = 1000, pendingTransactions = mongotx.array() },
    })
  end)

  local function recoverer(opts)
    local o = { application = "recoverer", stale_after = 0, lease = 0 }
    for k, v in pairs(opts or {}) do o[k] = v end
    return assert(db:manager(o))
  end

  local function transfer(from, to, n)
    return assert(tm:begin({
      { collection = "accounts", id = from, update = { ["$inc"] = { balance = -n } } },
      { collection = "accounts", id = to, update = { ["$inc"] = { balance = n } } },
    }))
  end

  local function balances() return helpers.balances(accounts) end

  local function state(t) return assert(tm:get(t._id)).state end

  describe("drives a stale transaction", function()
    it("pending: forward by default", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      age()
      local r = assert(recoverer():recover())
      assert.are.same(report{ examined = 1, done = 1 }, r)
      local T = assert(tm:get(t._id))
      assert.are.equal("done", T.state)
      assert.are.equal("recoverer", T.application)
      assert.are.same({ A = 900, B = 1100, C = 1000, D = 1000 }, balances())
    end)

    it("pending: back when stale_pending says so", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      age()
      local r = assert(recoverer{ stale_pending = function() return "back" end }:recover())
      assert.are.same(report{ examined = 1, cancelled = 1 }, r)
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.are.equal("string", type(T.reason))
      assert.are.same({ A = 1000, B = 1000, C = 1000, D = 1000 }, balances())
    end)

    it("applied: finishes it to done", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(tm:step("apply", t, 2))
      assert(tm:step("commit", t))
      assert(tm:step("finish", t, 1))
      age()
      local r = assert(recoverer():recover())
      assert.are.same(report{ examined = 1, done = 1 }, r)
      assert.are.equal("done", state(t))
      assert.are.same({ A = 900, B = 1100, C = 1000, D = 1000 }, balances())
    end)

    it("canceling: finishes the undo to cancelled", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(tm:step("cancel", t))
      age()
      local r = assert(recoverer():recover())
      assert.are.same(report{ examined = 1, cancelled = 1 }, r)
      assert.are.equal("cancelled", state(t))
      assert.are.same({ A = 1000, B = 1000, C = 1000, D = 1000 }, balances())
    end)

    it("initial: runs it by default", function()
      local t = transfer("A", "B", 100)
      age()
      local r = assert(recoverer():recover())
      assert.are.same(report{ examined = 1, done = 1 }, r)
      local T = assert(tm:get(t._id))
      assert.are.equal("done", T.state)
      assert.are.equal("recoverer", T.application)
      assert.are.same({ A = 900, B = 1100, C = 1000, D = 1000 }, balances())
    end)

    it("initial: expires it when stale_initial says so", function()
      local t = transfer("A", "B", 100)
      local before = helpers.dump(accounts)
      age()
      local r = assert(recoverer{ stale_initial = function() return "expire" end }:recover())
      assert.are.same(report{ examined = 1, cancelled = 1 }, r)
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.are.equal("expired", T.reason)
      assert.are.same(before, helpers.dump(accounts))
    end)

    it("every state in one pass, and counts each outcome", function()
      local t1 = transfer("A", "B", 100)            -- initial
      local t2 = transfer("C", "D", 10)             -- pending, op 1 applied
      assert(tm:step("claim", t2)); assert(tm:step("apply", t2, 1))
      local t3 = assert(tm:begin({                  -- applied
        { collection = "accounts", id = "A", update = { ["$inc"] = { spent = 1 } } } }))
      assert(tm:step("claim", t3)); assert(tm:step("apply", t3, 1))
      assert(tm:step("commit", t3))
      local t4 = assert(tm:begin({                  -- canceling
        { collection = "accounts", id = "D", update = { ["$inc"] = { balance = 5 } } } }))
      assert(tm:step("claim", t4)); assert(tm:step("apply", t4, 1))
      assert(tm:step("cancel", t4))
      age()
      local r = assert(recoverer():recover())
      assert.are.same(report{ examined = 4, done = 3, cancelled = 1 }, r)
      assert.are.same({ "done", "done", "done", "cancelled" },
                      { state(t1), state(t2), state(t3), state(t4) })
      assert.are.same({ A = 900, B = 1100, C = 990, D = 1010 }, balances())
      assert.are.equal(1, assert(accounts:find_one({ _id = "A" })).spent)
      -- nothing left to do: a second pass examines nothing
      assert.are.same(report{}, assert(recoverer():recover()))
    end)

    it("examines at most `limit` transactions per pass", function()
      local t1 = transfer("A", "B", 1)
      local t2 = transfer("C", "D", 1)
      age()
      local rec = recoverer()
      assert.are.same(report{ examined = 1, done = 1 }, assert(rec:recover{ limit = 1 }))
      assert.are.equal(1, txs:count({ state = "done" }))
      assert.are.equal(1, txs:count({ state = "initial" }))
      assert.are.same(report{ examined = 1, done = 1 }, assert(rec:recover{ limit = 1 }))
      assert.are.same({ "done", "done" }, { state(t1), state(t2) })
      assert.are.same({ A = 999, B = 1001, C = 999, D = 1001 }, balances())
    end)
  end)

  describe("leaves alone", function()
    it("a fresh transaction of another application, with the default stale_after", function()
      local owner = assert(db:manager{ application = "app-1" })
      local t = transfer("A", "B", 100)
      assert(owner:step("claim", t))
      assert(owner:step("apply", t, 1))
      local r = assert(assert(db:manager{ application = "recoverer" }):recover())
      assert.are.equal(0, r.done + r.cancelled + r.failed + r.parked)
      assert.are.equal(r.examined, r.skipped)
      local T = assert(tm:get(t._id))
      assert.are.equal("pending", T.state)
      assert.are.equal("app-1", T.application)
      local A = assert(accounts:find_one({ _id = "A" }))
      assert.are.equal(900, A.balance)
      assert.are.same({ t._id }, A.pendingTransactions)
      -- its owner can still finish it
      assert.are.equal("done", assert(owner:commit(t)).state)
      assert.are.same({ A = 900, B = 1100, C = 1000, D = 1000 }, balances())
    end)

    it("a transaction whose owner's lease has not expired, even when stale", function()
      local owner = assert(db:manager{ application = "app-1", lease = 30 })
      local t = transfer("A", "B", 100)
      assert(owner:step("claim", t))
      assert(owner:step("apply", t, 1))
      age()
      local r = assert(recoverer():recover())
      assert.are.same(report{ examined = 1, skipped = 1 }, r)
      local T = assert(tm:get(t._id))
      assert.are.equal("pending", T.state)
      assert.are.equal("app-1", T.application)
      assert.are.equal(900, assert(accounts:find_one({ _id = "A" })).balance)
    end)

    -- Issue 34 item 1: a begun transaction (never claimed) is its
    -- creator's until the creator's lease passed, not the recoverer's
    -- stale_after; its own application may take it once stale.
    it("a begun transaction until its creator's lease, however stale", function()
      local owner = assert(db:manager{ application = "live", lease = 3600 })
      local t1 = assert(owner:begin({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -100 } } },
        { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 100 } } } }))
      local t2 = assert(owner:begin({
        { collection = "accounts", id = "C", update = { ["$inc"] = { balance = -10 } } } }))
      local T = assert(txs:find_one({ _id = t1._id }))
      assert.are.equal("live", T.application)
      assert.are.equal(3600, T.lease)
      helpers.age(txs, t1._id, 60)
      helpers.age(txs, t2._id, 60)
      -- another application, with the default stale_after of 30 s
      local r = assert(assert(db:manager{ application = "other" }):recover())
      assert.are.same(report{ examined = 2, skipped = 2 }, r)
      assert.are.equal("initial", state(t1))
      assert.are.equal("initial", state(t2))
      assert.are.same({ A = 1000, B = 1000, C = 1000, D = 1000 }, balances())
      -- its owner still rolls it back, 60 s on
      assert.is_true(owner:rollback(t1))
      assert.are.equal("cancelled", state(t1))
      assert.are.same({ A = 1000, B = 1000, C = 1000, D = 1000 }, balances())
      -- another manager of its application takes it once stale
      r = assert(assert(db:manager{ application = "live" }):recover())
      assert.are.same(report{ examined = 1, done = 1 }, r)
      assert.are.same({ A = 1000, B = 1000, C = 990, D = 1000 }, balances())
    end)

    it("a begun transaction is another application's once its creator's lease passed", function()
      local owner = assert(db:manager{ application = "live", lease = 3600 })
      local t = assert(owner:begin({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -100 } } } }))
      helpers.age(txs, t._id, 3601)
      local r = assert(assert(db:manager{ application = "other" }):recover())
      assert.are.same(report{ examined = 1, done = 1 }, r)
      assert.are.equal("other", assert(tm:get(t._id)).application)
      assert.are.same({ A = 900, B = 1000, C = 1000, D = 1000 }, balances())
    end)
  end)

  describe("fencing the former owner", function()
    it("cannot apply an op again after recovery rolled the transaction forward", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      age()
      assert.are.same(report{ examined = 1, done = 1 }, assert(recoverer():recover()))
      local ok, err = tm:step("apply", t, 2)
      assert.is_nil(ok)
      assert.is_table(err)
      assert.are.equal("done", state(t))
      assert.are.same({ A = 900, B = 1100, C = 1000, D = 1000 }, balances())
    end)

    it("cannot apply an op after recovery rolled the transaction back", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      age()
      local rec = recoverer{ stale_pending = function() return "back" end }
      assert.are.same(report{ examined = 1, cancelled = 1 }, assert(rec:recover()))
      local ok = tm:step("apply", t, 2)
      assert.is_nil(ok)
      assert.are.equal("cancelled", state(t))
      assert.are.same({ A = 1000, B = 1000, C = 1000, D = 1000 }, balances())
    end)
  end)

  describe("failures", function()
    it("a document deleted meanwhile cancels the transaction by default", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(accounts:delete_one({ _id = "B" }))
      age()
      local r = assert(recoverer():recover())
      assert.are.same(report{ examined = 1, cancelled = 1 }, r)
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.are.equal("string", type(T.reason))
      assert.are.same({ A = 1000, C = 1000, D = 1000 }, balances())
    end)

    it("one that keeps failing is parked with its reason; others in the pass recover", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(accounts:delete_one({ _id = "B" }))
      local rec = recoverer{ max_attempts = 3, on_op_failure = function() return "fail" end }
      local parked_in, others = nil, {}
      for pass = 1, 3 do
        local u = transfer("C", "D", 1)
        others[#others + 1] = u
        age()
        local r = assert(rec:recover())
        assert.are.equal(1, r.done, "pass " .. pass) -- the other one recovered
        if r.parked == 1 then parked_in = pass break end
        assert.are.equal(1, r.failed, "pass " .. pass)
        assert.are.equal(t._id, r.errors[1].id)
        assert.are.equal("missing", r.errors[1].error.code)
      end
      assert.is_number(parked_in)
      local T = assert(tm:get(t._id))
      assert.is_true(T.parked)
      assert.are.equal("pending", T.state)
      assert.are.equal("string", type(T.reason))
      assert.truthy(T.reason:find("does not exist", 1, true), T.reason)
      assert.are.equal(1, assert(tm:stats()).parked)
      for _, u in ipairs(others) do assert.are.equal("done", state(u)) end
      -- a parked transaction is not examined again
      age()
      assert.are.same(report{}, assert(rec:recover()))
      assert.is_true(assert(tm:get(t._id)).parked)
    end)

    it("a failed one waits stale_after before its next try: passes in between do not " ..
       "add to its attempts (a sweep cannot park it in seconds)", function()
      local t = transfer("A", "B", 100)
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(accounts:delete_one({ _id = "B" }))
      local rec = recoverer{ stale_after = 1, max_attempts = 100,
                             on_op_failure = function() return "fail" end }
      local r = assert(rec:recover())
      assert.are.equal(1, r.failed)
      local T = assert(tm:get(t._id))
      local attempts, epoch = T.attempts, T.epoch
      assert.is_true(attempts >= 1)
      -- claimed by rec, so its own (may_recover: at once): spaced all the same
      for pass = 1, 4 do
        assert.are.same(report{}, assert(rec:recover()), "pass " .. pass)
      end
      T = assert(tm:get(t._id))
      assert.are.equal(attempts, T.attempts)
      assert.are.equal(epoch, T.epoch)
      assert.is_nil(T.parked)
      assert.are.equal("pending", T.state)
      mongotx.core.sleep(1.2)
      r = assert(rec:recover())
      assert.are.equal(1, r.failed)
      assert.is_true(assert(tm:get(t._id)).attempts > attempts)
      assert.are.same(report{}, assert(rec:recover()))
      -- unparked (parked here as recovery parks one): taken up again at once
      assert(txs:update_one({ _id = t._id }, { ["$set"] = { parked = true } }))
      assert(tm:unpark(t._id))
      assert.are.equal(1, assert(rec:recover()).examined)
    end)

    it("a policy that raises is reported as failed and does not stop the pass", function()
      local t1 = transfer("A", "B", 100)
      assert(tm:step("claim", t1))
      local t2 = transfer("C", "D", 10)
      assert(tm:step("claim", t2)); assert(tm:step("apply", t2, 1))
      assert(tm:step("apply", t2, 2)); assert(tm:step("commit", t2))
      age()
      local rec = recoverer{ stale_pending = function() error("boom") end }
      local r = assert(rec:recover())
      assert.are.equal(2, r.examined)
      assert.are.equal(1, r.done)
      assert.are.equal(1, r.failed)
      assert.are.equal(t1._id, r.errors[1].id)
      assert.truthy(tostring(r.errors[1].error):find("boom", 1, true))
      assert.are.equal("done", state(t2))
      local T1 = assert(tm:get(t1._id))
      assert.are.equal("pending", T1.state)
      assert.truthy(tostring(T1.reason):find("boom", 1, true))
      assert.are.same({ A = 1000, B = 1000, C = 990, D = 1010 }, balances())
    end)
  end)

  describe("prune", function()
    it("deletes finished transactions older than the given age and keeps active ones", function()
      local done = transfer("A", "B", 1)
      assert(tm:commit(done))
      local cancelled = transfer("A", "Z", 1)
      assert.is_nil((tm:commit(cancelled)))
      local pending = transfer("C", "D", 1)
      assert(tm:step("claim", pending))
      local initial = transfer("D", "C", 1)
      age()
      assert.are.equal(0, tm:prune{ older_than = 3600 })
      assert.are.equal(4, txs:count({}))
      assert.are.equal(2, tm:prune{ older_than = 0 })
      local left = helpers.dump(txs)
      assert.are.equal(2, #left)
      assert.is_nil(tm:get(done._id))
      assert.is_nil(tm:get(cancelled._id))
      assert.are.equal("pending", state(pending))
      assert.are.equal("initial", state(initial))
      assert.are.equal(0, tm:prune{ older_than = 0 })
      assert.are.equal(2, txs:count({}))
    end)

    -- t-1 debits A and inserts o-1; its owner applies the debit only (the
    -- insert is left for it to land later) and stalls; recovery rolls it
    -- back, fencing o-1 with a placeholder.  Returns orders and the report.
    local function rolled_back_insert()
      local orders = db:collection("orders")
      local t = assert(tm:begin({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -5 } } },
        { collection = "orders", id = "o-1", doc = { item = "x" } },
      }, { id = "t-1" }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      age()
      return orders, recoverer({ stale_pending = function() return "back" end }):recover()
    end

    it("removes the placeholder a rolled-back takeover left for an insert", function()
      local orders, r = rolled_back_insert()
      assert.are.same(report { examined = 1, cancelled = 1 }, r)
      -- the takeover fenced o-1 with a placeholder that names the transaction
      local placeholder = assert(orders:find_one({ _id = "o-1" }))
      assert.are.equal("t-1", placeholder.txPlaceholder)
      assert.is_nil(placeholder.item)
      -- so an insert of o-1 (as the former owner prepared it) fails on its _id
      local ok, err = orders:insert_one({ _id = "o-1", item = "x" })
      assert.is_nil(ok)
      assert.are.equal(11000, err.server_code)
      assert.is_nil(orders:find_one({ _id = "o-1" }).item)
      -- kept within the retention period, removed with the transaction after it
      assert.are.equal(0, tm:prune{ older_than = 3600 })
      assert.are.equal(1, orders:count({}))
      assert.are.equal(1, tm:prune{ older_than = 0 })
      assert.are.equal(0, orders:count({}))
      assert.are.equal(0, txs:count({}))
      assert.are.same({ A = 1000, B = 1000, C = 1000, D = 1000 }, balances())
    end)

    it("leaves a placeholder that mongotx wrote to since", function()
      local orders = rolled_back_insert()
      -- a later transaction updates what is now a document of orders
      assert(tm:run({ { collection = "orders", id = "o-1",
        update = { ["$set"] = { item = "y" } }, undo = { ["$unset"] = { item = true } } } }))
      age()
      assert.are.equal(2, tm:prune{ older_than = 0 })
      assert.are.equal("y", assert(orders:find_one({ _id = "o-1" })).item)
    end)

    it("keeps finished transactions within the retention period by default", function()
      assert(tm:transfer("accounts", "A", "B", 1))
      age()
      assert.are.equal(0, tm:prune())
      assert.are.equal(1, txs:count({ state = "done" }))
      local short = assert(db:manager{ application = "app-1", retention = 0 })
      assert.are.equal(1, short:prune())
      assert.are.equal(0, txs:count({}))
    end)
  end)

  it("the transactions collection has a state + lastModified index", function()
    local reply = assert(db.client:command(db.name, { listIndexes = "transactions" }))
    local found
    for _, index in ipairs(reply.cursor.firstBatch) do
      if index.key.state ~= nil then found = index end
    end
    assert.is_table(found)
    assert.are.equal(1, found.key.state)
    assert.are.equal(1, found.key.lastModified)
    local n = 0
    for _ in pairs(found.key) do n = n + 1 end
    assert.are.equal(2, n)
    -- state comes first
    assert.are.equal(mongotx.encode(mongotx.doc("state", 1, "lastModified", 1)),
                     mongotx.encode(found.key))
  end)
end)

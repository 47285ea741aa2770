-- Rolling back a pending transaction and compensating a committed one.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

describe("#server rollback", function()
  local db, tm, accounts, txs, events

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    events = {}
    tm = assert(db:manager{ application = "app-1", on_event = function(name, info)
      events[#events + 1] = { name = name, info = info }
    end })
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "C", balance = 1000, pendingTransactions = mongotx.array() },
    })
  end)

  local function inc(id, n)
    return { collection = "accounts", id = id, update = { ["$inc"] = { balance = n } } }
  end

  local function balances() return helpers.balances(accounts) end

  local function undo_results()
    local out = {}
    for _, e in ipairs(events) do
      if e.name == "undo" then out[#out + 1] = e.info.result.undone end
    end
    return out
  end

  describe("rollback", function()
    it("undoes only the applied ops, in reverse order, and ends cancelled", function()
      local t = assert(tm:begin({ inc("A", -100), inc("B", 60), inc("C", 40) }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(tm:step("apply", t, 2))
      assert.are.equal(900, assert(accounts:find_one({ _id = "A" })).balance)
      -- B's credit waits in txPending (docs/guards.md, Escrow)
      local B = assert(accounts:find_one({ _id = "B" }))
      assert.are.equal(1000, B.balance)
      assert.are.same({ balance = 60 }, B.txPending)
      events = {}
      assert.is_true(tm:rollback(t, "user abort"))
      -- op 3 (never applied) first, then 2, then 1
      assert.are.same({ false, true, true }, undo_results())
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.are.equal("user abort", T.reason)
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
      -- the undo took B's credit back out of txPending
      assert.are.same({ balance = 0 }, assert(accounts:find_one({ _id = "B" })).txPending)
      -- the op never applied left no trace on its document
      assert.are.same({ _id = "C", balance = 1000, pendingTransactions = {} },
                      assert(accounts:find_one({ _id = "C" })))
    end)

    it("undoes the first op alone when only it was applied", function()
      local t = assert(tm:begin({ inc("A", -100), inc("B", 60), inc("C", 40) }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      events = {}
      assert.is_true(tm:rollback(t))
      assert.are.same({ false, false, true }, undo_results())
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.are.equal("string", type(T.reason))
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
    end)

    it("undoes an insert by deleting the inserted document", function()
      local t = assert(tm:begin({ inc("A", -100),
        { collection = "orders", id = "o1", doc = { total = 100 } } }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(tm:step("apply", t, 2))
      assert.are.equal(1, db:collection("orders"):count({ _id = "o1" }))
      assert.is_true(tm:rollback(t))
      assert.are.same({}, helpers.dump(db:collection("orders")))
      assert.are.equal("cancelled", assert(tm:get(t._id)).state)
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
    end)

    it("cancels a transaction never started without touching any document", function()
      local t = assert(tm:begin({ inc("A", -100), inc("B", 100) }))
      local before = helpers.dump(accounts)
      assert.is_true(tm:rollback(t, "not wanted"))
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.are.equal("not wanted", T.reason)
      assert.are.same(before, helpers.dump(accounts))
      -- and it cannot be committed afterwards
      assert.is_nil((tm:commit(t)))
      assert.are.equal("cancelled", assert(tm:get(t._id)).state)
      assert.are.same(before, helpers.dump(accounts))
    end)

    it("refuses a committed transaction: compensate it instead", function()
      local done = assert(tm:transfer("accounts", "A", "B", 100))
      local ok, err = tm:rollback(done)
      assert.is_nil(ok)
      assert.are.equal("state", err.code)
      assert.are.equal("done", assert(tm:get(done._id)).state)
      assert.are.same({ A = 900, B = 1100, C = 1000 }, balances())
    end)

    it("is safe to repeat", function()
      local t = assert(tm:begin({ inc("A", -100), inc("B", 100) }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert.is_true(tm:rollback(t))
      assert.is_true(tm:rollback(t))
      assert.are.equal("cancelled", assert(tm:get(t._id)).state)
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
    end)

    it("does not take a pending transaction from another application under a fresh lease", function()
      local t = assert(tm:begin({ inc("A", -100), inc("B", 100) }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      local other = assert(db:manager{ application = "app-2" })
      local ok, err = other:rollback(t)
      assert.is_nil(ok)
      assert.are.equal("owned", err and err.code)
      local T = assert(tm:get(t._id))
      assert.are.equal("pending", T.state)
      assert.are.equal("app-1", T.application)
      local A = assert(accounts:find_one({ _id = "A" }))
      assert.are.equal(900, A.balance)
      assert.are.same({ t._id }, A.pendingTransactions)
    end)
  end)

  describe("compensate", function()
    it("restores the balances of a done transfer with a linked transaction", function()
      local T = assert(tm:transfer("accounts", "A", "B", 100))
      assert.are.same({ A = 900, B = 1100, C = 1000 }, balances())
      local C = assert(tm:compensate(T))
      assert.are.equal("done", C.state)
      assert.is_true(C.compensates == T._id)
      local cid = require("mongotx.manager").compensation_id(T._id)
      assert.are.equal(cid, C._id)
      local stored = assert(tm:get(cid))
      assert.are.equal("done", stored.state)
      assert.is_true(stored.compensates == T._id)
      assert.are.equal("done", assert(tm:get(T._id)).state) -- the original stays done
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
      assert.are.equal(2, txs:count({}))
      assert.are.equal(1, txs:count({ compensates = T._id }))
    end)

    it("creates one compensating transaction however often and from wherever it is called", function()
      local T = assert(tm:transfer("accounts", "A", "B", 100))
      local C1 = assert(tm:compensate(T))
      local C2 = assert(tm:compensate(T))
      local other = assert(db:manager{ application = "app-2" })
      local C3 = assert(other:compensate(T))
      for _, C in ipairs { C2, C3 } do
        assert.are.equal("done", C.state)
        assert.are.equal(mongotx.core.encode({ x = C1._id }), mongotx.core.encode({ x = C._id }))
      end
      assert.are.equal(2, txs:count({}))
      assert.are.equal(1, txs:count({ compensates = T._id }))
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
    end)

    it("uses the explicit undo of a $set and removes what an insert created", function()
      local orders = db:collection("orders")
      assert(orders:insert_one({ _id = "o1", status = "new" }))
      local T = assert(tm:commit(assert(tm:begin({
        { collection = "orders", id = "o1", update = { ["$set"] = { status = "paid" } },
          undo = { ["$set"] = { status = "new" } } },
        { collection = "orders", id = "o2", doc = { status = "paid" } },
        inc("A", -100),
      }))))
      assert.are.equal("paid", assert(orders:find_one({ _id = "o1" })).status)
      assert.are.equal(1, orders:count({ _id = "o2" }))
      local C = assert(tm:compensate(T))
      assert.are.equal("done", C.state)
      local o1 = assert(orders:find_one({ _id = "o1" }))
      assert.are.equal("new", o1.status)
      assert.are.same({}, o1.pendingTransactions)
      assert.are.equal(0, orders:count({ _id = "o2" }))
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
    end)

    it("refuses a transaction that removed a document, writing nothing", function()
      local sessions = db:collection("sessions")
      assert(sessions:insert_one({ _id = "s1" }))
      local T = assert(tm:commit(assert(tm:begin({
        { collection = "sessions", id = "s1", kind = "remove" }, inc("A", -1) }))))
      assert.are.equal(0, sessions:count({}))
      local C, err = tm:compensate(T)
      assert.is_nil(C)
      assert.are.equal("invalid", err.code)
      assert.are.equal(1, txs:count({}))
      assert.are.equal(999, assert(accounts:find_one({ _id = "A" })).balance)
    end)

    it("refuses a cancelled or pending transaction", function()
      local t1 = assert(tm:begin({ inc("A", -100), inc("Z", 100) }))
      assert.is_nil((tm:commit(t1)))
      local C, err = tm:compensate(t1)
      assert.is_nil(C)
      assert.are.equal("state", err.code)
      local t2 = assert(tm:begin({ inc("A", -100), inc("B", 100) }))
      assert(tm:step("claim", t2))
      C, err = tm:compensate(t2)
      assert.is_nil(C)
      assert.are.equal("state", err.code)
      assert.are.equal(2, txs:count({}))
      assert.are.equal(0, txs:count({ compensates = { ["$exists"] = true } }))
      assert.are.equal("cancelled", assert(tm:get(t1._id)).state)
      assert.are.equal("pending", assert(tm:get(t2._id)).state)
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
    end)

    it("finishes an applied transaction first, then compensates it", function()
      local t = assert(tm:begin({ inc("A", -100), inc("B", 100) }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(tm:step("apply", t, 2))
      assert(tm:step("commit", t))
      local C = assert(tm:compensate(t))
      assert.are.equal("done", C.state)
      assert.are.equal("done", assert(tm:get(t._id)).state)
      assert.are.same({ A = 1000, B = 1000, C = 1000 }, balances())
    end)
  end)
end)

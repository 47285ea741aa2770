-- Transactions across collections and op kinds, ops that cannot apply,
-- and idempotent begin.  Each spec checks what the database holds.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

describe("#server transactions", function()
  local db, tm, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager{ application = "app-1" })
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
    })
  end)

  local function inc(coll, id, field, n, where)
    return { collection = coll, id = id, update = { ["$inc"] = { [field] = n } }, where = where }
  end

  -- Accounts exactly as set up (no transaction left a trace on them).
  local function accounts_untouched()
    local docs = helpers.dump(accounts)
    assert.are.equal(2, #docs)
    for i, id in ipairs { "A", "B" } do
      assert.are.equal(id, docs[i]._id)
      assert.are.equal(1000, docs[i].balance)
      assert.are.same({}, docs[i].pendingTransactions)
    end
  end

  local function cancelled_with_reason(id, pattern)
    local T = assert(tm:get(id))
    assert.are.equal("cancelled", T.state)
    assert.are.equal("string", type(T.reason))
    if pattern then assert.truthy(T.reason:find(pattern, 1, true), T.reason) end
    return T
  end

  describe("round trips", function()
    -- One write per step and no read after one: each transition returns
    -- the transaction as it moved.  commit = the load of the transaction,
    -- the read of its documents' versions, then the 7 writes (claim, 2
    -- applies, commit, 2 finishes, done).
    it("begin takes 1, commit the 7 writes plus 2 reads", function()
      assert(tm:transfer("accounts", "A", "B", 1)) -- the clock and the $$NOW probe
      db.client:reset_counters()
      local t = assert(tm:begin({ inc("accounts", "A", "balance", -10),
                                  inc("accounts", "B", "balance", 10) }))
      local c = db.client:counters()
      assert.are.same({ 1, 1 }, { c.commands, c.writes })
      db.client:reset_counters()
      assert.are.equal("done", assert(tm:commit(t)).state)
      c = db.client:counters()
      assert.are.same({ 9, 7 }, { c.commands, c.writes })
      assert.are.same({ A = 989, B = 1011 }, helpers.balances(accounts))
    end)
  end)

  describe("across collections", function()
    it("reserves stock, creates an order and takes the payment as one unit", function()
      assert(db:collection("stock"):insert_one({ _id = "widget", qty = 10 }))
      assert(db:collection("payments"):insert_one({ _id = "acct-1", balance = 500 }))
      local t = assert(tm:begin({
        inc("stock", "widget", "qty", -2, { qty = { ["$gte"] = 2 } }),
        { collection = "orders", id = "o1", doc = { item = "widget", qty = 2 } },
        inc("payments", "acct-1", "balance", -40),
      }, { id = "order-o1", meta = { customer = "c1" } }))
      local T = assert(tm:get("order-o1"))
      assert.are.equal("initial", T.state)
      assert.are.same({ "update", "insert", "update" },
        { T.ops[1].kind, T.ops[2].kind, T.ops[3].kind })
      assert.are.same({ customer = "c1" }, T.meta)

      local final = assert(tm:commit(t))
      assert.are.equal("done", final.state)
      assert.are.equal("done", assert(tm:get("order-o1")).state)
      local widget = assert(db:collection("stock"):find_one({ _id = "widget" }))
      assert.are.equal(8, widget.qty)
      assert.are.same({}, widget.pendingTransactions)
      local orders = helpers.dump(db:collection("orders"))
      assert.are.equal(1, #orders)
      assert.are.equal("o1", orders[1]._id)
      assert.are.equal("widget", orders[1].item)
      assert.are.equal(2, orders[1].qty)
      assert.are.same({}, orders[1].pendingTransactions)
      local pay = assert(db:collection("payments"):find_one({ _id = "acct-1" }))
      assert.are.equal(460, pay.balance)
      assert.are.same({}, pay.pendingTransactions)
      accounts_untouched()
    end)

    it("cancels all of it when the last op cannot apply, undoing the others", function()
      assert(db:collection("stock"):insert_one({ _id = "widget", qty = 10 }))
      assert(db:collection("payments"):insert_one({ _id = "acct-1", balance = 30 }))
      local t = assert(tm:begin({
        inc("stock", "widget", "qty", -2, { qty = { ["$gte"] = 2 } }),
        { collection = "orders", id = "o1", doc = { item = "widget", qty = 2 } },
        inc("payments", "acct-1", "balance", -40, { balance = { ["$gte"] = 40 } }),
      }, { id = "order-o1" }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("guard", err.code)
      assert.are.equal(3, err.op)
      assert.are.equal("order-o1", err.id)
      assert.are.equal("string", type(tostring(err)))
      cancelled_with_reason("order-o1", "op 3")
      local widget = assert(db:collection("stock"):find_one({ _id = "widget" }))
      assert.are.equal(10, widget.qty)
      assert.are.same({}, widget.pendingTransactions)
      assert.are.same({}, helpers.dump(db:collection("orders")))
      local pay = assert(db:collection("payments"):find_one({ _id = "acct-1" }))
      assert.are.equal(30, pay.balance)
      assert.is_true(pay.pendingTransactions == nil or #pay.pendingTransactions == 0)
    end)
  end)

  describe("op kinds", function()
    it("assert: applies the others when its where holds, and leaves its document as it was", function()
      assert(db:collection("users"):insert_one({ _id = "u1", active = true, name = "Ann" }))
      local t = assert(tm:begin({
        { collection = "users", id = "u1", kind = "assert", where = { active = true } },
        inc("accounts", "A", "balance", -100),
        inc("accounts", "B", "balance", 100),
      }))
      assert.are.equal("assert", assert(tm:get(t._id)).ops[1].kind)
      assert.are.equal("done", assert(tm:commit(t)).state)
      local u = assert(db:collection("users"):find_one({ _id = "u1" }))
      assert.are.equal(true, u.active)
      assert.are.equal("Ann", u.name)
      assert.are.same({}, u.pendingTransactions)
      assert.are.equal(900, assert(accounts:find_one({ _id = "A" })).balance)
      assert.are.equal(1100, assert(accounts:find_one({ _id = "B" })).balance)
      assert.are.equal("done", assert(tm:get(t._id)).state)
    end)

    it("assert: a false where cancels after undoing what was applied before it", function()
      assert(db:collection("users"):insert_one({ _id = "u1", active = false }))
      local t = assert(tm:begin({
        inc("accounts", "A", "balance", -100),
        inc("accounts", "B", "balance", 100),
        { collection = "users", id = "u1", kind = "assert", where = { active = true } },
      }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("guard", err.code)
      assert.are.equal(3, err.op)
      cancelled_with_reason(t._id)
      accounts_untouched()
      local u = assert(db:collection("users"):find_one({ _id = "u1" }))
      assert.are.equal(false, u.active)
      assert.is_true(u.pendingTransactions == nil or #u.pendingTransactions == 0)
    end)

    it("remove: marks the document while open and deletes it only when done", function()
      assert(db:collection("sessions"):insert_one({ _id = "s1", user = "u1" }))
      local t = assert(tm:begin({
        { collection = "sessions", id = "s1", kind = "remove" },
        inc("accounts", "A", "balance", -1),
      }))
      local sessions = db:collection("sessions")
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      local s = assert(sessions:find_one({ _id = "s1" }))
      assert.are.same({ t._id }, s.pendingTransactions)
      assert(tm:step("apply", t, 2))
      assert(tm:step("commit", t))
      assert.are.equal(1, sessions:count({ _id = "s1" })) -- applied, not finished
      assert.are.same({ finished = true }, assert(tm:step("finish", t, 1)))
      assert.are.same({}, helpers.dump(sessions))
      assert.are.same({ finished = false }, assert(tm:step("finish", t, 1)))
      assert.are.equal("done", assert(tm:commit(t)).state)
      assert.are.equal("done", assert(tm:get(t._id)).state)
      local A = assert(accounts:find_one({ _id = "A" }))
      assert.are.equal(999, A.balance)
      assert.are.same({}, A.pendingTransactions)
    end)

    it("remove: a cancelled transaction leaves the document, unmarked", function()
      assert(db:collection("sessions"):insert_one({ _id = "s1", user = "u1" }))
      -- the second op cannot apply (its document is missing) after the
      -- remove marked s1, so the cancel undoes the remove (a failing guard
      -- would be checked first and leave s1 untouched)
      local t = assert(tm:begin({
        { collection = "sessions", id = "s1", kind = "remove" },
        inc("accounts", "Z", "balance", -1),
      }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("missing", err.code)
      cancelled_with_reason(t._id)
      local s = helpers.dump(db:collection("sessions"))
      assert.are.equal(1, #s)
      assert.are.equal("u1", s[1].user)
      assert.are.same({}, s[1].pendingTransactions)
      accounts_untouched()
    end)

    it("update with an explicit undo for $set: applied on done", function()
      assert(db:collection("orders"):insert_one({ _id = "o1", status = "new" }))
      local t = assert(tm:begin({
        { collection = "orders", id = "o1", update = { ["$set"] = { status = "shipped" } },
          undo = { ["$set"] = { status = "new" } } },
        inc("accounts", "A", "balance", -5),
      }))
      assert.are.equal("done", assert(tm:commit(t)).state)
      local o = assert(db:collection("orders"):find_one({ _id = "o1" }))
      assert.are.equal("shipped", o.status)
      assert.are.same({}, o.pendingTransactions)
    end)

    it("update with an explicit undo for $set: the undo runs when cancelled", function()
      assert(db:collection("orders"):insert_one({ _id = "o1", status = "new" }))
      local t = assert(tm:begin({
        { collection = "orders", id = "o1", update = { ["$set"] = { status = "shipped" } },
          undo = { ["$set"] = { status = "new" } } },
        inc("accounts", "nobody", "balance", 5),
      }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("missing", err.code)
      assert.are.equal(2, err.op)
      cancelled_with_reason(t._id, "does not exist")
      local o = assert(db:collection("orders"):find_one({ _id = "o1" }))
      assert.are.equal("new", o.status)
      assert.are.same({}, o.pendingTransactions)
      assert.are.equal(0, accounts:count({ _id = "nobody" }))
      accounts_untouched()
    end)
  end)

  describe("ops that cannot apply", function()
    it("a false where guard cancels with a reason: balances unchanged, no markers", function()
      local t = assert(tm:begin({
        inc("accounts", "B", "balance", 5000),
        inc("accounts", "A", "balance", -5000, { balance = { ["$gte"] = 5000 } }),
      }, { id = "big" }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("guard", err.code)
      assert.are.equal(2, err.op)
      assert.are.equal("big", err.id)
      cancelled_with_reason("big", "where")
      accounts_untouched()
      assert.are.same({ initial = 0, pending = 0, applied = 0, done = 0, canceling = 0,
                        cancelled = 1, parked = 0 }, assert(tm:stats()))
    end)

    it("a missing document cancels and no document is created", function()
      local t = assert(tm:begin({
        inc("accounts", "A", "balance", -100),
        inc("accounts", "Z", "balance", 100),
      }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("missing", err.code)
      assert.are.equal(2, err.op)
      cancelled_with_reason(t._id)
      accounts_untouched()
    end)

    it("an insert whose _id is taken cancels and leaves the existing document untouched", function()
      local orders = db:collection("orders")
      assert(orders:insert_one({ _id = "o1", item = "old", qty = 1 }))
      local before = helpers.dump(orders)
      local t = assert(tm:begin({
        inc("accounts", "A", "balance", -100),
        { collection = "orders", id = "o1", doc = { item = "new", qty = 9 } },
      }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("conflict", err.code)
      assert.are.equal(2, err.op)
      cancelled_with_reason(t._id)
      assert.are.same(before, helpers.dump(orders))
      assert.are.same({ { _id = "o1", item = "old", qty = 1 } }, helpers.dump(orders))
      accounts_untouched()
    end)

    it("on_op_failure = fail leaves the transaction pending; rollback then restores", function()
      tm = assert(db:manager{ application = "app-1",
                              on_op_failure = function() return "fail" end })
      local t = assert(tm:begin({
        inc("accounts", "A", "balance", -100),
        inc("accounts", "Z", "balance", 100),
      }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("missing", err.code)
      assert.are.equal("pending", assert(tm:get(t._id)).state)
      local A = assert(accounts:find_one({ _id = "A" }))
      assert.are.equal(900, A.balance)
      assert.are.same({ t._id }, A.pendingTransactions)
      assert.is_true(tm:rollback(t, "gave up"))
      cancelled_with_reason(t._id, "gave up")
      accounts_untouched()
    end)

    it("on_op_failure = retry tries again after sleeping and can then succeed", function()
      local slept = 0
      tm = assert(db:manager{ application = "app-1",
        on_op_failure = function() return "retry" end,
        sleep = function()
          slept = slept + 1
          if slept == 2 then
            assert(accounts:insert_one({ _id = "Z", balance = 0 }))
          end
        end })
      local t = assert(tm:begin({
        inc("accounts", "A", "balance", -100),
        inc("accounts", "Z", "balance", 100),
      }))
      assert.are.equal("done", assert(tm:commit(t)).state)
      assert.are.equal(2, slept)
      assert.are.equal("done", assert(tm:get(t._id)).state)
      assert.are.equal(900, assert(accounts:find_one({ _id = "A" })).balance)
      local Z = assert(accounts:find_one({ _id = "Z" }))
      assert.are.equal(100, Z.balance)
      assert.are.same({}, Z.pendingTransactions)
    end)

    it("on_op_failure = retry gives up after `retries` and cancels", function()
      local slept = 0
      tm = assert(db:manager{ application = "app-1", retries = 2,
        on_op_failure = function() return "retry" end,
        sleep = function() slept = slept + 1 end })
      local t = assert(tm:begin({
        inc("accounts", "A", "balance", -100),
        inc("accounts", "Z", "balance", 100),
      }))
      local ok, err = tm:commit(t)
      assert.is_nil(ok)
      assert.are.equal("missing", err.code)
      assert.are.equal(2, slept)
      cancelled_with_reason(t._id)
      accounts_untouched()
    end)
  end)

  describe("idempotency", function()
    local function ops()
      return { inc("accounts", "A", "balance", -100), inc("accounts", "B", "balance", 100) }
    end

    it("begin with the same id and ops returns the same transaction and outcome", function()
      local t1 = assert(tm:begin(ops(), { id = "pay-1" }))
      local t2 = assert(tm:begin(ops(), { id = "pay-1" }))
      assert.are.equal("pay-1", t1._id)
      assert.are.equal("pay-1", t2._id)
      assert.are.equal("initial", t2.state)
      assert.are.equal(1, txs:count({}))
      assert.are.equal("done", assert(tm:commit(t1)).state)
      assert.are.equal("done", assert(tm:commit(t2)).state)
      -- after it is done, begin again returns the outcome, and commit moves nothing
      local t3 = assert(tm:begin(ops(), { id = "pay-1" }))
      assert.are.equal("done", t3.state)
      assert.are.equal("done", assert(tm:commit(t3)).state)
      assert.are.equal(1, txs:count({}))
      local A = assert(accounts:find_one({ _id = "A" }))
      local B = assert(accounts:find_one({ _id = "B" }))
      assert.are.equal(900, A.balance)
      assert.are.equal(1100, B.balance)
      assert.are.same({}, A.pendingTransactions)
      assert.are.same({}, B.pendingTransactions)
    end)

    it("begin with the same id and other ops is an idempotency error", function()
      assert(tm:begin(ops(), { id = "pay-1" }))
      local before = helpers.dump(txs)
      mongotx.core.sleep(0.005) -- a write now would show in lastModified
      local t, err = tm:begin({ inc("accounts", "A", "balance", -999),
                                inc("accounts", "B", "balance", 999) }, { id = "pay-1" })
      assert.is_nil(t)
      assert.are.equal("idempotency", err.code)
      assert.are.equal("pay-1", err.id)
      assert.are.same(before, helpers.dump(txs))
      assert.are.equal(-100, assert(tm:get("pay-1")).ops[1].update["$inc"].balance)
      accounts_untouched()
    end)

    it("begin repeated with the same id and ops writes nothing to the existing transaction", function()
      local t = assert(tm:begin(ops(), { id = "pay-3" }))
      assert.are.equal("done", assert(tm:commit(t)).state)
      local before = helpers.dump(txs)
      mongotx.core.sleep(0.005) -- a write now would show in lastModified
      assert.are.equal("done", assert(tm:begin(ops(), { id = "pay-3" })).state)
      -- a refreshed lastModified would postpone prune() (and, for an
      -- active transaction, make a stale one look fresh to recover())
      assert.are.same(before, helpers.dump(txs))
    end)

    it("a cancelled transaction stays cancelled when begun and committed again", function()
      local guarded = function()
        return { inc("accounts", "A", "balance", -1500, { balance = { ["$gte"] = 1500 } }),
                 inc("accounts", "B", "balance", 1500) }
      end
      local t = assert(tm:begin(guarded(), { id = "pay-2" }))
      assert.is_nil((tm:commit(t)))
      local T = cancelled_with_reason("pay-2")
      -- the guard would hold now, yet the transaction does not come back
      assert(accounts:update_one({ _id = "A" }, { ["$set"] = { balance = 2000 } }))
      local again = assert(tm:begin(guarded(), { id = "pay-2" }))
      assert.are.equal("cancelled", again.state)
      local ok, err = tm:commit(again)
      assert.is_nil(ok)
      assert.are.equal("cancelled", err.code)
      local T2 = cancelled_with_reason("pay-2")
      assert.are.equal(T.reason, T2.reason)
      assert.are.equal(2000, assert(accounts:find_one({ _id = "A" })).balance)
      assert.are.equal(1000, assert(accounts:find_one({ _id = "B" })).balance)
      assert.are.equal(1, txs:count({}))
    end)
  end)

  describe("manager options", function()
    it("uses the configured marker, version field and transactions collection", function()
      tm = assert(db:manager{ application = "app-1", collection = "txlog",
                              marker = "locks", version_field = "v" })
      local t = assert(tm:begin({ inc("accounts", "A", "balance", -1),
                                  inc("accounts", "B", "balance", 1) }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      local A = assert(accounts:find_one({ _id = "A" }))
      -- outside `transactions` the marker holds the transaction's mark,
      -- which names collection and id (README, "Data model")
      local mark = assert(tm:get(t._id)).mark
      assert.are.same({ mark }, A.locks)
      local coll, id = require("mongotx.stored").named(mark)
      assert.are.equal("txlog", coll)
      assert.are.equal(t._id, id)
      assert.are.same({}, A.pendingTransactions)
      assert.are.equal(1, A.v)
      assert.is_nil(A.txVersion)
      assert.are.equal("done", assert(tm:commit(t)).state)
      assert.are.equal(1, db:collection("txlog"):count({ state = "done" }))
      assert.are.equal(0, txs:count({}))
      local docs = helpers.dump(accounts)
      assert.are.same({ { _id = "A", balance = 999, pendingTransactions = {}, locks = {}, v = 2 },
                        { _id = "B", balance = 1001, pendingTransactions = {}, locks = {},
                          txPending = { balance = 0 }, txEscrow = {}, v = 2 } },
                      docs)
    end)
  end)
end)

-- Bad input (DESIGN.md §8) is rejected before anything is written: an
-- `invalid` error for bad content, a raise for wrong argument types and
-- unknown options, and in every case the database exactly as it was.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local NAN, INF = 0 / 0, math.huge

describe("#server bad input", function()
  local db, tm, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager{ application = "app-1" })
    accounts = db:collection("accounts")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
    })
    assert(db:collection("orders"):insert_one({ _id = "o1", status = "new" }))
  end)

  -- Every collection of the database, by name, with all its documents.
  local function snapshot()
    local reply = assert(db.client:command(db.name, { listCollections = 1 }))
    local out = {}
    for _, c in ipairs(reply.cursor.firstBatch) do
      out[c.name] = helpers.dump(db:collection(c.name))
    end
    return out
  end

  local function rejected(before, ok, err)
    assert.is_nil(ok)
    assert.is_table(err)
    assert.are.equal("invalid", err.code)
    assert.are.equal("string", type(err.message))
    assert.are.equal("string", type(tostring(err)))
    assert.are.same(before, snapshot())
    assert.are.equal(0, db:collection("transactions"):count({}))
  end

  local function inc(id, n)
    return { collection = "accounts", id = id, update = { ["$inc"] = { balance = n } } }
  end

  local bad_ops = {
    { "an empty op list", {} },
    { "an op id that is a query operator", { inc({ ["$gt"] = "" }, 1) } },
    { "an op id holding an operator deeper down", { inc({ a = { ["$ne"] = 1 } }, 1) } },
    { "an id that is NaN", { inc(NAN, 1) } },
    { "an update without operators",
      { { collection = "accounts", id = "A", update = { balance = 5 },
          undo = { ["$set"] = { balance = 1000 } } } } },
    { "an empty update", { { collection = "accounts", id = "A", update = {},
                             undo = { ["$inc"] = { balance = 1 } } } } },
    { "an update touching _id",
      { { collection = "accounts", id = "A", update = { ["$set"] = { _id = "X" } },
          undo = { ["$set"] = { balance = 1000 } } } } },
    { "an update touching the marker",
      { { collection = "accounts", id = "A",
          update = { ["$push"] = { pendingTransactions = "x" } },
          undo = { ["$pull"] = { pendingTransactions = "x" } } } } },
    { "an update touching a path under the marker",
      { { collection = "accounts", id = "A",
          update = { ["$set"] = { ["pendingTransactions.0"] = "x" } },
          undo = { ["$set"] = { balance = 1000 } } } } },
    { "an update touching the version field",
      { { collection = "accounts", id = "A", update = { ["$inc"] = { txVersion = 1 } } } } },
    { "a $rename onto the marker",
      { { collection = "accounts", id = "A",
          update = { ["$rename"] = { balance = "pendingTransactions" } },
          undo = { ["$rename"] = { pendingTransactions = "balance" } } } } },
    { "an undo touching the marker",
      { { collection = "accounts", id = "A", update = { ["$set"] = { x = 1 } },
          undo = { ["$unset"] = { pendingTransactions = true } } } } },
    { "$set without undo",
      { { collection = "accounts", id = "A", update = { ["$set"] = { balance = 5 } } } } },
    { "a NaN $inc", { inc("A", NAN) } },
    { "an infinite $inc", { inc("A", INF) } },
    { "duplicate (collection, id)", { inc("A", -1), inc("B", 2), inc("A", -1) } },
    { "a where with $where",
      { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
          where = { ["$where"] = "this.balance > 0" } } } },
    { "a where on the marker",
      { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
          where = { pendingTransactions = { ["$size"] = 0 } } } } },
    { "a doc with a $ key", { { collection = "orders", id = "o2", doc = { ["$set"] = 1 } } } },
    { "a doc with a nested $ key",
      { { collection = "orders", id = "o2", doc = { total = { ["$gt"] = 1 } } } } },
    { "a doc setting the marker",
      { { collection = "orders", id = "o2", doc = { pendingTransactions = { 1 } } } } },
    { "a doc whose _id differs from the op id",
      { { collection = "orders", id = "o2", doc = { _id = "o3" } } } },
    { "a doc holding NaN", { { collection = "orders", id = "o2", doc = { total = NAN } } } },
    { "a collection name with $", { { collection = "acc$ounts", id = "A",
                                      update = { ["$inc"] = { balance = 1 } } } } },
    { "a system collection", { { collection = "system.x", id = "A",
                                 update = { ["$inc"] = { balance = 1 } } } } },
    { "an empty collection name", { { collection = "", id = "A",
                                      update = { ["$inc"] = { balance = 1 } } } } },
    { "the transactions collection itself",
      { { collection = "transactions", id = "A", update = { ["$inc"] = { balance = 1 } } } } },
    { "an unknown kind", { { collection = "accounts", id = "A", kind = "upsert" } } },
    { "an unknown op key", { { collection = "accounts", id = "A",
                               update = { ["$inc"] = { balance = 1 } }, upsert = true } } },
    { "an update on a remove op", { { collection = "accounts", id = "A", kind = "remove",
                                      update = { ["$inc"] = { balance = 1 } } } } },
    { "an op that is not a table", { "A" } },
    { "ops that are not a list", { inc("A", 1), [5] = inc("B", 1) } },
  }

  describe("begin rejects", function()
    for _, case in ipairs(bad_ops) do
      it(case[1], function()
        local before = snapshot()
        rejected(before, tm:begin(case[2]))
      end)
    end

    it("a transaction id that is a query operator", function()
      local before = snapshot()
      rejected(before, tm:begin({ inc("A", -1), inc("B", 1) }, { id = { ["$gt"] = "" } }))
    end)

    it("a transaction id that is NaN", function()
      local before = snapshot()
      rejected(before, tm:begin({ inc("A", -1), inc("B", 1) }, { id = NAN }))
    end)

    it("an op on the manager's own transactions collection when it is renamed", function()
      local other = assert(db:manager{ application = "app-1", collection = "txlog" })
      local before = snapshot()
      local ok, err = other:begin({ { collection = "txlog", id = "A",
                                      update = { ["$inc"] = { balance = 1 } } } })
      assert.is_nil(ok)
      assert.are.equal("invalid", err.code)
      assert.are.same(before, snapshot())
    end)

    it("an update touching a configured marker field", function()
      local other = assert(db:manager{ application = "app-1", marker = "locks" })
      local before = snapshot()
      local ok, err = other:begin({ { collection = "accounts", id = "A",
        update = { ["$set"] = { locks = mongotx.array() } },
        undo = { ["$set"] = { balance = 1000 } } } })
      assert.is_nil(ok)
      assert.are.equal("invalid", err.code)
      assert.are.same(before, snapshot())
    end)
  end)

  describe("transfer rejects", function()
    local amounts = { { "NaN", NAN }, { "inf", INF }, { "-inf", -INF }, { "0", 0 },
                      { "a negative amount", -5 }, { "a negative float", -0.5 } }
    for _, case in ipairs(amounts) do
      it(case[1], function()
        local before = snapshot()
        rejected(before, tm:transfer("accounts", "A", "B", case[2]))
      end)
    end

    it("from == to", function()
      local before = snapshot()
      rejected(before, tm:transfer("accounts", "A", "A", 10))
    end)

    it("a NaN minimum", function()
      local before = snapshot()
      rejected(before, tm:transfer("accounts", "A", "B", 10, { min = NAN }))
    end)

    it("an infinite minimum", function()
      local before = snapshot()
      rejected(before, tm:transfer("accounts", "A", "B", 10, { min = -INF }))
    end)

    it("the marker as the field", function()
      local before = snapshot()
      rejected(before, tm:transfer("accounts", "A", "B", 10, { field = "pendingTransactions" }))
    end)

    it("_id as the field", function()
      local before = snapshot()
      rejected(before, tm:transfer("accounts", "A", "B", 10, { field = "_id" }))
    end)

    it("an account id that is a query operator", function()
      local before = snapshot()
      rejected(before, tm:transfer("accounts", { ["$ne"] = "nobody" }, "B", 10))
    end)

    it("the transactions collection", function()
      local before = snapshot()
      rejected(before, tm:transfer("transactions", "A", "B", 10))
    end)
  end)

  describe("raises on programming errors", function()
    local function raises(fn)
      local before = snapshot()
      assert.has_error(fn)
      assert.are.same(before, snapshot())
      assert.are.equal(0, db:collection("transactions"):count({}))
    end

    it("an unknown begin option", function()
      raises(function() tm:begin({ inc("A", -1), inc("B", 1) }, { idempotency = "k" }) end)
    end)

    it("begin options that are not a table", function()
      raises(function() tm:begin({ inc("A", -1), inc("B", 1) }, "k") end)
    end)

    it("ops that are not a table", function()
      raises(function() tm:begin("A -> B") end)
    end)

    it("an unknown transfer option", function()
      raises(function() tm:transfer("accounts", "A", "B", 10, { minimum = 0 }) end)
    end)

    it("a transfer amount that is not a number", function()
      raises(function() tm:transfer("accounts", "A", "B", "10") end)
    end)

    it("a transfer field that is not a string", function()
      raises(function() tm:transfer("accounts", "A", "B", 10, { field = 1 }) end)
    end)

    it("an unknown manager option", function()
      raises(function() db:manager{ application = "app-1", stale = 5 } end)
    end)

    it("a manager policy of the wrong type", function()
      raises(function() db:manager{ application = "app-1", stale_after = "30" } end)
      raises(function() db:manager{ application = "app-1", on_op_failure = "cancel" } end)
    end)

    it("unknown recover and prune options", function()
      raises(function() tm:recover{ max = 1 } end)
      raises(function() tm:prune{ age = 1 } end)
    end)

    it("commit, rollback and compensate of something that is not a transaction", function()
      raises(function() tm:commit("id") end)
      raises(function() tm:rollback({}) end)
      raises(function() tm:compensate(42) end)
    end)

    it("an unknown step", function()
      local t = assert(tm:begin({ inc("A", -1), inc("B", 1) }))
      local before = snapshot()
      assert.has_error(function() tm:step("jump", t) end)
      assert.has_error(function() tm:step("apply", t, 3) end)
      assert.are.same(before, snapshot())
      assert.are.equal("initial", assert(tm:get(t._id)).state)
    end)
  end)
end)

-- The batch builder (bench/README.md, "Where the time goes"): each
-- op is encoded once (core.stored_ops) into the form the transaction
-- document stores, the create sends that form as it is with the fields a
-- batch shares added in C, and apply reads each op's filter and update
-- from it.  What is checked here is what the database holds: the stored
-- transactions equal what begin stores for the same ops, and every op of
-- a batch lands on its own document, whatever kind of id it names.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local core = require "mongotx.core"

-- A stored op or transaction with its Binary fields decoded, for
-- comparing by value.
local function readable(v)
  if core.type(v) == "binData" then return { bson = core.decode((v:value())) } end
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = readable(x) end
  return out
end

describe("#server the batch builder", function()
  local db, tm, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager { application = "builder", finish = "deferred" })
    txs = db:collection("transactions")
    local docs = {}
    for i = 1, 6 do docs[i] = { _id = "A" .. i, balance = 100, n = 0 } end
    docs[#docs + 1] = { _id = 7, balance = 100 }
    docs[#docs + 1] = { _id = core.doc("region", "eu", "no", 8), balance = 100 }
    docs[#docs + 1] = { _id = "gone", balance = 1 }
    assert(db:collection("accounts"):insert_many(docs))
  end)

  -- The string-keyed accounts' balances, asserting no marker is left.
  local function balances()
    local out = {}
    for _, d in ipairs(helpers.dump(db:collection("accounts"))) do
      assert.are.equal(0, #(d.pendingTransactions or {}))
      if type(d._id) == "string" then out[d._id] = d.balance end
    end
    return out
  end

  -- One op of each kind, a guard, an explicit undo and ids of three types.
  local function mixed_ops(tag)
    return {
      { collection = "accounts", id = "A1", update = { ["$inc"] = { balance = -10 } },
        where = { balance = { ["$gte"] = 10 } } },
      { collection = "accounts", id = 7, update = { ["$inc"] = { balance = 10 } } },
      { collection = "accounts", id = core.doc("region", "eu", "no", 8),
        update = { ["$set"] = { n = 1 } }, undo = { ["$set"] = { n = 0 } } },
      { collection = "accounts", id = "new-" .. tag, doc = { balance = 5 } },
      { collection = "accounts", id = "gone", kind = "remove" },
      { collection = "accounts", id = "A2", kind = "assert", where = { n = 0 } },
    }
  end

  it("stores each transaction as begin stores the same ops, with the fields a batch shares", function()
    local results, errs = tm:commit_many({ { ops = mixed_ops("x"), meta = { who = "batch" } } })
    assert.is_false(errs[1])
    local T = assert(results[1])
    local b = assert(tm:begin(mixed_ops("x"), { meta = { who = "batch" } }))
    local batched = assert(txs:find_one({ _id = T._id }))
    local begun = assert(txs:find_one({ _id = b._id }))
    -- the ops as stored, field by field (update, undo and where as BSON)
    local ops = readable(batched.ops)
    assert.are.same(readable(begun.ops), ops)
    assert.are.same({ ["$inc"] = { balance = -10 } }, ops[1].update.bson)
    assert.are.same({ ["$inc"] = { balance = 10 } }, ops[1].undo.bson)
    assert.are.same({ balance = { ["$gte"] = 10 } }, ops[1].where.bson)
    assert.are.same({ ["$set"] = { n = 0 } }, ops[3].undo.bson)
    assert.are.same({ "update", "update", "update", "insert", "remove", "assert" },
      { ops[1].kind, ops[2].kind, ops[3].kind, ops[4].kind, ops[5].kind, ops[6].kind })
    assert.are.same({ _id = "new-x", balance = 5 }, ops[4].doc)
    for _, op in ipairs(batched.ops) do
      assert.is_nil(op.floor) -- derived again on loading
      if op.update then assert.are.equal("binData", core.type(op.update)) end
    end
    assert.are.equal("lowers", batched.ops[1].effect)
    -- the shared fields, on the transaction itself
    assert.are.equal("applied", batched.state) -- deferred: committed, not finished
    assert.are.same({ 1, 1, "builder", tm.instance, { who = "batch" } },
      { batched.epoch, batched.attempts, batched.application, batched.instance, batched.meta })
    assert.are.equal("date", core.type(batched.lastModified))
    assert.are.equal(tm.engine.policy.lease, batched.lease)
    -- and the writes landed: each op on its own document
    assert.are.equal(1, tm:finish())
    local docs = {}
    for _, d in ipairs(helpers.dump(db:collection("accounts"))) do docs[core.id_key(d._id)] = d end
    assert.are.equal(90, docs[core.id_key("A1")].balance)
    assert.are.equal(110, docs[core.id_key(7)].balance)
    assert.are.equal(1, docs[core.id_key(core.doc("region", "eu", "no", 8))].n)
    assert.are.equal(5, docs[core.id_key("new-x")].balance)
    assert.is_nil(docs[core.id_key("gone")])
    assert.are.same({ done = 1, initial = 1 }, (function()
      local s = assert(tm:stats())
      local out = {}
      for k, v in pairs(s) do if v > 0 then out[k] = v end end
      return out
    end)())
  end)

  it("applies every op of a batch to its own document; a failed guard cancels only its own", function()
    local list = {}
    for i = 1, 5 do
      -- A1..A5 each give 60 to A6, guarded: each passes once; the second
      -- round (the same debits again) fails every guard but the transfers' credits
      list[i] = { collection = "accounts", from = "A" .. i, to = "A6", amount = 60, min = 0 }
    end
    local results, errs = tm:transfer_many(list)
    for i = 1, 5 do assert(results[i], tostring(errs[i])) end
    results, errs = tm:transfer_many(list)
    for i = 1, 5 do
      assert.is_false(results[i])
      assert.are.equal("guard", errs[i].code)
    end
    assert.are.equal(5, tm:finish())
    local b = balances()
    assert.are.same({ 40, 40, 40, 40, 40, 400 }, { b.A1, b.A2, b.A3, b.A4, b.A5, b.A6 })
    assert.are.same({ done = 5, cancelled = 5 }, (function()
      local s = assert(tm:stats())
      return { done = s.done, cancelled = s.cancelled }
    end)())
  end)

  it("an id that exists already: the same ops give its outcome, other ops an error and nothing written", function()
    assert(tm:run(mixed_ops("y"), { id = "t1" }))
    assert.are.equal(1, tm:finish())
    local credit = function(id)
      return { { collection = "accounts", id = id, update = { ["$inc"] = { balance = 1 } } } }
    end
    local results, errs = tm:commit_many({
      { ops = mixed_ops("y"), id = "t1" },
      { ops = credit("A3"), id = "t2" },
      { ops = credit("A4"), id = "t2" }, -- the id of item 2 again
    })
    assert.is_false(errs[1])
    assert.are.same({ "t1", "done" }, { results[1]._id, results[1].state })
    assert.is_false(errs[2])
    assert.is_false(results[3])
    assert.are.equal("invalid", errs[3].code)
    -- (t2 is left to finish, or went the one-at-a-time way when the
    -- server's count of the create did not say which inserts failed)
    assert(tm:finish())
    local b = balances()
    assert.are.same({ 101, 100 }, { b.A3, b.A4 })
    assert.are.equal("done", assert(txs:find_one({ _id = "t2" })).state)
    -- t1 again with other ops, in a batch with a good item
    local before = helpers.db_dump(db.client, db.name, { skip = { "transactions" } })
    local t1 = helpers.dump(txs)
    results, errs = tm:commit_many({ { ops = credit("A5"), id = "t1" } })
    assert.is_false(results[1])
    assert.are.equal("idempotency", errs[1].code)
    helpers.assert_dump_unchanged(before, db.client, db.name, { skip = { "transactions" } })
    assert.are.same(t1, helpers.dump(txs))
  end)

  it("core.stored_ops: the stored array and its size; what cannot be encoded raises", function()
    local ops = { { collection = "c", id = 1, kind = "update",
                    update = { ["$inc"] = { n = 1 } }, undo = { ["$inc"] = { n = -1 } } } }
    local arr, size = core.stored_ops(ops)
    assert.are.equal("array", core.type(arr))
    -- { ops = arr } is the array plus the document's 4 + 1 bytes and "ops"'s 5
    assert.are.equal(#core.encode({ ops = arr }), size + 10)
    local back = core.decode(core.encode({ ops = arr })).ops
    assert.are.same({ n = 1 }, core.decode((back[1].update:value()))["$inc"])
    assert.are.same({ n = -1 }, core.decode((back[1].undo:value()))["$inc"])
    assert.has_error(function()
      core.stored_ops({ { collection = "c", id = 1, kind = "update", update = { f = print } } })
    end)
    -- the snapshot a caller's table is checked on, and the bytes kept of it
    local t = setmetatable({}, { __pairs = function() error("not read") end,
                                 __index = { ["$inc"] = { n = 1 } } })
    local copy, bytes = core.snapshot(t)
    assert.are.same({}, copy) -- raw contents only
    assert.are.equal(core.encode({}), bytes)
  end)

  it("apply_many fences every op by the one deadline it takes; a deadline is a date", function()
    -- the fence condition is built once a batch (csrc/txn.c,
    -- deadline_condition) and must still say $$NOW < deadline for each op
    local steps = core.steps { marker = "m", version = "v", removing = "r", held = "h",
                               placeholder = "p", pending = "e", escrow = "s" }
    local coll = db.client:collection(db.name, "accounts")
    local function items(tid)
      return {
        { tid = tid, op = { collection = "accounts", id = "A1", update = { ["$inc"] = { balance = 1 } } },
          version = false },
        { tid = tid, op = { collection = "accounts", id = "A2", update = { ["$inc"] = { balance = 2 } } },
          version = false },
      }
    end
    local before = helpers.db_dump(db.client, db.name)
    for _, bad in ipairs { 12345, "2030-01-01", {} } do
      local ok, err = pcall(steps.apply_many, steps, coll, items("t0"), bad)
      assert.is_false(ok)
      assert.matches("a deadline is a date", tostring(err), 1, true)
    end
    helpers.assert_dump_unchanged(before, db.client, db.name)
    local lacks = helpers.no_deadlines()
    if lacks then return pending(lacks .. ": the deadline's fence is not tried there") end
    local now = assert(tm:server_now())
    local res = assert(steps:apply_many(coll, items("late"), core.Date(math.floor(now) - 60000)))
    assert.are.equal(0, res.matched) -- a passed deadline fences both
    helpers.assert_dump_unchanged(before, db.client, db.name)
    res = assert(steps:apply_many(coll, items("t1"), core.Date(math.floor(now) + 60000)))
    assert.are.equal(2, res.matched)
    local a1 = assert(coll:find_one({ _id = "A1" }))
    local a2 = assert(coll:find_one({ _id = "A2" }))
    assert.are.same({ 101, { "t1" }, 1 }, { a1.balance, a1.m, a1.v })
    assert.are.same({ 102, { "t1" }, 1 }, { a2.balance, a2.m, a2.v })
  end)

  it("an ObjectId's key is the one the general way gives it inside a document", function()
    local oid = core.ObjectId()
    local key, sent = core.id_key(oid)
    assert.are.equal("o" .. oid:value(), key)
    assert.are.equal(oid, sent)
    local nested = core.id_key(core.doc("k", oid))
    assert.are.equal("{s1:k=" .. key .. ",}", nested)
  end)
end)

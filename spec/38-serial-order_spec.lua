-- One serial order for every kind of op (docs/guards.md, "Isolation";
-- issue 39).  An op other than a debit, an escrowed credit or an assert
-- is exclusive: no other transaction's op applies to its document from
-- its apply to its finish or undo, and it waits for the ops of others
-- there.  Each spec holds t1 open between its steps (tm:step) on a
-- document, sends t2 down one path onto the same document, and lets t1
-- end while t2 waits (t2's manager's `sleep` runs t1's end: the
-- interleaving is fixed, not timed).  Without the rule t2 applied at
-- once and t1's undo erased t2's committed write, or two transactions
-- ended done in no serial order.  Each spec checks what the database
-- holds at the end.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

describe("#server serial order", function()
  local db, docs, txs, tm1

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    docs = db:collection("docs")
    txs = db:collection("transactions")
    assert(docs:insert_many {
      { _id = "A", x = 0, list = mongotx.array() },
      { _id = "B", x = 0, list = mongotx.array() },
    })
    -- a live owner: one whose lease passed is taken over by whoever
    -- meets its documents (Engine:resolve; spec/59)
    tm1 = assert(db:manager { application = "app-1", lease = 3600 })
  end)

  after_each(function() if db then db:close() end db = nil end)

  local function doc(id) return docs:find_one({ _id = id }) end
  local function state(id) return assert(txs:find_one({ _id = id })).state end

  local function set(id, v, old)
    return { collection = "docs", id = id, update = { ["$set"] = { x = v } },
             undo = { ["$set"] = { x = old or 0 } } }
  end

  -- t1 claimed, its ops `applied` (indexes) applied one by one.
  local function open(ops, applied, id)
    local t = assert(tm1:begin(ops, { id = id or "t1" }))
    assert(tm1:step("claim", t))
    for _, i in ipairs(applied) do assert(tm1:step("apply", t, i)) end
    return t
  end

  -- Rolls back the transaction `id` of manager tm if it is still open:
  -- where t2 did not wait, t1 ends after it, and its undo must not erase
  -- t2's effect either.
  local function settle(tm, id)
    local T = assert(tm:get(id))
    if T.state == "pending" then assert.is_true(tm:rollback(T)) end
  end

  -- A second manager whose first wait runs `during` (then sleeps no more):
  -- t2's op met t1's document held and waits while t1 ends.
  local function waiting(during, opts)
    local o = { application = "app-2", retries = 3 }
    for k, v in pairs(opts or {}) do o[k] = v end
    local waited = 0
    o.sleep = function()
      waited = waited + 1
      if waited == 1 then during() end
    end
    local tm = assert(db:manager(o))
    return tm, function() return waited end
  end

  it("t2's $set waits for t1's; t1's undo erases nothing of t2 (repro 1)", function()
    local t1 = open({ set("A", 1) }, { 1 })
    local tm2, waited = waiting(function() assert.is_true(tm1:rollback(t1)) end)
    local res, err = tm2:run({ set("A", 2) }, { id = "t2" })
    assert(res, tostring(err))
    assert.are.equal("done", res.state)
    assert.is_true(waited() >= 1, "t2 waited for t1")
    assert.are.equal("cancelled", state("t1"))
    assert.are.equal(2, doc("A").x)
    assert.are.same({}, doc("A").pendingTransactions)
  end)

  it("the same when t2 was begun before t1's apply (repro 1, tm:commit)", function()
    local tm2 = waiting(function() assert.is_true(tm1:rollback(assert(tm1:get("t1")))) end)
    local t2 = assert(tm2:begin({ set("A", 2) }, { id = "t2" }))
    open({ set("A", 1) }, { 1 })
    local res, err = tm2:commit(t2)
    assert(res, tostring(err))
    assert.are.equal("done", res.state)
    settle(tm1, "t1")
    assert.are.equal(2, doc("A").x)
  end)

  it("a t2 that t1 holds up too long is cancelled busy, nothing applied", function()
    local t1 = open({ set("A", 1) }, { 1 })
    local tm2, waited = waiting(function() end, { retries = 2 })
    local res, err = tm2:run({ set("B", 2), set("A", 2) }, { id = "t2" })
    assert.is_nil(res)
    assert.are.equal("busy", err.code, tostring(err))
    assert.are.equal(2, waited())
    assert.are.equal("cancelled", state("t2"))
    assert.are.equal(0, doc("B").x)
    assert.are.equal(1, doc("A").x)
    assert.are.same({}, doc("B").pendingTransactions)
    assert.are.equal("done", assert(tm1:commit(t1)).state)
    assert.are.equal(1, doc("A").x)
  end)

  it("two transactions on A and B interleaved step by step: neither takes the other's (repro 2)", function()
    local tm2 = assert(db:manager { application = "app-2", lease = 3600 })
    local t1 = open({ set("A", 1), set("B", 1) }, { 1 })
    local t2 = assert(tm2:begin({ set("A", 2), set("B", 2) }, { id = "t2" }))
    assert(tm2:step("claim", t2))
    -- T1:A, T2:B, then T1:B and T2:A each meet the other's document
    assert(tm2:step("apply", t2, 2))
    local res, err = tm1:step("apply", t1, 2)
    assert.is_nil(res)
    assert.are.equal("busy", err.code)
    res, err = tm2:step("apply", t2, 1)
    assert.is_nil(res)
    assert.are.equal("busy", err.code)
    assert.are.same({ 1, 2 }, { doc("A").x, doc("B").x })
    -- stepwise, the caller settles it: t2 gives way, t1 goes on
    assert.is_true(tm2:rollback(t2))
    assert(tm1:step("apply", t1, 2))
    assert.are.equal("done", assert(tm1:commit(t1)).state)
    assert.are.same({ 1, 1 }, { doc("A").x, doc("B").x })
    assert.are.equal("cancelled", state("t2"))
  end)

  it("run with its ops in opposite orders: both end, in one serial order", function()
    local t1 = open({ set("A", 1), set("B", 1) }, { 1 })
    if helpers.no_deadlines() then
      -- fenced by versions alone nothing is given back (docs/guards.md,
      -- "Isolation"): t2 waits holding B, then is cancelled busy
      local tm3 = waiting(function() end)
      local res, err = tm3:run({ set("B", 2), set("A", 2) }, { id = "t2" })
      assert.is_nil(res)
      assert.are.equal("busy", err.code)
      assert(tm1:step("apply", t1, 2))
      assert.are.equal("done", assert(tm1:commit(t1)).state)
      assert.are.same({ 1, 1 }, { doc("A").x, doc("B").x })
      return
    end
    -- t2 takes B, meets t1 (older) on A: gives B back before it waits,
    -- so t1 can take B and commit (t1's steps run in t2's wait)
    local tm3 = waiting(function()
      assert(tm1:step("apply", t1, 2))
      assert.are.equal("done", assert(tm1:commit(t1)).state)
    end)
    local res, err = tm3:run({ set("B", 2), set("A", 2) }, { id = "t2" })
    assert(res, tostring(err))
    assert.are.equal("done", res.state)
    if assert(tm1:get(t1._id)).state == "pending" then
      -- t2 did not wait: t1 goes on after it
      assert(tm1:step("apply", t1, 2))
      assert(tm1:commit(t1))
    end
    assert.are.equal("done", state("t1"))
    assert.are.same({ 2, 2 }, { doc("A").x, doc("B").x })
  end)

  it("an insert holds its new document: t2's $set on it waits; t1's undo deletes only its own", function()
    local t1 = open({ { collection = "docs", id = "N", kind = "insert", doc = { x = 1 } } }, { 1 })
    local tm2 = waiting(function() assert.is_true(tm1:rollback(t1)) end)
    local res, err = tm2:run({ set("N", 2) }, { id = "t2" })
    -- t1 gone, N never existed in any serial order: t2 finds no document
    assert.is_nil(res)
    assert.are.equal("missing", err.code, tostring(err))
    assert.is_nil(doc("N"))
  end)

  it("a remove waits for t1's $set, then removes what t1 left", function()
    local t1 = open({ set("A", 1) }, { 1 })
    local tm2, waited = waiting(function()
      assert.is_truthy(doc("A").pendingTransactions[1])
      assert.is_nil(doc("A").txRemoving)
      assert.are.equal("done", assert(tm1:commit(t1)).state)
    end)
    local res, err = tm2:run({ { collection = "docs", id = "A", kind = "remove" } }, { id = "t2" })
    assert(res, tostring(err))
    assert.is_true(waited() >= 1)
    assert.is_nil(doc("A"))
  end)

  it("$push with a $pop undo: t1's undo pops its own element, not t2's", function()
    local function push(id, v)
      return { collection = "docs", id = id, update = { ["$push"] = { list = v } },
               undo = { ["$pop"] = { list = 1 } } }
    end
    local t1 = open({ push("A", "t1") }, { 1 })
    local tm2 = waiting(function() assert.is_true(tm1:rollback(t1)) end)
    assert.are.equal("done", assert(tm2:run({ push("A", "t2") }, { id = "t2" })).state)
    assert.are.same({ "t2" }, doc("A").list)
  end)

  it("a debit and an escrowed credit wait for an exclusive holder too", function()
    assert(docs:update_one({ _id = "B" }, { ["$set"] = { n = 10 } }))
    local t1 = open({ set("B", 1) }, { 1 })
    local tm2, waited = waiting(function() assert.is_true(tm1:rollback(t1)) end)
    local res, err = tm2:run({
      { collection = "docs", id = "B", update = { ["$inc"] = { n = -5 } } },
      { collection = "docs", id = "A", update = { ["$inc"] = { n = 5 } } },
    }, { id = "t2" })
    assert(res, tostring(err))
    assert.is_true(waited() >= 1)
    assert.are.same({ 0, 5, 5 }, { doc("B").x, doc("B").n, doc("A").n })
  end)

  it("debits and escrowed credits of open transactions do not wait for each other", function()
    assert(docs:update_one({ _id = "A" }, { ["$set"] = { n = 100 } }))
    local inc = function(id, n) return { collection = "docs", id = id, update = { ["$inc"] = { n = n } } } end
    local t1 = open({ inc("A", -10), inc("B", 10) }, { 1, 2 })
    local tm2 = assert(db:manager { application = "app-2", retries = 0,
                                     sleep = function() error("waited") end })
    assert.are.equal("done", assert(tm2:run({ inc("A", -20), inc("B", 20) }, { id = "t2" })).state)
    -- but a $set of A waits for t1's debit
    local res, err = tm2:run({ set("A", 9) }, { id = "t3" })
    assert.is_nil(res)
    assert.are.equal("busy", err.code)
    assert.is_true(tm1:rollback(t1))
    assert.are.same({ 80, 20 }, { doc("A").n, doc("B").n })
  end)

  it("a batch: commit_many's transaction on t1's document waits, the others commit", function()
    local t1 = open({ set("A", 1) }, { 1 })
    local tm2 = waiting(function() assert.is_true(tm1:rollback(t1)) end)
    local results, errs = tm2:commit_many {
      { ops = { set("A", 2) }, id = "t2" },
      { ops = { set("B", 3) }, id = "t3" },
    }
    assert(results[1], tostring(errs[1]))
    assert(results[2], tostring(errs[2]))
    settle(tm1, "t1")
    assert.are.same({ 2, 3 }, { doc("A").x, doc("B").x })
  end)

  it("a batch whose transactions cross on two documents: both end done, one after the other", function()
    local tm2 = assert(db:manager { application = "app-2" })
    local results, errs = tm2:commit_many {
      { ops = { set("A", 1), set("B", 1) }, id = "t2" },
      { ops = { set("B", 2), set("A", 2) }, id = "t3" },
    }
    assert(results[1], tostring(errs[1]))
    assert(results[2], tostring(errs[2]))
    local a, b = doc("A"), doc("B")
    assert.are.equal(a.x, b.x, "one serial order on A and B")
    assert.are.same({}, a.pendingTransactions)
    assert.are.same({}, b.pendingTransactions)
  end)

  it("batch-mates that took what the other needs give it back, and both end done", function()
    -- guarded ops go first in a batch: t2 takes A and t3 takes B by their
    -- guards, then each meets the other on its second document
    local lacks = helpers.no_deadlines()
    if lacks then return pending(lacks .. ": nothing is given back there") end
    local function guarded(id, v)
      local op = set(id, v)
      op.where = { x = { ["$gte"] = 0 } }
      return op
    end
    local tm2 = assert(db:manager { application = "app-2", sleep = function() error("waited") end })
    local results, errs = tm2:commit_many {
      { ops = { guarded("A", 2), set("B", 2) }, id = "t2" },
      { ops = { guarded("B", 3), set("A", 3) }, id = "t3" },
    }
    assert(results[1], tostring(errs[1]))
    assert(results[2], tostring(errs[2]))
    assert.are.same({ "done", "done" }, { state("t2"), state("t3") })
    assert.are.same({ 3, 3 }, { doc("A").x, doc("B").x }) -- t2, then t3 on both
  end)

  it("recovery rolling t1 back erases nothing of a t2 that waited", function()
    local t1 = open({ set("A", 1) }, { 1 })
    local rec = assert(db:manager { application = "recoverer", stale_after = 0, lease = 0,
                                    stale_pending = function() return "back" end })
    -- t1's lease passes while t2 waits (before, t2 would take t1 over itself)
    local tm2 = waiting(function() helpers.age(txs, t1._id, 7200) assert(rec:recover()) end)
    assert.are.equal("done", assert(tm2:run({ set("A", 2) }, { id = "t2" })).state)
    assert.are.equal("cancelled", state("t1"))
    assert.are.equal(2, doc("A").x)
    assert(rec:recover())
    assert.are.equal(2, doc("A").x)
  end)

  it("recovery driving t1 forward: t2 follows t1's effect", function()
    local t1 = open({ set("A", 1, 0), set("B", 1) }, { 1 })
    local rec = assert(db:manager { application = "recoverer", stale_after = 0, lease = 0 })
    local tm2 = waiting(function() helpers.age(txs, t1._id, 7200) assert(rec:recover()) end)
    local res, err = tm2:run({ { collection = "docs", id = "A", update = { ["$inc"] = { x = 10 } },
                                 undo = { ["$inc"] = { x = -10 } } } }, { id = "t2" })
    assert(res, tostring(err))
    assert.are.equal("done", state("t1"))
    assert.are.same({ 11, 1 }, { doc("A").x, doc("B").x })
  end)

  it("another transactions collection's holder: t2 waits for it too", function()
    local tmx = assert(db:manager { application = "app-x", collection = "tx2", lease = 3600 })
    local tx = assert(tmx:begin({ set("A", 1) }, { id = "t1" }))
    assert(tmx:step("claim", tx))
    assert(tmx:step("apply", tx, 1))
    local tm2 = waiting(function() assert.is_true(tmx:rollback(tx)) end)
    assert.are.equal("done", assert(tm2:run({ set("A", 2) }, { id = "t2" })).state)
    settle(tmx, "t1")
    assert.are.equal(2, doc("A").x)
  end)

  it("an owner's give-back undo is fenced by its deadline: once it passed, it takes nothing back", function()
    -- a new owner may drive the pending transaction forward after its
    -- deadline; a late give-back would then erase a committed effect
    local lacks = helpers.no_deadlines()
    if lacks then return pending(lacks .. ": nothing is given back there") end
    local t1 = open({ set("A", 1) }, { 1 })
    local steps = mongotx.core.steps { marker = "pendingTransactions", version = "txVersion",
      removing = "txRemoving", held = "txHeld", placeholder = "txPlaceholder", pending = "txPending",
      escrow = "txEscrow" }
    local now = math.floor(assert(tm1:server_now()))
    local op = t1.ops[1]
    local res = assert(steps:undo(docs, "t1", op, mongotx.core.Date(now - 60000)))
    assert.is_false(res.undone)
    assert.are.same({ 1, { "t1" } }, { doc("A").x, doc("A").pendingTransactions })
    res = assert(steps:undo(docs, "t1", op, mongotx.core.Date(now + 60000)))
    assert.is_true(res.undone)
    assert.are.same({ 0, {} }, { doc("A").x, doc("A").pendingTransactions })
  end)

  it("compensation is a transaction like any: it waits for t1", function()
    local tm2 = assert(db:manager { application = "app-2" })
    local t0 = assert(tm2:run({ set("B", 5) }, { id = "t0" }))
    local t1 = open({ set("B", 1, 5) }, { 1 })
    local tm3 = waiting(function() assert.is_true(tm1:rollback(t1)) end)
    local res, err = tm3:compensate(t0)
    assert(res, tostring(err))
    settle(tm1, "t1")
    assert.are.equal(0, doc("B").x)
  end)
end)

-- Managers configured differently on the same documents (issue 27).  A
-- transaction's identity on a document (its mark) is unique across
-- transactions collections, and every actor drives a transaction with
-- the marker and version field it was begun with (recorded in the
-- transaction), whatever its own options say (README, "What a
-- transaction and its documents hold").  Each case stops one manager's
-- transaction at every step boundary, lets the other manager act, lets
-- the first one go on, and checks what the database holds: the sum of
-- the balances, each balance, no marker left in any array, every
-- transaction done.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local core = mongotx.core

-- The step boundaries of a transaction walked with tm:step: after each,
-- the other manager acts.
local BOUNDARIES = { "begun", "claimed", "op 1 applied", "committed", "partly finished" }

-- Walks t with tm:step up to boundary `upto`.
local function walk(tm, t, upto)
  if upto == "begun" then return end
  assert(tm:step("claim", t))
  if upto == "claimed" then return end
  assert(tm:step("apply", t, 1))
  if upto == "op 1 applied" then return end
  assert(tm:step("apply", t, 2))
  assert(tm:step("commit", t))
  if upto == "committed" then return end
  assert(tm:step("finish", t, 1))
end

describe("#server managers configured differently", function()
  local db, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    assert(accounts:insert_many {
      { _id = "A", balance = 1000 }, { _id = "B", balance = 1000 },
      { _id = "C", balance = 1000 },
    })
  end)

  after_each(function() if db then db:close() end db = nil end)

  local function ops(from, to, amount)
    return {
      { collection = "accounts", id = from, update = { ["$inc"] = { balance = -amount } } },
      { collection = "accounts", id = to, update = { ["$inc"] = { balance = amount } } },
    }
  end

  -- The balances, and every mongotx array on the accounts empty (or
  -- absent): no marker of any configuration left behind.
  local function check_accounts(want, arrays)
    local total, sum = 0, 0
    for id, balance in pairs(want) do
      local doc = assert(accounts:find_one({ _id = id }))
      assert.are.equal(balance, doc.balance, "balance of " .. id)
      for _, f in ipairs(arrays) do
        local list = doc[f]
        assert.is_true(list == nil or #list == 0,
          string.format("%s of %s holds %d entries", f, id, list and #list or 0))
      end
      total, sum = total + 1000, sum + doc.balance
    end
    assert.are.equal(total, sum, "the sum of the balances")
  end

  local function check_state(coll, id, state)
    local T = assert(db:collection(coll):find_one({ _id = id }))
    assert.are.equal(state, T.state, coll .. " " .. tostring(id))
  end

  local MARKERS = { "pendingTransactions", "txHeld", "otherMarker" }

  -- Issue 27, case 1: two transactions collections, the default marker,
  -- one caller id in both.
  for _, pair in ipairs { { "tx1", "tx2" }, { "transactions", "tx2" }, { "tx2", "transactions" } } do
    for _, upto in ipairs(BOUNDARIES) do
      it(string.format("collections %s and %s, one id: m2 runs while m1's is %s",
          pair[1], pair[2], upto), function()
        local m1 = assert(db:manager { collection = pair[1], application = "m1" })
        local m2 = assert(db:manager { collection = pair[2], application = "m2" })
        local t = assert(m1:begin(ops("A", "B", 10), { id = "order-7" }))
        walk(m1, t, upto)
        local done, err = m2:transfer("accounts", "A", "C", 5, { id = "order-7" })
        assert.truthy(done, tostring(err))
        done, err = m1:commit(t)
        assert.truthy(done, tostring(err))
        check_accounts({ A = 985, B = 1010, C = 1005 }, MARKERS)
        check_state(pair[1], "order-7", "done")
        check_state(pair[2], "order-7", "done")
      end)
    end
  end

  -- The same, with m2 stopped at each boundary (stepwise) while m1's whole
  -- transaction runs, then m2 going on.
  for _, upto in ipairs(BOUNDARIES) do
    it("collections tx1 and tx2, one id: m1 runs while m2's is " .. upto, function()
      local m1 = assert(db:manager { collection = "tx1", application = "m1" })
      local m2 = assert(db:manager { collection = "tx2", application = "m2" })
      local t2 = assert(m2:begin(ops("A", "C", 5), { id = "order-7" }))
      walk(m2, t2, upto)
      local t1 = assert(m1:begin(ops("A", "B", 10), { id = "order-7" }))
      assert(m1:commit(t1))
      assert(m2:commit(t2))
      check_accounts({ A = 985, B = 1010, C = 1005 }, MARKERS)
      check_state("tx1", "order-7", "done")
      check_state("tx2", "order-7", "done")
    end)
  end

  -- Both transactions open on A at once, then rolled back one and
  -- committed the other: the undo of one leaves the other's effect.
  it("collections tx1 and tx2, one id: one rolled back, one committed", function()
    local m1 = assert(db:manager { collection = "tx1", application = "m1" })
    local m2 = assert(db:manager { collection = "tx2", application = "m2" })
    local t1 = assert(m1:begin(ops("A", "B", 10), { id = "order-7" }))
    local t2 = assert(m2:begin(ops("A", "C", 5), { id = "order-7" }))
    walk(m1, t1, "op 1 applied")
    walk(m2, t2, "op 1 applied")
    assert(m1:rollback(t1))
    assert(m2:commit(t2))
    check_accounts({ A = 995, B = 1000, C = 1005 }, MARKERS)
    check_state("tx1", "order-7", "cancelled")
    check_state("tx2", "order-7", "done")
  end)

  -- A floor guard waits for (or finishes) the other collection's holder
  -- of the same id, instead of taking it for its own marker (m1 applies
  -- credits in place, so that its credit holds A: escrow = false).
  it("collections tx1 and tx2, one id: a guard of one meets a credit of the other", function()
    local m1 = assert(db:manager { collection = "tx1", application = "m1", escrow = false })
    local m2 = assert(db:manager { collection = "tx2", application = "m2", retries = 1,
                                   backoff = function() return 0 end })
    assert(accounts:update_one({ _id = "A" }, { ["$set"] = { balance = 0 } }))
    -- m1 credits A 50, open (applied, not committed)
    local t1 = assert(m1:begin(ops("B", "A", 50), { id = "order-7" }))
    walk(m1, t1, "op 1 applied")
    assert(m1:step("apply", t1, 2))
    -- m2's debit of A with a floor may not read that credit: busy
    local done, err = m2:transfer("accounts", "A", "C", 50, { id = "order-7", min = 0 })
    assert.is_nil(done)
    assert.are.equal("busy", err.code)
    assert(m1:commit(t1))
    done, err = m2:transfer("accounts", "A", "C", 50, { id = "order-8", min = 0 })
    assert.truthy(done, tostring(err))
    local a = assert(accounts:find_one({ _id = "A" }))
    assert.are.equal(0, a.balance)
    assert.are.equal(950, assert(accounts:find_one({ _id = "B" })).balance)
    assert.are.equal(1050, assert(accounts:find_one({ _id = "C" })).balance)
    assert.are.same({}, a.pendingTransactions)
    assert.are.same({}, a.txHeld)
  end)

  -- Issue 27, case 2: one transactions collection, another marker and
  -- version field.  m1 (lease 0: fenced by versions alone, so that m2
  -- may take over at once) stops at each boundary; m2 recovers (batched
  -- and alone) or steps it; m1 goes on as a stalled owner would.
  local function other(opts)
    local o = { application = "m2", marker = "otherMarker", version_field = "otherVersion",
                may_recover = function() return true end }
    for k, v in pairs(opts or {}) do o[k] = v end
    return assert(db:manager(o))
  end

  for _, size in ipairs { 1, 100 } do
    for _, upto in ipairs(BOUNDARIES) do
      it(string.format("one collection, another marker: m2 recovers (batch %d) m1's when %s",
          size, upto), function()
        local m1 = assert(db:manager { application = "m1", lease = 0 })
        local m2 = other()
        local t = assert(m1:begin(ops("A", "B", 10), { id = "order-7" }))
        walk(m1, t, upto)
        local report = assert(m2:recover { batch = size })
        assert.are.same({}, report.errors)
        assert.are.equal(1, report.done)
        check_state("transactions", "order-7", "done")
        -- the stalled owner goes on: it may apply nothing again
        if upto == "claimed" or upto == "op 1 applied" then
          local res, err = m1:step("apply", t, 2)
          assert.is_nil(res)
          assert.are.equal("state", err.code)
        end
        m1:commit(t)
        check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
        check_state("transactions", "order-7", "done")
        for _, id in ipairs { "A", "B" } do
          local doc = assert(accounts:find_one({ _id = id }))
          assert.is_nil(doc.otherVersion, "m2 wrote its own version field on " .. id)
        end
      end)
    end
  end

  it("one collection, another marker: a stalled owner's prepared apply stays fenced", function()
    -- m1 claimed and read B's version, then stalled; m2 took over and
    -- finished; m1's apply of op 2 (with the version it read) must not match
    local m1 = assert(db:manager { application = "m1", lease = 0 })
    local m2 = other()
    local t = assert(m1:begin(ops("A", "B", 10), { id = "order-7" }))
    walk(m1, t, "op 1 applied")
    local T = assert(m1:get("order-7"))
    local eng = m1.engine
    local versions = assert(eng:versions(T)) -- read by m1 before the takeover
    assert(m2:recover { batch = 1 })
    -- replay m1's apply as prepared before the takeover
    local res = assert(eng.steps:apply(eng:coll("accounts"), T._id, T.ops[2], versions[2].version))
    assert.is_false(res.applied)
    check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
  end)

  it("one collection, another marker: m2's steps finish and undo with m1's marker", function()
    local m1 = assert(db:manager { application = "m1" })
    local m2 = other()
    local t = assert(m1:begin(ops("A", "B", 10), { id = "order-7" }))
    walk(m1, t, "partly finished")
    assert.are.same({ finished = true }, assert(m2:step("finish", t, 2)))
    assert.are.same({ moved = true }, assert(m2:step("done", t)))
    check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
    check_state("transactions", "order-7", "done")

    local u = assert(m1:begin(ops("A", "C", 10), { id = "order-8" }))
    walk(m1, u, "op 1 applied")
    assert(m1:step("cancel", u))
    assert.are.same({ undone = true }, assert(m2:step("undo", u, 1)))
    assert.are.same({ undone = false }, assert(m2:step("undo", u, 2)))
    assert.are.same({ moved = true }, assert(m2:step("cancelled", u)))
    check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
    check_state("transactions", "order-8", "cancelled")
  end)

  it("a transaction records the marker and version field it was begun with", function()
    local m2 = other { lease = 0 }
    local t = assert(m2:begin(ops("A", "B", 10), { id = "order-7" }))
    local T = assert(db:collection("transactions"):find_one({ _id = "order-7" }))
    assert.are.equal("otherMarker", T.markerField)
    assert.are.equal("otherVersion", T.versionField)
    assert.is_nil(T.mark) -- in `transactions`, the mark is the _id
    walk(m2, t, "op 1 applied")
    local a = assert(accounts:find_one({ _id = "A" }))
    assert.are.same({ "order-7" }, a.otherMarker)
    assert.are.equal(1, a.otherVersion)
    assert.is_nil(a.pendingTransactions)
    -- a manager with the defaults drives it with otherMarker
    local m1 = assert(db:manager { application = "m1", may_recover = function() return true end })
    assert.are.equal(1, assert(m1:recover { batch = 1 }).done)
    check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
    a = assert(accounts:find_one({ _id = "A" }))
    assert.is_nil(a.txVersion)
    assert.are.equal(2, a.otherVersion)
  end)

  it("in another transactions collection the mark is a string naming collection and id", function()
    local m = assert(db:manager { collection = "tx2", application = "m" })
    local t = assert(m:begin(ops("A", "B", 10), { id = "order-7" }))
    walk(m, t, "op 1 applied")
    local T = assert(db:collection("tx2"):find_one({ _id = "order-7" }))
    assert.are.equal("string", type(T.mark))
    assert.are.equal("$mongotx:tx2$", T.mark:sub(1, 13))
    local stored = require "mongotx.stored"
    local coll, id = stored.named(T.mark)
    assert.are.equal("tx2", coll)
    assert.are.equal("order-7", id)
    assert.are.same({ T.mark }, assert(accounts:find_one({ _id = "A" })).pendingTransactions)
    assert(m:commit(t))
    check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
  end)

  it("a transaction an older build stored (no recorded fields) is driven with the manager's", function()
    -- what an older build inserted: no markerField, versionField nor mark
    local m = assert(db:manager { collection = "tx2", application = "m" })
    local _, stored = require("mongotx.validate").ops(ops("A", "B", 10), m.engine.vctx)
    assert(db:collection("tx2"):insert_one { _id = "old-1", state = "initial", epoch = 0,
      attempts = 0, ops = assert(stored), lastModified = core.Date(0) })
    local t = assert(m:get("old-1"))
    assert.is_nil(t.markerField)
    walk(m, t, "op 1 applied")
    -- as an older build marks: the bare _id
    assert.are.same({ "old-1" }, assert(accounts:find_one({ _id = "A" })).pendingTransactions)
    assert(m:commit(t))
    check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
    check_state("tx2", "old-1", "done")
  end)

  it("a transaction id may not start as the marks do", function()
    local m = assert(db:manager { application = "m" })
    local mark = require("mongotx.stored").new_mark("tx2", "order-7")
    for _, id in ipairs { mark, "$mongotx:x" } do
      local t, err = m:begin(ops("A", "B", 10), { id = id })
      assert.is_nil(t)
      assert.are.equal("invalid", err.code)
      t, err = m:transfer("accounts", "A", "B", 10, { id = id })
      assert.is_nil(t)
      assert.are.equal("invalid", err.code)
    end
    assert.are.equal(0, db:collection("transactions"):count({}))
    -- another string starting with $ is an id like any
    assert(m:transfer("accounts", "A", "B", 10, { id = "$mongotx" }))
    check_accounts({ A = 990, B = 1010, C = 1000 }, MARKERS)
  end)

  it("a recorded mark that names another transaction makes the transaction malformed", function()
    local m = assert(db:manager { collection = "tx2", application = "m" })
    assert(m:begin(ops("A", "B", 10), { id = "bad-2" }))
    local stored = require "mongotx.stored"
    for _, mark in ipairs { stored.new_mark("tx2", "other"), stored.new_mark("tx3", "bad-2"),
                            "$mongotx:tx2$zz", "bad-2" } do
      assert(db:collection("tx2"):update_one({ _id = "bad-2" }, { ["$set"] = { mark = mark } }))
      local report = assert(m:recover { batch = 1 })
      assert.are.equal(1, report.malformed, mark)
    end
    check_accounts({ A = 1000, B = 1000, C = 1000 }, MARKERS)
  end)

  it("a recorded marker field that is no field name makes the transaction malformed", function()
    local m = assert(db:manager { application = "m" })
    assert(m:begin(ops("A", "B", 10), { id = "bad-1" }))
    assert(db:collection("transactions"):update_one({ _id = "bad-1" },
      { ["$set"] = { markerField = "a.b" } }))
    local report = assert(m:recover { batch = 1 })
    assert.are.equal(1, report.malformed)
    -- nor does a call on it write anything: it answers malformed
    for _, call in ipairs { function() return m:commit({ _id = "bad-1" }) end,
                            function() return m:step("claim", { _id = "bad-1" }) end } do
      local res, err = call()
      assert.is_nil(res)
      assert.are.equal("malformed", err.code)
    end
    assert.are.equal("initial", assert(m:get("bad-1")).state)
    check_accounts({ A = 1000, B = 1000, C = 1000 }, MARKERS)
  end)
end)

-- Issue 27, item 3: a guard of a batch never reads an uncommitted credit
-- of its own batch; an item whose guard fails in the batch is tried again
-- alone once the batch's other items committed, and may then read their
-- credits, as if it came after them (README, "Guards").
describe("#server a guard in a batch", function()
  local db, accounts, tm

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    assert(accounts:insert_many {
      { _id = "A", balance = 0 }, { _id = "B", balance = 1000 }, { _id = "C", balance = 0 },
    })
    tm = assert(db:manager { application = "batch" })
  end)

  after_each(function() if db then db:close() end db = nil end)

  local function balances()
    local out = {}
    for _, d in ipairs(assert(accounts:find_all({}))) do
      out[d._id] = d.balance
      assert.is_true(d.pendingTransactions == nil or #d.pendingTransactions == 0)
      assert.is_true(d.txHeld == nil or #d.txHeld == 0)
    end
    return out
  end

  for _, order in ipairs { "credit first", "guarded debit first" } do
    it("reads the committed credit of a batch-mate (" .. order .. ")", function()
      local credit = { collection = "accounts", from = "B", to = "A", amount = 50 }
      local debit = { collection = "accounts", from = "A", to = "C", amount = 50, min = 0 }
      local list = order == "credit first" and { credit, debit } or { debit, credit }
      local results, errs = tm:transfer_many(list)
      assert.are.same({ false, false }, errs)
      assert.are.equal("done", results[1].state)
      assert.are.equal("done", results[2].state)
      assert.are.same({ A = 0, B = 950, C = 50 }, balances())
    end)
  end

  it("cancels the item with guard when even the batch's credits do not cover it", function()
    local results, errs = tm:transfer_many {
      { collection = "accounts", from = "B", to = "A", amount = 10 },
      { collection = "accounts", from = "A", to = "C", amount = 50, min = 0 },
    }
    assert.are.equal("done", results[1].state)
    assert.is_false(results[2])
    assert.are.equal("guard", errs[2].code)
    assert.are.same({ A = 10, B = 990, C = 0 }, balances())
  end)
end)

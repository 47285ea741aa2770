-- Version fencing by bands (csrc/txn.c, "Fencing"; mongotx.engine.bands),
-- with fencing = "version": an apply matches while the document's version
-- is still in the band of the version its owner read.  Ordinary writes
-- (other owners' applies and finishes) move it by 1 and leave it there; a
-- takeover's writes move it by a band, and so does the owner itself
-- before it sends an apply again after one whose reply never came.  Each
-- case plays the write a stalled owner or the network still holds, with
-- the manager's own Steps object, after the fact, and checks what the
-- documents hold.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local stored = require "mongotx.stored"

local core = mongotx.core
local BAND = core.VERSION_BAND

describe("#server version bands", function()
  local db, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    -- versions as the scheme before bands left them (counters from 1 up)
    assert(accounts:insert_many {
      { _id = "A", balance = 1000, txVersion = 7, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, txVersion = 7, pendingTransactions = mongotx.array() } })
  end)

  after_each(function()
    core.fault(nil)
    db:close()
  end)

  local function doc(id) return assert(accounts:find_one({ _id = id })) end

  local function balances() return { A = doc("A").balance, B = doc("B").balance } end

  local function owner(retries)
    return assert(db:manager { application = "owner", fencing = "version", lease = 0,
                               retries = retries })
  end

  local function rescuer(direction)
    return assert(db:manager { application = "rescuer", fencing = "version", stale_after = 0,
                               lease = 5, stale_pending = function() return direction end })
  end

  local TRANSFER = {
    { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -100 } } },
    { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 100 } } },
  }

  -- The apply of op i of T (as stored) that `tm` would send, fenced by
  -- `version`: the write a stalled owner or the network still holds.
  local function late_apply(tm, T, i, version)
    T = assert(tm:get(T._id))
    local res = assert(tm.engine.steps:apply(accounts, stored.mark(T), T.ops[i], version))
    return res.applied
  end

  local function late_finish(tm, T, i)
    T = assert(tm:get(T._id))
    return assert(tm.engine.steps:finish(accounts, stored.mark(T), T.ops[i])).finished
  end

  it("an apply stays fenced by the version read while only ordinary writes move it", function()
    local tm = owner()
    local t = assert(tm:begin(TRANSFER))
    assert(tm:step("claim", t)) -- reads A and B at 7
    -- another owner's transfer moves both versions by ordinary writes
    assert(owner():transfer("accounts", "B", "A", 1))
    assert.is_true(doc("B").txVersion > 7 and doc("B").txVersion < BAND)
    -- the apply fenced by 7 still lands: not equality, the band
    assert.is_true(late_apply(tm, t, 2, 7))
    assert.are.same({ A = 1001, B = 999 }, balances())
    assert.are.same({ t._id }, doc("B").pendingTransactions)
  end)

  for _, direction in ipairs { "forward", "back" } do
    it("a taken-over owner's late apply does not land (rolled " .. direction .. ")", function()
      local tm = owner()
      local t = assert(tm:begin(TRANSFER))
      assert(tm:step("claim", t)) -- versions read: 7 and 7
      assert(tm:step("apply", t, 1)) -- A debited; the owner stalls here
      core.sleep(0.01)
      local report = assert(rescuer(direction):recover())
      assert.are.equal(1, report.examined)
      local want = direction == "forward" and { A = 900, B = 1100 } or { A = 1000, B = 1000 }
      assert.are.same(want, balances())
      -- every document of T left band 0: the rescuer's apply or fence of
      -- B, its undo of A rolling back (rolling forward it only finished A)
      assert.is_true(doc("B").txVersion >= BAND)
      if direction == "back" then assert.is_true(doc("A").txVersion >= BAND) end
      -- the owner wakes up with its prepared apply of op 2
      assert.is_false(late_apply(tm, t, 2, 7))
      assert.are.same(want, balances())
      assert.are.same({}, doc("A").pendingTransactions)
      assert.are.same({}, doc("B").pendingTransactions)
      assert.are.equal(direction == "forward" and "done" or "cancelled", assert(tm:get(t._id)).state)
    end)
  end

  it("a taken-over owner's late finish does nothing", function()
    local tm = owner()
    local t = assert(tm:begin(TRANSFER))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    assert(tm:step("apply", t, 2))
    assert(tm:step("commit", t)) -- the owner stalls before its finishes
    core.sleep(0.01)
    local report = assert(rescuer("forward"):recover())
    assert.are.equal(1, report.done)
    assert.are.same({ A = 900, B = 1100 }, balances())
    for i = 1, 2 do assert.is_false(late_finish(tm, t, i)) end
    -- the escrowed credit was moved into B's balance once
    assert.are.same({ A = 900, B = 1100 }, balances())
    assert.are.same({}, doc("B").txEscrow or {})
    assert.are.same({}, doc("B").pendingTransactions)
  end)

  -- The owner's apply fails as a lost reply does (core.fault "drop": not
  -- sent); the copy still on its way is sent by the spec after the
  -- transaction is done.
  describe("an owner's own apply whose reply was lost", function()
    for _, min in ipairs { false, 0 } do
      it("lands once, in a transaction run at once" .. (min and " with a floor" or ""), function()
        local tm = owner()
        core.fault("apply:drop:1")
        local T = assert(tm:transfer("accounts", "A", "B", 100, min and { min = min } or nil))
        core.fault(nil)
        assert.are.equal("done", T.state)
        assert.are.same({ A = 900, B = 1100 }, balances())
        -- the owner moved the band of the document(s) the lost batch
        -- went to before it read them again
        assert.is_true(doc("A").txVersion >= BAND)
        -- the dropped write arrives now, as it was sent, fenced by 7: both
        -- ops, or with a floor the guarded debit alone (guarded ops go
        -- first, docs/guards.md)
        local items = { { tid = stored.mark(T), op = T.ops[1], version = 7 } }
        if not min then items[2] = { tid = stored.mark(T), op = T.ops[2], version = 7 } end
        local res = assert(tm.engine.steps:apply_many(accounts, items))
        assert.are.equal(0, res.matched)
        assert.are.same({ A = 900, B = 1100 }, balances())
        assert.are.same({}, doc("A").pendingTransactions)
        assert.are.same({}, doc("B").pendingTransactions)
      end)
    end

    it("lands once, step by step", function()
      local tm = owner()
      local t = assert(tm:begin(TRANSFER))
      assert(tm:step("claim", t))
      core.fault("apply:drop:1")
      assert(tm:step("apply", t, 2))
      core.fault(nil)
      assert.is_true(doc("B").txVersion >= BAND)
      assert(tm:step("apply", t, 1))
      assert(tm:step("commit", t))
      assert(tm:step("finish", t, 1))
      assert(tm:step("finish", t, 2))
      assert(tm:step("done", t))
      assert.are.same({ A = 900, B = 1100 }, balances())
      assert.is_false(late_apply(tm, t, 2, 7))
      assert.are.same({ A = 900, B = 1100 }, balances())
      assert.are.same({}, doc("B").pendingTransactions)
    end)

    it("a step that failed on it moves the band on its next try", function()
      local tm = owner(0) -- no retry: the step answers the error
      local t = assert(tm:begin(TRANSFER))
      assert(tm:step("claim", t))
      core.fault("apply:drop:1")
      local res, err = tm:step("apply", t, 2)
      core.fault(nil)
      assert.is_nil(res)
      assert.is_true(err.transient)
      assert.are.equal(7, doc("B").txVersion) -- nothing written yet
      -- the next try moves the band first, then applies once
      assert(tm:step("apply", t, 2))
      assert.is_true(doc("B").txVersion >= BAND)
      assert.is_false(late_apply(tm, t, 2, 7))
      assert.are.same({ A = 1000, B = 1000 }, balances())
      assert.are.equal(1, #doc("B").pendingTransactions)
      assert.are.equal(100, doc("B").txPending.balance)
    end)

    it("does not land after the owner rolled the transaction back", function()
      local tm = owner(0)
      local t = assert(tm:begin(TRANSFER))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      core.fault("apply:drop:1")
      assert.is_nil(tm:step("apply", t, 2))
      core.fault(nil)
      -- the owner gives up: its undo of op 2 (nothing to undo there)
      -- moves B's band first
      assert(tm:rollback(t))
      assert.are.equal("cancelled", assert(tm:get(t._id)).state)
      assert.is_true(doc("B").txVersion >= BAND)
      assert.is_false(late_apply(tm, t, 2, 7))
      assert.are.same({ A = 1000, B = 1000 }, balances())
      assert.are.same({}, doc("A").pendingTransactions)
      assert.are.same({}, doc("B").pendingTransactions)
    end)
  end)
end)

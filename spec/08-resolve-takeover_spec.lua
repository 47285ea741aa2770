-- An op that meets a holder whose owner's lease passed drives it to the
-- end recovery gives it (Engine:resolve), and claims it first as
-- recovery does, whatever state it is in: a canceling holder is undone
-- at epoch 2, a takeover, so with version fencing its undos move each
-- version by a band and fence the documents never applied.  The dead
-- owner's apply whose reply was lost (still on its way) then no longer
-- lands after the holder ended cancelled.  Recovery's own claim of the
-- same holder is the control.  A failure while driving the holder is not
-- the caller's: its op waits as for a live holder (`busy`) and the next
-- op drives the holder again; and a hold's opener, which sends its own
-- applies once, retries the applies of a holder it takes over.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local stored = require "mongotx.stored"

local core = mongotx.core

describe("#server resolve claims the holder it drives", function()
  local db, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
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

  local TRANSFER = {
    { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -100 } } },
    { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 100 } } },
  }

  -- The owner: claims T (versions 7, 7), applies op 1 (A), loses the
  -- reply of op 2's apply (B: the copy is still on its way), moves T to
  -- canceling (a caller's rollback) and dies before any undo.
  local function dead_owner()
    local tm = assert(db:manager { application = "owner", fencing = "version", lease = 0,
                                   retries = 0, escrow = false })
    local t = assert(tm:begin(TRANSFER))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    core.fault("apply:drop:1")
    assert.is_nil(tm:step("apply", t, 2))
    core.fault(nil)
    assert(tm:step("cancel", t))
    local T = assert(tm:get(t._id))
    assert.are.same({ "canceling", 1 }, { T.state, T.epoch })
    core.sleep(0.05) -- its lease (0) passed
    return tm, t
  end

  -- The copy of op 2's apply, fenced by the version the owner read.
  local function late_apply(tm, t)
    local T = assert(tm:get(t._id))
    return assert(tm.engine.steps:apply(accounts, stored.mark(T), T.ops[2], 7)).applied
  end

  local SET_A = { { collection = "accounts", id = "A", update = { ["$set"] = { frozen = true } },
                    undo = { ["$unset"] = { frozen = "" } } } }

  it("an exclusive op that meets a canceling holder claims it: the late apply is fenced", function()
    local owner, t = dead_owner()
    local payer = assert(db:manager { application = "payer", fencing = "version" })
    -- a $set of A (exclusive) meets T's marker: resolve claims T and unwinds it
    assert(payer:run(SET_A))
    assert.are.equal("cancelled", assert(owner:get(t._id)).state)
    assert.are.same({ A = 1000, B = 1000 }, balances())
    assert.is_true(doc("A").frozen)
    -- the copy of op 2's apply arrives now
    assert.is_false(late_apply(owner, t), "the lost apply landed after T was cancelled")
    assert.are.equal(2, assert(owner:get(t._id)).epoch) -- claimed: a takeover
    assert.are.same({ A = 1000, B = 1000 }, balances())
    assert.are.same({}, doc("A").pendingTransactions)
    assert.are.same({}, doc("B").pendingTransactions)
  end)

  it("control: recovery's claim of the canceling holder fences it", function()
    local owner, t = dead_owner()
    local rescuer = assert(db:manager { application = "rescuer", fencing = "version",
                                        stale_after = 0, lease = 5 })
    assert(rescuer:recover())
    assert.are.equal("cancelled", assert(owner:get(t._id)).state)
    assert.is_false(late_apply(owner, t))
    assert.are.same({ A = 1000, B = 1000 }, balances())
    assert.are.same({}, doc("B").pendingTransactions)
  end)

  -- tm:rollback and tm:commit of another owner's canceling transaction
  -- (Engine:drive) claim it first too, live owner or dead.
  for _, how in ipairs { "rollback", "commit" } do
    it(("a %s of another owner's canceling transaction claims it: the late apply is fenced"):format(how),
      function()
        local owner, t = dead_owner()
        local other = assert(db:manager { application = "other", fencing = "version" })
        if how == "rollback" then
          assert.is_true(other:rollback(t))
        else
          local ok, err = other:commit(t)
          assert.is_nil(ok)
          assert.are.equal("cancelled", err.code, tostring(err))
        end
        assert.is_false(late_apply(owner, t), "the lost apply landed after T was cancelled")
        local T = assert(owner:get(t._id))
        assert.are.same({ "cancelled", 2 }, { T.state, T.epoch }, "not claimed: no takeover")
        assert.are.same({ A = 1000, B = 1000 }, balances())
        assert.are.same({}, doc("A").pendingTransactions)
        assert.are.same({}, doc("B").pendingTransactions)
      end)
  end

  it("a transient failure driving the holder leaves it holding: busy, then driven again", function()
    local owner, t = dead_owner()
    local events = {}
    local payer = assert(db:manager { application = "payer", fencing = "version", retries = 0,
      on_event = function(name, info)
        if name == "resolve" then events[#events + 1] = { info.id, info.reason } end
      end })
    core.fault("undo:drop:1") -- the takeover's first undo (op 2, B) loses its reply
    local ok, err = payer:run(SET_A)
    core.fault(nil)
    assert.is_nil(ok)
    -- the payer's own answer: busy (retries = 0), not the holder's error
    assert.are_not.equal(t._id, err.id, "the holder's error came back as the payer's")
    assert.are.equal("busy", err.code)
    assert.are.equal("cancelled", assert(payer:get(err.id)).state)
    assert.are.same({ { t._id, "stream" } }, events)
    local T = assert(owner:get(t._id))
    assert.are.same({ "canceling", 2 }, { T.state, T.epoch }) -- claimed by the payer
    assert.is_nil(doc("A").frozen)
    -- the payer's next op drives it again (its own claim, not yet lapsed)
    assert(payer:run(SET_A))
    assert.are.same({ "cancelled", 2 }, { assert(owner:get(t._id)).state, assert(owner:get(t._id)).epoch })
    assert.is_true(doc("A").frozen)
    assert.is_false(late_apply(owner, t))
    assert.are.same({ A = 1000, B = 1000 }, balances())
    assert.are.same({}, doc("A").pendingTransactions)
    assert.are.same({}, doc("B").pendingTransactions)
  end)

  it("a hold's opener retries the applies of a holder it takes over", function()
    -- the dead owner: pending, its credit of A applied (exclusive: A's
    -- txHeld names it, so the hold's floor guard on A waits for it), its
    -- debit of B not yet
    local owner = assert(db:manager { application = "owner", fencing = "version", lease = 0,
                                      escrow = false })
    local t = assert(owner:begin {
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 100 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = -100 } } } })
    assert(owner:step("claim", t))
    assert(owner:step("apply", t, 1))
    core.sleep(0.05) -- its lease (0) passed
    local retried = {}
    local opener = assert(db:manager { application = "opener", fencing = "version",
      on_event = function(name, info)
        -- the takeover's claim of t: its apply of op 2 (B) then loses its reply once
        if name == "claim" and info.id == t._id then core.fault("apply:drop:1") end
        if name == "retry" then retried[#retried + 1] = { info.id, info.step } end
      end })
    local H = assert(opener:hold("accounts", "A", "B", 50, { min = 0, id = "h1", expires = 600 }))
    core.fault(nil)
    assert.are.equal("held", H.hold.status)
    assert.are.same({ { t._id, "apply" } }, retried)
    local T = assert(owner:get(t._id))
    assert.are.same({ "done", 2 }, { T.state, T.epoch })
    assert.are.same({ A = 1050, B = 900 }, balances())
    assert.are.equal(50, doc("B").txPending.balance) -- the hold's credit, in escrow
    for _, id in ipairs { "A", "B" } do -- the open hold's marker only
      assert.are.same({ "h1" }, doc(id).pendingTransactions)
    end
  end)
end)

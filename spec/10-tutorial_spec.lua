-- The seed's tutorial (MongoDB "Perform Two Phase Commits"), walked one
-- step at a time with tm:step, checking after every step what the
-- accounts and the transactions collection hold, and repeating every step
-- to show repeating it changes nothing.  The manager applies credits in
-- place, as the tutorial does (escrow = false); spec/29-escrow_spec.lua
-- walks the same steps with the default escrow.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

-- lastModified is the server's $currentDate at millisecond resolution:
-- wait a little between transitions so that it must strictly increase.
local function tick() mongotx.core.sleep(0.005) end

describe("#server tutorial", function()
  local db, tm, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager{ application = "app-1", escrow = false })
    accounts = db:collection("accounts")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
    })
  end)

  local function account(id)
    return assert(accounts:find_one({ _id = id }))
  end

  local function transfer_ops(value)
    return {
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -value } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = value } } },
    }
  end

  -- The transaction's state, and its lastModified (a Date later than prev).
  local function check_state(id, state, prev)
    local T = assert(tm:get(id))
    assert.are.equal(state, T.state)
    assert.are.equal("date", mongotx.type(T.lastModified))
    if prev then assert.is_true(prev < T.lastModified) end
    return T.lastModified, T
  end

  local function check_accounts(a_balance, a_marks, b_balance, b_marks)
    local A, B = account("A"), account("B")
    assert.are.equal(a_balance, A.balance)
    assert.are.same(a_marks, A.pendingTransactions)
    assert.are.equal(b_balance, B.balance)
    assert.are.same(b_marks, B.pendingTransactions)
  end

  it("walks a transfer of 100 from A to B step by step, each step safe to repeat", function()
    -- Initialize a transfer record: state initial, lastModified now.
    local t = assert(tm:begin(transfer_ops(100), { id = 1 }))
    assert.are.equal(1, t._id)
    assert.are.equal("initial", t.state)
    local last, T = check_state(1, "initial")
    assert.are.equal(2, #T.ops)
    assert.are.same({ ["$inc"] = { balance = -100 } }, T.ops[1].update)
    assert.are.same({ ["$inc"] = { balance = 100 } }, T.ops[1].undo)
    assert.are.equal(1, db:collection("transactions"):count({}))
    check_accounts(1000, {}, 1000, {})

    -- Retrieve the transaction and update its state to pending.
    tick()
    local claimed = assert(tm:step("claim", t))
    assert.are.equal("pending", claimed.state)
    assert.are.equal("app-1", claimed.application)
    last, T = check_state(1, "pending", last)
    assert.are.equal("app-1", T.application)
    check_accounts(1000, {}, 1000, {})

    -- Apply the transaction to both accounts; repeating does not double it.
    assert.are.same({ applied = true }, assert(tm:step("apply", t, 1)))
    check_accounts(900, { 1 }, 1000, {})
    assert.are.same({ applied = true }, assert(tm:step("apply", t, 1)))
    check_accounts(900, { 1 }, 1000, {})
    assert.are.same({ applied = true }, assert(tm:step("apply", t, 2)))
    check_accounts(900, { 1 }, 1100, { 1 })
    assert.are.same({ applied = true }, assert(tm:step("apply", t, 2)))
    check_accounts(900, { 1 }, 1100, { 1 })
    check_state(1, "pending")

    -- Update the transaction state to applied.
    tick()
    assert.are.same({ moved = true }, assert(tm:step("commit", t)))
    last = check_state(1, "applied", last)
    assert.are.same({ moved = false }, assert(tm:step("commit", t)))
    local again = check_state(1, "applied")
    assert.are.equal(last:value(), again:value()) -- the repeat wrote nothing
    check_accounts(900, { 1 }, 1100, { 1 })

    -- Update both accounts' list of pending transactions.
    assert.are.same({ finished = true }, assert(tm:step("finish", t, 1)))
    check_accounts(900, {}, 1100, { 1 })
    assert.are.same({ finished = false }, assert(tm:step("finish", t, 1)))
    check_accounts(900, {}, 1100, { 1 })
    assert.are.same({ finished = true }, assert(tm:step("finish", t, 2)))
    check_accounts(900, {}, 1100, {})
    assert.are.same({ finished = false }, assert(tm:step("finish", t, 2)))
    check_accounts(900, {}, 1100, {})
    check_state(1, "applied")

    -- Update the transaction state to done.
    tick()
    assert.are.same({ moved = true }, assert(tm:step("done", t)))
    last = check_state(1, "done", last)
    assert.are.same({ moved = false }, assert(tm:step("done", t)))
    assert.are.equal(last:value(), check_state(1, "done"):value())

    -- What the accounts hold in the end: balances moved once, markers
    -- empty, and each document's version counted every write mongotx made.
    assert.are.same({
      { _id = "A", balance = 900, pendingTransactions = {}, txVersion = 2 },
      -- the credit raised B, so B held the transaction in txHeld until
      -- its finish (README, "Guards")
      { _id = "B", balance = 1100, pendingTransactions = {}, txHeld = {}, txVersion = 2 },
    }, helpers.dump(accounts))
    assert.are.same({ initial = 0, pending = 0, applied = 0, done = 1, canceling = 0,
                      cancelled = 0, parked = 0 }, assert(tm:stats()))
  end)

  it("a repeated claim leaves the transaction pending and the accounts alone", function()
    local t = assert(tm:begin(transfer_ops(100), { id = 1 }))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    -- a transition out of a state the transaction is not in is refused
    for _, step in ipairs { "done", "cancelled" } do
      local res, err = tm:step(step, t)
      assert.is_nil(res)
      assert.are.equal("state", err.code)
    end
    check_state(1, "pending")
    check_accounts(900, { 1 }, 1000, {})
    -- and it can still be driven to the end
    local final = assert(tm:commit(t))
    assert.are.equal("done", final.state)
    check_state(1, "done")
    check_accounts(900, {}, 1100, {})
  end)

  it("rolls a pending transaction back as the tutorial does, each step safe to repeat", function()
    local t = assert(tm:begin(transfer_ops(100), { id = 1 }))
    assert(tm:step("claim", t))
    assert.are.same({ applied = true }, assert(tm:step("apply", t, 1)))
    check_accounts(900, { 1 }, 1000, {})
    local last = check_state(1, "pending")

    -- Update the transaction state to canceling.
    tick()
    assert.are.same({ moved = true }, assert(tm:step("cancel", t)))
    last = check_state(1, "canceling", last)
    assert.are.same({ moved = false }, assert(tm:step("cancel", t)))
    check_state(1, "canceling")

    -- Undo on both accounts: only where it was applied, and only once.
    assert.are.same({ undone = false }, assert(tm:step("undo", t, 2)))
    check_accounts(900, { 1 }, 1000, {})
    assert.are.same({ undone = true }, assert(tm:step("undo", t, 1)))
    check_accounts(1000, {}, 1000, {})
    assert.are.same({ undone = false }, assert(tm:step("undo", t, 1)))
    check_accounts(1000, {}, 1000, {})

    -- Update the transaction state to cancelled.
    tick()
    assert.are.same({ moved = true }, assert(tm:step("cancelled", t)))
    last = check_state(1, "cancelled", last)
    assert.are.same({ moved = false }, assert(tm:step("cancelled", t)))
    assert.are.equal(last:value(), check_state(1, "cancelled"):value())
    check_accounts(1000, {}, 1000, {})
    -- a cancelled transaction cannot be committed any more
    assert.is_nil((tm:commit(t)))
    check_state(1, "cancelled")
    check_accounts(1000, {}, 1000, {})
  end)

  it("tm:transfer runs it in one call and writes source, destination and value", function()
    local done = assert(tm:transfer("accounts", "A", "B", 100, { id = 1 }))
    assert.are.equal("done", done.state)
    assert.are.equal("A", done.source)
    assert.are.equal("B", done.destination)
    assert.are.equal(100, done.value)
    local T = assert(tm:get(1))
    assert.are.equal("done", T.state)
    assert.are.equal("A", T.source)
    assert.are.equal("B", T.destination)
    assert.are.equal(100, T.value)
    assert.are.equal("app-1", T.application)
    assert.are.equal("date", mongotx.type(T.lastModified))
    check_accounts(900, {}, 1100, {})
  end)

  it("tm:transfer with a field and a minimum moves the amount once per id", function()
    assert(accounts:insert_one({ _id = "C", credits = 50 }))
    assert(accounts:insert_one({ _id = "D", credits = 0 }))
    local done = assert(tm:transfer("accounts", "C", "D", 30,
      { field = "credits", min = 0, id = "x-1", meta = { who = "alice" } }))
    assert.are.equal("done", done.state)
    assert.are.same({ who = "alice" }, assert(tm:get("x-1")).meta)
    -- repeating the call with the same id does not move it again
    local again = assert(tm:transfer("accounts", "C", "D", 30,
      { field = "credits", min = 0, id = "x-1", meta = { who = "alice" } }))
    assert.are.equal("done", again.state)
    assert.are.equal(20, account("C").credits)
    assert.are.equal(30, account("D").credits)
    assert.are.same({}, account("C").pendingTransactions)
    assert.are.same({}, account("D").pendingTransactions)
    assert.are.equal(1, db:collection("transactions"):count({}))
    check_accounts(1000, {}, 1000, {})
  end)

  it("tm:transfer below the minimum ends cancelled and moves nothing", function()
    local ok, err = tm:transfer("accounts", "A", "B", 1001, { min = 0, id = 2 })
    assert.is_nil(ok)
    assert.are.equal("guard", err.code)
    assert.are.equal(1, err.op)
    assert.are.equal(2, err.id)
    local T = assert(tm:get(2))
    assert.are.equal("cancelled", T.state)
    assert.are.equal("string", type(T.reason))
    assert.truthy(T.reason:find("where", 1, true))
    check_accounts(1000, {}, 1000, {})
  end)
end)

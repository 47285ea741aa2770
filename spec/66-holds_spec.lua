-- Holds (docs/holds.md): tm:hold reserves (the debit in place, its floor
-- checked now; the credit in escrow), tm:capture posts all or part (the
-- rest back to `from` in the finish's writes), tm:void returns it all,
-- and a hold past its expiry, by the server's clock, is never captured:
-- a capture or void that meets it expires it, and so does recovery,
-- which reads no hold before its expiry and never drives one forward.
-- Each case checks what the accounts and the transaction hold afterwards.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local Date = mongotx.core.Date
-- one read more a call where the server cannot compare with $$NOW in a
-- write (FerretDB v1): versions before a create, its clock before a decision
local clock_reads = helpers.no_deadlines() and 1 or 0

describe("#server holds", function()
  local db, accounts, txs, tm

  local function setup(balances, opts)
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    local docs = {}
    for id, b in pairs(balances) do docs[#docs + 1] = { _id = id, balance = b } end
    assert(accounts:insert_many(docs))
    tm = assert(db:manager(opts or { application = "app-1" }))
  end

  after_each(function() if db then db:close() end db = nil end)

  -- { balance, txPending.balance, markers, txHeld } of account id
  local function seen(id)
    local d = assert(accounts:find_one({ _id = id }))
    return { d.balance, d.txPending and d.txPending.balance or 0,
             #(d.pendingTransactions or {}), #(d.txHeld or {}) }
  end

  -- Moves hold id's expiry (and so its deadline) `secs` into the past,
  -- as if it had been taken that long before: what the database holds
  -- decides, not how long the spec slept.
  local function expire_now(id, secs)
    local at = Date(math.floor(assert(tm:server_now()) - (secs or 1) * 1000))
    assert(txs:update_one({ _id = id }, { ["$set"] = { ["hold.expires"] = at, deadline = at } }))
  end

  it("reserves: from lowered at once, to credited only in escrow, nobody held", function()
    setup { A = 100, B = 0 }
    local H = assert(tm:hold("accounts", "A", "B", 60, { min = 0, id = "h1", expires = 600 }))
    assert.are.equal("pending", H.state)
    assert.are.equal("held", H.hold.status)
    assert.are.equal(60, H.hold.amount)
    assert.are.same({ 40, 0, 1, 0 }, seen("A"))
    assert.are.same({ 0, 60, 1, 0 }, seen("B"))
    local T = assert(txs:find_one({ _id = "h1" }))
    assert.are.equal("pending", T.state)
    assert.is_nil(T.hold.ready) -- no write after the applies: the marks say it is open
    assert.are.equal(T.hold.expires:value(), T.deadline:value()) -- nobody claims it before
    local now = assert(tm:server_now())
    assert.truthy(math.abs(T.hold.expires:value() - (now + 600000)) < 5000)
    -- the floor is checked now: a second hold or a transfer beyond it is refused
    local none, err = tm:hold("accounts", "A", "B", 41, { min = 0, id = "h2" })
    assert.is_nil(none)
    assert.are.equal("guard", err.code)
    none, err = tm:transfer("accounts", "A", "B", 41, { min = 0 })
    assert.is_nil(none)
    assert.are.equal("guard", err.code)
    assert.are.same({ 40, 0, 1, 0 }, seen("A"))
    -- the escrowed credit cannot be spent, and does not make B's floor wait
    none, err = tm:transfer("accounts", "B", "A", 1, { min = 0 })
    assert.is_nil(none)
    assert.are.equal("guard", err.code)
    assert(tm:transfer("accounts", "A", "B", 40, { min = 0 }))
    assert(tm:transfer("accounts", "B", "A", 40, { min = 0 }))
    assert.are.same({ 40, 0, 1, 0 }, seen("A"))
    assert.are.same({ 0, 60, 1, 0 }, seen("B"))
  end)

  it("captures all of it: to credited, the escrow emptied, done", function()
    setup { A = 100, B = 5 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    local T = assert(tm:capture("h1"))
    assert.are.equal("done", T.state)
    assert.are.same({ 40, 0, 0, 0 }, seen("A"))
    assert.are.same({ 65, 0, 0, 0 }, seen("B"))
    local stored = assert(tm:get("h1"))
    assert.are.equal("done", stored.state)
    assert.are.equal("captured", stored.hold.status)
    assert.are.equal(60, stored.hold.captured)
  end)

  it("captures part: the part to to, the rest back to from, in the finish's writes", function()
    setup { A = 100, B = 5 }
    assert(tm:hold("accounts", "A", "B", 60, { min = 0, id = "h1" }))
    db.client:reset_counters()
    local T = assert(tm:capture("h1", 25))
    -- its read, the count of its marks, the decision, finish (one bulk
    -- write for both documents), done; where the server cannot compare
    -- with $$NOW in a write, a read of its clock before the decision
    assert.are.same({ commands = 5 + clock_reads, writes = 4 }, db.client:counters())
    assert.are.equal("done", T.state)
    assert.are.same({ 75, 0, 0, 0 }, seen("A"))
    assert.are.same({ 30, 0, 0, 0 }, seen("B"))
    local stored = assert(tm:get("h1"))
    assert.are.equal(25, stored.hold.captured)
    assert.are.equal("captured", stored.hold.status)
    assert.are.same({ balance = 35 }, stored.ops[1].settle)
    assert.are.same({ balance = 25 }, stored.ops[2].settle)
  end)

  it("refuses a capture of more than is held, nothing changed", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    local before = helpers.db_dump(db.client, db.name)
    for _, n in ipairs { 61, 0, -1, 0 / 0, math.huge } do
      local none, err = tm:capture("h1", n)
      assert.is_nil(none)
      assert.are.equal("invalid", err.code, tostring(err))
      assert.are.equal("capture", err.step)
    end
    assert.has_error(function() tm:capture("h1", "60") end, "capture: amount must be a number")
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end)

  it("answers a retried capture with the first one's result, and refuses another outcome", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    local first = assert(tm:capture("h1", 30))
    local again = assert(tm:capture("h1", 30))
    assert.are.equal(first.state, again.state)
    assert.are.equal(30, again.hold.captured)
    local none, err = tm:capture("h1", 20)
    assert.is_nil(none)
    assert.are.equal("state", err.code)
    assert.are.equal("captured", err.status)
    assert.are.equal(30, err.captured)
    none, err = tm:capture("h1") -- all of it is another amount too
    assert.is_nil(none)
    assert.are.equal("captured", err.status)
    none, err = tm:void("h1")
    assert.is_nil(none)
    assert.are.equal("captured", err.status)
    assert.are.same({ 70, 0, 0, 0 }, seen("A"))
    assert.are.same({ 30, 0, 0, 0 }, seen("B"))
  end)

  it("voids: everything back, a repeat answers the same, a capture after it is refused", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    local T = assert(tm:void("h1"))
    assert.are.equal("cancelled", T.state)
    assert.are.equal("voided", T.hold.status)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0, 0 }, seen("B"))
    T = assert(tm:void("h1"))
    assert.are.equal("voided", T.hold.status)
    local none, err = tm:capture("h1")
    assert.is_nil(none)
    assert.are.equal("voided", err.status)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
    assert.are.equal("voided", assert(txs:find_one({ _id = "h1" })).cause)
  end)

  it("never captures a hold past its expiry: the capture expires it", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1", expires = 600 }))
    expire_now("h1")
    assert.are.equal("expired", assert(tm:get("h1")).hold.status)
    local none, err = tm:capture("h1", 10)
    assert.is_nil(none)
    assert.are.equal("state", err.code)
    assert.are.equal("expired", err.status)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0, 0 }, seen("B"))
    local T = assert(txs:find_one({ _id = "h1" }))
    assert.are.equal("cancelled", T.state)
    assert.are.equal("expired", T.cause)
    assert.is_nil(T.hold.captured)
  end)

  it("is decided by no step of tm:step, expired or not, nothing written", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { min = 0, id = "h1", expires = 600 }))
    local stepper = assert(db:manager { application = "app-2" })
    for _, expired in ipairs { false, true } do
      if expired then expire_now("h1") end
      local before = helpers.db_dump(db.client, db.name)
      for _, step in ipairs { { "claim" }, { "apply", 2 }, { "commit" }, { "finish", 1 },
                              { "done" }, { "cancel" }, { "undo", 1 } } do
        for _, m in ipairs { tm, stepper } do
          local none, err = m:step(step[1], { _id = "h1" }, step[2])
          assert.is_nil(none, step[1])
          assert.is_table(err, step[1])
          assert.truthy(err.code == "invalid" or err.code == "state", step[1] .. ": " .. err.code)
        end
      end
      helpers.assert_dump_unchanged(before, db.client, db.name)
    end
    -- what decides it still does: the expired hold ends expired
    local none, err = tm:capture("h1", 60)
    assert.is_nil(none)
    assert.are.equal("expired", err.status)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0, 0 }, seen("B"))
  end)

  it("answers a retried refused hold with the refusal the first answer gave", function()
    setup { A = 10, B = 0 }
    local answers = {}
    for n = 1, 2 do
      local none, err = tm:hold("accounts", "A", "B", 60, { min = 0, id = "h9" })
      assert.is_nil(none)
      answers[n] = { err.cause, err.op, err.collection, err.document }
    end
    assert.are.same({ "guard", 1, "accounts", "A" }, answers[1])
    assert.are.same(answers[1], answers[2])
    assert.are.same({ 10, 0, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0, 0 }, seen("B"))
  end)

  it("a void that meets an expired hold ends it expired", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1", expires = 600 }))
    expire_now("h1")
    local T = assert(tm:void("h1"))
    assert.are.equal("expired", T.hold.status)
    assert.are.equal("expired", assert(txs:find_one({ _id = "h1" })).cause)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
  end)

  it("judges expiry by the server's clock, not the caller's estimate", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1", expires = 600 }))
    -- this process's estimate of the server's clock an hour ahead: the
    -- hold is still the server's to judge, and it is not expired
    local clock = tm.engine.server_clock
    assert(clock:now())
    clock.offset = clock.offset + 3600 * 1000
    local T = assert(tm:capture("h1", 60))
    assert.are.equal("done", T.state)
    assert.are.same({ 60, 0, 0, 0 }, seen("B"))
  end)

  it("recovery reads no hold before its expiry, and expires it after, never forward", function()
    setup({ A = 100, B = 0 }, { application = "app-1", stale_after = 0, lease = 0 })
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1", expires = 600 }))
    local other = assert(db:manager { application = "app-2", stale_after = 0, lease = 0 })
    for _, m in ipairs { tm, other } do
      local report = assert(m:recover())
      assert.are.equal(0, report.examined)
    end
    assert.are.same({ 40, 0, 1, 0 }, seen("A"))
    expire_now("h1")
    local report = assert(other:recover())
    assert.are.equal(1, report.examined)
    assert.are.equal(1, report.cancelled)
    local T = assert(tm:get("h1"))
    assert.are.equal("cancelled", T.state)
    assert.are.equal("expired", T.hold.status)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0, 0 }, seen("B"))
  end)

  it("recovery expires a hold shorter than the opener's lease once its expiry passed", function()
    -- the opener's applies are fenced by the expiry, not by its lease of 60 s
    setup({ A = 100, B = 0 }, { application = "app-1", stale_after = 0, lease = 60 })
    local H = assert(tm:hold("accounts", "A", "B", 60, { id = "h1", expires = 0.5 }))
    assert.are.equal(H.hold.expires:value(), assert(txs:find_one({ _id = "h1" })).deadline:value())
    local other = assert(db:manager { application = "app-2", stale_after = 0 })
    local report
    for _ = 1, 100 do -- until the server's clock is past the expiry
      report = assert(other:recover())
      if report.cancelled == 1 then break end
      mongotx.core.sleep(0.05)
    end
    assert.are.equal(1, report.cancelled)
    assert.are.equal("expired", assert(tm:get("h1")).hold.status)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0, 0 }, seen("B"))
  end)

  it("recovery in batches expires many holds, leaving the others", function()
    setup({ A = 1000, B = 0 }, { application = "app-1", stale_after = 0, lease = 0 })
    for i = 1, 12 do assert(tm:hold("accounts", "A", "B", 10, { id = "h" .. i, expires = 600 })) end
    for i = 1, 6 do expire_now("h" .. i) end
    local report = assert(tm:recover { batch = 4 })
    assert.are.equal(6, report.examined)
    assert.are.equal(6, report.cancelled)
    for i = 1, 12 do
      assert.are.equal(i <= 6 and "expired" or "held", assert(tm:get("h" .. i)).hold.status)
    end
    assert.are.same({ 940, 0, 6, 0 }, seen("A"))
    assert.are.same({ 0, 60, 6, 0 }, seen("B"))
  end)

  it("refuses what is not a hold's input, writing nothing", function()
    setup { A = 100, B = 0 }
    local before = helpers.db_dump(db.client, db.name)
    local function refused(msg, ...)
      local none, err = tm:hold(...)
      assert.is_nil(none)
      assert.are.equal("invalid", err.code, tostring(err))
      assert.truthy(err.message:find(msg, 1, true), err.message)
    end
    refused("expires", "accounts", "A", "B", 10, { expires = 0 })
    refused("expires", "accounts", "A", "B", 10, { expires = -1 })
    refused("amount", "accounts", "A", "B", 0)
    refused("id", "accounts", "A", "B", 10, { id = { ["$gt"] = "" } })
    refused("one op per document", "accounts", "A", "A", 10)
    assert.has_error(function() tm:hold("accounts", "A", "B", 10, { expire = 5 }) end)
    local plain = assert(db:manager { application = "app-1", escrow = false })
    local none, err = plain:hold("accounts", "A", "B", 10)
    assert.is_nil(none)
    assert.are.equal("invalid", err.code)
    assert.truthy(err.message:find("escrow", 1, true))
    helpers.assert_dump_unchanged(before, db.client, db.name)
    -- a transaction that is not a hold, and a hold decided otherwise
    assert(tm:transfer("accounts", "A", "B", 10, { id = "t1" }))
    none, err = tm:capture("t1")
    assert.is_nil(none)
    assert.are.equal("invalid", err.code)
    none, err = tm:void("nothing")
    assert.is_nil(none)
    assert.are.equal("state", err.code)
    assert(tm:hold("accounts", "A", "B", 10, { id = "h1" }))
    none, err = tm:commit({ _id = "h1" })
    assert.is_nil(none)
    assert.are.equal("invalid", err.code)
    assert.are.same({ 80, 0, 1, 0 }, seen("A"))
    assert.are.equal("pending", assert(txs:find_one({ _id = "h1" })).state)
  end)

  it("is idempotent by id: the same hold answers as it stands, another is refused", function()
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    local again = assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    assert.are.equal("held", again.hold.status)
    assert(tm:capture("h1", 20))
    again = assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    assert.are.equal("captured", again.hold.status)
    local none, err = tm:hold("accounts", "A", "B", 50, { id = "h1" })
    assert.is_nil(none)
    assert.are.equal("idempotency", err.code)
    -- one refused by its guard answers so again, as a transfer's key does
    none, err = tm:hold("accounts", "A", "B", 500, { id = "h2", min = 0 })
    assert.is_nil(none)
    assert.are.equal("guard", err.code)
    none, err = tm:hold("accounts", "A", "B", 500, { id = "h2", min = 0 })
    assert.is_nil(none)
    assert.are.equal("cancelled", err.code)
    assert.are.equal("guard", err.cause)
    -- one still opening (its opener died before ready) is in progress
    assert(txs:insert_one({ _id = "h3", state = "pending", epoch = 1, attempts = 1,
      ops = assert(txs:find_one({ _id = "h2" })).ops, application = "gone",
      hold = { amount = 500, expires = Date(0), ready = false } }))
    none, err = tm:hold("accounts", "A", "B", 500, { id = "h3", min = 0 })
    assert.is_nil(none)
    assert.are.equal("in_progress", err.code)
    assert.are.same({ 80, 0, 0, 0 }, seen("A"))
    assert.are.same({ 20, 0, 0, 0 }, seen("B"))
  end)

  it("compensates what a capture took, keeping the floor; a hold is not rolled back", function()
    setup { A = 100, B = 5 }
    assert(tm:hold("accounts", "A", "B", 60, { min = 0, id = "h1" }))
    local none, err = tm:rollback({ _id = "h1" })
    assert.is_nil(none)
    assert.are.equal("invalid", err.code)
    assert.are.same({ 40, 0, 1, 0 }, seen("A"))
    assert(tm:capture("h1", 25))
    local C = assert(tm:compensate({ _id = "h1" }))
    assert.are.equal("done", C.state)
    assert.are.same({ 100, 0, 0, 0 }, seen("A")) -- 75 and the 25 captured
    assert.are.same({ 5, 0, 0, 0 }, seen("B"))
    -- the refund keeps B's floor: with 24 left it could not give 25 back
    setup { A = 100, B = 0 }
    assert(tm:hold("accounts", "A", "B", 60, { min = 0, id = "h1" }))
    assert(tm:capture("h1", 25))
    assert(tm:transfer("accounts", "B", "A", 1, { min = 0 }))
    none, err = tm:compensate({ _id = "h1" })
    assert.is_nil(none)
    assert.are.equal("guard", err.cause)
    assert.are.same({ 24, 0, 0, 0 }, seen("B"))
  end)

  it("refuses a transaction whose settle does not fit its update as malformed", function()
    setup({ A = 100, B = 0 }, { application = "app-1", stale_after = 0, lease = 0 })
    assert(tm:hold("accounts", "A", "B", 60, { id = "h1" }))
    -- hand-edited: more than the credit holds would make money
    assert(txs:update_one({ _id = "h1" }, { ["$set"] = {
      ["ops.1.settle"] = { balance = 61 }, state = "applied" } }))
    local report = assert(tm:recover())
    assert.are.equal(1, report.malformed)
    assert.truthy(tostring(report.errors[1].error):find("settle", 1, true))
    assert.are.same({ 0, 60, 1, 0 }, seen("B"))
  end)
end)

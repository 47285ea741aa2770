-- What a hold costs (docs/holds.md, "Cost"): a hold and its capture take
-- the 7 writes of the transfer they replace, with or without a floor, as
-- the client's counters count them; and the opener sends each apply once,
-- so a hold decided between an apply and its lost answer is never applied
-- twice (the reason a hold needs no write after its applies); and a
-- decision that reads the marks after another decided the hold answers
-- with that outcome, not "opening".
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local errors = require "mongotx.errors"

-- one read more a call where the server cannot compare with $$NOW in a
-- write (FerretDB v1): versions before a create, its clock before a decision
local clock_reads = helpers.no_deadlines() and 1 or 0

describe("#server what a hold costs", function()
  local db, accounts, tm

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    assert(accounts:insert_many { { _id = "A", balance = 100 }, { _id = "B", balance = 0 } })
    tm = assert(db:manager { application = "app-1" })
  end)

  after_each(function() db:close() end)

  -- { balance, txPending.balance, markers } of account id
  local function seen(id)
    local d = assert(accounts:find_one({ _id = id }))
    return { d.balance, d.txPending and d.txPending.balance or 0, #(d.pendingTransactions or {}) }
  end

  for _, min in ipairs { false, 0 } do
    it("is a transfer's 7 writes for a hold and its capture, " .. (min and "with" or "without") ..
       " a floor", function()
      local opts = { min = min or nil }
      assert(tm:transfer("accounts", "A", "B", 1, opts)) -- (the server's probes, once a manager)
      -- a floor: the guarded debit first, then the credit (no credit is
      -- seen whose debit did not apply), one round trip more
      local guard = min and 1 or 0
      db.client:reset_counters()
      assert(tm:transfer("accounts", "A", "B", 1, opts))
      assert.are.same({ commands = 5 + guard + clock_reads, writes = 7 }, db.client:counters())
      -- the hold: create, the applies; the capture: its read, the find
      -- of the marks, the decision, both finishes in one bulk write, done
      db.client:reset_counters()
      assert(tm:hold("accounts", "A", "B", 10, { id = "h1", min = opts.min }))
      local hold = db.client:counters()
      assert.are.same({ commands = 2 + guard + clock_reads, writes = 3 }, hold)
      db.client:reset_counters()
      assert(tm:capture("h1", 4))
      local capture = db.client:counters()
      assert.are.same({ commands = 5 + clock_reads, writes = 4 }, capture)
      assert.are.equal(7, hold.writes + capture.writes)
      -- a void: its read, the find, the decision, both undos, cancelled
      assert(tm:hold("accounts", "A", "B", 5, { id = "h2", min = opts.min }))
      db.client:reset_counters()
      assert(tm:void("h2"))
      assert.are.same({ commands = 5 + clock_reads, writes = 4 }, db.client:counters())
      assert.are.same({ 94, 0, 0 }, seen("A"))
      assert.are.same({ 6, 0, 0 }, seen("B"))
    end)
  end

  it("sends each apply once: a capture between the applies and their lost answer stays the one outcome",
     function()
    -- another process captures the hold once both marks are on, before
    -- the opener hears of its applies; then the answer is lost (a
    -- transient error): sending the applies again would take 10 from A a
    -- second time, the capture having pulled the marks
    local other_db = assert(mongotx.connect(helpers.uri(), { database = db.name }))
    local other = assert(other_db:manager { application = "other" })
    local real, lost, captured = tm.engine.steps, true, nil
    tm.engine.steps = setmetatable({}, { __index = function(_, name)
      local step = real[name]
      return function(_, ...)
        local res, err = step(real, ...)
        if name == "apply_many" and res and lost then
          lost = false
          captured = assert(other:capture("h1"))
          return nil, errors.new("stream", "the answer was lost", { transient = true })
        end
        return res, err
      end
    end })
    local none, err = tm:hold("accounts", "A", "B", 10, { id = "h1" })
    tm.engine.steps = real
    assert.is_nil(none)
    assert.are.equal("stream", err.code)
    assert.are.equal(10, captured.hold.captured)
    assert.are.same({ 90, 0, 0 }, seen("A"))
    assert.are.same({ 10, 0, 0 }, seen("B"))
    assert.are.equal("captured", assert(tm:get("h1")).hold.status)
    -- the opener asks again: the hold as it stands
    local again = assert(tm:hold("accounts", "A", "B", 10, { id = "h1" }))
    assert.are.equal("captured", again.hold.status)
    assert.are.same({ 90, 0, 0 }, seen("A"))
    other_db:close()
  end)

  it("answers a void with the capture another made between its read and its find of the marks",
     function()
    -- the capture's finish pulls the marks: without both on, the hold
    -- would look as if it never opened
    assert(tm:hold("accounts", "A", "B", 10, { id = "h1", min = 0 }))
    local other_db = assert(mongotx.connect(helpers.uri(), { database = db.name }))
    local other = assert(other_db:manager { application = "other" })
    local real = db:collection("accounts")
    local first = true
    tm.engine.colls.accounts = setmetatable({}, { __index = function(_, name)
      return function(_, ...)
        if name == "find_all" and first then
          first = false
          assert(other:capture("h1", 4))
        end
        return real[name](real, ...)
      end
    end })
    local none, err = tm:void("h1")
    tm.engine.colls.accounts = nil
    assert.is_nil(none)
    assert.are.equal("state", err.code)
    assert.are.equal("captured", err.status)
    assert.are.equal(4, err.captured)
    assert.are.same({ 96, 0, 0 }, seen("A"))
    assert.are.same({ 4, 0, 0 }, seen("B"))
    other_db:close()
  end)
end)

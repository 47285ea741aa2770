-- Room (docs/guards.md, "Escrow"): an escrowed credit is
-- finished after the commit point, where a 64-bit integer that would pass
-- 2^63 - 1 is refused (MongoDB, FerretDB v2) or wraps (mongo-java-server).
-- So its apply requires room: the field at most 2^62 - 4096, and the
-- credits waiting for it, this one with them, at most 2^62.  A credit
-- without room is refused before the commit point: cancelled with cause
-- `refused`, nothing moved.  Balances are Int64 and compared on the server
-- (LuaJIT reads an Int64 back as a double).
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local core = mongotx.core

local I = core.Int64
local FIELD_MAX = "4611686018427383808" -- 2^62 - 4096
local OVER = "4611686018427387909"      -- 2^62 + 5
local NEAR_MAX = "9223372036854775800"  -- 2^63 - 8

describe("#server credit room", function()
  local db, accounts, txs, tm

  local function setup(balances)
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    local docs = {}
    for id, b in pairs(balances) do
      docs[#docs + 1] = { _id = id, balance = type(b) == "string" and I(b) or b }
    end
    assert(accounts:insert_many(docs))
    tm = assert(db:manager { application = "room" })
  end

  after_each(function() if db then db:close() end db = nil end)

  -- Does `id` hold exactly `balance` (a string: an Int64), no marker, and
  -- nothing in escrow?
  local function holds(id, balance)
    local b = type(balance) == "string" and I(balance) or balance
    assert.are.equal(1, assert(accounts:count({ _id = id, balance = b })),
      id .. " holds " .. tostring(balance))
    local d = assert(accounts:find_one({ _id = id }))
    assert.are.equal(0, #(d.pendingTransactions or {}), id .. " keeps a marker")
    local pending = d.txPending and d.txPending.balance
    assert.is_true(pending == nil or pending == 0, id .. " keeps a credit in escrow")
  end

  -- T (or its error) is cancelled with cause refused, stored so.
  local function refused(id, T, err)
    assert.is_nil(T)
    assert.are.same({ "refused", "refused" }, { err.code, err.cause })
    assert.truthy(err.message:find("): no room for the credit of balance", 1, true), err.message)
    local stored = assert(txs:find_one({ _id = id }))
    assert.are.same({ "cancelled", "refused" }, { stored.state, stored.cause })
  end

  for _, case in ipairs { { "past 2^62", OVER }, { "near 2^63 - 1", NEAR_MAX } } do
    it("transfer into a field " .. case[1] .. ": refused, nothing moved", function()
      setup { A = 100, B = case[2] }
      refused("t", tm:transfer("accounts", "A", "B", 10, { min = 0, id = "t" }))
      holds("A", 100)
      holds("B", case[2])
    end)

    it("run into a field " .. case[1] .. ": refused, nothing moved", function()
      setup { A = 100, B = case[2] }
      refused("r", tm:run({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -10 } } },
        { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 10 } } } },
        { id = "r" }))
      holds("A", 100)
      holds("B", case[2])
    end)

    it("hold into a field " .. case[1] .. ": refused, nothing held", function()
      setup { A = 100, B = case[2] }
      refused("h", tm:hold("accounts", "A", "B", 10, { min = 0, id = "h" }))
      holds("A", 100)
      holds("B", case[2])
    end)
  end

  it("transfer_many: the item without room refused, the others done", function()
    setup { A = 100, B = NEAR_MAX, C = 100, D = 5 }
    local res, errs = tm:transfer_many {
      { collection = "accounts", from = "C", to = "D", amount = 10, id = "m1" },
      { collection = "accounts", from = "A", to = "B", amount = 10, id = "m2" },
      { collection = "accounts", from = "D", to = "A", amount = 1, id = "m3" } }
    assert.are.equal("done", res[1].state)
    assert.is_false(res[2])
    refused("m2", nil, errs[2])
    assert.are.equal("done", res[3].state)
    holds("A", 101)
    holds("B", NEAR_MAX)
    holds("C", 90)
    holds("D", 14)
  end)

  it("hold_many: the hold without room fails alone, the other held", function()
    setup { A = 100, B = OVER, C = 0 }
    local res, errs = tm:hold_many {
      { collection = "accounts", from = "A", to = "B", amount = 10, id = "h1" },
      { collection = "accounts", from = "A", to = "C", amount = 20, id = "h2" } }
    assert.is_false(res[1])
    refused("h1", nil, errs[1])
    assert.are.equal("failed", assert(tm:get("h1")).hold.status)
    assert.are.equal("held", res[2].hold.status)
    holds("B", OVER)
    assert.are.equal("done", assert(tm:capture("h2")).state)
    holds("A", 80)
    holds("C", 20)
  end)

  it("a credit just inside the room is done, one past it refused", function()
    setup { A = 100, B = FIELD_MAX, C = 100, D = "4611686018427383809" }
    assert.are.equal("done", assert(tm:transfer("accounts", "A", "B", 10, { id = "in" })).state)
    holds("A", 90)
    holds("B", "4611686018427383818")
    refused("out", tm:transfer("accounts", "C", "D", 10, { id = "out" }))
    holds("C", 100)
    holds("D", "4611686018427383809")
  end)

  it("counts the credits waiting: only what they leave is room", function()
    -- B's escrow holds 2^62 - 1024 (credits in flight): 1000 fits, 2000 not
    setup { C = 10000 }
    local waiting = I("4611686018427386880")
    assert(accounts:insert_one({ _id = "B", balance = 0, txPending = { balance = waiting } }))
    assert.are.equal("done", assert(tm:transfer("accounts", "C", "B", 1000, { id = "in" })).state)
    refused("out", tm:transfer("accounts", "C", "B", 2000, { id = "out" }))
    holds("C", 9000)
    assert.are.equal(1, assert(accounts:count({ _id = "B", balance = 1000,
      ["txPending.balance"] = waiting })))
  end)

  it("a hold inside the room, captured in part: the part to B, the rest back to A", function()
    setup { A = 100, B = FIELD_MAX }
    assert(tm:hold("accounts", "A", "B", 10, { min = 0, id = "h" }))
    assert.are.equal("done", assert(tm:capture("h", 4)).state)
    holds("A", 96)
    holds("B", "4611686018427383812")
  end)

  it("refuses an escrowed credit above 2^62 up front, nothing written", function()
    setup { A = NEAR_MAX, B = 0 }
    local T, err = tm:run({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 2 ^ 63 } } } },
      { id = "big" })
    assert.is_nil(T)
    assert.are.equal("invalid", err.code)
    assert.truthy(err.message:find("at most 2^62", 1, true), err.message)
    assert.is_nil(txs:find_one({ _id = "big" }))
    holds("A", NEAR_MAX)
    holds("B", 0)
  end)
end)

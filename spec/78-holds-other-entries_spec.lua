-- A hold is decided only by capture, void or its expiry (docs/holds.md):
-- an ordinary call that names its id (tm:transfer, tm:transfer_many,
-- tm:commit_many: the ways a transfer's idempotency key is retried) from
-- another manager, before its expiry or after it, when its deadline
-- passed and the engine would take an ordinary transaction over, is
-- refused and writes nothing; the expired hold then still ends expired,
-- the money back.  (spec/66 covers tm:step, tm:commit and tm:rollback.)
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local Date = mongotx.core.Date

describe("#server a hold's id named by an ordinary call", function()
  local db, accounts, txs, tm

  after_each(function() if db then db:close() end db = nil end)

  local function seen(id)
    local d = assert(accounts:find_one({ _id = id }))
    return { d.balance, d.txPending and d.txPending.balance or 0, #(d.pendingTransactions or {}) }
  end

  it("is refused before and after its expiry, nothing written; the hold then expires", function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    assert(accounts:insert_many({ { _id = "A", balance = 100 }, { _id = "B", balance = 0 } }))
    tm = assert(db:manager { application = "app-1", lease = 1 })
    local other = assert(db:manager { application = "app-2", lease = 1, stale_after = 0 })
    assert(tm:hold("accounts", "A", "B", 80, { min = 0, id = "h1", expires = 600 }))
    local ops = {
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -80 } },
        where = { balance = { ["$gte"] = 80 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 80 } } } }
    local item = { collection = "accounts", from = "A", to = "B", amount = 80, min = 0, id = "h1" }
    for _, expired in ipairs { false, true } do
      if expired then
        -- its expiry and deadline in the past, as if taken long ago
        local at = Date(math.floor(assert(tm:server_now()) - 5000))
        assert(txs:update_one({ _id = "h1" }, { ["$set"] = { ["hold.expires"] = at, deadline = at } }))
      end
      local before = helpers.db_dump(db.client, db.name)
      for _, m in ipairs { tm, other } do
        local none, err = m:transfer("accounts", "A", "B", 80, { min = 0, id = "h1" })
        assert.is_nil(none)
        assert.are.equal("invalid", err.code)
        local results, errs = m:transfer_many({ item })
        assert.is_false(results[1])
        assert.are.equal("invalid", errs[1].code)
        results, errs = m:commit_many({ { id = "h1", ops = ops } })
        assert.is_false(results[1])
        assert.are.equal("invalid", errs[1].code)
      end
      helpers.assert_dump_unchanged(before, db.client, db.name)
      assert.are.same({ 20, 0, 1 }, seen("A"))
      assert.are.same({ 0, 80, 1 }, seen("B"))
    end
    local none, err = other:capture("h1")
    assert.is_nil(none)
    assert.are.equal("expired", err.status)
    assert.are.same({ 100, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0 }, seen("B"))
    local T = assert(txs:find_one({ _id = "h1" }))
    assert.are.equal("cancelled", T.state)
    assert.are.equal("expired", T.cause)
    assert.is_nil(T.hold.captured)
  end)
end)

-- The reads of a hold's marks (tm:get, capture and void: one hold's two
-- documents; tm:hold_views and `mongotx list --holds`: a page's, up to
-- 2 000 documents) send a sort, as every read of many documents does
-- (spec/57): FerretDB v2's unsorted cursor may repeat a document across
-- replies, and the limit, spent on the repeat, would miss one, showing an
-- open hold as opening.  Proved on what the server received (its debug log).
describe("#server the reads of holds' marks", function()
  local server = require "spec.support.server"
  local s, db

  teardown(function()
    if db then db:close() end
    if s then s:stop() end
  end)

  it("send a sort", function()
    s = assert(server.start { kind = "memory", log_level = "debug" })
    local name = helpers.db_name()
    db = assert(mongotx.connect(s.uri, { database = name }))
    local accounts = db:collection("accounts")
    local docs, list = {}, {}
    for i = 1, 120 do
      docs[2 * i - 1] = { _id = "from" .. i, balance = 10 }
      docs[2 * i] = { _id = "to" .. i, balance = 0 }
      list[i] = { collection = "accounts", from = "from" .. i, to = "to" .. i, amount = 5, id = "h" .. i }
    end
    assert(accounts:insert_many(docs))
    local tm = assert(db:manager { application = "views" })
    local opened = assert(tm:hold_many(list))
    for i = 1, 120 do assert.truthy(opened[i], "hold " .. i) end
    assert.are.equal("held", assert(tm:get("h1")).hold.status)
    local page = assert(tm:find({ hold = { ["$exists"] = true } }, { limit = 1000 }))
    assert.are.equal(120, #page)
    assert(tm:hold_views(page))
    for _, T in ipairs(page) do assert.are.equal("held", T.hold.status) end
    local unsorted, marks = {}, 0
    local marker = '"$db" : "' .. name .. '"'
    for line in io.lines(s.log) do
      local doc = line:match("document: (%b{})")
      if doc and doc:find('^{"find" : "accounts"') and doc:find(marker, 1, true) then
        marks = marks + 1
        if not doc:find('"sort" : {"_id" : 1', 1, true) then unsorted[#unsorted + 1] = doc end
      end
    end
    assert.truthy(marks >= 2, "no read of the marks in the server's log")
    assert.are.same({}, unsorted)
  end)
end)

-- Holds as operators and code see them: tm:get's hold.status, `mongotx
-- show` and `mongotx list --holds`, the events (hold, capture, void,
-- expire) and the metrics they feed (docs/metrics.md).
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local metrics = require "mongotx.metrics"
local support = require "spec.support.cli"

local no_build, run = support.no_build, support.run
local Date = mongotx.core.Date

describe("#server holds, visible", function()
  local db, txs, tm, events, m

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    txs = db:collection("transactions")
    assert(db:collection("accounts"):insert_many { { _id = "A", balance = 1000 }, { _id = "B", balance = 0 } })
    events = {}
    m = metrics.new()
    tm = assert(db:manager(m:wrap { application = "shop", stale_after = 0, lease = 0,
      on_event = function(name, info)
        if name == "hold" or name == "capture" or name == "void" or name == "expire" then
          events[#events + 1] = { name, info.id, info.amount }
        end
      end }))
    assert(tm:hold("accounts", "A", "B", 100, { id = "held", expires = 600 }))
    assert(tm:hold("accounts", "A", "B", 100, { id = "cap" }))
    assert(tm:capture("cap", 40))
    assert(tm:hold("accounts", "A", "B", 100, { id = "void" }))
    assert(tm:void("void"))
    assert(tm:hold("accounts", "A", "B", 100, { id = "late" }))
    local past = Date(math.floor(assert(tm:server_now()) - 1000))
    assert(txs:update_one({ _id = "late" }, { ["$set"] = { ["hold.expires"] = past, deadline = past } }))
    assert(tm:recover())
  end)

  after_each(function() db:close() end)

  it("tm:get says each hold's status, what was captured and when it expires", function()
    local want = { held = "held", cap = "captured", void = "voided", late = "expired" }
    for id, status in pairs(want) do
      local T = assert(tm:get(id))
      assert.are.equal(status, T.hold.status, id)
      assert.are.equal(100, T.hold.amount)
      assert.are.equal("date", mongotx.core.type(T.hold.expires))
    end
    assert.are.equal(40, assert(tm:get("cap")).hold.captured)
    -- the status is not stored: the document says what was decided
    assert.is_nil(assert(txs:find_one({ _id = "held" })).hold.status)
  end)

  it("counts an open hold active, but not stale nor the oldest until it expires", function()
    -- the open hold, last changed an hour ago
    assert(txs:update_one({ _id = "held" }, { ["$set"] = {
      lastModified = Date(math.floor(assert(tm:server_now()) - 3600 * 1000)) } }))
    local b = assert(tm:backlog())
    assert.are.equal(1, b.active)
    assert.are.equal(0, b.stale)
    assert.is_nil(b.oldest_id)
    local at = Date(math.floor(assert(tm:server_now()) - 1000))
    assert(txs:update_one({ _id = "held" }, { ["$set"] = { ["hold.expires"] = at, deadline = at } }))
    b = assert(tm:backlog())
    assert.are.equal(1, b.stale)
    assert.are.equal("held", b.oldest_id)
  end)

  it("sends an event for each decision, and the metrics count them", function()
    assert.are.same({ { "hold", "held", 100 }, { "hold", "cap", 100 }, { "capture", "cap", 40 },
      { "hold", "void", 100 }, { "void", "void", 100 }, { "hold", "late", 100 },
      { "expire", "late", 100 } }, events)
    local text = m:render()
    for _, line in ipairs {
      'mongotx_holds_opened_total{application="shop"} 4',
      'mongotx_holds_decided_total{application="shop",outcome="captured"} 1',
      'mongotx_holds_decided_total{application="shop",outcome="voided"} 1',
      'mongotx_holds_decided_total{application="shop",outcome="expired"} 1',
      'mongotx_holds_captured_amount_total{application="shop"} 40',
      'mongotx_holds_amount{application="shop"} 100',
    } do
      assert.truthy(text:find(line, 1, true), line .. " not in\n" .. text)
    end
  end)

  it("mongotx show and list --holds say held, captured (amount), voided, expired", function()
    if no_build then pending(no_build) return end
    local code, out, err = run({ "--database", db.name, "show", "cap" })
    assert.are.equal(0, code, err)
    assert.truthy(out:find("hold:%s+captured 40 of 100, expires "), out)
    code, out = run({ "--database", db.name, "show", "held" })
    assert.are.equal(0, code)
    assert.truthy(out:find("hold:%s+held: 100, expires [^\n]+ %(in "), out)
    code, out = run({ "--database", db.name, "list", "--holds" })
    assert.are.equal(0, code)
    for _, row in ipairs { "held%s+pending %(held%)", "cap%s+done %(captured%)",
                           "void%s+cancelled %(voided%)", "late%s+cancelled %(expired%)" } do
      assert.truthy(out:find(row), row .. " not in\n" .. out)
    end
    assert(tm:transfer("accounts", "A", "B", 1, { id = "plain" }))
    code, out = run({ "--database", db.name, "list", "--holds" })
    assert.are.equal(0, code)
    assert.falsy(out:find("plain", 1, true), out)
    code, out = run({ "--database", db.name, "list" })
    assert.are.equal(0, code)
    assert.truthy(out:find("plain", 1, true), out)
  end)
end)

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

  -- holds whose opener died before both applies landed: copies of `held`
  -- under other ids, whose marks are on no document (o1..o6), and one
  -- whose credit's mark is gone (half)
  local function opening_holds()
    local T = assert(txs:find_one({ _id = "held" }))
    for i = 1, 6 do
      T._id, T.mark = "o" .. i, nil
      assert(txs:insert_one(T))
    end
    assert(tm:hold("accounts", "A", "B", 100, { id = "half", expires = 600 }))
    -- (a transaction of `transactions` is marked by its _id)
    assert(db:collection("accounts"):update_one({ _id = "B" },
      { ["$pull"] = { pendingTransactions = "half" } }))
    assert.are.equal("opening", assert(tm:get("o1")).hold.status)
    assert.are.equal("opening", assert(tm:get("half")).hold.status)
  end

  it("mongotx show and list --holds say opening where tm:get does", function()
    if no_build then pending(no_build) return end
    opening_holds()
    local code, out, err = run({ "--database", db.name, "show", "o1" })
    assert.are.equal(0, code, err)
    assert.truthy(out:find("hold:%s+opening: 100, expires "), out)
    code, out = run({ "--database", db.name, "show", "held" })
    assert.are.equal(0, code)
    assert.truthy(out:find("hold:%s+held: 100, expires "), out)
    code, out = run({ "--database", db.name, "--json", "show", "half" })
    assert.are.equal(0, code)
    assert.truthy(out:find('"status":"opening"', 1, true), out)
    code, out = run({ "--database", db.name, "list", "--holds" })
    assert.are.equal(0, code)
    for _, row in ipairs { "held%s+pending %(held%)", "half%s+pending %(opening%)",
                           "o1%s+pending %(opening%)", "o6%s+pending %(opening%)",
                           "cap%s+done %(captured%)", "late%s+cancelled %(expired%)" } do
      assert.truthy(out:find(row), row .. " not in\n" .. out)
    end
    code, out = run({ "--database", db.name, "--json", "list", "--holds" })
    assert.are.equal(0, code)
    for id, status in pairs { held = "held", half = "opening", o3 = "opening", void = "voided" } do
      local line = out:match('[^\n]*"_id":"' .. id .. '"[^\n]*')
      assert.truthy(line and line:find('"status":"' .. status .. '"', 1, true), id .. ": " .. out)
    end
  end)

  it("mongotx list reads the marks of a page at once, not of each hold", function()
    if no_build then pending(no_build) return end
    opening_holds()
    local before = helpers.db_dump(db.client, db.name)
    local function list(page)
      local cmds, _, text = support.list_here(tm, db, { holds = true }, page)
      return cmds, text
    end
    -- 11 holds, 8 of them pending: the clock, the page, the marks of the
    -- page's documents (one collection), the opening ones read again
    local cmds, text = list(1000)
    assert.are.equal(4, cmds)
    assert.truthy(text:find("o4%s+pending %(opening%)"), text)
    assert.truthy(text:find("held%s+pending %(held%)"), text)
    -- pages of 4 (getMores): each page its reads, at most 4 a page
    local paged
    cmds, paged = list(4)
    assert.truthy(cmds <= 1 + 3 * 4, cmds)
    local function aged(t) return (t:gsub("%d+%.%d s", "<age>"):gsub("%s+", " ")) end
    assert.are.equal(select(2, aged(text):gsub("opening", "")), select(2, aged(paged):gsub("opening", "")))
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end)
end)

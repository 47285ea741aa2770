-- Batched holds (docs/holds.md, "hold_many"): tm:hold_many opens several
-- holds with one insert and their applies in one bulk write (two with a
-- floor), as the client's counters count them; each hold has its own
-- outcome (one refused by its floor fails alone); bad input in any item
-- writes nothing; and a hold opened in a batch is decided, expired,
-- recovered, counted and reported as one opened alone.  mongotx.group
-- (plain Lua, a coroutine scheduler) takes hold calls into its batches
-- the same way, each caller answered as its call alone.  Each case checks
-- what the accounts and the transactions hold afterwards.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local errors = require "mongotx.errors"
local metrics = require "mongotx.metrics"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local unpack = table.unpack or unpack -- luacheck: ignore 143

local Date = mongotx.core.Date
-- one read more a call where the server cannot compare with $$NOW in a
-- write (FerretDB v1): the versions before the create
local clock_reads = helpers.no_deadlines() and 1 or 0

describe("#server batched holds", function()
  local db, accounts, txs, tm, events, m

  local function setup(balances)
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    local docs = {}
    for id, b in pairs(balances) do docs[#docs + 1] = { _id = id, balance = b } end
    assert(accounts:insert_many(docs))
    events, m = {}, metrics.new()
    tm = assert(db:manager(m:wrap { application = "app-1", on_event = function(name, info)
      if name == "hold" or name == "capture" or name == "void" or name == "expire" then
        events[#events + 1] = name .. " " .. tostring(info.id) .. " " .. tostring(info.amount)
      end
    end }))
    -- (the server's probes, once a manager; and every account gets a
    -- version: where versions fence (FerretDB), the applies of a batch
    -- fenced by "no version yet" on one document would match once)
    for id in pairs(balances) do
      if id ~= "A" then
        assert(tm:transfer("accounts", "A", id, 0.5))
        assert(tm:transfer("accounts", id, "A", 0.5))
      end
    end
    events = {}
  end

  after_each(function() if db then db:close() end db = nil end)

  -- { balance, txPending.balance, markers, txHeld } of account id
  local function seen(id)
    local d = assert(accounts:find_one({ _id = id }))
    return { d.balance, d.txPending and d.txPending.balance or 0,
             #(d.pendingTransactions or {}), #(d.txHeld or {}) }
  end

  local function item(from, to, amount, id, more)
    local it = { collection = "accounts", from = from, to = to, amount = amount, id = id }
    for k, v in pairs(more or {}) do it[k] = v end
    return it
  end

  for _, min in ipairs { false, 0 } do
    it("shares the insert and the applies of its holds, " .. (min and "with" or "without") ..
       " a floor", function()
      setup { A = 1000, B = 0, C = 0 }
      local guard = min and 1 or 0
      local list = {}
      for i = 1, 6 do
        list[i] = item("A", i % 2 == 0 and "B" or "C", 10 * i, "h" .. i,
                       { min = min or nil, expires = 600 })
      end
      db.client:reset_counters()
      local results, errs = tm:hold_many(list)
      -- one insert, one bulk write of the 12 applies (a floor: the debits,
      -- then the credits): 18 writes, the 3 a hold of each
      assert.are.same({ commands = 2 + guard + clock_reads, writes = 18 }, db.client:counters())
      for i = 1, 6 do
        assert.are.equal(false, errs[i], tostring(errs[i]))
        assert.are.equal("held", results[i].hold.status)
        assert.are.equal("h" .. i, results[i]._id)
        assert.are.equal("held", assert(tm:get("h" .. i)).hold.status)
      end
      assert.are.same({ 790, 0, 6, 0 }, seen("A"))
      assert.are.same({ 0, 120, 3, 0 }, seen("B"))
      assert.are.same({ 0, 90, 3, 0 }, seen("C"))
      -- alone: the round trips of a hold, each
      db.client:reset_counters()
      assert(tm:hold("accounts", "A", "B", 1, { id = "alone", min = min or nil }))
      assert.are.same({ commands = 2 + guard + clock_reads, writes = 3 }, db.client:counters())
    end)
  end

  it("gives each hold its own outcome: one refused by its floor fails alone", function()
    setup { A = 100, B = 0, C = 0 }
    local results, errs = tm:hold_many {
      item("A", "B", 40, "h1", { min = 0 }),
      item("A", "C", 50, "h2", { min = 0 }),
      item("A", "B", 30, "h3", { min = 0 }), -- 10 left: below the floor
      item("C", "B", 5, "h4"),               -- C has 0 and no floor: it goes below
      item("A", "Z", 5, "h5"),               -- no such account
    }
    assert.are.equal("held", results[1].hold.status)
    assert.are.equal("held", results[2].hold.status)
    assert.are.equal(false, results[3])
    assert.are.equal("guard", errs[3].code)
    assert.are.equal("held", results[4].hold.status)
    assert.are.equal(false, results[5])
    assert.are.equal("missing", errs[5].code)
    assert.are.same({ 10, 0, 2, 0 }, seen("A"))
    assert.are.same({ 0, 45, 2, 0 }, seen("B"))
    assert.are.same({ -5, 50, 2, 0 }, seen("C"))
    assert.are.equal("failed", assert(tm:get("h3")).hold.status)
    assert.are.equal("failed", assert(tm:get("h5")).hold.status)
    -- asked again under their ids: as tm:hold's key answers
    results, errs = tm:hold_many { item("A", "B", 40, "h1", { min = 0 }),
                                   item("A", "B", 30, "h3", { min = 0 }) }
    assert.are.equal("held", results[1].hold.status)
    assert.are.equal("cancelled", errs[2].code)
    assert.are.equal("guard", errs[2].cause)
    results, errs = tm:hold_many { item("A", "B", 41, "h1", { min = 0 }) }
    assert.are.equal(false, results[1])
    assert.are.equal("idempotency", errs[1].code)
    assert.are.same({ 10, 0, 2, 0 }, seen("A"))
    assert.are.same({ "hold h1 40", "hold h2 50", "hold h4 5" }, events)
  end)

  it("writes nothing when an item is bad, and says which", function()
    setup { A = 100, B = 0 }
    local good = item("A", "B", 10, "g1")
    for _, case in ipairs {
      { item("A", "B", -1, "x"), "amount" },
      { item("A", "B", 10, "x", { expires = 0 }), "expires" },
      { item("A", "B", 10, "x", { expires = math.huge }), "expires" },
      { item("A", "B", 10, "x", { expires = 0 / 0 }), "expires" },
      { item("A", "A", 10, "x"), "" },
      { item("A", "B", 10, "g1"), "repeats the id of item 1" },
      { item("A", "B", 10, { ["$gt"] = "" }), "" },
    } do
      local before = helpers.db_dump(db.client, db.name)
      local res, err = tm:hold_many { good, case[1] }
      assert.is_nil(res)
      assert.is_table(err)
      assert.are.equal("invalid", err.code, tostring(err))
      assert.are.equal(2, err.item)
      assert.are.equal("hold_many", err.step)
      assert.truthy(err.message:find("item 2", 1, true), err.message)
      assert.truthy(err.message:find(case[2], 1, true), err.message)
      helpers.assert_dump_unchanged(before, db.client, db.name)
    end
    local before = helpers.db_dump(db.client, db.name)
    assert.has_error(function() tm:hold_many("x") end, "hold_many takes a list")
    assert.has_error(function() tm:hold_many { good, item("A", "B", 1, "x", { colour = 1 }) } end,
      "unknown option colour for hold_many item 2")
    assert.has_error(function() tm:hold_many { good, item("A", "B", "1") } end)
    assert.has_error(function() tm:hold_many { good, item("A", "B", 1, "x", { expires = "60" }) } end,
      "option expires of hold_many item 2 must be a number, not string")
    assert.has_error(function() tm:hold_many { good, 7 } end, "hold_many: item 2 is not a table")
    helpers.assert_dump_unchanged(before, db.client, db.name)
    local results, errs = tm:hold_many {}
    assert.are.same({}, results)
    assert.are.same({}, errs)
    assert.are.equal(0, txs:count({ hold = { ["$exists"] = true } }))
  end)

  it("opens more than a batch takes as several", function()
    setup { A = 1000, B = 0 }
    local list = {}
    for i = 1, 250 do list[i] = item("A", "B", 1) end
    db.client:reset_counters()
    local results, errs = tm:hold_many(list)
    -- batches of 100: an insert and a bulk write of the applies each (on
    -- FerretDB v1, 25 statements a command: mongotx.engine.commands)
    local commands = db.client:counters().commands
    if helpers.server_kind() == "ferretdb" then
      assert(commands <= 30, commands .. " commands for 250 holds")
    else
      assert.are.equal(3 * (2 + clock_reads), commands)
    end
    for i = 1, 250 do
      assert.are.equal(false, errs[i])
      assert.are.equal("held", results[i].hold.status)
    end
    assert.are.same({ 750, 0, 250, 0 }, seen("A"))
    assert.are.same({ 0, 250, 250, 0 }, seen("B"))
  end)

  it("is decided, expired and recovered as a hold opened alone", function()
    setup { A = 1000, B = 0 }
    assert(tm:hold("accounts", "A", "B", 100, { id = "alone", min = 0, expires = 600 }))
    local results, errs = tm:hold_many {
      item("A", "B", 100, "cap", { min = 0, expires = 600 }),
      item("A", "B", 100, "void", { min = 0, expires = 600 }),
      item("A", "B", 100, "late", { min = 0, expires = 600 }),
      item("A", "B", 100, "kept", { min = 0, expires = 600, meta = { cart = 7 } }),
    }
    for i = 1, 4 do assert.are.equal(false, errs[i], tostring(errs[i])) end
    assert.are.equal(7, results[4].meta.cart)
    -- the same document as one opened alone, but for its id, mark, meta and times
    local alone = assert(txs:find_one({ _id = "alone" }))
    local kept = assert(txs:find_one({ _id = "kept" }))
    for _, T in ipairs { alone, kept } do
      T._id, T.mark, T.meta, T.lastModified, T.deadline, T.hold.expires = nil, nil, nil, nil, nil, nil
    end
    assert.are.same(alone, kept)
    -- a capture costs what it costs after tm:hold
    db.client:reset_counters()
    local T = assert(tm:capture("cap", 30))
    assert.are.same({ commands = 5 + clock_reads, writes = 4 }, db.client:counters())
    assert.are.equal("captured", T.hold.status)
    assert(tm:void("void"))
    local _, err = tm:capture("void")
    assert.are.equal("voided", err.status)
    -- past its expiry: recovery expires it, and nobody captures it
    local at = Date(math.floor(assert(tm:server_now()) - 1000))
    assert(txs:update_one({ _id = "late" }, { ["$set"] = { ["hold.expires"] = at, deadline = at } }))
    local report = assert(tm:recover())
    assert.are.equal(1, report.cancelled)
    _, err = tm:capture("late")
    assert.are.equal("expired", err.status)
    assert.are.same({ 1000 - 200 - 30, 0, 2, 0 }, seen("A")) -- alone and kept open, 30 captured
    assert.are.same({ 30, 200, 2, 0 }, seen("B"))
    assert.are.same({ "hold alone 100", "hold cap 100", "hold void 100", "hold late 100",
      "hold kept 100", "capture cap 30", "void void 100", "expire late 100" }, events)
    local text = m:render()
    for _, line in ipairs {
      'mongotx_holds_opened_total{application="app-1"} 5',
      'mongotx_holds_decided_total{application="app-1",outcome="captured"} 1',
      'mongotx_holds_decided_total{application="app-1",outcome="voided"} 1',
      'mongotx_holds_decided_total{application="app-1",outcome="expired"} 1',
      'mongotx_holds_amount{application="app-1"} 200',
    } do
      assert.truthy(text:find(line, 1, true), line .. " not in\n" .. text)
    end
  end)

  it("sends the applies once: a lost answer fails the call, the holds stand, recovery expires them",
     function()
    setup { A = 100, B = 0 }
    local real, lost = tm.engine.steps, true
    tm.engine.steps = setmetatable({}, { __index = function(_, name)
      local step = real[name]
      return function(_, ...)
        local res, err = step(real, ...)
        if name == "apply_many" and res and lost then
          lost = false -- (a resend would be answered)
          return nil, errors.new("stream", "the answer was lost", { transient = true })
        end
        return res, err
      end
    end })
    local results, errs = tm:hold_many { item("A", "B", 10, "h1", { expires = 600 }),
                                         item("A", "B", 20, "h2", { expires = 600 }) }
    tm.engine.steps = real
    assert.are.same({ false, false }, results)
    assert.are.equal("stream", errs[1].code)
    assert.are.equal("stream", errs[2].code)
    -- applied once each, and pending: both marks on, decided by nobody yet
    assert.are.same({ 70, 0, 2, 0 }, seen("A"))
    assert.are.same({ 0, 30, 2, 0 }, seen("B"))
    -- asked again: the same holds, as they stand
    results = tm:hold_many { item("A", "B", 10, "h1", { expires = 600 }) }
    assert.are.equal("held", results[1].hold.status)
    assert.are.same({ 70, 0, 2, 0 }, seen("A"))
    -- past their expiry, recovery gives everything back
    local at = Date(math.floor(assert(tm:server_now()) - 1000))
    assert(txs:update_many({ _id = { ["$in"] = { "h1", "h2" } } },
      { ["$set"] = { ["hold.expires"] = at, deadline = at } }))
    assert.are.equal(2, assert(tm:recover()).cancelled)
    assert.are.same({ 100, 0, 0, 0 }, seen("A"))
    assert.are.same({ 0, 0, 0, 0 }, seen("B"))
    assert.are.equal("expired", assert(tm:get("h2")).hold.status)
  end)
  -- Runs calls[i] = { method, args... } at once through a group of tm
  -- (group.wrap under a coroutine scheduler): what each got (pcall's),
  -- and the group events' sizes.
  local function grouped(calls)
    local S, sizes = scheduler(), {}
    local g = group.wrap(tm, { max = 32, delay = 0.01, signal = S.signal, spawn = S.spawn,
                               now = S.now })
    local run = g.group.run
    g.group.run = function(items, info)
      sizes[#sizes + 1] = #items
      return run(items, info)
    end
    local got = {}
    for i, c in ipairs(calls) do
      S.spawn(function() got[i] = { pcall(g[c[1]], g, unpack(c, 2)) } end)
    end
    S.loop()
    return got, sizes
  end

  it("mongotx.group opens concurrent holds as one batch, each answered as alone", function()
    setup { A = 100, B = 0, C = 0 }
    local calls = {}
    for i = 1, 6 do
      calls[i] = { "hold", "accounts", "A", i % 2 == 0 and "B" or "C", 10, { min = 0, id = "g" .. i } }
    end
    calls[7] = { "hold", "accounts", "A", "B", -1 }                -- invalid
    calls[8] = { "hold", "accounts", "A", "B", 1, { bogus = 1 } }  -- raises
    db.client:reset_counters()
    local got, sizes = grouped(calls)
    assert.are.same({ 8 }, sizes)
    -- the six holds: one insert, the debits, the credits
    assert.are.same({ commands = 3 + clock_reads, writes = 18 }, db.client:counters())
    for i = 1, 6 do
      assert.is_true(got[i][1])
      assert.are.equal("held", got[i][2].hold.status, tostring(got[i][3]))
      assert.are.equal("g" .. i, got[i][2]._id)
    end
    assert.are.same({ true, nil, "invalid" }, { got[7][1], got[7][2], got[7][3].code })
    assert.is_false(got[8][1])
    assert.truthy(tostring(got[8][2]):find("unknown option bogus for hold", 1, true), got[8][2])
    assert.are.same({ 40, 0, 6, 0 }, seen("A"))
    assert.are.same({ 0, 30, 3, 0 }, seen("B"))
    assert.are.same({ 0, 30, 3, 0 }, seen("C"))
    -- decided as any hold
    assert(tm:capture("g2", 4))
    assert(tm:void("g3"))
    assert.are.same({ 56, 0, 4, 0 }, seen("A"))
    assert.are.same({ 4, 20, 2, 0 }, seen("B"))
    -- the same again: the holds as they stand, nothing written
    got = grouped { { "hold", "accounts", "A", "B", 10, { min = 0, id = "g2" } },
                    { "hold", "accounts", "A", "C", 10, { min = 0, id = "g3" } } }
    assert.are.equal("captured", got[1][2].hold.status)
    assert.are.equal("voided", got[2][2].hold.status)
    assert.are.same({ 56, 0, 4, 0 }, seen("A"))
  end)

  it("mongotx.group runs a hold after the transfers of its batch, as alone in that order", function()
    setup { A = 100, B = 0, C = 0 }
    -- the transfer takes 70 first: the hold of 40 with a floor is refused,
    -- as alone after it; the hold and a transfer under one id: the second
    -- waits for the next batch
    local got, sizes = grouped {
      { "hold", "accounts", "A", "C", 40, { min = 0, id = "h1" } },
      { "transfer", "accounts", "A", "B", 70, { min = 0 } },
      { "hold", "accounts", "A", "C", 20, { min = 0, id = "h2" } },
      { "transfer", "accounts", "A", "B", 1, { min = 0, id = "h2" } },
    }
    assert.are.same({ 4, 1 }, sizes)
    assert.are.equal("guard", got[1][3].code)
    assert.are.equal("done", got[2][2].state)
    assert.are.equal("held", got[3][2].hold.status)
    assert.are.equal("idempotency", got[4][3].code)
    assert.are.same({ 10, 0, 1, 0 }, seen("A"))
    assert.are.same({ 70, 0, 0, 0 }, seen("B"))
    assert.are.same({ 0, 20, 1, 0 }, seen("C"))
  end)
end)

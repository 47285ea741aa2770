-- The contract at the doors (issue 20): values no caller means (numbers
-- that are not numbers, strings that are not UTF-8) are refused with
-- `invalid` before anything is written, wherever they would be stored or
-- reach a guard; what libmongoc's own validation refuses the checks refuse
-- too (the same values run through both); every public entry point
-- raises for a wrong Lua type and returns nil, `invalid` for a bad value
-- of the right type, writing nothing; the owner recovers its own
-- transaction at once; the manager's transactions collection is checked
-- as an op's collection is.  Every bad-input case asserts an unchanged
-- database dump.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local pool = require "mongotx.pool"

local D, Regex = mongotx.Decimal128, mongotx.Regex
local NAN, INF = 0 / 0, math.huge

local function fixture()
  local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
  local tm = assert(db:manager{ application = "app-1" })
  assert(db:collection("accounts"):insert_many{
    { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
    { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
  })
  assert(db:collection("orders"):insert_one({ _id = "o1", status = "new" }, {}))
  return { db = db, tm = tm, queue = assert(db:queue{ collection = "jobs" }) }
end

-- fn(e) must return nil and an `invalid` error whose message holds msg
-- (a pattern), with the database as it was.
local function assert_refused(e, fn, msg)
  local before = helpers.db_dump(e.db.client, e.db.name)
  local ok, res, err = pcall(fn, e)
  assert.is_true(ok, "raised: " .. tostring(res))
  assert.is_nil(res)
  assert.is_table(err, "expected an error, got " .. tostring(err))
  assert.are.equal("invalid", err.code, tostring(err))
  if msg then
    local found = false
    for _, m in ipairs(type(msg) == "table" and msg or { msg }) do
      found = found or err.message:find(m) ~= nil
    end
    assert.is_true(found, err.message)
  end
  helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
end

-- fn(e) must raise (a wrong Lua type), with the database as it was.
local function assert_raises(e, fn)
  local before = helpers.db_dump(e.db.client, e.db.name)
  local ok, res = pcall(fn, e)
  assert.is_false(ok, "expected a raise, got " .. tostring(res))
  helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
end

local function upd(update, undo)
  return { { collection = "accounts", id = "A", update = update,
             undo = undo or { ["$set"] = { balance = 1000 } } } }
end

-- The places a caller's value reaches a stored value or a guard: x is
-- put there, and the call must refuse it.
local places = {
  { "$inc", numeric = true, function(e, x) return e.tm:begin(upd { ["$inc"] = { balance = x } }) end },
  { "$mul", numeric = true, function(e, x) return e.tm:begin(upd { ["$mul"] = { balance = x } }) end },
  { "$set", function(e, x) return e.tm:begin(upd { ["$set"] = { note = x } }) end },
  { "$min", function(e, x) return e.tm:begin(upd { ["$min"] = { balance = x } }) end },
  { "$max", function(e, x) return e.tm:begin(upd { ["$max"] = { balance = x } }) end },
  { "$push", function(e, x) return e.tm:begin(upd { ["$push"] = { log = x } }) end },
  { "$addToSet $each", function(e, x)
    return e.tm:begin(upd { ["$addToSet"] = { log = { ["$each"] = { 1, x } } } })
  end },
  { "$pull", function(e, x) return e.tm:begin(upd { ["$pull"] = { log = x } }) end },
  { "$set nested", function(e, x)
    return e.tm:begin(upd { ["$set"] = { note = { deep = { x } } } })
  end },
  { "undo", function(e, x)
    return e.tm:begin(upd({ ["$set"] = { note = 1 } }, { ["$set"] = { note = x } }))
  end },
  { "insert doc", function(e, x)
    return e.tm:begin({ { collection = "orders", id = "o2", doc = { total = x } } })
  end },
  { "insert doc array", function(e, x)
    return e.tm:begin({ { collection = "orders", id = "o2", doc = { items = { 1, x } } } })
  end },
  { "where value", function(e, x)
    return e.tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                          where = { balance = x } } })
  end },
  { "where $gte", function(e, x)
    return e.tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                          where = { balance = { ["$gte"] = x } } } })
  end },
  { "where $in", function(e, x)
    return e.tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                          where = { balance = { ["$in"] = { 1, x } } } } })
  end },
  { "meta", function(e, x)
    return e.tm:begin(upd { ["$inc"] = { balance = 1 } }, { meta = { why = x } })
  end },
  { "commit_many meta", function(e, x)
    local results, errs = e.tm:commit_many({ { ops = upd { ["$inc"] = { balance = 1 } },
                                               meta = { why = x } } })
    return results[1] or nil, errs[1]
  end },
  { "queue details", function(e, x)
    return e.queue:push("mail", { to = x })
  end },
}

describe("#server numbers that are not numbers", function()
  local e
  before_each(function() e = fixture() end)
  after_each(function() e.db:close() end)

  local bad = {
    { "Decimal128 NaN", function() return D("NaN") end },
    { "Decimal128 Infinity", function() return D("Infinity") end },
    { "Decimal128 -Infinity", function() return D("-Infinity") end },
    { "NaN", function() return NAN end },
    { "infinity", function() return -INF end },
  }
  for _, p in ipairs(places) do
    for _, b in ipairs(bad) do
      it(p[1] .. " refuses " .. b[1], function()
        assert_refused(e, function() return p[2](e, b[2]()) end, { "[Nn]a[Nn]", "[Ii]nf" })
      end)
    end
  end

  it("takes finite Decimal128s, Int64s and doubles where numbers go", function()
    local lacks = helpers.ferretdb_lacks("Decimal128 (it drops the connection on one)")
    if lacks then return pending(lacks) end
    local t = assert(e.tm:run({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = D("-1.5") } },
        undo = { ["$inc"] = { balance = D("1.5") } }, where = { balance = { ["$gte"] = D("1.5") } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = mongotx.Int64(2) } },
        undo = { ["$inc"] = { balance = mongotx.Int64(-2) } } },
      { collection = "orders", id = "o2", doc = { total = D("12.50"), rate = 0.5 } },
    }))
    assert.are.equal("done", t.state)
    local a = assert(e.db:collection("accounts"):find_one({ _id = "A" }))
    assert.are.equal("decimal", mongotx.type(a.balance))
    assert.are.equal('Decimal128("998.5")', tostring(a.balance))
    local o = assert(e.db:collection("orders"):find_one({ _id = "o2" }))
    assert.are.equal('Decimal128("12.50")', tostring(o.total))
  end)

  it("transfer amounts and floors are Lua numbers: a Decimal128 raises, NaN is invalid", function()
    assert_raises(e, function() return e.tm:transfer("accounts", "A", "B", D("1")) end)
    assert_raises(e, function() return e.tm:transfer("accounts", "A", "B", 1, { min = D("0") }) end)
    assert_refused(e, function() return e.tm:transfer("accounts", "A", "B", NAN) end, "finite")
    assert_refused(e, function()
      return e.tm:transfer("accounts", "A", "B", 1, { min = NAN })
    end, "finite")
  end)

  it("ledger values and queue priorities are whole Lua numbers", function()
    local ledger = assert(e.db:ledger{ collection = "entries" })
    assert_raises(e, function() return ledger:transfer("A", "B", D("1")) end)
    assert_refused(e, function() return ledger:transfer("A", "B", NAN) end, "whole number")
    assert_raises(e, function() return e.queue:push("mail", {}, { priority = D("1") }) end)
    assert_refused(e, function() return e.queue:push("mail", {}, { priority = NAN }) end, "priority")
  end)
end)

-- Byte strings that are not UTF-8: a stray byte, a broken pair, a
-- truncated sequence, a surrogate, an overlong encoding.
local not_utf8 = { "\255", "\195\40", "a\226\130", "\237\160\128", "\192\175" }

describe("#server strings that are not UTF-8", function()
  local e
  before_each(function() e = fixture() end)
  after_each(function() e.db:close() end)

  for _, p in ipairs(places) do
    for k, s in ipairs(p.numeric and {} or not_utf8) do
      it(p[1] .. " refuses bad string " .. k, function()
        assert_refused(e, function() return p[2](e, s) end, "UTF%-8")
      end)
    end
  end

  for k, s in ipairs(not_utf8) do
    it("a Regex whose pattern is not UTF-8 is refused in a doc (" .. k .. ")", function()
      assert_refused(e, function()
        return e.tm:begin({ { collection = "orders", id = "o2", doc = { r = Regex(s) } } })
      end, "UTF%-8")
    end)
    it("a field name that is not UTF-8 is refused by transfer (" .. k .. ")", function()
      assert_refused(e, function()
        return e.tm:transfer("accounts", "A", "B", 1, { field = s })
      end, "field")
    end)
    it("a field name that is not UTF-8 is refused by transfer_many (" .. k .. ")", function()
      assert_refused(e, function()
        local results, errs = e.tm:transfer_many({ { collection = "accounts", from = "A", to = "B",
                                                      amount = 1, field = s } })
        return results[1] or nil, errs[1]
      end, "field")
    end)
    it("a $rename target that is not UTF-8 is refused (" .. k .. ")", function()
      assert_refused(e, function()
        return e.tm:begin(upd({ ["$rename"] = { note = "n" .. s } }, { ["$rename"] = { n = "note" } }))
      end, "field name")
    end)
  end

  it("takes UTF-8 of every width and a NUL inside a string value, as libmongoc does", function()
    local t = assert(e.tm:run({
      { collection = "orders", id = "o2", doc = { s = "h\195\169 \226\130\172 \240\159\152\128", z = "a\0b" } },
    }))
    assert.are.equal("done", t.state)
    local o = assert(e.db:collection("orders"):find_one({ _id = "o2" }))
    assert.are.equal("a\0b", o.z)
  end)
end)

-- The same values through libmongoc's own validation (a collection
-- handle of the C core writes with libmongoc's default validation) and
-- through the checks: whatever libmongoc refuses the checks refuse, and
-- the checks refuse every value of the classes issue 20 names, whichever
-- libmongoc this is built on (1.23 lets a string that is not UTF-8 pass,
-- later ones refuse it).
describe("#server libmongoc's validation and the checks agree", function()
  local e, scratch
  before_each(function()
    e = fixture()
    scratch = e.db.client:collection(helpers.db_name(), "lib")
    assert(scratch:insert_one({ _id = 0 }, {}))
  end)
  after_each(function() e.db:close() end)

  -- { name, value, bad }: bad when no stored document should hold it.
  local corpus = {
    { "a plain value", { a = 1, s = "x" }, false },
    { "a NUL in a string value", { s = "a\0b" }, false },
    { "UTF-8 of every width", { s = "\195\169\226\130\172\240\159\152\128" }, false },
    { "an empty key", { [""] = 1 }, true },
    { "an empty key deep down", { a = { b = { { [""] = 1 } } } }, true },
    { "a dotted key", { ["a.b"] = 1 }, true },
    { "a $ key", { ["$x"] = 1 }, true },
    { "a DBRef", mongotx.doc("$ref", "x", "$id", 1), true },
    { "a Decimal128 NaN", { d = D("NaN") }, true },
    { "a Decimal128 infinity", { d = D("-Infinity") }, true },
  }
  for k, s in ipairs(not_utf8) do
    corpus[#corpus + 1] = { "a string that is not UTF-8 " .. k, { s = s }, true }
    corpus[#corpus + 1] = { "a string that is not UTF-8 in an array " .. k, { l = { "ok", s } }, true }
    corpus[#corpus + 1] = { "a Regex that is not UTF-8 " .. k, { r = Regex(s) }, true }
  end

  local function libmongoc_refuses(write)
    local before = e.db.client:counters().commands
    local res = write()
    local sent = e.db.client:counters().commands - before
    -- refused by the driver: nothing went to the server
    return res == nil and sent == 0
  end

  for n, c in ipairs(corpus) do
    it("an inserted document holding " .. c[1], function()
      local lib = libmongoc_refuses(function() return scratch:insert_one({ _id = n, v = c[2] }, {}) end)
      local before = helpers.db_dump(e.db.client, e.db.name)
      local res, err = e.tm:begin({ { collection = "orders", id = "o2", doc = { v = c[2] } } })
      if lib or c[3] then
        assert.is_nil(res, "the checks took what " .. (lib and "libmongoc" or "no stored document should hold"))
        assert.are.equal("invalid", err.code, tostring(err))
        helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
      else
        assert.is_table(res, tostring(err))
      end
    end)
    it("an update setting " .. c[1], function()
      local lib = libmongoc_refuses(function()
        return scratch:update_one({ _id = 0 }, { ["$set"] = { v = c[2] } }, {})
      end)
      local before = helpers.db_dump(e.db.client, e.db.name)
      local res, err = e.tm:begin(upd({ ["$set"] = { v = c[2] } }, { ["$unset"] = { v = "" } }))
      if lib or c[3] then
        assert.is_nil(res, "the checks took what " .. (lib and "libmongoc" or "no stored document should hold"))
        assert.are.equal("invalid", err.code, tostring(err))
        helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
      else
        assert.is_table(res, tostring(err))
      end
    end)
  end

  -- libmongoc's rules on the update document itself
  for _, c in ipairs {
    { "an update without operators", { balance = 1 } },
    { "an update with an empty key", { ["$set"] = { [""] = 1 } } },
  } do
    it(c[1] .. " is refused by both", function()
      assert.is_true(libmongoc_refuses(function() return scratch:update_one({ _id = 0 }, c[2], {}) end))
      assert_refused(e, function() return e.tm:begin(upd(c[2])) end)
    end)
  end
end)

describe("#server the transactions collection is checked as an op's is", function()
  local e
  before_each(function() e = fixture() end)
  after_each(function() e.db:close() end)

  for _, c in ipairs {
    { "longer than the namespace allows", function(db) return ("t"):rep(300 - #db.name) end },
    { "not UTF-8", function() return "tx\255" end },
    { "starting with a dot", function() return ".tx" end },
    { "holding a NUL", function() return "t\0x" end },
    { "holding a $", function() return "t$x" end },
    { "system.*", function() return "system.tx" end },
    { "empty", function() return "" end },
  } do
    it("db:manager refuses a collection " .. c[1] .. ", naming collection", function()
      assert_refused(e, function(x) return x.db:manager{ collection = c[2](x.db) } end, "collection")
    end)
  end

  it("takes the longest name the namespace allows, as an op's collection", function()
    local name = ("t"):rep(mongotx.core.MAX_NAMESPACE - #e.db.name - 1)
    local tm = assert(e.db:manager{ collection = name })
    assert.are.equal("done", assert(tm:transfer("accounts", "A", "B", 1)).state)
  end)

  it("raises for a collection that is not a string", function()
    assert_raises(e, function(x) return x.db:manager{ collection = 1 } end)
  end)
end)

describe("#server the owner recovers its own transaction at once", function()
  local e
  before_each(function() e = fixture() end)
  after_each(function() e.db:close() end)

  -- A transfer claimed and applied on its first op only, by tm's own
  -- steps: what an apply that failed on the second op leaves (pending,
  -- claimed by tm, its lease and deadline an hour away).
  local function half_applied(tm, from, to)
    local t = assert(tm:begin({
      { collection = "accounts", id = from, update = { ["$inc"] = { balance = -5 } } },
      { collection = "accounts", id = to, update = { ["$inc"] = { balance = 5 } } },
    }))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    local T = assert(tm:get(t._id))
    assert.are.equal("pending", T.state)
    assert.are.equal(tm.instance, T.instance)
    return t
  end

  local function owner()
    return assert(e.db:manager{ application = "app-1", lease = 3600, stale_after = 3600 })
  end

  for _, size in ipairs { 1, 100 } do
    it("one transaction left pending, before its lease runs out (batch = " .. size .. ")", function()
      local tm = owner()
      local t = half_applied(tm, "A", "B")
      local report = assert(tm:recover{ batch = size })
      assert.are.equal(1, report.done, tostring(report.errors[1] and report.errors[1].error))
      assert.are.equal("done", assert(tm:get(t._id)).state)
      assert.are.same({ A = 995, B = 1005 }, helpers.balances(e.db:collection("accounts")))
    end)
  end

  it("two left pending, recovered in one batch", function()
    assert(e.db:collection("accounts"):insert_many{
      { _id = "C", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "D", balance = 1000, pendingTransactions = mongotx.array() },
    })
    local tm = owner()
    local t1, t2 = half_applied(tm, "A", "B"), half_applied(tm, "C", "D")
    local report = assert(tm:recover())
    assert.are.equal(2, report.done, tostring(report.errors[1] and report.errors[1].error))
    assert.are.equal("done", assert(tm:get(t1._id)).state)
    assert.are.equal("done", assert(tm:get(t2._id)).state)
    assert.are.same({ A = 995, B = 1005, C = 995, D = 1005 },
      helpers.balances(e.db:collection("accounts")))
  end)

  it("another instance of the application still waits for stale_after", function()
    local tm = owner()
    local t = half_applied(tm, "A", "B")
    local before = helpers.db_dump(e.db.client, e.db.name)
    local report = assert(owner():recover())
    assert.are.equal(0, report.done)
    assert.are.equal(0, report.examined - report.skipped)
    helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
    assert.are.equal("pending", assert(tm:get(t._id)).state)
  end)
end)

describe("#server each checks its items through the manager's public check", function()
  it("each.lua calls no private method of the manager", function()
    local src = assert(io.open("lua/mongotx/each.lua")):read("a")
    assert.is_nil(src:find("tm:_"), "each.lua calls a private method of the manager")
    assert.is_nil(src:find("tm%._"), "each.lua reads a private field of the manager")
  end)

  it("tm:check refuses what begin refuses, writes nothing, and takes what begin takes", function()
    local e = fixture()
    assert_refused(e, function() return e.tm:check(upd { ["$set"] = { note = "\255" } }) end, "UTF%-8")
    assert_refused(e, function() return e.tm:check(upd { ["$inc"] = { balance = 1 } }, { meta = { x = D("NaN") } }) end)
    assert_raises(e, function() return e.tm:check("ops") end)
    local before = helpers.db_dump(e.db.client, e.db.name)
    assert.is_true(e.tm:check(upd { ["$inc"] = { balance = 1 } }, { id = "t-9" }))
    helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
    e.db:close()
  end)
end)

-- The README's error rule at every public entry point, one row per
-- argument: each value of `wrong` (a wrong Lua type) raises, each value
-- of `bad` (the right type, a value that cannot work) returns nil and an
-- `invalid` error; neither writes anything (after the row's setup).  Batch calls answer per item:
-- their rows return the first item's result and error.
local function first(results, errs) return results[1] or nil, errs[1] end
local function op(update, undo) return upd(update, undo) end
local good_ops = op { ["$inc"] = { balance = 1 } }
local evil_id = { ["$gt"] = "" }

-- Setups of rows that need something to act on: a claimed job (e.job),
-- a posted ledger entry (e.entry), an orders document left flagged by a
-- propagation that failed (a repair that ran would clear it).
local function claimed(e)
  assert(e.queue:push("mail", {}))
  e.job = assert(e.queue:claim("w1"))
end
local function posted(e) e.entry = assert(e.ledger:transfer("A", "B", 1)) end
local function flagged(e)
  local s = assert(e.db:sync{ collection = "orders", propagate = function() return nil, "down" end })
  local _, err = s:change("o1", { ["$set"] = { status = "paid" } })
  assert.are.equal("propagation", err and err.code)
end
-- A mongotx.pool handle on the test database.
local function pooled()
  return assert(pool.connect(helpers.uri(), { database = helpers.db_name() }))
end

local entry_points = {
  { "db:manager collection", function(e, v) return e.db:manager{ collection = v } end,
    wrong = { 1, true }, bad = { "", "a$b", ".x", "x\255", "system.x" } },
  { "db:manager application", function(e, v) return e.db:manager{ application = v } end,
    wrong = { 1 }, bad = { "" } },
  { "db:manager application (stored on every transaction it claims)",
    function(e, v) return e.db:manager{ application = v } end,
    wrong = { true }, bad = { "app\255" } },
  { "db:manager marker", function(e, v) return e.db:manager{ marker = v } end,
    wrong = { 1 }, bad = { "", "$m", "a.b", "_id", "m\255" } },
  { "db:manager lease", function(e, v) return e.db:manager{ lease = v } end,
    wrong = { "1" }, bad = { -1, NAN, INF, 1e12 } },
  { "db:manager write_concern", function(e, v) return e.db:manager{ write_concern = v } end,
    wrong = { "majority" }, bad = { { w = -1 }, { w = 0 }, { wtimeout = -1 } } },
  { "tm:begin ops", function(e, v) return e.tm:begin(v) end,
    wrong = { "ops", 1 }, bad = { {}, { 1 }, { {} }, op { ["$set"] = { s = "\255" } },
                                  op { ["$inc"] = { balance = D("NaN") } } } },
  { "tm:begin id", function(e, v) return e.tm:begin(good_ops, { id = v }) end,
    wrong = {}, bad = { evil_id, NAN, "t\255" } },
  { "tm:begin meta", function(e, v) return e.tm:begin(good_ops, { meta = v }) end,
    wrong = { "m", 1 }, bad = { { ["$x"] = 1 }, { ["a.b"] = 1 }, { x = D("Infinity") }, { s = "\255" } } },
  { "tm:run ops", function(e, v) return e.tm:run(v) end,
    wrong = { "ops" }, bad = { {}, op { ["$set"] = { s = "\255" } } } },
  { "tm:check ops", function(e, v) return e.tm:check(v) end,
    wrong = { "ops" }, bad = { {}, op { ["$set"] = { s = "\255" } } } },
  { "tm:transfer collection", function(e, v) return e.tm:transfer(v, "A", "B", 1) end,
    wrong = {}, bad = { "", "a$b", "x\255", "transactions" } },
  { "tm:transfer from", function(e, v) return e.tm:transfer("accounts", v, "B", 1) end,
    wrong = {}, bad = { evil_id, NAN, "A\255" } },
  { "tm:transfer amount", function(e, v) return e.tm:transfer("accounts", "A", "B", v) end,
    wrong = { "1", D("1") }, bad = { 0, -1, NAN, INF, 2 ^ 60 } },
  { "tm:transfer field", function(e, v) return e.tm:transfer("accounts", "A", "B", 1, { field = v }) end,
    wrong = { 1 }, bad = { "", "$x", "a..b", "b\255", "b\0c", "pendingTransactions" } },
  { "tm:transfer min", function(e, v) return e.tm:transfer("accounts", "A", "B", 1, { min = v }) end,
    wrong = { "0", D("0") }, bad = { NAN, INF, 2 ^ 60 } },
  { "tm:commit_many item", function(e, v) return first(e.tm:commit_many({ v })) end,
    wrong = {}, bad = { {}, op { ["$set"] = { s = "\255" } }, { ops = good_ops, meta = { s = "\255" } } } },
  { "tm:commit_many list", function(e, v) return e.tm:commit_many(v) end,
    wrong = { "list", 1 }, bad = {} },
  { "tm:transfer_many item", function(e, v) return first(e.tm:transfer_many({ v })) end,
    wrong = {}, bad = { { collection = "accounts", from = "A", to = "B", amount = NAN },
                        { collection = "accounts", from = "A", to = "B", amount = 1, field = "b\255" },
                        { collection = "x\255", from = "A", to = "B", amount = 1 } } },
  { "tm:get id", function(e, v) return e.tm:get(v) end,
    wrong = { print }, bad = { evil_id, NAN } },
  { "tm:commit t", function(e, v) return e.tm:commit(v) end,
    wrong = { "t", 1 }, bad = { { _id = evil_id } } },
  { "tm:rollback t", function(e, v) return e.tm:rollback(v) end,
    wrong = { "t" }, bad = { { _id = evil_id } } },
  { "tm:rollback reason (stored on the transaction)",
    setup = function(e) e.t = assert(e.tm:begin(good_ops)) end,
    function(e, v) return e.tm:rollback(e.t, v) end,
    wrong = { 1, {} }, bad = { "why \255", ("x"):rep(17 * 1024 * 1024) } },
  { "tm:step op index", setup = function(e) e.t = assert(e.tm:begin(good_ops)) end,
    function(e, v) return e.tm:step("apply", e.t, v) end,
    wrong = { "1", 9 }, bad = {} },
  { "tm:compensate t", function(e, v) return e.tm:compensate(v) end,
    wrong = { "t" }, bad = { { _id = evil_id } } },
  { "tm:recover limit", function(e, v) return e.tm:recover{ limit = v } end,
    wrong = { "1" }, bad = { 0, -1, 1.5, NAN } },
  { "tm:recover batch", function(e, v) return e.tm:recover{ batch = v } end,
    wrong = { "1" }, bad = { 0, 1e9, NAN } },
  { "tm:prune older_than", function(e, v) return e.tm:prune{ older_than = v } end,
    wrong = { "1" }, bad = { -1, NAN, INF } },
  { "tm:prune limit", function(e, v) return e.tm:prune{ limit = v } end,
    wrong = { "1" }, bad = { 0, 0.5 } },
  -- (an unknown step is misuse, as an unknown option is)
  { "tm:step name", function(e, v) return e.tm:step(v, { _id = "nope" }) end,
    wrong = { 1, "nope" }, bad = {} },
  { "tm:unpark id", function(e, v) return e.tm:unpark(v) end,
    wrong = { print }, bad = { evil_id } },
  { "tm:inspect id", function(e, v) return e.tm:inspect(v) end,
    wrong = { print }, bad = { evil_id } },
  { "tm:each item ops", function(e, v)
      return e.tm:each({ 1 }, function() return v end, { id = "job", key = function(i) return i end })
    end, wrong = { "ops" }, bad = { {}, op { ["$set"] = { s = "\255" } } } },
  { "tm:each item meta", function(e, v)
      return e.tm:each({ 1 }, function() return good_ops, v end, { id = "job", key = function(i) return i end })
    end, wrong = { "meta" }, bad = { { s = "\255" }, { d = D("NaN") } } },
  { "tm:each batch", function(e, v)
      return e.tm:each({ 1 }, function() return good_ops end,
        { id = "job", key = function(i) return i end, batch = v })
    end,
    wrong = { "1" }, bad = { 0, NAN } },
  { "queue:push kind", function(e, v) return e.queue:push(v, {}) end,
    wrong = { 1 }, bad = { "" } },
  { "queue:push type (stored on the job)", function(e, v) return e.queue:push(v, {}) end,
    wrong = {}, bad = { "m\255", "m\0x" } },
  { "queue:claim worker (stored on the job)", setup = function(e) assert(e.queue:push("mail", {})) end,
    function(e, v) return e.queue:claim(v) end,
    wrong = { 1 }, bad = { "", "w\255" } },
  { "queue:push details", function(e, v) return e.queue:push("mail", v) end,
    wrong = {}, bad = { { ["$x"] = 1 }, { s = "\255" }, { d = D("NaN") }, "\255" } },
  { "queue:push priority", function(e, v) return e.queue:push("mail", {}, { priority = v }) end,
    wrong = { "1", D("1") }, bad = { NAN, 1.5, 1e9 } },
  { "ledger:transfer amount", function(e, v) return e.ledger:transfer("A", "B", v) end,
    wrong = { "1", D("1") }, bad = { 0, -1, 1.5, NAN, 2 ^ 60 } },
  { "ledger:transfer from", function(e, v) return e.ledger:transfer(v, "B", 1) end,
    wrong = {}, bad = { evil_id, NAN, "A\255" } },
  { "ledger:post changes", function(e, v) return e.ledger:post(v) end,
    wrong = { "changes" }, bad = { {}, { { account = "A", value = NAN } } } },
  { "sync:change update", function(e, v) return e.sync:change("o1", v) end,
    wrong = {}, bad = { { ["$set"] = { s = "\255" } }, { ["$inc"] = { n = D("NaN") } }, { status = 1 } } },
  { "sync:change id", function(e, v) return e.sync:change(v, { ["$set"] = { s = 1 } }) end,
    wrong = {}, bad = { evil_id, NAN } },
  { "versioned put doc", function(e, v) return e.writer:put("i1", v) end,
    wrong = { "doc" }, bad = { { s = "\255" }, { d = D("NaN") }, { ["$x"] = 1 } } },
  -- (issue 20, item 3: the entry points the first audit left out)
  { "tm:find filter", function(e, v) return e.tm:find(v) end,
    wrong = { "f", 1 }, bad = { { state = { ["$bogus"] = 1 } }, { ["$where"] = "true" },
                                { ["$expr"] = { ["$gt"] = { "$a", 1 } } }, { x = print },
                                -- pairs() shows nothing, the encoder sends $where
                                setmetatable({ ["$where"] = "true" },
                                  { __pairs = function() return next, {}, nil end }) } },
  { "tm:find opts", function(e, v) return e.tm:find({}, v) end,
    wrong = { "o", { bogus = 1 }, { limit = "1" }, { sort = 1 } },
    bad = { { limit = -1 }, { limit = NAN }, { limit = 1.5 }, { limit = INF }, { skip = -1 },
            { batch_size = -1 }, { skip = NAN }, { limit = 100001 } } },
  { "queue:heartbeat job", setup = claimed, function(e, v) return e.queue:heartbeat(v) end,
    wrong = { "job", 1, {}, { _id = "j" } }, bad = { { _id = evil_id, epoch = 1 } } },
  { "queue:heartbeat epoch", setup = claimed,
    function(e, v) return e.queue:heartbeat({ _id = e.job._id, epoch = v }) end,
    wrong = { "1" }, bad = { -1, 1.5, NAN, INF, 2 ^ 40 } },
  { "queue:heartbeat _id", setup = claimed,
    function(e, v) return e.queue:heartbeat({ _id = v, epoch = e.job.epoch }) end,
    wrong = {}, bad = { evil_id, NAN, "j\255" } },
  { "queue:done job", setup = claimed, function(e, v) return e.queue:done(v) end,
    wrong = { "job", 1, {} }, bad = { { _id = evil_id, epoch = 1 }, { _id = "j\255", epoch = 1 } } },
  { "queue:done epoch", setup = claimed,
    function(e, v) return e.queue:done({ _id = e.job._id, epoch = v }) end,
    wrong = { "1" }, bad = { -1, 1.5, NAN, 2 ^ 40 } },
  { "queue:done result (stored on the job)", setup = claimed,
    function(e, v) return e.queue:done(e.job, v) end,
    wrong = {}, bad = { { ["$x"] = 1 }, { ["a.b"] = 1 }, { s = "\255" }, { d = D("NaN") }, NAN, "\255",
                        ("x"):rep(17 * 1024 * 1024) } },
  { "queue:fail job", setup = claimed, function(e, v) return e.queue:fail(v, "boom") end,
    wrong = { "job", 1, {}, { _id = "j", epoch = 1 } },
    bad = { { _id = evil_id, epoch = 1, attempts = 1 }, { _id = "x", epoch = -1, attempts = 1 } } },
  { "queue:fail epoch", setup = claimed,
    function(e, v) return e.queue:fail({ _id = e.job._id, epoch = v, attempts = e.job.attempts }, "boom") end,
    wrong = { "1" }, bad = { -1, 1.5, NAN, 2 ^ 40 } },
  { "queue:fail attempts", setup = claimed,
    function(e, v) return e.queue:fail({ _id = e.job._id, epoch = e.job.epoch, attempts = v }, "boom") end,
    wrong = { "1" }, bad = { NAN, -1, 1.5, 99, INF } },
  { "ledger:reverse id", setup = posted, function(e, v) return e.ledger:reverse(v) end,
    wrong = { print }, bad = { evil_id, NAN, "e\255" } },
  { "ledger:reverse opts", setup = posted, function(e, v) return e.ledger:reverse(e.entry._id, v) end,
    wrong = { "o", { bogus = 1 }, { min = "0" }, { min = D("0") } },
    bad = { { min = NAN }, { min = INF }, { min = -INF } } },
  { "ledger:commit opts", setup = posted, function(e, v) return e.ledger:commit(v) end,
    wrong = { "o", { bogus = 1 }, { limit = "1" } },
    bad = { { limit = 0 }, { limit = -1 }, { limit = 1.5 }, { limit = NAN }, { account = evil_id },
            { account = "A\255" }, { account = {} }, { account = "A", limit = 1 }, { limit = 100001 } } },
  { "ledger:reconcile account", setup = posted, function(e, v) return e.ledger:reconcile(v) end,
    wrong = { print }, bad = { evil_id, NAN, {}, "A\255" } },
  { "sync:repair opts", setup = flagged, function(e, v) return e.sync:repair(v) end,
    wrong = { "o", { bogus = 1 }, { older_than = "1" }, { limit = "1" } },
    bad = { { older_than = -1 }, { older_than = NAN }, { older_than = INF }, { limit = 0 },
            { limit = 1.5 }, { limit = NAN } } },
  { "versioned read root", function(e, v) return e.versioned:read(v) end,
    wrong = { print }, bad = { evil_id, NAN, "r\255" } },
  { "versioned gc opts", function(e, v) return e.versioned:gc(v) end,
    wrong = { "o", { bogus = 1 }, { older_than = "1" } },
    bad = { { older_than = -1 }, { older_than = NAN }, { older_than = INF } } },
  { "versioned delete item", function(e, v) return e.writer:delete(v) end,
    wrong = { print }, bad = { evil_id, NAN, "i\255" } },
  { "mongotx.connect uri", function(_, v) return mongotx.connect(v) end,
    wrong = { 1, {} }, bad = { "", "http://x", "mongodb://", "mongodb://u:p:q@127.0.0.1",
                               "mongodb://127.0.0.1/?serverSelectionTimeoutMS=abc" } },
  { "mongotx.connect opts", function(_, v) return mongotx.connect(helpers.uri(), v) end,
    wrong = { "o", { bogus = 1 }, { database = 1 }, { appname = 1 }, { write_concern = "majority" },
              { write_concern = { w = true } }, { read_preference = 1 }, { tls = "yes" },
              { tls = { ca_file = 1 } }, { tls = { bogus = true } } },
    bad = { { database = "" }, { database = "a/b" }, { database = "a.b" }, { database = "a b" },
            { database = "a\255" },
            { appname = ("x"):rep(129) }, { write_concern = { w = -1 } },
            { write_concern = { w = 1.5 } }, { write_concern = { w = 0, j = true } },
            { write_concern = { wtimeout = -1 } }, { read_preference = "primaryish" } } },
  { "mongotx.pool connect uri", function(_, v) return pool.connect(v) end,
    wrong = { 1, {} }, bad = { "", "http://x", "mongodb://u:p:q@127.0.0.1" } },
  { "mongotx.pool connect opts", function(_, v) return pool.connect(helpers.uri(), v) end,
    wrong = { "o", { bogus = 1 }, { database = 1 }, { write_concern = { w = true } } },
    bad = { { database = "a/b" }, { appname = ("x"):rep(129) }, { write_concern = { w = -1 } },
            { read_preference = "primaryish" } } },
  { "mongotx.pool db:manager opts", function(e, v) return pooled(e):manager(v) end,
    wrong = { "o", { lease = "1" }, { bogus = 1 } },
    bad = { { lease = -1 }, { collection = "a$b" }, { application = "a\255" }, { write_concern = { w = 0 } } } },
  { "mongotx.pool tm:transfer field", function(e, v)
      return assert(pooled(e):manager{ application = "app-1" }):transfer("accounts", "A", "B", 1, { field = v })
    end, wrong = { 1 }, bad = { "", "$x", "b\255", "pendingTransactions" } },
  { "mongotx.pool tm:find opts", function(e, v)
      return assert(pooled(e):manager{ application = "app-1" }):find({}, v)
    end, wrong = { "o", { limit = "1" } }, bad = { { limit = -1 }, { limit = NAN } } },
}

it("#server the core's collection handle raises for an empty name (libmongoc aborted on a read)", function()
  local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
  assert.has_error(function() return db:collection(""):find_all({}) end)
  assert.has_error(function() return db.client:collection("", "x"):count({}) end)
  db:close()
end)

describe("#server the error rule at every public entry point", function()
  local e
  before_each(function()
    e = fixture()
    e.ledger = assert(e.db:ledger{ collection = "entries" })
    e.sync = assert(e.db:sync{ collection = "orders", propagate = function() return true end })
    e.versioned = assert(e.db:versioned{ roots = "roots", items = "items" })
    e.writer = assert(e.versioned:begin("r1"))
  end)
  after_each(function() e.db:close() end)

  -- a row whose set-up posts a ledger entry needs what the ledger needs
  local no_ledger = helpers.ferretdb_lacks("a unique index inside an array of documents (the ledger refuses to post)")
  for _, row in ipairs(entry_points) do
    for k, v in ipairs(row.wrong) do
      it(row[1] .. ": wrong type " .. k .. " (" .. type(v) .. ") raises", function()
        if row.setup == posted and no_ledger then pending(no_ledger) return end
        if row.setup then row.setup(e) end
        assert_raises(e, function() return row[2](e, v) end)
      end)
    end
    for k, v in ipairs(row.bad) do
      it(row[1] .. ": bad value " .. k .. " is invalid", function()
        if row.setup == posted and no_ledger then pending(no_ledger) return end
        if row.setup then row.setup(e) end
        assert_refused(e, function() return row[2](e, v) end)
      end)
    end
  end

  it("mongotx.resty is audited in nginx", function()
    pending("mongotx.resty needs nginx: make test-openresty runs its rows (spec/40)")
  end)
end)

-- The command (bin/mongotx) under the same rule: its arguments are all
-- strings, so there is no wrong type, and every bad value exits 2 with one
-- line `mongotx: ...` on stderr (after argparse's usage, for its own
-- refusals), no traceback, nothing on stdout and nothing written.  One
-- row per argument: args(v) is the command line for the value v
-- (opts.uri: the --uri given instead of the test server's).
local cli = require "spec.support.cli"
local bad_ids = { '{"$gt":1}', "[1]", "oid:xyz", "long:12a", "1e999", "bin:zz", "date:x",
                  "bool:maybe", "x\255", "str:x\255" }
local command_rows = {
  { "--uri", function(v) return { "status" }, { uri = v } end,
    bad = { "", "http://x", "mongodb://u:p:q@127.0.0.1", "mongodb://127.0.0.1/?serverSelectionTimeoutMS=abc" } },
  { "--database", function(v) return { "--database", v, "status" } end,
    bad = { "", "a/b", "a.b", "a b", "a\255" } },
  { "--collection", function(v) return { "--collection", v, "status" } end,
    bad = { "", "$x", ".x", "x\255", "system.x" } },
  { "--policy", function(v) return { "--policy", v, "recover" } end,
    bad = { "/nonexistent/p.lua", "/tmp", "" } },
  { "status --stale-after", function(v) return { "status", "--stale-after", v } end,
    bad = { "-1", "nan", "x", "1e99", "" } },
  { "list --state", function(v) return { "list", "--state", v } end,
    bad = { "weird", "" } },
  { "list --older-than", function(v) return { "list", "--older-than", v } end,
    bad = { "-1", "inf", "x" } },
  { "list --limit", function(v) return { "list", "--limit", v } end,
    bad = { "0", "-1", "1.5", "x", "99999999999" } },
  { "show id", function(v) return { "show", v } end, bad = bad_ids },
  { "recover --limit", function(v) return { "recover", "--limit", v } end,
    bad = { "0", "1.5", "x" } },
  { "recover --loop", function(v) return { "recover", "--loop", v } end,
    bad = { "-1", "nan", "x" } },
  { "recover --stale-after", function(v) return { "recover", "--stale-after", v } end,
    bad = { "-1", "nan" } },
  { "recover --application (stored on what it claims)",
    function(v) return { "recover", "--application", v } end, bad = { "", "a\255" } },
  { "recover --batch", function(v) return { "recover", "--batch", v } end,
    bad = { "0", "-5", "1.5", "x" } },
  { "recover --metrics-file", function(v) return { "recover", "--metrics-file", v } end,
    bad = { "/nonexistent/dir/m.prom", "" } },
  { "rollback id", function(v) return { "rollback", v } end, bad = bad_ids },
  { "rollback --reason (stored on the transaction)",
    function(v) return { "rollback", "pend", "--reason", v } end, bad = { "why \255" } },
  { "compensate id", function(v) return { "compensate", v } end, bad = bad_ids },
  { "unpark id", function(v) return { "unpark", v } end, bad = bad_ids },
  { "prune --older-than", function(v) return { "prune", "--older-than", v } end,
    bad = { "-1", "nan", "x" } },
  { "prune --batch", function(v) return { "prune", "--batch", v } end,
    bad = { "0", "1.5", "x" } },
}

describe("#server the error rule at the command", function()
  local e
  before_each(function()
    e = fixture()
    -- a transaction a rollback that got through would cancel: claimed,
    -- half applied, its owner's lease over
    local tm = assert(e.db:manager{ application = "app-1", lease = 0.1 })
    local t = assert(tm:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -5 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 5 } } },
    }, { id = "pend" }))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    mongotx.core.sleep(0.2)
  end)
  after_each(function() e.db:close() end)

  for _, row in ipairs(command_rows) do
    for k, v in ipairs(row.bad) do
      it(row[1] .. ": bad value " .. k .. " exits 2 with one line", function()
        if cli.no_build then return pending(cli.no_build) end
        local args, opts = row[2](v)
        table.insert(args, 1, "--database")
        table.insert(args, 2, e.db.name)
        if row[1] == "--database" then table.remove(args, 1); table.remove(args, 1) end
        local before = helpers.db_dump(e.db.client, e.db.name)
        local code, out, err = cli.run(args, opts)
        local what = table.concat(args, " ") .. ": " .. err
        assert.are.equal(2, code, what)
        assert.are.equal("", out, what)
        local said, last = 0, nil
        for line in err:gmatch("[^\n]+") do
          if line:find("^mongotx: ") then said = said + 1 end
          -- libmongoc's own log lines (FerretDB: "endSessions" refused as
          -- the client closes) come after ours
          if not line:find("^%d+/%d+/%d+ [%d:.]+: %[ *%d+%]: +%u+: ") then last = line end
        end
        assert.are.equal(1, said, what)
        assert.truthy(last and last:find("^mongotx: "), what)
        assert.falsy(err:find("traceback", 1, true), what)
        assert.falsy(err:find("%.lua:%d+:"), what)
        helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
      end)
    end
  end
end)

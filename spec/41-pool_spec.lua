-- The process-wide connection pools (core.connect with pool = true,
-- csrc/client.c), the engine over them (mongotx.pool), and
-- mongotx.resty's calls run in the calling Lua state (offload = false),
-- which cross the same BSON boundary as calls run in nginx's worker
-- threads (spec/40-openresty_spec.lua runs those).
local helpers = require "spec.helpers"
local core = helpers.core
local mongotx = require "mongotx"
local pool = require "mongotx.pool"
local resty = require "mongotx.resty"

local ERROR_MT = getmetatable(core.error({ code = "x" }))

-- The URI with more options (the test server's URI has a query already).
local function with_options(extra)
  local uri = helpers.uri()
  if uri:find("?", 1, true) then return uri .. "&" .. extra end
  -- options follow a "/": libmongoc refuses mongodb://host:port?x
  if not uri:match("^[^:]+://[^/]*/") then uri = uri .. "/" end
  return uri .. "?" .. extra
end

describe("#server pooled clients", function()
  it("come from one pool per URI and options in the process, and go back on close", function()
    local uri = with_options("appname=pool-spec-1")
    local a = assert(core.connect(uri, { pool = true }))
    local b = assert(core.connect(uri, { pool = true, write_concern = { w = 1 } }))
    assert.matches("^mongotx%.Client %(pooled, ", tostring(a))
    local pa, pb = a:pool(), b:pool()
    assert.are.equal(pa.id, pb.id)
    assert.are.equal(2, pb.in_use)
    assert.are.equal(100, pb.max_size)
    assert.are.equal(1, assert(a:command("admin", { ping = 1 })).ok)
    a:close()
    assert.are.equal(1, b:pool().in_use)
    local c = assert(core.connect(uri, { pool = true }))
    assert.are.equal(2, c:pool().peak) -- the client a gave back, not a new one
    local other = assert(core.connect(helpers.uri(), { pool = true, appname = "pool-spec-other" }))
    assert.are_not.equal(pa.id, other:pool().id)
    other:close()
    local plain = assert(core.connect(uri))
    assert.is_nil(plain:pool()) -- a plain client has no pool
    plain:close()
    b:close()
    c:close()
    assert.has_error(function() a:command("admin", { ping = 1 }) end, "attempt to use a closed client")
  end)

  it("count the commands of every client of the pool", function()
    local uri = with_options("appname=pool-spec-2")
    local a = assert(core.connect(uri, { pool = true }))
    local b = assert(core.connect(uri, { pool = true }))
    a:reset_counters()
    assert(a:command("admin", { ping = 1 }))
    assert(b:command("admin", { ping = 1 }))
    assert.are.equal(2, b:counters().commands)
    a:close()
    b:close()
  end)

  it("wait at most waitQueueTimeoutMS for a client when maxPoolSize are out", function()
    local uri = with_options("appname=pool-spec-3&maxPoolSize=1&waitQueueTimeoutMS=100")
    local a = assert(core.connect(uri, { pool = true }))
    assert.are.equal(1, a:pool().max_size)
    local b, err = core.connect(uri, { pool = true })
    assert.is_nil(b)
    assert.are.equal("client", err.code)
    assert.matches("waitQueueTimeoutMS", err.message)
    a:close()
    b = assert(core.connect(uri, { pool = true }))
    b:close()
  end)

  it("check the pool option", function()
    assert.has_error(function() core.connect(helpers.uri(), { pool = 1 }) end,
      "mongotx: option 'pool' must be a boolean, got 1")
  end)
end)

describe("#server mongotx.pool", function()
  local name, db, accounts

  before_each(function()
    name = helpers.db_name()
    local plain = assert(mongotx.connect(helpers.uri(), { database = name }))
    accounts = plain:collection("accounts")
    assert(accounts:insert_many {
      { _id = "A", balance = 1000 }, { _id = "B", balance = 1000 }, { _id = "C", balance = 1000 },
    })
    db = assert(pool.connect(with_options("appname=pool-spec-m"), { database = name }))
  end)

  it("runs the manager's calls on clients of the pool, each given back after the call", function()
    local tm = assert(db:manager { application = "pooled" })
    local t = assert(tm:transfer("accounts", "A", "B", 100, { min = 0, id = "p-1" }))
    assert.are.equal("done", t.state)
    assert.are.equal("p-1", assert(tm:transfer("accounts", "A", "B", 100, { min = 0, id = "p-1" }))._id)
    local _, err = tm:transfer("accounts", "A", "B", 5000, { min = 0 })
    assert.are.equal("guard", err.code)
    assert.are.equal(ERROR_MT, getmetatable(err))
    assert.are.same({ A = 900, B = 1100, C = 1000 }, (helpers.balances(accounts)))
    assert.are.equal(0, db:pool().in_use)
    assert.are.equal("done", tm:get("p-1").state)
    assert.is_nil(tm:get("none"))
    assert.are.equal(1, tm:stats().done)
  end)

  it("raises a misuse at the caller and gives the client back", function()
    local tm = assert(db:manager { application = "pooled" })
    local ok, err = pcall(function()
      local t = tm:transfer("accounts", "A", "B", 1, { bogus = 1 })
      return t
    end)
    assert.is_false(ok)
    assert.matches("^spec/41%-pool_spec%.lua:%d+: unknown option bogus for transfer", err)
    assert.are.equal(0, db:pool().in_use)
    assert.has_error(function() db:manager { lease = "x" } end,
      "option lease of manager must be a number, not string")
    local none, why = db:manager { lease = -1 }
    assert.is_nil(none)
    assert.are.equal("invalid", why.code)
  end)

  it("gives a call that comes while another one is suspended a manager of its own", function()
    local first = true
    local tm = assert(db:manager { application = "pooled", on_event = function(event)
      if event == "create" and first then
        first = false
        coroutine.yield()
      end
    end })
    local co = coroutine.create(function() return tm:transfer("accounts", "A", "B", 10) end)
    assert(coroutine.resume(co)) -- suspended inside the call, holding its client
    assert.are.equal(1, db:pool().in_use)
    local t2 = assert(tm:transfer("accounts", "B", "C", 20))
    assert.are.equal(2, tm.slots)
    local ok, t1 = coroutine.resume(co)
    assert(ok, t1)
    assert.are.equal("done", t1.state)
    assert.are.equal("done", t2.state)
    assert.are.same({ A = 990, B = 990, C = 1020 }, (helpers.balances(accounts)))
    assert.are.equal(0, db:pool().in_use)
  end)

  it("refuses a URI libmongoc refuses, and options as mongotx.connect does", function()
    local bad, err = pool.connect("mongo://nope")
    assert.is_nil(bad)
    assert.are.equal("table", type(err))
    assert.has_error(function() pool.connect(helpers.uri(), { bogus = 1 }) end,
      "unknown option bogus for connect")
  end)
end)

describe("#server mongotx.resty in the calling Lua state (offload = false)", function()
  local name, db, tm, accounts

  before_each(function()
    name = helpers.db_name()
    local plain = assert(mongotx.connect(helpers.uri(), { database = name }))
    accounts = plain:collection("accounts")
    assert(accounts:insert_many { { _id = "A", balance = 1000 }, { _id = "B", balance = 1000 } })
    db = assert(resty.connect(helpers.uri(), { database = name, offload = false }))
    tm = assert(db:manager { application = "resty" })
  end)

  local ops = {
    { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -5 } } },
    { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 5 } } },
  }

  it("returns what require \"mongotx\" returns: BSON values, key order, nil, err", function()
    local id = core.ObjectId()
    local t = assert(tm:begin(ops, { id = id, meta = {
      at = core.Date(1234), big = core.Int64("9007199254740993"), order = core.doc("z", 1, "a", 2),
      none = core.null, list = core.array() } }))
    assert.are.equal(id, t._id)
    assert.are.equal("objectId", core.type(t._id))
    assert.are.equal("date", core.type(t.meta.at))
    assert.are.equal(1234, t.meta.at:value())
    assert.are.equal(core.encode({ v = core.Int64("9007199254740993") }), core.encode({ v = t.meta.big }))
    assert.are.equal(core.encode(core.doc("z", 1, "a", 2)), core.encode(t.meta.order))
    assert.are.equal(core.null, t.meta.none)
    assert.are.equal(core.encode({ l = core.array() }), core.encode({ l = t.meta.list }))
    local done = assert(tm:commit(t))
    assert.are.equal("done", done.state)
    assert.are.equal(id, tm:get(id)._id)
    local none, nerr = tm:get("no such id")
    assert.is_nil(none)
    assert.is_nil(nerr)
    assert.are.same({ A = 995, B = 1005 }, (helpers.balances(accounts)))
  end)

  it("returns errors with their metatable and fields, also inside results", function()
    local _, err = tm:transfer("accounts", "A", "B", 5000, { min = 0 })
    assert.are.equal(ERROR_MT, getmetatable(err))
    assert.are.equal("guard", err.code)
    assert.matches("^mongotx: ", tostring(err))
    local results, errs = tm:transfer_many {
      { collection = "accounts", from = "A", to = "B", amount = 1 },
      { collection = "accounts", from = "A", to = "B", amount = -1 },
    }
    assert.are.equal("done", results[1].state)
    assert.is_false(results[2])
    assert.is_false(errs[1])
    assert.are.equal(ERROR_MT, getmetatable(errs[2]))
    assert.are.equal("invalid", errs[2].code)
    local report = assert(tm:recover())
    assert.are.equal(0, report.failed)
    assert.are.equal(1, tm:stats().done)
  end)

  it("raises a misuse at the caller, and refuses functions in a manager's options", function()
    local ok, err = pcall(function()
      local t = tm:transfer("accounts", "A", "B", 1, { bogus = 1 })
      return t
    end)
    assert.is_false(ok)
    assert.matches("^spec/41%-pool_spec%.lua:%d+: unknown option bogus for transfer", err)
    assert.has_error(function() db:manager { may_recover = function() return true end } end)
    local ok2, err2 = pcall(db.manager, db, { stale_pending = function() return "back" end })
    assert.is_false(ok2)
    assert.matches("policies = ", err2)
    -- an argument BSON cannot carry is invalid, like a meta BSON cannot store
    local _, bad = tm:begin(ops, { meta = { f = print } })
    assert.are.equal("invalid", bad.code)
  end)

  it("takes policy functions from a module named by policies", function()
    package.loaded["spec.support.test_policies"] = {
      stale_pending = function() return "back" end, max_attempts = 7,
    }
    local tm2 = assert(db:manager { application = "resty-2", policies = "spec.support.test_policies" })
    assert(tm2:transfer("accounts", "A", "B", 1))
    local ok, err = pcall(db.manager, db, { policies = "spec.support.no_such_module" })
    assert.is_false(ok)
    assert.matches("policies module spec.support.no_such_module", err, 1, true)
  end)
end)

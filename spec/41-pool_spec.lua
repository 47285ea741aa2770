-- The process-wide connection pools (core.connect with pool = true,
-- csrc/client.c) and the engine over them (mongotx.pool).
local helpers = require "spec.helpers"
local core = helpers.core
local mongotx = require "mongotx"
local pool = require "mongotx.pool"

local ERROR_MT = getmetatable(core.error({ code = "x" }))

-- The URI with more options (the test server's URI has a query already).
local function with_options(extra)
  local uri = helpers.uri()
  return uri .. (uri:find("?", 1, true) and "&" or "?") .. extra
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

-- Holds through group commit in nginx (mongotx.group through
-- mongotx.resty): concurrent POST /hold of examples/openresty/bank.lua in
-- one worker join its batches, opened with one insert and their applies
-- shared (the holds of one batch carry its one lastModified stamp, which
-- a hold opened alone, an upsert, does not); each request is answered as
-- it is by an nginx with group = false; the holds are then captured as
-- any.  `make test-openresty` runs it; the other targets report it
-- pending.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty grouped holds in nginx", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local cjson = require "cjson"
local mongotx = require "mongotx"

describe("#openresty grouped holds in nginx", function()
  local srv

  setup(function()
    srv = assert(server.start { kind = "memory" })
  end)

  teardown(function()
    if srv then srv:stop() end
  end)

  local function bank(balances)
    local name = helpers.db_name()
    local db = assert(mongotx.connect(srv.uri, { database = name }))
    local docs = {}
    for id, b in pairs(balances) do docs[#docs + 1] = { _id = id, balance = b } end
    table.sort(docs, function(x, y) return x._id < y._id end)
    assert(db:collection("accounts"):insert_many(docs))
    return db, name
  end

  -- nginx on database `name`, one worker, its group events in
  -- /tmp/mongotx-group-events-<app> (spec/support/group_events.lua)
  local function start(name, app, group)
    os.remove("/tmp/mongotx-group-events-" .. app)
    return assert(nginx.start { uri = srv.uri, database = name, workers = 1, threads = 4, vms = 16,
      configure = ("{ manager = { application = %q, policies = 'spec.support.group_events', " ..
        "group = %s }, recovery = false }"):format(app, group) })
  end

  local function batches(app)
    local out = {}
    for line in (nginx.readfile("/tmp/mongotx-group-events-" .. app) or ""):gmatch("[^\n]+") do
      out[#out + 1] = tonumber(line:match("^(%d+) "))
    end
    return out
  end

  local function account(db, id)
    local d = assert(db:collection("accounts"):find_one({ _id = id }))
    return { d.balance, d.txPending and d.txPending.balance or 0, #(d.pendingTransactions or {}) }
  end

  -- 48 requests: holds of A (30 that fit, 6 beyond its floor), 4 repeating
  -- a key of those, 4 with a bad expiry (refused before tm:hold), 4 to an
  -- unknown account
  local function requests()
    local list = {}
    local function add(body, key)
      list[#list + 1] = { method = "POST", path = "/hold", body = body,
                          headers = { ["Idempotency-Key"] = key } }
    end
    for i = 1, 30 do add(('{"from":"A","to":"%s","amount":10}'):format(i % 3 == 0 and "C" or "B"), "h" .. i) end
    for i = 1, 6 do add('{"from":"A","to":"B","amount":5000}', "o" .. i) end
    for i = 1, 4 do add('{"from":"A","to":"C","amount":10}', "h" .. i * 3) end
    for i = 1, 4 do add('{"from":"A","to":"B","amount":1,"expires":-1}', "x" .. i) end
    for i = 1, 4 do add('{"from":"A","to":"nobody","amount":1}', "n" .. i) end
    return list
  end

  -- An answer as compared: status, error name, hold status and amount
  local function normal(res)
    local ok, t = pcall(cjson.decode, res.body)
    if not ok or type(t) ~= "table" then return { res.status, res.body } end
    return { res.status, t.error, t.status, t.amount, t.id, t.state }
  end

  it("opens concurrent holds of a worker in shared batches, each answered as alone", function()
    local db, name = bank { A = 1000, B = 0, C = 0 }
    local n = start(name, "holds-grouped", "{ max = 100, delay = 0.005 }")
    finally(function() n:stop() end)
    local list = requests()
    local got = assert(n:many(list, { parallel = true }):wait(60))
    for i = 1, 30 do
      assert.are.equal(200, got[i].status, got[i].body)
      assert.are.equal("held", cjson.decode(got[i].body).status)
    end
    for i = 31, 36 do assert.are.equal(422, got[i].status, got[i].body) end
    for i = 41, 44 do assert.are.equal(400, got[i].status, got[i].body) end
    for i = 45, 48 do assert.are.equal(404, got[i].status, got[i].body) end
    -- the repeated keys: the same hold (409 in_progress when asked while
    -- another batch of another request still opened it)
    for i = 37, 40 do
      assert(got[i].status == 200 or got[i].status == 409, got[i].body)
    end
    -- batches of several calls, every hold call among them
    local sizes, calls, biggest = batches("holds-grouped"), 0, 0
    for _, s in ipairs(sizes) do calls, biggest = calls + s, math.max(biggest, s) end
    assert.are.equal(40, calls)
    assert(biggest > 1 and #sizes < 40, #sizes .. " batches for 40 calls")
    -- the holds of a batch were inserted together: one stamp a batch
    local holds = assert(db:collection("transactions"):find_all({ state = "pending" }))
    assert.are.equal(30, #holds)
    local stamps, distinct = {}, 0
    for _, T in ipairs(holds) do
      local k = T.lastModified:value()
      if not stamps[k] then stamps[k], distinct = true, distinct + 1 end
    end
    assert(distinct < 30 and distinct <= #sizes, distinct .. " stamps for 30 holds in " .. #sizes .. " batches")
    assert.are.same({ 700, 0, 30 }, account(db, "A"))
    assert.are.same({ 0, 200, 20 }, account(db, "B"))
    assert.are.same({ 0, 100, 10 }, account(db, "C"))
    -- the same requests to an nginx that groups nothing, one at a time
    local db2, name2 = bank { A = 1000, B = 0, C = 0 }
    local n2 = start(name2, "holds-alone", "false")
    finally(function() n2:stop() end)
    local alone = assert(n2:many(list):wait(60))
    for i = 1, #list do
      if got[i].status ~= 409 then
        assert.are.same(normal(alone[i]), normal(got[i]), "request " .. i)
      end
    end
    assert.are.same({}, batches("holds-alone"))
    assert.are.same(account(db2, "A"), account(db, "A"))
    -- captured as any hold: 4 of each, the rest back to A
    local captures = {}
    for i = 1, 30 do
      captures[i] = { method = "POST", path = "/capture", body = ('{"id":"h%d","amount":4}'):format(i) }
    end
    local done = assert(n:many(captures, { parallel = true }):wait(60))
    for i = 1, 30 do assert.are.equal(200, done[i].status, done[i].body) end
    assert.are.same({ 880, 0, 0 }, account(db, "A"))
    assert.are.same({ 80, 0, 0 }, account(db, "B"))
    assert.are.same({ 40, 0, 0 }, account(db, "C"))
    db:close()
    db2:close()
  end)
end)

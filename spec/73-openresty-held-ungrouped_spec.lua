-- Ungrouped nginx (group = false) waits for a held key in the request's
-- own coroutine, not in a worker thread (issue 41; mongotx.resty.held):
-- with a thread pool of ONE thread, a transfer whose Idempotency-Key
-- another process's call holds (pending, lease an hour) waits for it up
-- to holder_wait, while transfers on other keys and accounts keep being
-- answered at once; when the holder finishes during the wait, the
-- waiting request answers its outcome.  `make test-openresty` runs it.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty a held key without group commit", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local cjson = require "cjson"
local core = helpers.core
local mongotx = require "mongotx"

-- The holder: tm:transfer(A -> B, 10, min 0, id arg[3]) as bank.lua's
-- /transfer makes it, lease an hour; at its applies it writes arg[4] and
-- waits until arg[5] exists (or for ever), then finishes.
local HOLDER = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local db = assert(mongotx.connect(arg[1], { database = arg[2] }))
local tm = assert(db:manager { application = "holder", lease = 3600,
  on_event = function(name)
    if name == "apply" then
      local f = assert(io.open(arg[4], "w")); f:write("ready\n"); f:close()
      while not io.open(arg[5]) do mongotx.core.sleep(0.02) end
    end
  end })
local T, err = tm:transfer("accounts", arg[6], arg[7], 10, { min = 0, id = arg[3] })
print("state " .. (T and T.state or tostring(err)))
]]

local HOLDER_WAIT = 3

-- POST /many: tm:transfer_many of the body's list (as JSON), on bank's
-- manager options; answers { states = [...], codes = [...] }.  POST
-- /refusing: tm:commit_many of the body's list, on a manager whose
-- on_op_failure raises (spec.support.refusing_policy); answers their
-- messages too.
local MANY = ([[
location = /many { content_by_lua_block {
  local cjson = require "cjson"
  local resty = require "mongotx.resty"
  local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = os.getenv("MONGOTX_DATABASE") }))
  local tm = assert(db:manager { application = "bank", group = false, holder_wait = %d })
  ngx.req.read_body()
  local results, errs = tm:transfer_many(cjson.decode(ngx.req.get_body_data()))
  local states, codes = {}, {}
  for i = 1, #errs do
    states[i] = results[i] and results[i].state or "none"
    codes[i] = errs[i] and errs[i].code or "none"
  end
  ngx.say(cjson.encode({ states = states, codes = codes }))
} }
location = /refusing { content_by_lua_block {
  local cjson = require "cjson"
  local resty = require "mongotx.resty"
  local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = os.getenv("MONGOTX_DATABASE") }))
  local tm = assert(db:manager { application = "refusing", group = false, holder_wait = %d,
    policies = "spec.support.refusing_policy" })
  ngx.req.read_body()
  local results, errs = tm:commit_many(cjson.decode(ngx.req.get_body_data()))
  local states, codes, messages = {}, {}, {}
  for i = 1, #errs do
    states[i] = results[i] and results[i].state or "none"
    codes[i] = errs[i] and errs[i].code or "none"
    messages[i] = errs[i] and errs[i].message or "none"
  end
  ngx.say(cjson.encode({ states = states, codes = codes, messages = messages }))
} }
]]):format(HOLDER_WAIT, HOLDER_WAIT)

describe("#openresty a held key without group commit", function()
  local srv, db, name, n

  setup(function()
    srv = assert(server.start { kind = "memory" })
    name = helpers.db_name()
    db = assert(mongotx.connect(srv.uri, { database = name }))
    local docs = {}
    for _, id in ipairs { "A", "B", "C", "D", "E", "F" } do
      docs[#docs + 1] = { _id = id, balance = 1000, pendingTransactions = core.array() }
    end
    assert(db:collection("accounts"):insert_many(docs))
    -- one thread in the pool: a call that slept in it would hold up all others
    n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, threads = 1, vms = 4,
      recovery = false, locations = MANY,
      configure = ("{ manager = { application = 'bank', group = false, holder_wait = %d } }")
        :format(HOLDER_WAIT) })
  end)

  teardown(function()
    if n then n:stop() end
    if srv then srv:stop() end
  end)

  local function body(from, to, amount)
    return ('{"from":"%s","to":"%s","amount":%d}'):format(from, to, amount)
  end

  -- A holder of key `key` (A -> B or `from` -> `to`), pending at its
  -- applies; :go() lets it finish, :stop() kills it and says what it printed.
  local function holder(key, from, to)
    local ready, go = os.tmpname(), os.tmpname()
    os.remove(ready)
    os.remove(go)
    local pid, out, script = helpers.spawn_script(HOLDER, srv.uri, name, key, ready, go, from, to)
    assert.is_true(helpers.wait_file(ready, 30), "the holder never reached its applies")
    return {
      go = function() assert(io.open(go, "w")):close() end,
      stop = function(_, kill)
        if kill then helpers.signal(pid, "KILL") end
        assert.is_true(helpers.wait_exit(pid, 30))
        local said = helpers.read_file(out)
        for _, f in ipairs { ready, go, out, script } do os.remove(f) end
        return said
      end,
    }
  end

  local function state(id)
    return assert(db:collection("transactions"):find_one({ _id = id })).state
  end

  local function balances()
    local out = {}
    for _, d in ipairs(helpers.dump(db:collection("accounts"))) do out[d._id] = d.balance end
    return out
  end

  it("answers other keys at once while a held one waits, then in_progress", function()
    assert.are.equal(200, (n:request("POST", "/transfer", body("C", "D", 1)))) -- warm
    local h = holder("k1", "A", "B")
    local waiting = n:spawn("POST", "/transfer", body("A", "B", 10),
                            { headers = { ["Idempotency-Key"] = "k1" } })
    core.sleep(0.3) -- it is in its wait
    local slowest = 0
    for _ = 1, 5 do
      local status, res, took = n:request("POST", "/transfer", body("E", "F", 1))
      assert.are.equal(200, status, res)
      assert.are.equal("done", cjson.decode(res).state)
      slowest = math.max(slowest, took)
    end
    -- a call that slept in the only thread would have held these for
    -- most of holder_wait
    assert.is_true(slowest < 1, ("a transfer on other keys took %.2f s"):format(slowest))
    local status, res, took = waiting:wait(30)
    assert.are.equal(409, status, res)
    assert.are.equal("in_progress", cjson.decode(res).error)
    assert.is_true(took >= HOLDER_WAIT - 0.5 and took < HOLDER_WAIT + 3,
      ("the held request answered after %.2f s"):format(took))
    h:stop(true)
    -- the held one as its holder left it; the others done
    assert.are.equal("pending", state("k1"))
    local b = balances()
    assert.are.same({ 999, 1001, 995, 1005 }, { b.C, b.D, b.E, b.F })
    assert.are.equal(990, b.A) -- k1's debit applied, its credit escrowed
    assert.are.same({ "k1" }, assert(db:collection("accounts"):find_one({ _id = "A" })).pendingTransactions)
  end)

  it("answers the holder's outcome when it finishes during the wait", function()
    local h = holder("k2", "C", "D")
    local waiting = n:spawn("POST", "/transfer", body("C", "D", 10),
                            { headers = { ["Idempotency-Key"] = "k2" } })
    core.sleep(1)
    local status, res = n:request("POST", "/transfer", body("E", "F", 1))
    assert.are.equal(200, status, res)
    h:go()
    assert.are.equal("done", (h:stop():match("state (%S+)")))
    local took
    status, res, took = waiting:wait(30)
    assert.are.equal(200, status, res)
    local t = cjson.decode(res)
    assert.are.same({ "k2", "done" }, { t.id, t.state })
    assert.is_true(took < HOLDER_WAIT, ("the held request answered after %.2f s"):format(took))
    assert.are.equal("done", state("k2"))
    local b = balances()
    assert.are.same({ 989, 1011, 994, 1006 }, { b.C, b.D, b.E, b.F })
    assert.are.equal(0, db:collection("transactions"):count({ _id = "k2", state = { ["$ne"] = "done" } }))
  end)

  it("transfer_many: the other items answer, the held one waits outside the thread", function()
    local h = holder("k3", "C", "D")
    local t0 = core.monotonic_ms()
    local waiting = n:spawn("POST", "/many", cjson.encode {
      { collection = "accounts", from = "E", to = "F", amount = 2, id = "m1" },
      { collection = "accounts", from = "C", to = "D", amount = 10, min = 0, id = "k3" } })
    -- its other item is done at once, before the held one's wait
    for _ = 1, 100 do
      if db:collection("transactions"):count({ _id = "m1", state = "done" }) == 1 then break end
      core.sleep(0.02)
    end
    assert.are.equal("done", state("m1"))
    assert.is_true(core.monotonic_ms() - t0 < 1500, "the other item was not done at once")
    core.sleep(0.5)
    local status, res, took = n:request("POST", "/transfer", body("A", "B", 1))
    assert.are.equal(200, status, res)
    assert.is_true(took < 1, ("a transfer meanwhile took %.2f s"):format(took))
    h:go()
    assert.are.equal("done", (h:stop():match("state (%S+)")))
    status, res = waiting:wait(30)
    assert.are.equal(200, status, res)
    assert.are.same({ states = { "done", "done" }, codes = { "none", "none" } }, cjson.decode(res))
    assert.are.equal("done", state("k3"))
    local b = balances()
    assert.are.same({ 979, 1021, 992, 1008 }, { b.C, b.D, b.E, b.F })
  end)

  -- The held items of /refusing: pending, claimed by this process's
  -- manager (lease `lease`), their first op guarded (P >= 500: false).
  local GUARDED = {
    { collection = "accounts", id = "P", update = { ["$inc"] = { balance = -500 } },
      where = { balance = { ["$gte"] = 500 } } },
    { collection = "accounts", id = "Q", update = { ["$inc"] = { balance = 500 } } } }

  local function claimed(id, lease)
    local owner = assert(db:manager { application = "owner", lease = lease })
    assert(owner:step("claim", assert(owner:begin(GUARDED, { id = id }))))
    return { id = id, ops = GUARDED }
  end

  local function credit(id, to)
    return { id = id, ops = { { collection = "accounts", id = to, update = { ["$inc"] = { balance = 1 } } } } }
  end

  it("commit_many: a policy that raises for the held item is that item's error, the others answer", function()
    assert(db:collection("accounts"):insert_many { { _id = "P", balance = 100 }, { _id = "Q", balance = 0 },
                                                   { _id = "R", balance = 0 } })
    local held = claimed("r1", 1)
    local status, res, took = n:request("POST", "/refusing", cjson.encode { credit("r2", "R"), held })
    -- (on the old code the policy's raise failed the whole call: a 500)
    assert.are.equal(200, status, res)
    local t = cjson.decode(res)
    assert.are.same({ states = { "done", "none" }, codes = { "none", "policy" } },
                    { states = t.states, codes = t.codes })
    assert.truthy(t.messages[2]:find("policy says no", 1, true), t.messages[2])
    -- taken over once its lease passed (1 s), not at holder_wait's end
    assert.is_true(took > 0.8 and took < HOLDER_WAIT, ("answered after %.2f s"):format(took))
    assert.are.same({ "done", "pending" }, { state("r2"), state("r1") })
    local b = balances()
    assert.are.same({ 100, 0, 1 }, { b.P, b.Q, b.R })
  end)

  it("commit_many: a held item whose transaction vanished during the wait answers so", function()
    local held = claimed("r3", 3600)
    local waiting = n:spawn("POST", "/refusing", cjson.encode { credit("r4", "R"), held })
    core.sleep(0.5) -- it is in its wait
    assert.are.equal(1, assert(db:collection("transactions"):delete_one({ _id = "r3" })).deleted)
    local status, res, took = waiting:wait(30)
    assert.are.equal(200, status, res)
    -- (on the old code: "no such transaction", from a commit of it by id)
    assert.are.same({ states = { "done", "none" }, codes = { "none", "state" },
                      messages = { "none", "the transaction disappeared" } }, cjson.decode(res))
    assert.is_true(took < HOLDER_WAIT, ("answered after %.2f s"):format(took))
    assert.are.same({ "done", 0 }, { state("r4"), db:collection("transactions"):count({ _id = "r3" }) })
    local b = balances()
    assert.are.same({ 100, 0, 2 }, { b.P, b.Q, b.R })
  end)
end)

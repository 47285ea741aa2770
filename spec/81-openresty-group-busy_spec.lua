-- Group commit in nginx (mongotx.group through mongotx.resty): a request
-- whose transfer meets a document another open transaction holds (`busy`)
-- holds none of its worker's other requests (issue 41).  Its batch
-- answers the others at once; its handler sleeps its backoffs
-- (ngx.sleep, no worker thread and no batch held), then a worker thread
-- goes on with its transaction alone: cancelled `busy` after its retries
-- while the holder stays open (503), `done` when the holder ends between
-- them (200).  Meanwhile the worker's other requests (one worker, one
-- batch at a time: inflight = 1) are answered at their own pace.  Each
-- case checks what the database holds.  Ungrouped (group = false) the
-- same: the handler sleeps, not the worker thread (one thread here).
-- `make test-openresty` runs it; the other targets report it pending.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty a busy call in nginx's group commit", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local cjson = require "cjson"
local mongotx = require "mongotx"

-- The busy call's retries: alone it waits RETRIES x BACKOFF in all.
local RETRIES, BACKOFF = 3, require("spec.support.busy_policies").backoff()
local WAIT = RETRIES * BACKOFF
-- Unrelated requests, one after another while the busy one waits.
local K = 6

-- POST /many: tm:transfer_many of the body's list (JSON), ungrouped, on
-- the spec's manager options; answers { states = [...], codes = [...] }.
local MANY = ([[
location = /many { content_by_lua_block {
  local cjson = require "cjson"
  local resty = require "mongotx.resty"
  local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = os.getenv("MONGOTX_DATABASE") }))
  local tm = assert(db:manager { application = "busy", group = false, retries = %d,
    policies = "spec.support.busy_policies" })
  ngx.req.read_body()
  local results, errs = tm:transfer_many(cjson.decode(ngx.req.get_body_data()))
  local states, codes = {}, {}
  for i = 1, #errs do
    states[i] = results[i] and results[i].state or "none"
    codes[i] = errs[i] and errs[i].code or "none"
  end
  ngx.say(cjson.encode({ states = states, codes = codes }))
} }
]]):format(RETRIES)

describe("#openresty a busy call in nginx's group commit", function()
  local srv

  setup(function()
    srv = assert(server.start { kind = "memory" })
  end)

  teardown(function()
    if srv then srv:stop() end
  end)

  -- The bank, and the holder: alive (lease an hour), its transaction
  -- caught with its credit on X (exclusive: escrow = false, in txHeld).
  local function bank()
    local name = helpers.db_name()
    local db = assert(mongotx.connect(srv.uri, { database = name }))
    local docs = { { _id = "H", balance = 1000 }, { _id = "V", balance = 0 }, { _id = "X", balance = 50 } }
    for i = 1, K do docs[#docs + 1] = { _id = "U" .. i, balance = 50 } end
    assert(db:collection("accounts"):insert_many(docs))
    local holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
    helpers.hold_open(holder, "X", "h")
    return db, name, holder
  end

  -- nginx, one worker; grouped (inflight = 1), or group = false with one
  -- worker thread
  local function start(name, ungrouped)
    return assert(nginx.start { uri = srv.uri, database = name, workers = 1,
      threads = ungrouped and 1 or 4, vms = ungrouped and 1 or 8, locations = MANY,
      configure = ("{ manager = { application = 'busy', retries = %d, " ..
        "policies = 'spec.support.busy_policies', group = %s }, " ..
        "recovery = false, account_cache = false }"):format(RETRIES,
          ungrouped and "false" or "{ max = 100, delay = 0, inflight = 1 }") })
  end

  local function transfer(from, key)
    return ('{"from":"%s","to":"V","amount":10}'):format(from), { headers = { ["Idempotency-Key"] = key } }
  end

  -- The busy request (X pays V; or `many`: a POST /many with it) in the
  -- background; then K unrelated ones one after another, each answered
  -- well before the busy one's wait is over; `during` (if any) once they
  -- are.  Returns the busy request's status, body and seconds.
  local function run(n, during, many)
    local body, opts = transfer("X", "x")
    local busy = many and n:spawn("POST", "/many", many) or n:spawn("POST", "/transfer", body, opts)
    server.sleep(0.1) -- (its batch ran: its handler sleeps)
    for i = 1, K do
      local status, answer, seconds = n:request("POST", "/transfer", transfer("U" .. i, "u" .. i))
      assert.are.equal(200, status, answer)
      assert.is_true(seconds < BACKOFF, ("u%d took %.3f s: it waited for the busy request " ..
        "(its backoff: %.2f s)"):format(i, seconds, BACKOFF))
    end
    if during then during() end
    return busy:wait(30)
  end

  local function check_db(db, holder, done)
    local h = assert(holder:get("h"))
    if h.state ~= "cancelled" then assert(holder:rollback(h)) end
    local accounts, txs = db:collection("accounts"), db:collection("transactions")
    local want = { H = 1000, V = 10 * K + (done and 10 or 0), X = done and 40 or 50 }
    for i = 1, K do
      want["U" .. i] = 40
      assert.are.equal("done", assert(txs:find_one({ _id = "u" .. i })).state)
    end
    assert.are.same(want, helpers.balances(accounts))
    local T = assert(txs:find_one({ _id = "x" }))
    if done then
      assert.are.equal("done", T.state)
    else
      assert.are.same({ "cancelled", "busy" }, { T.state, T.cause })
    end
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end

  it("answers the worker's other requests while the busy one waits; it ends busy after its retries", function()
    local db, name, holder = bank()
    local n = start(name)
    finally(function() n:stop() end)
    local status, body, seconds = run(n)
    assert.are.equal(503, status, body)
    assert.are.equal("busy", cjson.decode(body).error)
    assert.is_true(seconds >= WAIT, ("the busy request took %.2f s, not its backoffs"):format(seconds))
    check_db(db, holder, false)
  end)

  it("a busy request whose holder ends between its retries is done", function()
    local db, name, holder = bank()
    local n = start(name)
    finally(function() n:stop() end)
    local status, body = run(n, function()
      assert(holder:rollback(assert(holder:get("h"))))
    end)
    assert.are.equal(200, status, body)
    assert.are.equal("done", cjson.decode(body).state)
    check_db(db, holder, true)
  end)

  it("ungrouped (group = false, one worker thread): the busy request sleeps in its handler, " ..
     "not in the thread", function()
    local db, name, holder = bank()
    local n = start(name, true)
    finally(function() n:stop() end)
    local status, body, seconds = run(n)
    assert.are.equal(503, status, body)
    assert.are.equal("busy", cjson.decode(body).error)
    assert.is_true(seconds >= WAIT, ("the busy request took %.2f s, not its backoffs"):format(seconds))
    check_db(db, holder, false)
  end)

  it("ungrouped: a busy request whose holder ends between its retries is done", function()
    local db, name, holder = bank()
    local n = start(name, true)
    finally(function() n:stop() end)
    local status, body = run(n, function()
      assert(holder:rollback(assert(holder:get("h"))))
    end)
    assert.are.equal(200, status, body)
    assert.are.equal("done", cjson.decode(body).state)
    check_db(db, holder, true)
  end)

  it("ungrouped transfer_many: its busy item sleeps in the handler, its other items answer", function()
    local db, name, holder = bank()
    local n = start(name, true)
    finally(function() n:stop() end)
    local status, body, seconds = run(n, nil, cjson.encode {
      { collection = "accounts", from = "X", to = "V", amount = 10, min = 0, id = "x" },
      { collection = "accounts", from = "H", to = "V", amount = 10, min = 0, id = "m" } })
    assert.are.equal(200, status, body)
    assert.are.same({ states = { "none", "done" }, codes = { "busy", "none" } }, cjson.decode(body))
    assert.is_true(seconds >= WAIT, ("the busy item took %.2f s, not its backoffs"):format(seconds))
    -- (H paid V 10 more: m)
    local h = assert(holder:get("h"))
    assert(holder:rollback(h))
    local want = { H = 990, V = 10 * K + 10, X = 50 }
    for i = 1, K do want["U" .. i] = 40 end
    assert.are.same(want, helpers.balances(db:collection("accounts")))
    assert.are.same({ "cancelled", "busy" }, { assert(db:collection("transactions"):find_one({ _id = "x" })).state,
      assert(db:collection("transactions"):find_one({ _id = "x" })).cause })
    for _, d in ipairs(helpers.dump(db:collection("accounts"))) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)
end)

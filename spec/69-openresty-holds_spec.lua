-- Holds in nginx: examples/openresty/bank.lua's POST /hold, /capture and
-- /void behind a generated nginx.conf (spec/support/nginx.lua), their
-- answers and what the database holds after them; captures and voids of
-- one hold sent at once to several nginx workers end it in one outcome.
--
-- `make test-openresty` runs it (MONGOTX_OPENRESTY=1); the other targets
-- report it pending.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty holds in nginx", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local mongotx = require "mongotx"

local function json(s) return (require "cjson").decode(s) end

describe("#openresty holds in nginx", function()
  local srv, db, n

  setup(function()
    srv = assert(server.start { kind = "memory" })
  end)

  teardown(function()
    if srv then srv:stop() end
  end)

  before_each(function()
    db = assert(mongotx.connect(srv.uri, { database = helpers.db_name() }))
    assert(db:collection("accounts"):insert_many { { _id = "A", balance = 100 }, { _id = "B", balance = 0 } })
    n = assert(nginx.start { uri = srv.uri, database = db.name, workers = 2 })
  end)

  after_each(function()
    if n then n:stop() end
    if db then db:close() end
  end)

  local function account(id)
    local d = assert(db:collection("accounts"):find_one({ _id = id }))
    return { d.balance, d.txPending and d.txPending.balance or 0, #(d.pendingTransactions or {}) }
  end

  local function post(path, body, key)
    local status, res = n:request("POST", path, body, key and { headers = { ["Idempotency-Key"] = key } })
    return status, res ~= "" and json(res) or nil
  end

  it("reserves, captures part, refuses more than held, voids, each with its answer", function()
    local status, res = post("/hold", '{"from":"A","to":"B","amount":60,"expires":600}', "cart-1")
    assert.are.equal(200, status)
    assert.are.equal("held", res.status)
    assert.are.equal("cart-1", res.id)
    assert.are.same({ 40, 0, 1 }, account("A"))
    assert.are.same({ 0, 60, 1 }, account("B"))
    status, res = post("/hold", '{"from":"A","to":"B","amount":60}', "cart-2")
    assert.are.equal(422, status)
    assert.are.equal("insufficient_funds", res.error)
    status, res = post("/capture", '{"id":"cart-1","amount":61}')
    assert.are.equal(400, status)
    assert.are.equal("invalid", res.error)
    assert.are.same({ 0, 60, 1 }, account("B"))
    status, res = post("/capture", '{"id":"cart-1","amount":25}')
    assert.are.equal(200, status)
    assert.are.equal("captured", res.status)
    assert.are.equal(25, res.captured)
    status = post("/capture", '{"id":"cart-1","amount":25}') -- a retry
    assert.are.equal(200, status)
    status, res = post("/void", '{"id":"cart-1"}')
    assert.are.equal(409, status)
    assert.are.equal("hold_captured", res.error)
    assert.are.same({ 75, 0, 0 }, account("A"))
    assert.are.same({ 25, 0, 0 }, account("B"))
    assert(post("/hold", '{"from":"A","to":"B","amount":70}', "cart-3") == 200)
    status, res = post("/void", '{"id":"cart-3"}')
    assert.are.equal(200, status)
    assert.are.equal("voided", res.status)
    status, res = post("/capture", '{"id":"cart-3"}')
    assert.are.equal(409, status)
    assert.are.equal("hold_voided", res.error)
    assert.are.same({ 75, 0, 0 }, account("A"))
    -- bad input: nothing written
    local before = helpers.db_dump(db.client, db.name)
    assert.are.equal(400, (post("/hold", '{"from":"A","to":"B","amount":5}')))  -- no key
    assert.are.equal(400, (post("/hold", '{"from":"A","to":"B","amount":5,"expires":-1}', "k")))
    assert.are.equal(400, (post("/capture", '{"id":{"$gt":""}}')))
    assert.are.equal(400, (post("/void", '{"id":"cart-3","amount":5}')))
    assert.are.equal(404, (post("/capture", '{"id":"none"}')))
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end)

  it("ends a hold that workers capture and void at once in one outcome", function()
    local holds = 10
    for i = 1, holds do
      assert.are.equal(200, (post("/hold", '{"from":"A","to":"B","amount":10}', "h" .. i)))
    end
    local list = {}
    for i = 1, holds do
      for k = 1, 4 do
        list[#list + 1] = { method = "POST", path = k % 2 == 0 and "/capture" or "/void",
          body = k % 2 == 0 and ('{"id":"h%d","amount":%d}'):format(i, k) or ('{"id":"h%d"}'):format(i) }
      end
    end
    local results = assert(n:many(list, { parallel = true }):wait(60))
    local captured = 0
    for i = 1, holds do
      local T = assert(db:collection("transactions"):find_one({ _id = "h" .. i }))
      local oks = 0
      for k = 1, 4 do
        local r = results[(i - 1) * 4 + k]
        if r.status == 200 then
          oks = oks + 1
          local body = json(r.body)
          if T.state == "done" then
            assert.are.equal("captured", body.status)
            assert.are.equal(T.hold.captured, body.captured)
          else
            assert.are.equal("voided", body.status)
          end
        else
          assert.are.equal(409, r.status, r.body)
        end
      end
      assert.truthy(oks >= 1)
      if T.state == "done" then
        captured = captured + T.hold.captured
      else
        assert.are.equal("cancelled", T.state)
      end
    end
    assert.are.same({ 100 - captured, 0, 0 }, account("A"))
    assert.are.same({ captured, 0, 0 }, account("B"))
  end)
end)

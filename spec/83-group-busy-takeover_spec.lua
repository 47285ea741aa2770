-- Group commit, a call handed to its caller `busy` (mongotx.group.busy):
-- what its caller is told must be what becomes of its transaction, as
-- for the call alone.  (1) While its caller waits a backoff, its owner's
-- lease passes and another manager takes its transaction over: the call
-- alone waits for the new owner's outcome and answers it
-- (mongotx.manager.batches, await_held: the same transaction); grouped
-- it must not run the call afresh (a second transfer).  (2) With
-- mongotx.pool, no client free at its next try: the call must not answer
-- the pool's error while its transaction stays pending for recovery to
-- roll forward; it tries again, and after holder_wait without one answers
-- in_progress naming its transaction.  (3) In nginx: the same with no
-- worker thread (`overloaded`), and a takeover while its handler waits.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local BACKOFF, LEASE = 0.6, 1

describe("#server group commit: a busy call taken over while its caller waits", function()
  local db, dbname, accounts, txs, holder, payer, taker

  before_each(function()
    dbname = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    assert(accounts:insert_many({ { _id = "H", balance = 1000 }, { _id = "X", balance = 50 },
                                  { _id = "U", balance = 50 } }))
    -- the holder: its credit on X applied, left open (exclusive: txHeld)
    holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
    helpers.hold_open(holder, "X", "h")
    payer = assert(db:manager { application = "payer", lease = LEASE, retries = 5,
      backoff = function() return BACKOFF end })
    taker = assert(db:manager { application = "taker", lease = 3600 })
  end)
  after_each(function() db:close() end)

  it("answers the outcome of its own transaction, taken over, and transfers once", function()
    local S = scheduler()
    local g = group.wrap(payer, { signal = S.signal, spawn = S.spawn, now = S.now })
    local T, err, id
    S.spawn(function() T, err = g:transfer("accounts", "U", "X", 10, { min = 0 }) end)
    S.spawn(function()
      -- past the payer's lease (its second backoff): the holder rolls
      -- back, the taker claims the payer's transaction
      S.signal():wait(LEASE + 0.1)
      assert(holder:rollback(assert(holder:get("h"))))
      local mine = assert(txs:find_one({ _id = { ["$ne"] = "h" } }))
      id = mine._id
      assert.are.equal("pending", mine.state)
      assert(taker:step("claim", { _id = id }))
      -- the payer's caller meets it held (its next try), then it ends
      S.signal():wait(BACKOFF)
      assert(taker:commit({ _id = id }))
    end)
    S.loop()
    assert.is_truthy(T, tostring(err))
    assert.are.equal("done", T.state)
    assert.are.same({ H = 1000, X = 60, U = 40 }, helpers.balances(accounts))
    assert.are.equal(tostring(id), tostring(T._id), "the answer is another transaction than the call's")
    assert.are.equal(2, #helpers.dump(txs)) -- "h" and the call's, no second one
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)

  -- With mongotx.pool, the caller goes on through tm:later, which needs
  -- a client of the pool: when none comes free at its next try, the call
  -- answers the pool's error (as if nothing was done) and leaves its
  -- transaction pending, partly applied, owned by no one, for recovery
  -- to roll forward.  The call alone holds its client through its
  -- retries: it answers its outcome (here: cancelled, busy).
  -- a pool of one client (its own appname: its own pool in this process)
  local function one_client(appname)
    local uri = helpers.uri()
    if not uri:find("?", 1, true) then
      if not uri:match("^[^:]+://[^/]*/") then uri = uri .. "/" end
      uri = uri .. "?"
    else
      uri = uri .. "&"
    end
    uri = uri .. "appname=" .. appname .. "&maxPoolSize=1&waitQueueTimeoutMS=50"
    return assert(require("mongotx.pool").connect(uri, { database = dbname }))
  end

  it("a pool without a free client at its next try: the call's outcome, not the pool's error", function()
    local pdb = one_client("r41-83")
    local pooled = assert(pdb:manager { application = "pooled", retries = 3, lease = 0.5,
      backoff = function() return 0.25 end })
    local S = scheduler()
    local g = group.wrap(pooled, { signal = S.signal, spawn = S.spawn, now = S.now })
    local T, err
    S.spawn(function() T, err = g:transfer("accounts", "U", "X", 10, { min = 0, id = "p" }) end)
    S.spawn(function()
      -- another call of this process has the pool's only client while
      -- the busy call's caller goes on (its first backoff: 0.25 s)
      S.signal():wait(0.1)
      local c = assert(pdb:client())
      S.signal():wait(0.3)
      c:close()
    end)
    S.loop()
    -- what the answer says must be what the database ends with, once
    -- the holder rolled back and recovery ran past the lease
    assert(holder:rollback(assert(holder:get("h"))))
    helpers.core.sleep(0.6)
    assert(taker:recover())
    local P = assert(txs:find_one({ _id = "p" }))
    local b = helpers.balances(accounts)
    assert.are.same(T and { U = 40, X = 60 } or { U = 50, X = 50 }, { U = b.U, X = b.X },
      ("the call answered %s, yet its transaction ended %s"):format(T and T.state or tostring(err), P.state))
    -- and the answer is the call's own outcome (alone: `busy`, its
    -- transaction cancelled busy), got once the client came free
    assert.is_nil(T)
    assert.are.equal("busy", err.code, tostring(err))
    assert.are.same({ "cancelled", "busy" }, { P.state, P.cause })
  end)

  -- No client for longer than holder_wait: the caller stops trying and
  -- answers in_progress naming its transaction, which is pending then
  -- (never the pool's `client`: nothing done).
  it("a pool without a free client for holder_wait: in_progress, naming its pending transaction", function()
    local pdb = one_client("f2-83")
    local pooled = assert(pdb:manager { application = "pooled", retries = 3, lease = 0.5, holder_wait = 0.4,
      backoff = function() return 0.25 end })
    local S = scheduler()
    local g = group.wrap(pooled, { signal = S.signal, spawn = S.spawn, now = S.now })
    local T, err, at, state
    S.spawn(function()
      T, err = g:transfer("accounts", "U", "X", 10, { min = 0, id = "p" })
      at, state = S.now(), assert(txs:find_one({ _id = "p" })).state
    end)
    local held_from
    S.spawn(function()
      S.signal():wait(0.1)
      local c = assert(pdb:client())
      held_from = S.now()
      S.signal():wait(1.5) -- past the first backoff (0.25 s) + holder_wait (0.4 s)
      c:close()
    end)
    S.loop()
    assert.is_nil(T)
    assert.are.same({ "in_progress", "p" }, { err.code, err.id }, tostring(err))
    assert.are.equal("pending", state)
    -- it tried for about holder_wait after its first backoff, no longer
    assert.is_true(at - held_from >= 0.4 and at - held_from < 1.2, ("answered after %.3f s"):format(at - held_from))
    -- what it names is what recovery ends (here: the holder rolled back)
    assert(holder:rollback(assert(holder:get("h"))))
    helpers.core.sleep(0.6)
    assert(taker:recover())
    local P = assert(txs:find_one({ _id = "p" }))
    local b = helpers.balances(accounts)
    assert.are.same(P.state == "done" and { U = 40, X = 60 } or { U = 50, X = 50 }, { U = b.U, X = b.X })
  end)
end)

-- (3) The same in nginx (mongotx.resty): grouped, the handler goes on
-- with the call; ungrouped, tm:later hands it to the handler.  A
-- transfer without an id (POST /plain), its owner's lease 1 s, taken
-- over by another manager while its handler sleeps a backoff.
-- `make test-openresty` runs it; the other targets report it pending.
if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty a busy call taken over while its handler waits", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local cjson = require "cjson"

-- POST /plain?group=0|1: tm:transfer("accounts", "U", "X", 10) without
-- an id; answers { id, state } or { code }.
local PLAIN = [[
location = /plain { content_by_lua_block {
  local cjson = require "cjson"
  local resty = require "mongotx.resty"
  local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = os.getenv("MONGOTX_DATABASE") }))
  local tm = assert(db:manager { application = "plain", lease = 1, retries = 6,
    policies = "spec.support.busy_policies",
    group = ngx.var.arg_group == "1" and { max = 100, delay = 0, inflight = 1 } or false })
  local T, err = tm:transfer("accounts", "U", "X", 10, { min = 0 })
  ngx.say(cjson.encode(T and { id = tostring(T._id), state = T.state } or { code = err.code }))
} }
]]

-- POST /waiting?group=0|1: as /plain, its db waiting 0.1 s for a worker
-- thread VM (then `overloaded`).  POST /hog: a transfer H -> X whose busy op
-- holds the only worker-thread VM 1.2 s (spec/support/hog_policies), then
-- is cancelled.
local WAITING = [[
location = /waiting { content_by_lua_block {
  local cjson = require "cjson"
  local resty = require "mongotx.resty"
  local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = os.getenv("MONGOTX_DATABASE"),
    wait = 0.1 }))
  local tm = assert(db:manager { application = "waiting", retries = 3,
    holder_wait = tonumber(ngx.var.arg_holder_wait) or 10, policies = "spec.support.busy_policies",
    group = ngx.var.arg_group == "1" and { max = 100, delay = 0, inflight = 1 } or false })
  local T, err
  if ngx.var.arg_many == "1" then -- (a batch's busy item: mongotx.group.busy's settle_items)
    local res, errs = tm:transfer_many({ { collection = "accounts", from = "U", to = "X", amount = 10,
                                           min = 0, id = "w" } })
    T, err = res[1], errs[1]
  else
    T, err = tm:transfer("accounts", "U", "X", 10, { min = 0, id = "w" })
  end
  ngx.say(cjson.encode(T and { state = T.state } or { code = err.code, id = err.id }))
} }
location = /hog { content_by_lua_block {
  local cjson = require "cjson"
  local resty = require "mongotx.resty"
  local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = os.getenv("MONGOTX_DATABASE") }))
  local tm = assert(db:manager { application = "hog", group = false, policies = "spec.support.hog_policies" })
  local T, err = tm:transfer("accounts", "H", "X", 1, { min = 0 })
  ngx.say(cjson.encode(T and { state = T.state } or { code = err.code }))
} }
]]

describe("#openresty a busy call taken over while its handler waits", function()
  local srv

  setup(function() srv = assert(server.start { kind = "memory" }) end)
  teardown(function() if srv then srv:stop() end end)

  for _, how in ipairs { "grouped", "ungrouped", "ungrouped transfer_many" } do
    local grouped = how == "grouped"
    -- (a takeover: the calls of one transaction)
    if how ~= "ungrouped transfer_many" then it(("%s: answers its own transaction's outcome and transfers once"):format(
        how), function()
      local name = helpers.db_name()
      local db = assert(mongotx.connect(srv.uri, { database = name }))
      local accounts, txs = db:collection("accounts"), db:collection("transactions")
      assert(accounts:insert_many({ { _id = "H", balance = 1000 }, { _id = "X", balance = 50 },
                                    { _id = "U", balance = 50 } }))
      local holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
      helpers.hold_open(holder, "X", "h")
      local taker = assert(db:manager { application = "taker", lease = 3600 })
      local n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, threads = 4, vms = 8,
        locations = PLAIN, configure = "{ recovery = false, account_cache = false }" })
      finally(function() n:stop() end)
      local call = n:spawn("POST", "/plain?group=" .. (grouped and "1" or "0"), "")
      -- past its lease (1 s; backoff 0.3 s): the holder rolls back, the
      -- taker claims the call's transaction; its next try finds it held
      server.sleep(1.15)
      assert(holder:rollback(assert(holder:get("h"))))
      local mine = assert(txs:find_one({ _id = { ["$ne"] = "h" } }))
      assert.are.equal("pending", mine.state)
      assert(taker:step("claim", { _id = mine._id }))
      server.sleep(0.5)
      assert(taker:commit({ _id = mine._id }))
      local status, body = call:wait(30)
      assert.are.equal(200, status, body)
      assert.are.same({ id = tostring(mine._id), state = "done" }, cjson.decode(body))
      assert.are.same({ H = 1000, X = 60, U = 40 }, helpers.balances(accounts))
      assert.are.equal(2, #helpers.dump(txs)) -- "h" and the call's, no second one
      db:close()
    end) end

    -- No worker thread for longer than holder_wait (0.3 s): in_progress
    -- naming its transaction, pending when answered.
    if how ~= "ungrouped transfer_many" then it(("%s: no worker thread for holder_wait: in_progress, its id"):format(
        how), function()
      local name = helpers.db_name()
      local db = assert(mongotx.connect(srv.uri, { database = name }))
      local accounts, txs = db:collection("accounts"), db:collection("transactions")
      assert(accounts:insert_many({ { _id = "H", balance = 1000 }, { _id = "X", balance = 50 },
                                    { _id = "U", balance = 50 } }))
      local holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
      helpers.hold_open(holder, "X", "h")
      local n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, threads = 1, vms = 1,
        locations = WAITING, configure = "{ recovery = false, account_cache = false }" })
      finally(function() n:stop() end)
      local call = n:spawn("POST", "/waiting?holder_wait=0.3&group=" .. (grouped and "1" or "0"), "")
      server.sleep(0.15)
      local hog = n:spawn("POST", "/hog", "")
      local status, body = call:wait(30)
      local state = assert(txs:find_one({ _id = "w" })).state
      local hs, hb = hog:wait(30)
      assert.are.equal(200, hs, hb)
      assert.are.equal(200, status, body)
      assert.are.same({ code = "in_progress", id = "w" }, cjson.decode(body))
      assert.are.equal("pending", state)
      db:close()
    end) end

    -- No worker thread at its next try (another request holds the only
    -- one past the db's wait): the handler tries again, and answers the
    -- call's own outcome (cancelled busy: the holder stays open), never
    -- `overloaded` with its transaction pending.
    it(("%s: no worker thread at its next try: its outcome, not overloaded"):format(how), function()
      local name = helpers.db_name()
      local db = assert(mongotx.connect(srv.uri, { database = name }))
      local accounts, txs = db:collection("accounts"), db:collection("transactions")
      assert(accounts:insert_many({ { _id = "H", balance = 1000 }, { _id = "X", balance = 50 },
                                    { _id = "U", balance = 50 } }))
      local holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
      helpers.hold_open(holder, "X", "h")
      local n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, threads = 1, vms = 1,
        locations = WAITING, configure = "{ recovery = false, account_cache = false }" })
      finally(function() n:stop() end)
      local call = n:spawn("POST", "/waiting?group=" .. (grouped and "1" or "0") ..
        (how == "ungrouped transfer_many" and "&many=1" or ""), "")
      server.sleep(0.15) -- (its first backoff: 0.3 s)
      local hog = n:spawn("POST", "/hog", "")
      local status, body = call:wait(30)
      local hs, hb = hog:wait(30)
      assert.are.equal(200, hs, hb)
      assert.are.equal(200, status, body)
      local W = assert(txs:find_one({ _id = "w" }))
      assert.are.same({ code = "busy", id = "w" }, cjson.decode(body), "its transaction is " .. W.state)
      assert.are.same({ "cancelled", "busy" }, { W.state, W.cause })
      -- (X: the holder's credit only, its marker still on)
      assert.are.same({ 50, 51 }, { assert(accounts:find_one({ _id = "U" })).balance,
                                    assert(accounts:find_one({ _id = "X" })).balance })
      db:close()
    end)
  end
end)

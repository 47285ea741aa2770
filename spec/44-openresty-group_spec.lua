-- Group commit in real nginx (mongotx.group through mongotx.resty): the
-- handlers of examples/openresty/bank.lua with db:manager{ group = ... },
-- and POST /commit (spec/support/group_commit.lua: tm:commit of a begun
-- transaction, on the same manager), against a mongo-java-server this
-- spec starts itself.  `make
-- test-openresty` runs it; the other targets report it pending.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty group commit in nginx", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local cjson = require "cjson"
local core = helpers.core
local mongotx = require "mongotx"
local catalog = require "mongotx.catalog"

local function sleep(s) core.sleep(s) end

-- Where each grouped request ran: "mongotx-group req=<X-Req> batch=<n>
-- pos=<i>" in the error log (the handler's ngx.ctx.mongotx_group).
local LOG_GROUP = [[
  log_by_lua_block {
    local g = ngx.ctx.mongotx_group
    if g then
      ngx.log(ngx.NOTICE, "mongotx-group req=", ngx.var.http_x_req, " batch=", g.batch,
              " pos=", g.position)
    end
  }
]]

describe("#openresty group commit in nginx", function()
  local srv

  setup(function()
    srv = assert(server.start { kind = "memory" })
  end)

  teardown(function()
    if srv then
      srv:kill("CONT")
      srv:stop()
    end
  end)

  -- A fresh database with the accounts of `balances` ({ A = 100, ... }).
  local function bank(balances)
    local name = helpers.db_name()
    local db = assert(mongotx.connect(srv.uri, { database = name }))
    local docs = {}
    for id, b in pairs(balances) do
      docs[#docs + 1] = { _id = id, balance = b, pendingTransactions = core.array() }
    end
    table.sort(docs, function(x, y) return x._id < y._id end)
    assert(db:collection("accounts"):insert_many(docs))
    return db, name
  end

  -- nginx on database `name`, one worker; group: a Lua table source or
  -- "false".
  local function start(name, app, group, o)
    o = o or {}
    o.uri, o.database, o.workers = srv.uri, name, o.workers or 1
    o.threads, o.vms = o.threads or 4, o.vms or 16
    o.http = LOG_GROUP
    -- /commit's manager: the options table bank's /transfer uses
    o.init_worker = 'require("spec.support.group_commit").manager = conf.manager'
    o.locations = 'location = /commit { content_by_lua_block { require("spec.support.group_commit").commit() } }'
      .. (o.locations or "")
    o.configure = ("{ manager = { application = %q, policies = 'spec.support.group_events', " ..
      "group = %s, stale_after = 1, lease = 1 }, recovery = %s }")
      :format(app, group, o.recovery == false and "false" or "{ every = 0.5 }")
    if o.recovery == false then o.recovery = nil end
    return assert(nginx.start(o))
  end

  local function events(app)
    local path = "/tmp/mongotx-group-events-" .. app
    local out = {}
    for line in (nginx.readfile(path) or ""):gmatch("[^\n]+") do
      local size, wait = line:match("^(%d+) (%S+)$")
      out[#out + 1] = { size = tonumber(size), wait = tonumber(wait) }
    end
    return out
  end

  local function body(from, to, amount)
    return string.format('{"from":"%s","to":"%s","amount":%s}', from, to, tostring(amount))
  end

  -- n requests over `accounts` (ids), seeded: good transfers, overdrafts,
  -- bad input, unknown accounts, and idempotency keys used twice (for the
  -- same transfer, or for another).
  local function mix(n, accounts, seed)
    math.randomseed(seed)
    local list = {}
    local function pick2()
      local a = accounts[math.random(#accounts)]
      local b
      repeat b = accounts[math.random(#accounts)] until b ~= a
      return a, b
    end
    local keyed = {}
    for i = 1, n do
      local r = { method = "POST", path = "/transfer", headers = { ["X-Req"] = tostring(i) } }
      local kind = math.random(100)
      local from, to = pick2()
      if kind <= 55 then
        r.body = body(from, to, math.random(1, 60))
      elseif kind <= 70 then
        r.body = body(from, to, math.random(400, 900)) -- more than any balance: guard
      elseif kind <= 74 then
        r.body = '{"from":"' .. from .. '",'                -- malformed
      elseif kind <= 78 then
        r.body = body(from, to, -5)                         -- bad amount
      elseif kind <= 81 then
        r.body = body(from, "nobody", 5)                    -- unknown account (404)
      elseif kind <= 90 or #keyed == 0 then
        local key = "k-" .. seed .. "-" .. i
        r.body, r.headers["Idempotency-Key"] = body(from, to, math.random(1, 60)), key
        keyed[#keyed + 1] = r
      else
        -- a key used before: the same transfer again, or another
        local first = keyed[math.random(#keyed)]
        r.headers["Idempotency-Key"] = first.headers["Idempotency-Key"]
        r.body = math.random(2) == 1 and first.body or body(from, to, math.random(1, 60))
      end
      list[i] = r
    end
    return list
  end

  -- Transactions begun (ids b-<seed>-<i>) over `accounts`, the same in
  -- every database they are begun in: transfers, some more than any
  -- balance (their guard fails), some to an unknown account.
  local function begun(n, accounts, seed)
    math.randomseed(seed)
    local list = {}
    for i = 1, n do
      local a = accounts[math.random(#accounts)]
      local b
      repeat b = accounts[math.random(#accounts)] until b ~= a
      local kind, amount = math.random(10), math.random(1, 60)
      if kind <= 2 then amount = math.random(400, 900) elseif kind == 3 then b = "nobody" end
      list[i] = { id = ("b-%d-%d"):format(seed, i), ops = {
        { collection = "accounts", id = a, update = { ["$inc"] = { balance = -amount } },
          where = { balance = { ["$gte"] = amount } } },
        { collection = "accounts", id = b, update = { ["$inc"] = { balance = amount } } } } }
    end
    return list
  end

  -- (lease: the beginner's, which recovery by another application waits
  -- for: a begun transaction is its owner's until then)
  local function begin_all(db, list, lease)
    local tm = assert(db:manager{ application = "beginner", lease = lease })
    for _, b in ipairs(list) do assert(tm:begin(b.ops, { id = b.id })) end
  end

  -- The requests that commit `list` (begun), spread over `requests`
  -- (one every `every`), with one id committed twice and one that is none.
  local function with_commits(requests, list, every)
    local out, k = {}, 0
    local function commit(id)
      k = k + 1
      return { method = "POST", path = "/commit", headers = { ["X-Txid"] = id, ["X-Req"] = "c" .. k } }
    end
    local commits = {}
    for _, b in ipairs(list) do commits[#commits + 1] = commit(b.id) end
    commits[#commits + 1] = commit(list[1].id)
    commits[#commits + 1] = commit("none-such")
    for i, r in ipairs(requests) do
      out[#out + 1] = r
      if i % every == 0 and #commits > 0 then out[#out + 1] = table.remove(commits, 1) end
    end
    for _, c in ipairs(commits) do out[#out + 1] = c end
    for i, r in ipairs(out) do r.headers["X-Req"] = tostring(i) end
    return out
  end

  -- A response as compared: JSON without lastModified, and without the
  -- id when the request named none (a fresh ObjectId).
  local function normal(req, res)
    local ok, t = pcall(cjson.decode, res.body)
    if not ok then return { status = res.status, raw = res.body } end
    if type(t) == "table" then
      t.lastModified = nil
      if not req.headers["Idempotency-Key"] and not req.headers["X-Txid"] then t.id = nil end
    end
    return { status = res.status, body = t }
  end

  -- Reads account balances every few ms until done() says stop; returns
  -- how many reads, and the first balance seen below floor.
  local function poll(db, floor, done)
    local accounts, reads, below = db:collection("accounts"), 0, nil
    while not done() do
      for _, d in ipairs(assert(accounts:find_all({}))) do
        if d.balance < floor and not below then below = d._id .. "=" .. d.balance end
      end
      reads = reads + 1
      sleep(0.002)
    end
    return reads, below
  end

  local function settled(db, seconds)
    local txs
    for _ = 1, seconds * 10 do
      txs = assert(db:collection("transactions"):find_all({}))
      local open = 0
      for _, T in ipairs(txs) do
        if T.state ~= "done" and T.state ~= "cancelled" then open = open + 1 end
      end
      local marked = assert(db:collection("accounts"):count({ ["pendingTransactions.0"] = { ["$exists"] = true } }))
      if open == 0 and marked == 0 then return txs, 0 end
      sleep(0.1)
    end
    return txs
  end

  local function assert_consistent(db, sum, seconds)
    local txs = settled(db, seconds or 15)
    for _, T in ipairs(txs) do
      assert(T.state == "done" or T.state == "cancelled",
             "transaction " .. tostring(T._id) .. " left " .. tostring(T.state))
    end
    local marked = assert(db:collection("accounts"):count({ ["pendingTransactions.0"] = { ["$exists"] = true } }))
    assert.are.equal(0, marked)
    local _, total = helpers.balances(db:collection("accounts"))
    assert.are.equal(sum, total)
    return txs
  end

  -- Runs `list` at once through a grouped nginx while a poller checks the
  -- floor, then the same requests one at a time, ungrouped, in the order
  -- the batches ran them, against a copy of the starting balances; every
  -- response and the final databases must be the same.  Two batches run
  -- at once (inflight = 2): those that overlap share no account, so the
  -- order the batches began in is still one the calls could have taken
  -- one at a time.
  local function grouped_equals_alone(balances, list, app, txs)
    os.remove("/tmp/mongotx-group-events-" .. app)
    local db, name = bank(balances)
    begin_all(db, txs)
    local n = start(name, app, "{ max = 100, delay = 0.002, inflight = 2 }", { recovery = false })
    finally(function() n:stop() end)
    local h = n:many(list, { parallel = true })
    local results
    local reads, below = poll(db, 0, function()
      results = results or h:wait(0.05)
      return results ~= nil
    end)
    assert.is_nil(below, "a balance went below its floor")
    assert(reads >= 3, "the poller read " .. reads .. " times")
    -- which batch ran each request that reached the manager
    local order, log = {}, n:error_log()
    for req, b, pos in log:gmatch("mongotx%-group req=(%d+) batch=(%d+) pos=(%d+)") do
      order[#order + 1] = { req = tonumber(req), batch = tonumber(b), pos = tonumber(pos) }
    end
    table.sort(order, function(x, y)
      if x.batch ~= y.batch then return x.batch < y.batch end
      return x.pos < y.pos
    end)
    -- batches that held commits and transfers together
    local kinds, mixed = {}, 0
    for _, o in ipairs(order) do
      kinds[o.batch] = kinds[o.batch] or {}
      kinds[o.batch][list[o.req].path] = true
    end
    for _, k in pairs(kinds) do
      if k["/commit"] and k["/transfer"] then mixed = mixed + 1 end
    end
    assert(mixed > 0, "no batch held a commit and a transfer")
    local ev, calls, biggest = events(app), 0, 0
    for _, e in ipairs(ev) do
      calls, biggest = calls + e.size, math.max(biggest, e.size)
      assert(e.wait >= 0 and e.wait < 1, "a batch waited " .. e.wait .. " s")
    end
    assert.are.equal(#order, calls)       -- one event per batch, sizes adding up
    assert(biggest > 1, "no batch held more than one call (" .. #ev .. " batches)")
    assert_consistent(db, (function()
      local s = 0
      for _, b in pairs(balances) do s = s + b end
      return s
    end)())
    n:stop()
    -- the same requests, alone, in that order (then the ones that never
    -- reached the manager, whose answers do not depend on the state)
    local replay, reached, index = {}, {}, {}
    for _, o in ipairs(order) do
      replay[#replay + 1], reached[o.req] = list[o.req], true
      index[#replay] = o.req
    end
    for i, r in ipairs(list) do
      if not reached[i] then replay[#replay + 1], index[#replay + 1] = r, i end
    end
    local db2, name2 = bank(balances)
    begin_all(db2, txs)
    local n2 = start(name2, app .. "-alone", "false", { recovery = false })
    local alone = assert(n2:many(replay):wait(120))
    n2:stop()
    local statuses, committed = {}, {}
    for k, res in ipairs(alone) do
      local i = index[k]
      assert.are.same(normal(list[i], res), normal(list[i], results[i]),
        "request " .. i .. " " .. tostring(list[i].body or list[i].headers["X-Txid"]))
      local counts = list[i].path == "/commit" and committed or statuses
      counts[tostring(res.status)] = (counts[tostring(res.status)] or 0) + 1
    end
    -- commits done, cancelled (a guard, an unknown account) and of no
    -- such transaction
    for _, st in ipairs { "200", "404", "409" } do
      assert(committed[st], "no commit answered " .. st .. ": " .. cjson.encode(committed))
    end
    assert.are.same(helpers.balances(db2:collection("accounts")),
                    helpers.balances(db:collection("accounts")))
    return statuses, #ev
  end

  it("answers 282 concurrent requests (transfers, overdrafts, bad input, repeated keys, " ..
     "commits of begun transactions) each as the same request alone, and no balance ever " ..
     "goes below its floor", function()
    local balances = {}
    for c = 65, 76 do balances[string.char(c)] = math.random(50, 300) end
    local ids = {}
    for id in pairs(balances) do ids[#ids + 1] = id end
    table.sort(ids)
    local txs = begun(40, ids, 4242)
    local statuses, batches = grouped_equals_alone(balances,
      with_commits(mix(240, ids, 4242), txs, 6), "group-mix", txs)
    -- every kind of answer was met
    for _, s in ipairs { "200", "400", "404", "409", "422" } do
      assert(statuses[s] and statuses[s] > 0, "no " .. s .. ": " .. cjson.encode(statuses))
    end
    assert(batches < 230, batches .. " batches for 282 requests")
  end)

  it("does the same when every request touches the same 3 accounts", function()
    local txs = begun(30, { "A", "B", "C" }, 77)
    local statuses = grouped_equals_alone({ A = 300, B = 200, C = 100 },
      with_commits(mix(200, { "A", "B", "C" }, 77), txs, 6), "group-hot", txs)
    assert((statuses["200"] or 0) > 20 and (statuses["422"] or 0) > 0, cjson.encode(statuses))
  end)

  it("leaves every transaction recoverable when the worker is killed mid-batch", function()
    local balances = {}
    for c = 65, 74 do balances[string.char(c)] = 1000 end
    local ids = {}
    for id in pairs(balances) do ids[#ids + 1] = id end
    table.sort(ids)
    local db, name = bank(balances)
    local txs = begun(50, ids, 99)
    begin_all(db, txs, 1) -- those no batch reaches are recovered below
    -- the first batch to commit begun transactions stops once they are
    -- `applied` (spec/support/group_events.lua's hold)
    local hold = "/tmp/mongotx-group-hold/hold" -- (spec/support/group_events.lua's HOLD)
    assert(os.execute("mkdir -p /tmp/mongotx-group-hold && chmod 777 /tmp/mongotx-group-hold"))
    os.remove(hold .. ".held")
    assert(io.open(hold .. ".armed", "w")):close()
    local n = start(name, "group-kill", "{ max = 100, delay = 0.002 }", { recovery = false })
    finally(function()
      os.remove(hold .. ".armed")
      os.remove(hold .. ".held")
      n:stop()
    end)
    local list = {}
    for i = 1, 150 do
      local a, b = ids[(i % #ids) + 1], ids[((i * 7) % #ids) + 1]
      if a == b then b = ids[((i + 1) % #ids) + 1] end
      list[i] = { method = "POST", path = "/transfer", body = body(a, b, 10),
                  headers = { ["X-Req"] = tostring(i) } }
    end
    list = with_commits(list, txs, 3)
    local h = n:many(list, { parallel = true, max_time = 20 })
    for _ = 1, 500 do
      if io.open(hold .. ".held") then break end
      sleep(0.02)
    end
    assert(io.open(hold .. ".held"), "no batch committed a begun transaction")
    local victim = n:workers()[1]
    helpers.signal(victim, "KILL")
    assert(h:wait(60))
    -- the batch the worker died in left its commits midway: begun
    -- transactions `applied`, their markers on the accounts
    sleep(0.3)
    local txc = db:collection("transactions")
    local begun_ids = {}
    for i, t in ipairs(txs) do begun_ids[i] = t.id end
    local midway = assert(txc:count({ _id = { ["$in"] = begun_ids }, state = "applied" }))
    assert(midway > 0, "no begun transaction was left midway by the kill")
    local open = assert(txc:count({ state = { ["$nin"] = { "done", "cancelled" } } }))
    -- recovery (here, as another process would) settles them all
    sleep(1.2) -- past their lease and stale_after
    local tm = assert(db:manager{ application = "group-kill", stale_after = 1, lease = 1 })
    local report = assert(tm:recover())
    assert(report.done + report.cancelled >= open, cjson.encode(report.errors or {}))
    assert_consistent(db, 10000)
    -- the new worker groups as before
    local status, res = n:request("POST", "/transfer", body("A", "B", 1))
    assert.are.equal(200, status, res)
  end)

  it("groups by default and with group = true, and not with group = false", function()
    -- 16 concurrent transfers, each between accounts of its own (so that
    -- none meets another's hold, grouped or not)
    local balances = {}
    for i = 1, 32 do balances["a" .. i] = 100 end
    for _, case in ipairs { { "nil", true }, { "true", true }, { "false", false } } do
      local db, name = bank(balances)
      local n = start(name, "group-default-" .. case[1], case[1], { recovery = false })
      local list = {}
      for i = 1, 16 do
        list[i] = { method = "POST", path = "/transfer", headers = { ["X-Req"] = tostring(i) },
                    body = body("a" .. (2 * i - 1), "a" .. (2 * i), 3) }
      end
      local answers = assert(n:many(list, { parallel = true }):wait(60))
      local log = n:error_log()
      n:stop()
      for i = 1, #list do assert.are.equal(200, answers[i].status, answers[i].body) end
      local grouped = 0
      for _ in log:gmatch("mongotx%-group req=%d+ batch=%d+") do grouped = grouped + 1 end
      assert.are.equal(case[2] and 16 or 0, grouped, "group = " .. case[1])
      local txs = assert_consistent(db, 3200)
      assert.are.equal(16, #txs)
    end
  end)

  it("answers a grouped call whose driver's timer nginx never runs (lua_max_running_timers 1)", function()
    -- the handler's own timer takes the one running slot, so the group's
    -- driver timer is accepted and then skipped: its caller drives
    local db, name = bank({ A = 100, B = 0 })
    local n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, threads = 2, vms = 4,
      http = "lua_max_running_timers 1;\nlua_shared_dict via_timer 1m;", locations = [[
        location = /via-timer { content_by_lua_block {
          local resty = require "mongotx.resty"
          local ok, err = ngx.timer.at(0, function()
            local db = assert(resty.connect(os.getenv("MONGOTX_URI"),
                                            { database = os.getenv("MONGOTX_DATABASE") }))
            local tm = assert(db:manager({ application = "via-timer" }))
            local T, e = tm:transfer("accounts", "A", "B", 1)
            ngx.shared.via_timer:set("r", T and T.state or tostring(e))
          end)
          if not ok then return ngx.say("timer: ", err) end
          for _ = 1, 300 do -- (a cold worker's first call: its pool, its manager)
            ngx.sleep(0.1)
            local v = ngx.shared.via_timer:get("r")
            if v then return ngx.say(v) end
          end
          ngx.say("no answer in 30 s")
        } }
      ]] })
    finally(function() n:stop() end)
    local status, res = n:request("GET", "/via-timer", nil, { timeout = 40 })
    assert.are.equal(200, status)
    assert.are.equal("done\n", res)
    assert(n:error_log():find("lua_max_running_timers are not enough", 1, true),
           "nginx did not skip the driver's timer")
    assert.are.same({ A = 99, B = 1 }, (helpers.balances(db:collection("accounts"))))
  end)

  -- (issue 35) deferred finish under group commit answered `applied` and
  -- left the markers until recovery came (about 35 s): each worker
  -- thread's queue waited for finish_batch commits that never came
  it("refuses finish = deferred with group commit, before it creates anything", function()
    local db, name = bank({ A = 100 })
    local n = start(name, "group-deferred", "nil", { recovery = false, locations = [[
      location = /deferred { content_by_lua_block {
        local resty = require "mongotx.resty"
        local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = os.getenv("MONGOTX_DATABASE") }))
        for _, case in ipairs {
          { "grouped", { application = "d1", collection = "tx1", finish = "deferred" } },
          { "grouped-policies", { application = "d2", collection = "tx2",
                                  policies = "spec.support.deferred_finish" } },
          { "ungrouped", { application = "d3", collection = "tx3", finish = "deferred", group = false } },
        } do
          local tm, err = db:manager(case[2])
          ngx.say(case[1], " ", tm and "ok" or err.code .. " " .. err.message)
        end
      } }
    ]] })
    finally(function() n:stop() end)
    local status, res = n:request("GET", "/deferred")
    assert.are.equal(200, status, res)
    local said = {}
    for line in res:gmatch("[^\n]+") do
      local case, rest = line:match("^(%S+) (.*)$")
      said[case] = rest
    end
    for _, case in ipairs { "grouped", "grouped-policies" } do
      assert.truthy(said[case]:find('^invalid option finish = "deferred" of manager does not go ' ..
        'with group commit: .*set group = false$'), said[case])
    end
    assert.are.equal("ok", said.ungrouped)
    -- the refused managers made no index, so no collection
    assert.is_false(catalog.has_collection(db.client, name, "tx1"))
    assert.is_false(catalog.has_collection(db.client, name, "tx2"))
    assert.is_true(catalog.has_collection(db.client, name, "tx3"))
  end)

  it("runs the batch of callers that went away while it formed, and serves the next ones", function()
    os.remove("/tmp/mongotx-group-events-group-abort")
    local db, name = bank({ A = 1000, B = 1000, C = 1000, D = 1000 })
    -- a batch waits 1.5 s for more calls; the clients give up after 0.5 s
    -- and lua_check_client_abort ends their handlers
    local n = start(name, "group-abort", "{ max = 100, delay = 1.5 }",
                    { check_client_abort = true, recovery = false })
    finally(function() n:stop() end)
    local list = {}
    for i = 1, 12 do
      list[i] = { method = "POST", path = "/transfer",
                  body = body(string.char(65 + i % 4), string.char(65 + (i + 1) % 4), 7) }
    end
    local gone = assert(n:many(list, { parallel = true, max_time = 0.5 }):wait(30))
    for i = 1, #list do assert.are.equal(0, gone[i].status, "request " .. i .. " answered") end
    sleep(1.5)
    -- their transfers ran and finished all the same
    local txs = assert_consistent(db, 4000)
    assert.are.equal(12, #txs)
    for _, T in ipairs(txs) do assert.are.equal("done", T.state) end
    -- and the queue is not stuck behind them
    local status, res, t = n:request("POST", "/transfer", body("C", "D", 1), { timeout = 10 })
    assert.are.equal(200, status, res)
    assert(t < 3, "answered in " .. t .. " s")
  end)
end)

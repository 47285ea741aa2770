-- mongotx.metrics.shared in real nginx (README, "Metrics"): the events of
-- every worker process and worker-thread VM summed in one
-- lua_shared_dict and served by examples/openresty at GET /metrics, read
-- back with Python's prometheus_client parser (spec/support/prometheus.lua)
-- and compared with what the database holds; and a full dict, which loses
-- counts (counted in mongotx_metrics_dropped_total) but never a transfer.
--
-- `make test-openresty` runs it (MONGOTX_OPENRESTY=1, LuaJIT); the other
-- targets report it pending.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty mongotx.metrics.shared in nginx", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local prom = require "spec.support.prometheus"
local core = helpers.core
local mongotx = require "mongotx"
local metrics = require "mongotx.metrics"

describe("#openresty mongotx.metrics.shared in nginx", function()
  local srv, db, name, n

  setup(function()
    srv = assert(server.start { kind = "memory" })
  end)

  teardown(function()
    if srv then srv:stop() end
  end)

  before_each(function()
    name = helpers.db_name()
    db = assert(mongotx.connect(srv.uri, { database = name }))
    assert(db:collection("accounts"):insert_many {
      { _id = "A", balance = 1000, pendingTransactions = core.array() },
      { _id = "B", balance = 1000, pendingTransactions = core.array() },
    })
  end)

  after_each(function()
    if n then n:stop() end
    n = nil
    db:close()
  end)

  -- Test endpoints: /_park counts a park event of application "probe" in
  -- whichever worker answers and says which; /_fill fills the dict with
  -- other keys until it is full.
  local LOCATIONS = [[
    location = /_park { content_by_lua_block {
      local m = require("mongotx.metrics.shared").new("mongotx_metrics")
      m:on_event("probe")("park", { id = 1, reason = "x" })
      ngx.say(ngx.worker.pid())
    } }
    location = /_fill { content_by_lua_block {
      local dict, i = ngx.shared.mongotx_metrics, 0
      while dict:safe_add("junk:" .. i, string.rep("x", 64)) do i = i + 1 end
      ngx.say(i)
    } }
  ]]

  local function transfer(from, to, amount)
    return n:request("POST", "/transfer", string.format('{"from":"%s","to":"%s","amount":%d}',
      from, to, amount))
  end

  local function scrape()
    local status, body = n:request("GET", "/metrics")
    assert.are.equal(200, status, body)
    return assert(prom.parse(body)), body
  end

  local function count(filter) return assert(db:collection("transactions"):count(filter)) end

  it("sums the workers and their thread VMs, as the database holds them", function()
    n = assert(nginx.start { uri = srv.uri, database = name, workers = 2, recovery = false,
                             locations = LOCATIONS })
    local calls = {}
    for i = 1, 16 do
      local amount = i % 4 == 0 and 5000 or 1 -- every fourth overdraws: cancelled
      calls[i] = n:spawn("POST", "/transfer", string.format(
        '{"from":"%s","to":"%s","amount":%d}', i % 2 == 0 and "A" or "B",
        i % 2 == 0 and "B" or "A", amount))
    end
    for _, c in ipairs(calls) do assert.truthy(c:wait(30)) end
    -- the worker itself (offload = false) counts into the same dict
    assert.are.equal(200, (n:request("POST", "/direct/transfer", '{"from":"A","to":"B","amount":1}')))
    -- a park counted in each of both workers lands in one sum
    local pids, parks = {}, 0
    for _ = 1, 60 do
      local spawned = {}
      for i = 1, 8 do spawned[i] = n:spawn("GET", "/_park") end
      for _, s in ipairs(spawned) do
        local status, body = s:wait(10)
        assert.are.equal(200, status)
        pids[body:match("%d+")] = true
        parks = parks + 1
      end
      if next(pids, next(pids)) then break end
    end
    assert.truthy(next(pids, next(pids)), "one worker answered every /_park")

    local families, text = scrape()
    local bank = { application = "bank" }
    assert.are.equal(count {}, prom.value(families, "mongotx_transactions_begun_total", bank), text)
    assert.are.equal(17, count {})
    assert.are.equal(count { state = "done" },
      prom.value(families, "mongotx_transactions_done_total", bank))
    -- cancelled by reason, as the causes stored on the transactions say
    -- (parallel transfers of A and B may also wait and give up: busy)
    local by_reason = {}
    for _, T in ipairs(assert(db:collection("transactions"):find_all { state = "cancelled" })) do
      local reason = metrics.cancel_reason(T.reason, T.cause)
      by_reason[reason] = (by_reason[reason] or 0) + 1
    end
    -- (the four overdrafts at least: guard, or busy when they met an open credit)
    assert.truthy(count { state = "cancelled" } >= 4)
    local fam = assert(prom.family(families, "mongotx_transactions_cancelled"))
    local reported = {}
    for _, sample in ipairs(fam.samples) do
      assert.are.equal("bank", sample.labels.application)
      reported[sample.labels.reason] = tonumber(sample.value)
    end
    assert.are.same(by_reason, reported)
    assert.are.equal(17, prom.value(families, "mongotx_transaction_seconds_count",
      { application = "bank", outcome = "done" }) + prom.value(families,
      "mongotx_transaction_seconds_count", { application = "bank", outcome = "cancelled" }))
    assert.are.equal(parks, prom.value(families, "mongotx_parked_total", { application = "probe" }))
    assert.are.equal(0, prom.value(families, "mongotx_metrics_dropped_total"))
  end)

  -- Workers killed under load (issue 40, item 10): each worker process
  -- dies right after its 25th write of a done (MONGOTX_FAULT, before the
  -- event that counts it), and one is also kill -9'd at random moments.
  -- The marks in the dict outlive them: the other workers' events and the
  -- recovery pass's reconcile count each transaction once, so in flight
  -- (begun - done - cancelled) is never below 0 at any scrape, and back
  -- to 0 once recovery settled everything (docs/metrics.md).
  it("counts each transaction once when workers are killed under load", function()
    n = assert(nginx.start { uri = srv.uri, database = name, workers = 2, threads = 4, vms = 16,
      env = { MONGOTX_FAULT = "done:after:25" },
      configure = "{ manager = { application = 'bank', metrics = 'mongotx_metrics', " ..
                  "stale_after = 1, lease = 1 }, recovery = { every = 0.5 } }" })
    local bank = { application = "bank" }
    -- begun, done, cancelled as served
    local function figures()
      local families, text = scrape()
      local cancelled = 0
      for _, sample in ipairs((prom.family(families, "mongotx_transactions_cancelled") or {}).samples
          or {}) do
        cancelled = cancelled + tonumber(sample.value)
      end
      local begun = prom.value(families, "mongotx_transactions_begun_total", bank) or 0
      local done = prom.value(families, "mongotx_transactions_done_total", bank) or 0
      assert.truthy(begun - done - cancelled >= 0, text)
      return begun, done, cancelled, text, families
    end
    local scripts = {}
    for c = 1, 6 do
      local lines = {}
      for i = 1, 80 do
        lines[i] = string.format(
          "curl -s -o /dev/null -w '%%{http_code}\\n' --max-time 10 -X POST --data-binary '%s' %s",
          string.format('{"from":"%s","to":"%s","amount":1}', i % 2 == 0 and "A" or "B",
            i % 2 == 0 and "B" or "A"), n:url("/transfer"))
      end
      local script = os.tmpname()
      local f = assert(io.open(script, "w"))
      f:write(table.concat(lines, "\n"), "\n")
      f:close()
      scripts[c] = script
      nginx.execute(string.format("sh %s > %s.out 2>&1 &", script, script))
    end
    for _ = 1, 4 do -- a worker killed four times, the master starting another
      server.sleep(0.6)
      figures()
      -- (a worker its fault just ended may not be replaced yet)
      local pid
      for _ = 1, 50 do
        pid = n:workers()[1]
        if pid then break end
        server.sleep(0.1)
      end
      helpers.signal(assert(pid, "no nginx worker came back in 5 s"), "KILL")
    end
    for _, script in ipairs(scripts) do
      for _ = 1, 600 do
        local _, lines = (nginx.readfile(script .. ".out") or ""):gsub("\n", "")
        if lines >= 80 then break end
        server.sleep(0.1)
        figures()
      end
      os.remove(script)
      os.remove(script .. ".out")
    end
    -- workers died at the crash point (nginx logs their exit code, 86)
    local _, crashed = (nginx.readfile(n.log) or ""):gsub("exited with code 86", "")
    assert.truthy(crashed >= 2, "the crash point was not reached twice")
    -- recovery settles what the killed workers left, and reconciles
    local open = { state = { ["$nin"] = { "done", "cancelled" } } }
    local begun, done, cancelled, text, families
    for _ = 1, 300 do
      begun, done, cancelled, text, families = figures()
      if count(open) == 0 and begun - done - cancelled == 0 then break end
      server.sleep(0.1)
    end
    assert.are.equal(0, count(open))
    assert.are.equal(0, begun - done - cancelled, text)
    -- each counted once at most: a worker killed between a create and its
    -- event counted that one nowhere
    assert.truthy(begun <= count {} and begun >= count {} - 50, text)
    assert.truthy(done <= count { state = "done" }, text)
    assert.truthy(cancelled <= count { state = "cancelled" }, text)
    assert.are.equal(0, prom.value(families, "mongotx_metrics_dropped_total"))
  end)

  -- Ends racing for the same marks in two worker processes at once
  -- (as a reconcile and a late event, or two workers' recoveries, do):
  -- each mark is taken by one of them, so each transaction counts done
  -- once and in flight never goes below 0.
  it("counts each end once when workers race to end the same transactions", function()
    n = assert(nginx.start { uri = srv.uri, database = name, workers = 2, recovery = false,
      reuseport = true, locations = [[
        location = /_race { content_by_lua_block {
          local on = require("mongotx.metrics.shared").new("mongotx_metrics"):on_event("race")
          local step, from, to = ngx.var.arg_step, tonumber(ngx.var.arg_from), tonumber(ngx.var.arg_to)
          for i = from, to do
            on(step, { id = "r" .. i, result = {} })
          end
          ngx.say(ngx.worker.pid())
        } }
      ]] })
    local race = { application = "race" }
    local N = 5000 -- marks at once (8 000 fit in 1m)
    -- reuseport spreads the 8 calls of a round over the workers by a hash
    -- of each connection: a round lands on one worker 1 time in 128
    local raced = 0
    for round = 0, 7 do
      local from, to = round * N + 1, (round + 1) * N
      assert.are.equal(200, (n:request("GET", ("/_race?step=create&from=%d&to=%d"):format(from, to))))
      local calls, pids = {}, {}
      for i = 1, 8 do
        calls[i] = n:spawn("GET", ("/_race?step=done&from=%d&to=%d"):format(from, to))
      end
      for _, c in ipairs(calls) do
        local status, body = c:wait(60)
        assert.are.equal(200, status)
        pids[body:match("%d+")] = true
      end
      if next(pids, next(pids)) then raced = raced + 1 end
      local families, text = scrape()
      assert.are.equal(to, prom.value(families, "mongotx_transactions_begun_total", race), text)
      assert.are.equal(to, prom.value(families, "mongotx_transactions_done_total", race), text)
    end
    assert.is_true(raced > 0, "one worker answered every call of every round")
  end)

  -- A mark whose id its key does not tell (a double: not a string, an
  -- integer or an ObjectId) keeps the id beside it; recovery's reconcile
  -- reads it back from there (a wrong id would read as gone: `unknown`).
  it("reconciles a transaction with an id of another type", function()
    n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, recovery = false,
      locations = [[
        location = /_odd { content_by_lua_block {
          local resty = require "mongotx.resty"
          local db = assert(resty.connect(os.getenv("MONGOTX_URI"),
            { database = os.getenv("MONGOTX_DATABASE") }))
          local tm = assert(db:manager { application = "odd", metrics = "mongotx_metrics",
                                         stale_after = 0 })
          if ngx.var.arg_step == "begin" then
            assert(tm:begin({ { collection = "accounts", id = "A",
              update = { ["$inc"] = { balance = -1 } } } }, { id = 1.5 }))
          else
            assert(tm:recover())
          end
          ngx.say("ok")
        } }
      ]] })
    local odd = { application = "odd" }
    assert.are.equal(200, (n:request("GET", "/_odd?step=begin")))
    assert.are.equal(1, prom.value(scrape(), "mongotx_transactions_begun_total", odd))
    -- parked: the passes leave it to the reconcile
    local txs = db:collection("transactions")
    assert.are.equal(1, assert(txs:update_one({ _id = 1.5 }, { ["$set"] = { parked = true } })).matched)
    assert.are.equal(200, (n:request("GET", "/_odd?step=recover"))) -- still initial: not counted
    local families = scrape()
    assert.is_nil(prom.value(families, "mongotx_transactions_cancelled_total",
      { application = "odd", reason = "rollback" }))
    -- another process cancels it
    assert.are.equal(1, assert(txs:update_one({ _id = 1.5 },
      { ["$set"] = { state = "cancelled", cause = "rollback" } })).matched)
    assert.are.equal(200, (n:request("GET", "/_odd?step=recover")))
    families = scrape()
    assert.are.equal(1, prom.value(families, "mongotx_transactions_cancelled_total",
      { application = "odd", reason = "rollback" }))
    assert.are.equal(1, prom.value(families, "mongotx_transactions_begun_total", odd))
  end)

  -- m:reconcile of a mongotx.resty manager (no engine in the worker: the
  -- read runs in a worker thread), as a deployment whose recovery is the
  -- `mongotx recover` worker calls it; the marks expire after a week at
  -- the latest; a call with none due copies no key of the dict (an older
  -- build's mark, which only a listing deletes, stays).
  it("reconciles a mongotx.resty manager's marks from a handler", function()
    n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, recovery = false,
      locations = [[
        location = /_rec { content_by_lua_block {
          local resty = require "mongotx.resty"
          local shared = require "mongotx.metrics.shared"
          local dict = ngx.shared.mongotx_metrics
          local db = assert(resty.connect(os.getenv("MONGOTX_URI"),
            { database = os.getenv("MONGOTX_DATABASE") }))
          local tm = assert(db:manager { application = "rec", metrics = "mongotx_metrics" })
          local step, OLD = ngx.var.arg_step, "mongotx_begun\trec\ts2:o1"
          if step == "begin" then
            assert(tm:begin({ { collection = "accounts", id = "A",
              update = { ["$inc"] = { balance = -1 } } } }, { id = ngx.var.arg_id }))
            local ttls = {}
            for _, k in ipairs(dict:get_keys(0)) do
              if k:find("^mongotx\t") then ttls[#ttls + 1] = dict:ttl(k) end
            end
            ngx.say(table.concat(ttls, " "))
          elseif step == "old" then
            dict:set(OLD, 1) -- a mark of an older build: never counted, deleted by a listing
            ngx.say("ok")
          else
            local m = shared.new("mongotx_metrics")
            local got = assert(m:reconcile(tm, { age = tonumber(ngx.var.arg_age) }))
            ngx.say(got, " ", dict:get(OLD) and "old" or "-")
          end
        } }
      ]] })
    local function call(q)
      local status, body = n:request("GET", "/_rec?" .. q)
      assert.are.equal(200, status, body)
      return body:match("^(.-)%s*$")
    end
    local ttls = call("step=begin&id=r1")
    assert.are.equal(1, select(2, ttls:gsub("%S+", "")), ttls) -- r1's mark
    for ttl in ttls:gmatch("%S+") do
      assert.is_true(tonumber(ttl) > 7 * 86400 - 60 and tonumber(ttl) <= 7 * 86400, ttl)
    end
    call("step=begin&id=r2")
    call("step=old")
    assert.are.equal("0 -", call("step=reconcile&age=3600")) -- listed once: the old mark deleted
    call("step=old")
    assert.are.equal("0 old", call("step=reconcile&age=3600")) -- none due: no listing
    -- another process ends r2, and r1 is removed
    local txs = db:collection("transactions")
    assert.are.equal(1, assert(txs:update_one({ _id = "r2" },
      { ["$set"] = { state = "cancelled", cause = "rollback" } })).matched)
    assert.are.equal(1, assert(txs:delete_many({ _id = "r1" })).deleted)
    assert.are.equal("2 -", call("step=reconcile&age=0"))
    assert.are.equal("0 -", call("step=reconcile&age=0"))
    local families, text = scrape()
    local rec = { application = "rec" }
    assert.are.equal(2, prom.value(families, "mongotx_transactions_begun_total", rec), text)
    assert.are.equal(1, prom.value(families, "mongotx_transactions_cancelled_total",
      { application = "rec", reason = "unknown" }), text)
    assert.are.equal(1, prom.value(families, "mongotx_transactions_cancelled_total",
      { application = "rec", reason = "rollback" }), text)
  end)

  it("loses counts, not transfers, when the dict is full, and says how many", function()
    n = assert(nginx.start { uri = srv.uri, database = name, workers = 1, recovery = false,
                             locations = LOCATIONS })
    assert.are.equal(200, (transfer("A", "B", 1))) -- its keys exist before the dict fills
    local status, filled = n:request("GET", "/_fill")
    assert.are.equal(200, status)
    assert.truthy(tonumber(filled) > 0)
    for _ = 1, 3 do assert.are.equal(200, (transfer("A", "B", 1))) end
    assert.are.equal(422, (transfer("A", "B", 100000))) -- a guard: a series not seen before
    assert.are.equal(5, count {})
    assert.are.equal(4, count { state = "done" })
    local _, sum = helpers.balances(db:collection("accounts"))
    assert.are.equal(2000, sum)
    local families = scrape()
    local bank = { application = "bank" }
    -- a transfer counts only where its mark found room (how many did
    -- depends on the dict's slabs), and the new series are lost
    local begun = prom.value(families, "mongotx_transactions_begun_total", bank)
    local done = prom.value(families, "mongotx_transactions_done_total", bank)
    assert.is_true(done >= 1 and done <= 4 and begun >= done and begun <= 5, begun .. " " .. done)
    assert.is_nil(prom.value(families, "mongotx_transactions_cancelled_total",
      { application = "bank", reason = "guard" }))
    assert.truthy(prom.value(families, "mongotx_metrics_dropped_total") >= 1)
  end)
end)

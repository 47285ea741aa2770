-- One dead worker stalls no other (issue 41): nginx with 2 workers and
-- group commit (examples/openresty/bank.lua), 16 keep-alive clients that
-- retry a reset request with the same Idempotency-Key
-- (spec/support/retrying_load.py), and one worker killed with kill -9
-- under that load.  The retries of the dead worker's requests meet keys
-- it held; they must not hold the other worker's batches: its answers
-- per second after the kill stay at least half of before, and the p99
-- of its other requests stays as it was.  Afterwards every answer agrees
-- with the database.  `make test-openresty` runs it.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty a worker killed under retrying load", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local cjson = require "cjson"
local core = helpers.core
local mongotx = require "mongotx"

local ACCOUNTS, CONNECTIONS, SECONDS, KILL_AT = 1000, 16, 10, 4

-- Which worker answered: a header on every response.
local WORKER_HEADER = [[
  header_filter_by_lua_block { ngx.header["X-Worker"] = ngx.worker.pid() }
]]

local function p99(list)
  table.sort(list)
  return list[math.max(1, math.ceil(#list * 0.99))] or 0
end

describe("#openresty a worker killed under retrying load", function()
  local srv

  setup(function() srv = assert(server.start { kind = "memory" }) end)
  teardown(function() if srv then srv:stop() end end)

  it("leaves the other worker its pace, and every answer agrees with the database", function()
    local name = helpers.db_name()
    local db = assert(mongotx.connect(srv.uri, { database = name }))
    local docs = {}
    for i = 0, ACCOUNTS - 1 do
      docs[#docs + 1] = { _id = "a" .. i, balance = 1000000, pendingTransactions = core.array() }
    end
    assert(db:collection("accounts"):insert_many(docs))
    -- lease 1 s: a dead worker's keys are taken over a second after its
    -- last step (docs/openresty.md, "A key another call holds")
    local n = assert(nginx.start { uri = srv.uri, database = name, workers = 2, threads = 4, vms = 16,
      http = WORKER_HEADER, reuseport = true,
      configure = "{ manager = { application = 'kill', lease = 1, stale_after = 1 }, " ..
                  "recovery = { every = 0.5 } }" })
    finally(function() n:stop() end)
    local before_workers = n:workers()
    local out = os.tmpname()
    local p = assert(io.popen(("python3 spec/support/retrying_load.py %d %d %g %d %s > %s.log 2>&1 & echo $!")
      :format(n.port, CONNECTIONS, SECONDS, ACCOUNTS, out, out)))
    local pid = tonumber(p:read("*l"))
    p:close()
    -- kill -9 the first worker KILL_AT seconds in (by the clients' clock:
    -- the last answer's time then)
    -- (the worker that answered most so far: the kernel may give one
    -- worker most connections)
    local kill_at, served
    for _ = 1, 400 do
      core.sleep(0.05)
      local last
      served = {}
      for line in io.lines(out) do
        last = line
        local w = line:match("^[%d.]+ (%d+) ")
        if w then served[w] = (served[w] or 0) + 1 end
      end
      local t = last and tonumber(last:match("^([%d.]+) "))
      if t and t >= KILL_AT then kill_at = t break end
    end
    assert(kill_at, "the clients never got going")
    local victim, survivor = before_workers[1], before_workers[2]
    if (served[tostring(survivor)] or 0) > (served[tostring(victim)] or 0) then
      victim, survivor = survivor, victim
    end
    helpers.signal(victim, "KILL")
    assert.is_true(helpers.wait_exit(pid, SECONDS + 60), "the clients did not end")
    -- the answers: per second of the survivor, its latencies before and
    -- after the kill (first tries only), and the retried ones
    local per_second, all, before, after, retried, answers = {}, {}, {}, {}, {}, {}
    for line in io.lines(out) do
      local t, worker, status, secs, tries, key = line:match("^([%d.]+) (%S+) (%d+) ([%d.]+) (%d+) (%S+)$")
      if t then
        t, status, secs, tries = tonumber(t), tonumber(status), tonumber(secs), tonumber(tries)
        answers[key] = status
        if tries > 1 then retried[#retried + 1] = { key = key, status = status, secs = secs } end
        all[math.floor(t)] = (all[math.floor(t)] or 0) + 1
        if worker == tostring(survivor) then
          local s = math.floor(t)
          per_second[s] = (per_second[s] or 0) + 1
          if tries == 1 and t >= 1 and t < kill_at then before[#before + 1] = secs end
          if tries == 1 and t >= kill_at then after[#after + 1] = secs end
        end
      end
    end
    os.remove(out)
    os.remove(out .. ".log")
    -- the answers per second of the whole seconds before the kill (the
    -- first aside: the clients start) and after it, of the survivor and
    -- of all workers
    local function rates(by_second)
      local sum, k, later = 0, 0, {}
      for s = 1, math.floor(kill_at) - 1 do sum, k = sum + (by_second[s] or 0), k + 1 end
      for s = math.floor(kill_at) + 1, SECONDS - 1 do later[#later + 1] = by_second[s] or 0 end
      return sum / k, later
    end
    local rate, seconds = rates(per_second)
    local rate_all, seconds_all = rates(all)
    local report = cjson.encode({ rate_before = rate, after = seconds, all_before = rate_all,
      all_after = seconds_all, p99_before = p99(before), p99_after = p99(after), retried = #retried })
    assert.is_true(#retried > 0, "no request was reset by the kill: " .. report)
    -- (the clients of the dead worker's requests wait for their keys:
    -- the instance's rate is reported, not checked)
    assert.is_true(rate >= 0.2 * rate_all, "the survivor served too few before the kill: " .. report)
    for _, r in ipairs(seconds) do
      assert.is_true(r >= 0.5 * rate, "a second after the kill below half the rate before: " .. report)
    end
    assert.is_true(p99(after) <= math.max(2 * p99(before), p99(before) + 0.1),
      "the p99 of the other requests grew: " .. report)
    -- every retried one answered: its outcome (taken over after the dead
    -- worker's lease), or in_progress
    for _, r in ipairs(retried) do
      assert.truthy(r.status == 200 or r.status == 409 or r.status == 503, cjson.encode(r))
    end
    -- recovery settles what the kill left; then each 200 is a done
    -- transaction, and the money is all there
    local txs, accounts = db:collection("transactions"), db:collection("accounts")
    for _ = 1, 100 do
      if assert(txs:count({ state = { ["$nin"] = { "done", "cancelled" } } })) == 0 then break end
      core.sleep(0.1)
    end
    assert.are.equal(0, assert(txs:count({ state = { ["$nin"] = { "done", "cancelled" } } })))
    local done = {}
    for _, T in ipairs(assert(txs:find_all({ state = "done" }, { projection = { _id = 1 } }))) do
      done[T._id] = true
    end
    for key, status in pairs(answers) do
      if status == 200 then assert.is_true(done[key] == true, key .. " answered 200, not done") end
    end
    local _, sum = helpers.balances(accounts)
    assert.are.equal(ACCOUNTS * 1000000, sum)
    print("\n" .. report)
  end)
end)

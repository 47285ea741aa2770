-- mongotx.metrics (README, "Metrics"): the counters and histograms that
-- the engine's events feed, checked against what the database holds, and
-- their exposition read back by an independent parser (Python's
-- prometheus_client, spec/support/prometheus.lua), which also rejects
-- what it would let through: a repeated HELP, buckets that are not
-- cumulative, a +Inf bucket that is not _count.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local metrics = require "mongotx.metrics"
local exposition = require "mongotx.metrics.exposition"
local prom = require "spec.support.prometheus"

local function parsed(m)
  local text = m:render()
  local families, err = prom.parse(text)
  assert(families, tostring(err) .. "\n" .. text)
  return families, text
end

describe("mongotx.metrics exposition", function()
  it("writes numbers and escapes label values and help as the format says", function()
    assert.are.equal("3", exposition.number(3))
    assert.are.equal("0.1", exposition.number(0.1))
    assert.are.equal("+Inf", exposition.number(math.huge))
    assert.are.equal("-Inf", exposition.number(-math.huge))
    assert.are.equal("NaN", exposition.number(0 / 0))
    assert.are.equal("1e+300", exposition.number(1e300))
    assert.are.equal([[a\\b\"c\nd]], exposition.escape('a\\b"c\nd'))
    local out = {}
    exposition.header(out, "x_total", "counter", "back\\slash and\nnewline")
    exposition.sample(out, "x_total", exposition.labels { "k", 'a\\b"c\nd{}=,' }, 2)
    local families = assert(prom.parse(table.concat(out, "\n") .. "\n"))
    assert.are.equal("back\\slash and\nnewline", families[1].help)
    assert.are.same({ k = 'a\\b"c\nd{}=,' }, families[1].samples[1].labels)
  end)

  it("is refused by the checker when a histogram is not cumulative", function()
    -- the checker itself can fail: a broken histogram does not pass
    local bad = "# HELP h x\n# TYPE h histogram\n" ..
      'h_bucket{le="1"} 2\nh_bucket{le="2"} 1\nh_bucket{le="+Inf"} 2\nh_sum 1\nh_count 2\n'
    assert.is_nil((prom.parse(bad)))
    assert.is_nil((prom.parse("# TYPE a counter\na_total 1\n# TYPE a counter\n")))
  end)

  it("renders nothing before the first event", function()
    assert.are.equal("", metrics.new():render())
  end)
end)

describe("#server mongotx.metrics", function()
  local db, tm, accounts, txs, m, events

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    m = metrics.new()
    events = {}
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many{
      { _id = "A", balance = 100, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 0, pendingTransactions = mongotx.array() },
    })
  end)

  after_each(function() db:close() end)

  local function manager(opts)
    opts.on_event = function(name) events[#events + 1] = name end
    return assert(db:manager(m:wrap(opts)))
  end

  local function count(filter) return assert(txs:count(filter)) end

  it("counts begun, done and cancelled by reason as the database holds them", function()
    local app = 'shop "eu"\\1\n'
    tm = manager { application = app, retries = 0, sleep = function() end }
    assert(tm:transfer("accounts", "A", "B", 10, { min = 0 }))
    assert.is_nil((tm:transfer("accounts", "A", "B", 1000, { min = 0 })))
    local results = tm:transfer_many {
      { collection = "accounts", from = "A", to = "B", amount = 5, min = 0 },
      { collection = "accounts", from = "A", to = "B", amount = 500, min = 0 },
      { collection = "accounts", from = "A", to = "C", amount = 1 },
    }
    assert.truthy(results[1])
    local t = assert(tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 1 } } } }))
    assert(tm:rollback(t, "customer changed their mind"))
    -- the label is the code stored on it, not what its reason's text reads like
    t = assert(tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 1 } } } }))
    assert(tm:rollback(t, "op 1 (update A of accounts): its where condition is false"))
    -- the same id again: no second transaction, no second count
    assert(tm:transfer("accounts", "A", "B", 1, { id = "k-1" }))
    assert(tm:transfer("accounts", "A", "B", 1, { id = "k-1" }))

    local families = parsed(m)
    local labels = { application = app }
    assert.are.equal(count({}), prom.value(families, "mongotx_transactions_begun_total", labels))
    assert.are.equal(count({ state = "done" }),
      prom.value(families, "mongotx_transactions_done_total", labels))
    assert.are.equal(3, count({ state = "done" }))
    local function cancelled(reason)
      return prom.value(families, "mongotx_transactions_cancelled_total",
                        { application = app, reason = reason })
    end
    assert.are.equal(2, cancelled("guard"))
    assert.are.equal(1, cancelled("missing"))
    assert.are.equal(2, cancelled("rollback"))
    assert.are.equal(count({ state = "cancelled" }), 5)
    -- every finished transaction was timed, by outcome
    assert.are.equal(3, prom.value(families, "mongotx_transaction_seconds_count",
                                   { application = app, outcome = "done" }))
    assert.are.equal(5, prom.value(families, "mongotx_transaction_seconds_count",
                                   { application = app, outcome = "cancelled" }))
    assert.are.equal(3, prom.value(families, "mongotx_transaction_seconds_bucket",
                                   { application = app, outcome = "done", le = "+Inf" }))
    local fam = prom.family(families, "mongotx_transaction_seconds")
    assert.are.equal("histogram", fam.type)
    -- no transaction id among the labels
    for _, f in ipairs(families) do
      for _, s in ipairs(f.samples) do
        for k in pairs(s.labels) do
          assert.truthy(({ application = true, reason = true, outcome = true, le = true })[k], k)
        end
      end
    end
    -- and the caller's own on_event saw every event
    assert.truthy(#events >= 20)
  end)

  it("counts busy waits as retries, then the cancel they end in", function()
    tm = manager { application = "a", retries = 2, sleep = function() end }
    -- an open transaction holds B with a credit applied in place (an
    -- explicit undo: not escrowed): a floor guard on B waits
    local t = assert(tm:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -50 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 50 } },
        undo = { ["$inc"] = { balance = -50 } } },
    }))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 2))
    local res, err = tm:transfer("accounts", "B", "A", 10, { min = 0 })
    assert.is_nil(res)
    assert.are.equal("busy", err.code)
    local families = parsed(m)
    assert.are.equal(2, prom.value(families, "mongotx_retries_total",
                                   { application = "a", reason = "busy" }))
    assert.are.equal(1, prom.value(families, "mongotx_transactions_cancelled_total",
                                   { application = "a", reason = "busy" }))
    assert.are.equal(1, count({ state = "cancelled" }))
  end)

  it("counts recovery passes with what they moved, expired and parked ones", function()
    tm = manager { application = "w", stale_after = 0, lease = 0,
                   stale_initial = function() return "expire" end }
    local ops = { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } } }
    assert(tm:begin(ops))
    assert(tm:begin(ops))
    -- a pending one whose tries ran out: parked
    local t = assert(tm:begin(ops))
    assert(tm:step("claim", t))
    assert(txs:update_one({ _id = t._id }, { ["$set"] = { attempts = 99 } }))
    local report = assert(tm:recover())
    assert.are.equal(2, report.cancelled)
    assert.are.equal(1, report.parked)
    local families = parsed(m)
    local w = { application = "w" }
    assert.are.equal(1, prom.value(families, "mongotx_recovery_passes_total", w))
    assert.are.equal(2, prom.value(families, "mongotx_recovered_total",
                                   { application = "w", outcome = "cancelled" }))
    assert.are.equal(1, prom.value(families, "mongotx_recovered_total",
                                   { application = "w", outcome = "parked" }))
    assert.are.equal(1, prom.value(families, "mongotx_parked_total", w))
    assert.are.equal(2, prom.value(families, "mongotx_transactions_cancelled_total",
                                   { application = "w", reason = "expired" }))
    assert.are.equal(0, prom.value(families, "mongotx_recovery_malformed", w))
    -- the pass's seconds: one observation, from its recovering event to its report
    assert.are.equal(1, prom.value(families, "mongotx_recovery_pass_seconds_count", w))
    local secs = prom.value(families, "mongotx_recovery_pass_seconds_sum", w)
    assert.truthy(secs > 0 and secs < 30, tostring(secs))
    assert(tm:recover())
    families = parsed(m)
    assert.are.equal(2, prom.value(families, "mongotx_recovery_passes_total", w))
    assert.are.equal(2, prom.value(families, "mongotx_recovery_pass_seconds_count", w))
    assert.are.equal(1, count({ parked = true }))
    assert(tm:unpark(t._id))
    assert.are.equal(1, prom.value(parsed(m), "mongotx_unparked_total", w))
  end)

  it("takes group-commit batches (size, wait) and the client's round trips", function()
    m = metrics.new { client = db.client }
    local on_event = m:on_event("g")
    on_event("group", { size = 3, wait = 0.002 })
    on_event("group", { size = 1, wait = 0 })
    on_event("group", { size = 600, wait = 0.5 })
    local families = parsed(m)
    local g = { application = "g" }
    assert.are.equal(3, prom.value(families, "mongotx_group_size_count", g))
    assert.are.equal(604, prom.value(families, "mongotx_group_size_sum", g))
    assert.are.equal(1, prom.value(families, "mongotx_group_size_bucket",
                                   { application = "g", le = "1" }))
    assert.are.equal(2, prom.value(families, "mongotx_group_size_bucket",
                                   { application = "g", le = "4" }))
    assert.are.equal(2, prom.value(families, "mongotx_group_size_bucket",
                                   { application = "g", le = "512" }))
    assert.are.equal(3, prom.value(families, "mongotx_group_size_bucket",
                                   { application = "g", le = "+Inf" }))
    assert.are.equal(0.502, prom.value(families, "mongotx_group_wait_seconds_sum", g))
    local trips = prom.value(families, "mongotx_round_trips_total")
    assert.are.equal(db.client:counters().commands, trips)
  end)

  it("never fails a transaction, nor keeps the caller's on_event from its events", function()
    local seen = 0
    m = metrics.new { store = { incr = function() error("store down") end,
                                set = function() error("store down") end } }
    tm = assert(db:manager(m:wrap { application = "x",
      on_event = function() seen = seen + 1 end }))
    assert(tm:transfer("accounts", "A", "B", 10, { min = 0 }))
    assert.are.equal(1, count({ state = "done" }))
    assert.are.same({ A = 90, B = 10 }, (helpers.balances(accounts)))
    assert.truthy(seen >= 5)
  end)
end)

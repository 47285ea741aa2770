-- Why a transaction was cancelled, as a code stored on it (`cause`) on
-- every path that cancels, and given back as err.cause on every later
-- answer for its id (issue 34, item 3); an older transaction without the
-- field still answers, from its reason's text.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local metrics = require "mongotx.metrics"

local format = string.format

local core = helpers.core

describe("#server the cause of a cancel", function()
  local db, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many { { _id = "A", balance = 100 }, { _id = "B", balance = 0 },
                                  { _id = "C", balance = 0 } })
  end)

  local function stored(id) return assert(txs:find_one({ _id = id })) end

  local function credit(id, amount)
    return { { collection = "accounts", id = id, update = { ["$inc"] = { balance = amount } } } }
  end

  -- A retried key answers cancelled with the first refusal's code.
  local function assert_again(cause, fn)
    local T, err = fn()
    assert.is_nil(T)
    assert.are.equal("cancelled", err.code)
    assert.are.equal(cause, err.cause)
  end

  it("one at a time: guard, missing, conflict, stored and given back on a retried key", function()
    local tm = assert(db:manager {})
    local function refused() return tm:transfer("accounts", "A", "B", 500, { min = 0, id = "t-1" }) end
    local _, err = refused()
    assert.are.same({ "guard", "guard" }, { err.code, err.cause })
    assert.are.same({ "cancelled", "guard" }, { stored("t-1").state, stored("t-1").cause })
    assert_again("guard", refused)
    assert_again("guard", function() return tm:commit({ _id = "t-1" }) end)

    local function missing() return tm:transfer("accounts", "A", "nobody", 1, { id = "t-2" }) end
    _, err = missing()
    assert.are.equal("missing", err.code)
    assert.are.equal("missing", stored("t-2").cause)
    assert_again("missing", missing)

    local insert = { { collection = "accounts", id = "B", kind = "insert", doc = { balance = 1 } } }
    _, err = tm:run(insert, { id = "t-3" })
    assert.are.equal("conflict", err.code)
    assert.are.equal("conflict", stored("t-3").cause)
    assert_again("conflict", function() return tm:run(insert, { id = "t-3" }) end)
    assert.are.same({ A = 100, B = 0, C = 0 }, (helpers.balances(accounts)))
  end)

  it("batches and group commit store it, and answer it on a retried key", function()
    local tm = assert(db:manager {})
    local list = {
      { collection = "accounts", from = "A", to = "B", amount = 500, min = 0, id = "b-1" },
      { collection = "accounts", from = "A", to = "C", amount = 10, id = "b-2" },
    }
    local results, errs = tm:transfer_many(list)
    assert.are.same({ "guard", "guard" }, { errs[1].code, errs[1].cause })
    assert(results[2], tostring(errs[2]))
    assert.are.equal("guard", stored("b-1").cause)
    results, errs = tm:transfer_many(list)
    assert.is_false(results[1])
    assert.are.same({ "cancelled", "guard" }, { errs[1].code, errs[1].cause })

    assert(tm:run_calls({
      { method = "transfer", n = 5, "accounts", "A", "B", 500, { min = 0, id = "g-1" } },
      { method = "run", n = 2, credit("nobody", 1), { id = "g-2" } },
    }, 0))
    assert.are.equal("guard", stored("g-1").cause)
    assert.are.equal("missing", stored("g-2").cause)
    local out = assert(tm:run_calls({
      { method = "transfer", n = 5, "accounts", "A", "B", 500, { min = 0, id = "g-1" } },
    }, 0))
    local err = out[1][2]
    assert.are.same({ "cancelled", "guard" }, { err.code, err.cause })
  end)

  it("each, rollback by a caller, a stepwise cancel, recovery's and expiry's", function()
    local tm = assert(db:manager { application = "app", lease = 1, stale_after = 1 })
    local report = assert(tm:each({ "A", "nobody" }, function(id) return credit(id, 1) end,
      { id = "job", key = function(id) return id end }))
    assert.are.equal(1, report.cancelled)
    assert.are.equal("missing", stored("job/s6:nobody").cause)

    local t = assert(tm:begin(credit("A", 1), { id = "r-1" }))
    assert(tm:rollback(t, "op 1 (update A of accounts): its where condition is false"))
    assert.are.equal("rollback", stored("r-1").cause)
    assert_again("rollback", function() return tm:commit({ _id = "r-1" }) end)
    t = assert(tm:begin(credit("A", 1), { id = "r-2" }))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    assert(tm:rollback(t))
    assert.are.equal("rollback", stored("r-2").cause)

    t = assert(tm:begin(credit("A", 1), { id = "s-1" }))
    assert(tm:step("claim", t))
    assert(tm:step("cancel", t))
    assert(tm:step("cancelled", t))
    assert.are.equal("rollback", stored("s-1").cause)

    -- (one registry for both: the registry that counted them begun
    -- counts their ends, docs/metrics.md)
    local m = metrics.new()
    local gone = assert(db:manager(m:wrap { application = "app", lease = 1, stale_after = 1 }))
    t = assert(gone:begin(credit("A", 1), { id = "v-1" }))
    assert(gone:step("claim", t))
    assert(gone:begin(credit("B", 1), { id = "v-2" }))
    core.sleep(1.2)
    local back = assert(db:manager(m:wrap { application = "app", lease = 1, stale_after = 1,
                                     stale_pending = function() return "back" end,
                                     stale_initial = function() return "expire" end }))
    local r = assert(back:recover { batch = 1 }) -- one at a time
    assert.are.equal(2, r.cancelled)
    assert.are.equal("recovery", stored("v-1").cause)
    assert.are.equal("expired", stored("v-2").cause)
    for _, id in ipairs { "v-3", "v-4", "v-5", "v-6" } do
      t = assert(gone:begin(credit("A", 1), { id = id }))
      assert(gone:step("claim", t))
    end
    -- canceling by a stepwise cancel (no reason, cause rollback): recovery
    -- ends them and the metrics label them by their cause
    for _, id in ipairs { "v-5", "v-6" } do assert(gone:step("cancel", { _id = id })) end
    core.sleep(1.2)
    r = assert(back:recover()) -- batched
    assert.are.equal(4, r.cancelled)
    assert.are.equal("recovery", stored("v-3").cause)
    assert.are.equal("rollback", stored("v-5").cause)
    local text = m:render()
    for reason, n in pairs { recovery = 3, expired = 1, rollback = 2 } do
      local line = format('mongotx_transactions_cancelled_total{application="app",reason="%s"} %d',
        reason, n)
      assert.truthy(text:find(line, 1, true), line .. " in\n" .. text)
    end
    assert_again("recovery", function() return tm:commit({ _id = "v-1" }) end)
    assert.are.same({ A = 101, B = 0, C = 0 }, (helpers.balances(accounts)))
  end)

  it("a transaction cancelled before causes were stored answers from its reason", function()
    local tm = assert(db:manager {})
    local function refused() return tm:transfer("accounts", "A", "B", 500, { min = 0, id = "o-1" }) end
    assert.is_nil((refused()))
    assert(txs:update_one({ _id = "o-1" }, { ["$unset"] = { cause = "" } }))
    assert_again("guard", refused)
  end)
end)

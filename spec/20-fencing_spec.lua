-- A worker stalls (SIGSTOP) while it holds a transaction, between two of
-- its applies; another manager takes the transaction over and settles it;
-- the worker resumes (SIGCONT) with its prepared apply.  Version fencing
-- must reject that apply, even though the markers are gone by then.

local helpers = require "spec.helpers"

local reason = helpers.no_concurrency()

describe("#server #concurrency fencing a stalled owner", function()
  if reason then
    it("runs on servers that isolate concurrent writers", function() pending(reason) end)
    return
  end

  local function scenario(direction)
    local db, worker = helpers.stalled_owner()
    local accounts = db:collection("accounts")

    -- the worker applied op 1 (A) and holds a prepared apply of op 2 (B)
    local tm = assert(db:manager {
      application = "rescuer",
      stale_pending = function() return direction end,
    })
    local report = assert(tm:recover())
    assert.equal(1, report.examined)

    return db, accounts, tm, report, helpers.resume_owner(worker)
  end

  it("rolled forward by the new owner: the resumed apply does not repeat", function()
    local _, accounts, tm, report, said = scenario("forward")
    assert.equal(1, report.done)
    local a = accounts:find_one({ _id = "A" })
    local b = accounts:find_one({ _id = "B" })
    assert.equal(900, a.balance)
    assert.equal(1100, b.balance) -- not 1200: op 2 applied once
    assert.equal(0, #a.pendingTransactions)
    assert.equal(0, #b.pendingTransactions)
    local list = assert(tm:find())
    assert.equal(1, #list)
    assert.equal("done", list[1].state)
    assert.equal(2, list[1].epoch) -- claimed by the worker, then by the rescuer
    -- the worker learnt it had been overtaken; the transaction it reports is
    -- the finished one, never a second application
    assert.truthy(said:find("exit"), said)
  end)

  it("rolled back by the new owner: the resumed apply cannot land", function()
    local _, accounts, tm, report, said = scenario("back")
    assert.equal(1, report.cancelled)
    local a = accounts:find_one({ _id = "A" })
    local b = accounts:find_one({ _id = "B" })
    assert.equal(1000, a.balance)
    assert.equal(1000, b.balance) -- the worker's apply of +100 was fenced
    assert.equal(0, #a.pendingTransactions)
    assert.equal(0, #b.pendingTransactions)
    local list = assert(tm:find())
    assert.equal("cancelled", list[1].state)
    assert.equal("rolled back by recovery", list[1].reason)
    assert.truthy(said:find("cancelled"), said)
  end)
end)

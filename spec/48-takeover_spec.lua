-- A retry takes over a key whose owner died, once the owner's lease
-- passed (issue 41, part 2): for each state the owner died in (initial,
-- pending, applied, canceling), the retry (tm:run with the same id and
-- ops, or tm:commit of the id) drives the transaction to the outcome
-- recovery would give, at once; within the lease it waits for the holder
-- at most holder_wait, and takes over when the lease passes during that
-- wait.  The owner is a manager that stops calling (as a killed process
-- does); its lease is made to have passed by moving its lastModified
-- and deadline back (helpers.age), not by sleeping.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local core = helpers.core

local function pay(amount)
  return {
    { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -amount } },
      where = { balance = { ["$gte"] = amount } } },
    { collection = "accounts", id = "B", update = { ["$inc"] = { balance = amount } } },
  }
end

-- The owner's steps before it died, by state.
local DIE_IN = {
  initial = {},
  pending = { { "claim" }, { "apply", 1 } },
  applied = { { "claim" }, { "apply", 1 }, { "apply", 2 }, { "commit" }, { "finish", 1 } },
  canceling = { { "claim" }, { "apply", 1 }, { "cancel" } },
}

describe("#server a retry after its owner died", function()
  local db, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    assert(accounts:insert_many({ { _id = "A", balance = 1000 }, { _id = "B", balance = 0 } }))
  end)
  after_each(function() db:close() end)

  -- A transaction "k" paying 10 from A to B, its owner (another
  -- application, lease `lease`) dead in `state`.
  local function died_in(state, lease)
    local owner = assert(db:manager { application = "worker-1", lease = lease })
    local t = assert(owner:begin(pay(10), { id = "k" }))
    for _, s in ipairs(DIE_IN[state]) do assert(owner:step(s[1], t, s[2])) end
    assert.are.equal(state, assert(txs:find_one({ _id = "k" })).state)
    return t
  end

  -- What recovery gives, by state: the outcome, and A's and B's balances.
  local OUTCOME = {
    initial = { "done", 990, 10 }, pending = { "done", 990, 10 },
    applied = { "done", 990, 10 }, canceling = { "cancelled", 1000, 0 },
  }

  for _, state in ipairs { "initial", "pending", "applied", "canceling" } do
    for _, how in ipairs { "run", "commit" } do
      it(("is taken over at once past the lease (died %s, retried by %s)"):format(state, how), function()
        died_in(state, 30)
        helpers.age(txs, "k", 60)
        local tm = assert(db:manager { application = "worker-2", holder_wait = 5 })
        local t0 = core.monotonic_ms()
        local T, err
        if how == "run" then T, err = tm:run(pay(10), { id = "k" }) else T, err = tm:commit({ _id = "k" }) end
        local took = (core.monotonic_ms() - t0) / 1000
        assert.is_true(took < 1, "the retry took " .. took .. " s")
        local want = OUTCOME[state]
        if want[1] == "done" then
          assert.are.equal("done", T and T.state, tostring(err))
        else
          assert.is_nil(T)
          assert.are.equal("cancelled", err.code, tostring(err))
        end
        local stored = assert(txs:find_one({ _id = "k" }))
        assert.are.equal(want[1], stored.state)
        assert.are.same({ A = want[2], B = want[3] }, (helpers.balances(accounts)))
      end)
    end
  end

  it("is rolled back past the lease where stale_pending says back (died pending)", function()
    died_in("pending", 30)
    helpers.age(txs, "k", 60)
    local tm = assert(db:manager { application = "worker-2", holder_wait = 5,
                                   stale_pending = function() return "back" end })
    local T, err = tm:run(pay(10), { id = "k" })
    assert.is_nil(T)
    assert.are.equal("cancelled", err.code, tostring(err))
    local stored = assert(txs:find_one({ _id = "k" }))
    assert.are.equal("cancelled", stored.state)
    assert.are.equal("recovery", stored.cause)
    assert.are.same({ A = 1000, B = 0 }, (helpers.balances(accounts)))
  end)

  it("waits at most holder_wait within the lease, writing nothing (died pending)", function()
    died_in("pending", 3600)
    local before = helpers.db_dump(db.client, db.name)
    local tm = assert(db:manager { application = "worker-2", holder_wait = 1 })
    local t0 = core.monotonic_ms()
    local T, err = tm:run(pay(10), { id = "k" })
    local took = (core.monotonic_ms() - t0) / 1000
    assert.is_nil(T)
    assert.are.equal("in_progress", err.code, tostring(err))
    assert.is_true(took >= 1 and took < 3, "the retry took " .. took .. " s")
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end)

  it("takes over when the lease passes during its wait (died pending)", function()
    local why = helpers.no_deadlines()
    if why then pending(why) return end
    died_in("pending", 1) -- its deadline: a second from its claim
    local tm = assert(db:manager { application = "worker-2", holder_wait = 10 })
    local t0 = core.monotonic_ms()
    local T, err = tm:run(pay(10), { id = "k" })
    local took = (core.monotonic_ms() - t0) / 1000
    assert.are.equal("done", T and T.state, tostring(err))
    assert.is_true(took < 4, "the retry took " .. took .. " s")
    assert.are.equal(2, assert(txs:find_one({ _id = "k" })).epoch) -- claimed again: taken over
    assert.are.same({ A = 990, B = 10 }, (helpers.balances(accounts)))
  end)
end)

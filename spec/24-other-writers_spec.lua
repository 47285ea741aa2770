-- Writers other than mongotx (README, "Other writers").  A writer that
-- follows the tutorial's recipe (PyMongo, the mongo shell) knows nothing
-- of txVersion, so version fencing cannot stop a stalled mongotx owner
-- after such a writer recovered its transaction.  The owner's deadline
-- does: every apply of an owner is fenced by the server's clock, and an
-- owner that outlives its deadline renews it (a write the other writer
-- sees as a fresh lastModified) before it applies again.  So a writer that
-- only recovers transactions whose lastModified is older than the
-- owner's lease never races an owner's apply.
--
-- Here a worker (spec/support/worker.lua stall, lease 1 s) is stopped with
-- SIGSTOP between its two applies; the other writer waits past the lease
-- and runs the tutorial's recovery with plain updates; the worker resumes.

local helpers = require "spec.helpers"

local reason = helpers.no_concurrency()
if not reason and helpers.no_deadlines() then
  reason = helpers.no_deadlines() .. ": applies are fenced by versions alone, which " ..
           "other writers do not move"
end

describe("#server #concurrency other writers", function()
  if reason then
    it("runs on servers that evaluate $$NOW and isolate writers", function() pending(reason) end)
    return
  end

  it("a stalled owner does not apply again after a tutorial-style recovery", function()
    -- stopped past its 1 s lease, as the recipe's staleness threshold
    local db, worker = helpers.stalled_owner()
    local accounts = db:collection("accounts")

    local T = assert(db:collection("transactions"):find_one({}))
    assert.equal("pending", T.state)
    -- the tutorial's recovery, by a writer that knows nothing of mongotx
    local ops = { { "A", -100 }, { "B", 100 } }
    helpers.recipe_apply(db, T._id, ops)
    helpers.recipe_finish(db, T._id, ops)

    local said = helpers.resume_owner(worker)

    -- op 2 (B's credit) was applied once, by the other writer: the
    -- worker's prepared apply missed its deadline and was not renewed
    local a, b = accounts:find_one({ _id = "A" }), accounts:find_one({ _id = "B" })
    assert.equal(900, a.balance)
    assert.equal(1100, b.balance)
    assert.same({}, a.pendingTransactions)
    assert.same({}, b.pendingTransactions)
    T = assert(db:collection("transactions"):find_one({ _id = T._id }))
    assert.equal("done", T.state)
    assert.equal(1, T.epoch) -- nobody but the worker ever claimed it
    assert.truthy(said:find("exit"), said)
    db:close()
  end)
end)

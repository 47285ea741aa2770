-- The stepwise API (tm:step) used the way an attacker or a confused
-- script would: by a manager that does not hold the transaction, out of
-- order, on transactions in the wrong state, and every step repeated.
-- Contract: a step by a non-holder that needs the holder (claim while the
-- owner's lease runs, apply, commit, cancel) answers nil, err "owned"; a
-- step the state does not allow answers nil, err "state"; a successful
-- step repeated changes nothing.  Each refusal is checked byte for byte
-- on the database (helpers.db_dump before and after).
--
-- Then one policy that must look at the state it decides for:
-- stale_pending decides for pending transactions, not for initial ones.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

-- lastModified must be strictly older than the server's clock.
local function age() mongotx.core.sleep(0.01) end

describe("#server the stepwise API", function()
  local db, tm, other, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager{ application = "app-1" })
    other = assert(db:manager{ application = "app-2" })
    accounts = db:collection("accounts")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
    })
  end)
  after_each(function() db:close() end)

  local function inc(id, n)
    return { collection = "accounts", id = id, update = { ["$inc"] = { balance = n } } }
  end

  -- A → B 100, begun (initial) under the id "t".
  local function begun()
    return assert(tm:begin({ inc("A", -100), inc("B", 100) }, { id = "t" }))
  end

  local function dump() return helpers.db_dump(db.client, db.name) end
  local function unchanged(before) helpers.assert_dump_unchanged(before, db.client, db.name) end

  -- The step answered nil, err with this code (or one of these codes).
  local function refused(codes, res, err)
    if type(codes) == "string" then codes = { codes } end
    assert.is_nil(res, "expected a refusal, got " .. tostring(res))
    assert.is_table(err)
    local ok = false
    for _, c in ipairs(codes) do ok = ok or err.code == c end
    assert.is_true(ok, "code " .. tostring(err.code) .. ", expected " ..
      table.concat(codes, " or ") .. ": " .. tostring(err))
  end

  local function state() return assert(tm:get("t")).state end

  local function doc(id) return assert(accounts:find_one({ _id = id })) end

  -- Runs steps { name, i } on t with tm, asserting each succeeds.
  local function walk(t, steps)
    for _, s in ipairs(steps) do
      local res, err = tm:step(s[1], t, s[2])
      assert(res, string.format("step %s %s: %s", s[1], tostring(s[2]), tostring(err)))
    end
  end

  local function balances() return helpers.balances(accounts) end

  describe("the tutorial walk", function()
    it("claim, apply 1, apply 2, commit, finish 1, finish 2, done", function()
      local t = begun()
      local T = assert(tm:step("claim", t))
      assert.are.equal("pending", T.state)
      assert.are.equal("app-1", T.application)
      assert.are.same({ applied = true }, assert(tm:step("apply", t, 1)))
      assert.are.same({ applied = true }, assert(tm:step("apply", t, 2)))
      assert.are.same({ { "t" }, { "t" } }, { doc("A").pendingTransactions, doc("B").pendingTransactions })
      assert.are.same({ moved = true }, assert(tm:step("commit", t)))
      assert.are.equal("applied", state())
      assert.are.same({ finished = true }, assert(tm:step("finish", t, 1)))
      assert.are.same({ finished = true }, assert(tm:step("finish", t, 2)))
      assert.are.same({ moved = true }, assert(tm:step("done", t)))
      assert.are.equal("done", state())
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    -- Each step, then the same step again: the second changes nothing.
    local function repeated(t, steps)
      for _, s in ipairs(steps) do
        local res, err = tm:step(s[1], t, s[2])
        assert(res, string.format("step %s %s: %s", s[1], tostring(s[2]), tostring(err)))
        local before = dump()
        mongotx.core.sleep(0.005) -- a write now would show in lastModified
        res, err = tm:step(s[1], t, s[2])
        -- safe to repeat: a result, or at most a refusal saying the state moved on
        assert(res ~= nil or err.code == "state",
          string.format("step %s %s repeated: %s", s[1], tostring(s[2]), tostring(err)))
        local ok, why = pcall(unchanged, before)
        assert(ok, string.format("step %s %s repeated wrote: %s", s[1], tostring(s[2]), tostring(why)))
      end
    end

    it("every step of the walk repeated changes nothing", function()
      local t = begun()
      repeated(t, { { "claim" }, { "apply", 1 }, { "apply", 2 }, { "commit" },
                    { "finish", 1 }, { "finish", 2 }, { "done" } })
      assert.are.equal("done", state())
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    it("every step of a cancel walk repeated changes nothing", function()
      local t = begun()
      repeated(t, { { "claim" }, { "apply", 1 }, { "cancel" }, { "undo", 2 }, { "undo", 1 },
                    { "cancelled" } })
      assert.are.equal("cancelled", state())
      assert.are.same({ A = 1000, B = 1000 }, balances())
    end)

    it("claim repeated by the holder returns the transaction with its epoch and attempts", function()
      local t = begun()
      local first = assert(tm:step("claim", t))
      local before = dump()
      mongotx.core.sleep(0.005)
      local again = assert(tm:step("claim", t))
      assert.are.equal("t", again._id)
      assert.are.equal("pending", again.state)
      assert.are.equal(first.epoch, again.epoch)
      assert.are.equal(first.attempts, again.attempts)
      unchanged(before)
      -- and the holder still holds it
      walk(t, { { "apply", 1 }, { "apply", 2 }, { "commit" } })
      assert.are.equal("done", assert(tm:commit(t)).state)
    end)
  end)

  describe("ownership", function()
    -- t pending, held by tm (app-1, lease 30 s), with the ops applied
    -- that `applied` lists.
    local function held(applied)
      local t = begun()
      walk(t, { { "claim" } })
      for _, i in ipairs(applied or {}) do walk(t, { { "apply", i } }) end
      return t
    end

    it("another application cannot claim it while the owner's lease runs", function()
      local t = held({ 1 })
      local T0 = assert(tm:get("t"))
      local before = dump()
      refused("owned", other:step("claim", t))
      unchanged(before)
      local T = assert(tm:get("t"))
      assert.are.same({ "pending", "app-1", T0.instance, T0.epoch, T0.attempts },
                      { T.state, T.application, T.instance, T.epoch, T.attempts })
      -- the owner carries on
      walk(t, { { "apply", 2 }, { "commit" } })
      assert.are.equal("done", assert(tm:commit(t)).state)
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    for _, who in ipairs { "another application", "another manager of the same application" } do
      local function stranger()
        if who == "another application" then return other end
        return assert(db:manager{ application = "app-1" })
      end

      it("apply by " .. who .. " is refused: owned", function()
        local t = held({ 1 })
        local before = dump()
        refused("owned", stranger():step("apply", t, 2))
        unchanged(before)
      end)

      it("commit by " .. who .. " is refused: owned", function()
        local t = held({ 1, 2 })
        local before = dump()
        refused("owned", stranger():step("commit", t))
        unchanged(before)
        assert.are.equal("pending", state())
        walk(t, { { "commit" } })
        assert.are.equal("applied", state())
      end)

      it("cancel by " .. who .. " is refused: owned", function()
        local t = held({ 1 })
        local before = dump()
        refused("owned", stranger():step("cancel", t))
        unchanged(before)
        assert.are.equal("pending", state())
      end)
    end

    it("a manager that never claimed it cannot apply an initial transaction", function()
      local t = begun()
      local before = dump()
      refused({ "owned", "state" }, tm:step("apply", t, 1))
      unchanged(before)
    end)

    it("a manager that never claimed it cannot commit an initial transaction", function()
      local t = begun()
      local before = dump()
      refused({ "owned", "state" }, tm:step("commit", t))
      unchanged(before)
      assert.are.equal("initial", state())
    end)
  end)

  describe("steps the state does not allow", function()
    it("claim of a done transaction: state, the document unchanged", function()
      local t = begun()
      assert.are.equal("done", assert(tm:commit(t)).state)
      for _, m in ipairs { tm, other } do
        local before = dump()
        refused("state", m:step("claim", t))
        unchanged(before)
      end
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    it("claim of a cancelled transaction: state, the document unchanged", function()
      local t = begun()
      assert(tm:rollback(t))
      for _, m in ipairs { tm, other } do
        local before = dump()
        refused("state", m:step("claim", t))
        unchanged(before)
      end
      assert.are.equal("cancelled", state())
    end)

    it("commit by the holder with an op not applied: state, still pending", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 } })
      local before = dump()
      refused("state", tm:step("commit", t))
      unchanged(before)
      assert.are.equal("pending", state())
      -- a committed transaction with op 2 never applied would leave B short
      assert(tm:rollback(t))
      assert.are.same({ A = 1000, B = 1000 }, balances())
    end)

    it("finish on a pending transaction: state, the marker stays", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 } })
      local before = dump()
      refused("state", tm:step("finish", t, 1))
      unchanged(before)
      assert.are.same({ "t" }, doc("A").pendingTransactions)
      assert(tm:rollback(t))
      assert.are.same({ A = 1000, B = 1000 }, balances())
    end)

    it("undo on a pending transaction (not canceling): state, the op stays applied", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 } })
      local before = dump()
      refused("state", tm:step("undo", t, 1))
      unchanged(before)
      walk(t, { { "apply", 2 }, { "commit" } })
      assert.are.equal("done", assert(tm:commit(t)).state)
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    it("done while a marker of the transaction remains: state, still applied", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 }, { "apply", 2 }, { "commit" }, { "finish", 1 } })
      local before = dump()
      refused("state", tm:step("done", t))
      unchanged(before)
      assert.are.equal("applied", state())
      assert.are.same({ "t" }, doc("B").pendingTransactions)
      walk(t, { { "finish", 2 }, { "done" } })
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    it("cancelled while an op is still applied: state, still canceling", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 }, { "apply", 2 }, { "cancel" }, { "undo", 2 } })
      local before = dump()
      refused("state", tm:step("cancelled", t))
      unchanged(before)
      assert.are.equal("canceling", state())
      walk(t, { { "undo", 1 }, { "cancelled" } })
      assert.are.equal("cancelled", state())
      assert.are.same({ A = 1000, B = 1000 }, balances())
    end)

    -- `applied` is the commit point (DESIGN.md §4): after it a
    -- transaction only moves forward.
    it("undo on a committed transaction: state, nothing undone", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 }, { "apply", 2 }, { "commit" } })
      local before = dump()
      refused("state", tm:step("undo", t, 1))
      unchanged(before)
      assert.are.equal("done", assert(tm:commit(t)).state)
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    -- Pulling the marker of a canceling transaction's applied op would
    -- leave the op in place for good: its undo runs only where the marker is.
    it("finish on a canceling transaction: state, and the rollback still restores", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 }, { "cancel" } })
      local before = dump()
      refused("state", tm:step("finish", t, 1))
      unchanged(before)
      assert.are.same({ "t" }, doc("A").pendingTransactions)
      assert(tm:rollback(t))
      assert.are.equal("cancelled", state())
      assert.are.same({ A = 1000, B = 1000 }, balances())
    end)

    it("apply on a canceling transaction by its holder writes nothing", function()
      local t = begun()
      walk(t, { { "claim" }, { "apply", 1 }, { "cancel" } })
      local before = dump()
      refused({ "state", "owned" }, tm:step("apply", t, 2))
      unchanged(before)
      assert(tm:rollback(t))
      assert.are.same({ A = 1000, B = 1000 }, balances())
    end)
  end)

  describe("recovery policies see the state", function()
    local function recoverer(opts)
      local o = { application = "recoverer", stale_after = 0, lease = 0 }
      for k, v in pairs(opts) do o[k] = v end
      return assert(db:manager(o))
    end

    it("stale_pending = back does not cancel a stale initial transaction: it runs", function()
      tm = assert(db:manager{ application = "app-1", lease = 0 })
      local t = begun()
      age()
      local r = assert(recoverer{ stale_pending = function() return "back" end }:recover())
      assert.are.equal(1, r.examined)
      assert.are.equal(1, r.done, "stale_initial (default run) decides an initial transaction")
      assert.are.equal(0, r.cancelled)
      assert.are.equal("done", assert(tm:get(t._id)).state)
      assert.are.same({ A = 900, B = 1100 }, balances())
    end)

    it("stale_pending = back with stale_initial = expire: it expires", function()
      tm = assert(db:manager{ application = "app-1", lease = 0 })
      local t = begun()
      age()
      local r = assert(recoverer{ stale_pending = function() return "back" end,
                                  stale_initial = function() return "expire" end }:recover())
      assert.are.equal(1, r.cancelled)
      local T = assert(tm:get(t._id))
      assert.are.equal("cancelled", T.state)
      assert.are.equal("expired", T.reason)
      assert.are.same({ A = 1000, B = 1000 }, balances())
    end)

    it("stale_pending sees only pending transactions", function()
      tm = assert(db:manager{ application = "app-1", lease = 0 })
      local seen = {}
      local t1 = assert(tm:begin({ inc("A", -1), inc("B", 1) }, { id = "t1" }))
      local t2 = assert(tm:begin({ inc("A", -2), inc("B", 2) }, { id = "t2" }))
      assert(tm:step("claim", t2))
      assert(tm:step("apply", t2, 1))
      age()
      local r = assert(recoverer{ stale_pending = function(tx)
        seen[#seen + 1] = tx._id .. ":" .. tostring(tx.state)
        return "back"
      end }:recover())
      assert.are.same({ "t2:pending" }, seen)
      assert.are.equal(1, r.done)
      assert.are.equal(1, r.cancelled)
      assert.are.equal("done", assert(tm:get(t1._id)).state)
      assert.are.equal("cancelled", assert(tm:get(t2._id)).state)
      assert.are.same({ A = 999, B = 1001 }, balances())
    end)
  end)
end)

-- A batch never holds its other items for a held key (issue 41, part 1):
-- a key another live call holds within its lease (a pending transaction
-- of another manager, lease 3600 s) in commit_many or a group batch.
-- The held keys are waited for all at once, at most holder_wait, after
-- the other items finished (commit_many), or answered on their own while
-- the others answer at once (mongotx.group); what the database holds
-- afterwards is each item's own outcome.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local core = helpers.core

-- The ops of a payment of `amount` from `from` to `to`.
local function pay(from, to, amount)
  return {
    { collection = "accounts", id = from, update = { ["$inc"] = { balance = -amount } } },
    { collection = "accounts", id = to, update = { ["$inc"] = { balance = amount } } },
  }
end

-- Every account's balance, markers or not.
local function balances(accounts)
  local out = {}
  for _, d in ipairs(helpers.dump(accounts)) do out[d._id] = d.balance end
  return out
end

describe("#server a held key in a batch", function()
  local db, accounts, txs, holder

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    assert(accounts:insert_many({ { _id = "A", balance = 1000 }, { _id = "B", balance = 0 },
                                  { _id = "C", balance = 500 }, { _id = "D", balance = 0 } }))
    holder = assert(db:manager { application = "shop", lease = 3600 })
  end)
  after_each(function() db:close() end)

  -- h1..hn held by `holder`: begun, claimed, their first op applied, so
  -- pending; each pays 1 from A to B.
  local function hold(n)
    local held = {}
    for k = 1, n do
      local t = assert(holder:begin(pay("A", "B", 1), { id = "h" .. k }))
      assert(holder:step("claim", t))
      assert(holder:step("apply", t, 1))
      held[k] = t
    end
    return held
  end

  it("commit_many: waits for 3 held keys at once, after the unrelated item finished", function()
    local held = hold(3)
    local before = helpers.db_dump(db.client, db.name, { skip = { "accounts" } })
    local seen -- the unrelated item and C, D as the first wait began
    local waiter = assert(db:manager { application = "shop", holder_wait = 1,
      sleep = function(s)
        if not seen then
          local T = txs:find_one({ _id = "free" })
          seen = { state = T and T.state, balances = balances(accounts) }
        end
        core.sleep(s)
      end })
    local items = {}
    for k = 1, 3 do items[k] = { ops = pay("A", "B", 1), id = "h" .. k } end
    items[4] = { ops = pay("C", "D", 10), id = "free" }
    local t0 = core.monotonic_ms()
    local results, errs = waiter:commit_many(items)
    local took = (core.monotonic_ms() - t0) / 1000
    -- one holder_wait for the three, not one each
    assert.is_true(took >= 1 and took < 2, "commit_many took " .. took .. " s")
    for k = 1, 3 do
      assert.is_false(results[k])
      assert.are.equal("in_progress", errs[k].code, tostring(errs[k]))
      assert.are.equal("h" .. k, errs[k].id)
    end
    assert.are.equal("done", results[4].state)
    assert.is_false(errs[4])
    -- the unrelated item was done, its effect there, before any wait
    assert.are.same({ state = "done", balances = { A = 997, B = 0, C = 490, D = 10 } }, seen)
    -- the held ones are as their holder left them (the others' documents
    -- aside: the unrelated item is there too)
    for k = 1, 3 do
      local T = assert(txs:find_one({ _id = "h" .. k }))
      assert.are.equal("pending", T.state)
      assert.are.equal(holder.engine.instance, T.instance)
      assert.are.equal(1, T.epoch)
    end
    local free = assert(txs:find_one({ _id = "free" }))
    assert(txs:delete_one({ _id = "free" }))
    helpers.assert_dump_unchanged(before, db.client, db.name, { skip = { "accounts" } })
    assert(txs:insert_one(free))
    -- their holder finishes them; the retry answers what they became
    for _, t in ipairs(held) do assert.are.equal("done", assert(holder:commit(t)).state) end
    results, errs = waiter:commit_many(items)
    for k = 1, 4 do assert.are.equal("done", results[k].state, tostring(errs[k])) end
    assert.are.same({ A = 997, B = 3, C = 490, D = 10 }, (helpers.balances(accounts)))
  end)

  it("commit_many: a held key its holder finishes during the wait answers its outcome", function()
    local held = hold(3)
    local sleeps = 0
    local waiter = assert(db:manager { application = "shop", holder_wait = 2,
      sleep = function(s)
        sleeps = sleeps + 1
        if sleeps == 2 then assert(holder:commit(held[2])) end
        core.sleep(s)
      end })
    local t0 = core.monotonic_ms()
    local results, errs = waiter:commit_many({ { ops = pay("A", "B", 1), id = "h1" },
                                               { ops = pay("A", "B", 1), id = "h2" },
                                               { ops = pay("C", "D", 10), id = "free" },
                                               { ops = pay("A", "B", 1), id = "h3" } })
    local took = (core.monotonic_ms() - t0) / 1000
    assert.is_true(took >= 2 and took < 3.5, "commit_many took " .. took .. " s")
    assert.are.equal("in_progress", errs[1].code, tostring(errs[1]))
    assert.are.equal("done", results[2].state, tostring(errs[2]))
    assert.are.equal("done", results[3].state, tostring(errs[3]))
    assert.are.equal("in_progress", errs[4].code, tostring(errs[4]))
    assert.are.equal("pending", assert(txs:find_one({ _id = "h1" })).state)
    assert.are.equal("done", assert(txs:find_one({ _id = "h2" })).state)
    assert.are.equal("pending", assert(txs:find_one({ _id = "h3" })).state)
    -- h1's and h3's first ops are applied (their markers on A), h2 and
    -- free are done
    assert.are.same({ A = 997, B = 1, C = 490, D = 10 }, balances(accounts))
    assert.are.equal(2, #assert(accounts:find_one({ _id = "A" })).pendingTransactions)
  end)

  it("tm:later answers held keys at once and names them, for the caller to wait (mongotx.resty)", function()
    hold(2)
    local tm = assert(db:manager { application = "shop", holder_wait = 5,
      sleep = function() error("tm:later slept") end })
    local t0 = core.monotonic_ms()
    local held, results, errs = tm:later("commit_many", { { ops = pay("A", "B", 1), id = "h1" },
                                                          { ops = pay("C", "D", 10), id = "free" },
                                                          { ops = pay("A", "B", 1), id = "h2" } })
    assert.are.equal("done", results[2].state, tostring(errs[2]))
    assert.are.same({ "in_progress", "in_progress" }, { errs[1].code, errs[3].code })
    assert.are.same({ { 1, "h1", 5 }, { 3, "h2", 5 } },
      { { held[1].i, held[1].id, held[1].wait }, { held[2].i, held[2].id, held[2].wait } })
    assert.is_true(held[1].lapse > 3000, "lapse " .. tostring(held[1].lapse)) -- the holder's lease: an hour
    local T, err
    held, T, err = tm:later("transfer", "accounts", "A", "B", 1, { id = "h1" })
    assert.is_nil(T)
    assert.are.equal("in_progress", err.code)
    assert.are.same({ "h1" }, { held[1].id })
    held, T, err = tm:later("commit", { _id = "h2" })
    assert.is_nil(T)
    assert.are.equal("in_progress", err.code)
    assert.are.same({ "h2" }, { held[1].id })
    -- a call that meets no held key names none, and answers as itself
    held, T = tm:later("run", pay("C", "D", 1), { id = "free2" })
    assert.are.same({}, held)
    assert.are.equal("done", T.state)
    assert.is_true(core.monotonic_ms() - t0 < 2000, "tm:later waited")
    assert.are.same({ "pending", "pending", "done", "done" }, {
      assert(txs:find_one({ _id = "h1" })).state, assert(txs:find_one({ _id = "h2" })).state,
      assert(txs:find_one({ _id = "free" })).state, assert(txs:find_one({ _id = "free2" })).state })
    assert.are.same({ A = 998, B = 0, C = 489, D = 11 }, balances(accounts))
    assert.has_error(function() tm:later("recover") end)
  end)

  it("tm:later(\"held\") settles a batch's held items by id, as commit_many's own wait does (mongotx.resty)", function()
    local held = hold(2)
    assert.are.equal("done", assert(holder:commit(held[2])).state) -- h2 left pending
    -- g1: its owner's lease (1 s) passes; its guard is false (C has 500)
    local owner = assert(db:manager { application = "owner", lease = 1 })
    assert(owner:step("claim", assert(owner:begin({
      { collection = "accounts", id = "C", update = { ["$inc"] = { balance = -5000 } },
        where = { balance = { ["$gte"] = 5000 } } },
      { collection = "accounts", id = "D", update = { ["$inc"] = { balance = 5000 } } } }, { id = "g1" }))))
    core.sleep(1.2)
    local tm = assert(db:manager { application = "shop", holder_wait = 5,
      sleep = function() error("tm:later slept") end,
      on_op_failure = function() error("policy says no") end })
    local again, results, errs = tm:later("held", { "h1", "h2", "gone", "g1" })
    -- h1 held again: named (its index) and answered in_progress, not waited for
    assert.are.same({ { 1, "h1" } }, { { again[1].i, again[1].id } })
    assert.are.equal(1, #again)
    assert.are.same({ false, "in_progress" }, { results[1], errs[1].code })
    assert.are.same({ "done", false }, { results[2].state, errs[2] })
    assert.are.same({ false, "state", "the transaction disappeared" },
                    { results[3], errs[3].code, errs[3].message })
    -- the policy's raise is g1's error, not the call's
    assert.are.same({ false, "policy" }, { results[4], errs[4].code })
    assert.truthy(errs[4].message:find("policy says no", 1, true), errs[4].message)
    assert.are.same({ "pending", "done", "pending" }, { assert(txs:find_one({ _id = "h1" })).state,
      assert(txs:find_one({ _id = "h2" })).state, assert(txs:find_one({ _id = "g1" })).state })
    assert.are.equal(0, txs:count({ _id = "gone" }))
    assert.are.same({ A = 998, B = 1, C = 500, D = 0 }, balances(accounts))
  end)

  it("group commit: the unrelated calls of the batch answer at once, the held one on its own", function()
    hold(2)
    local tm = assert(db:manager { application = "shop", holder_wait = 1 })
    local S = scheduler()
    local g = group.wrap(tm, { signal = S.signal, spawn = S.spawn, now = S.now, max = 10 })
    local answered, got = {}, {}
    local t0 = S.now()
    local calls = {
      { "h1", pay("A", "B", 1) }, { "x1", pay("C", "D", 10) },
      { "h2", pay("A", "B", 1) }, { "x2", pay("C", "D", 20) },
    }
    for i, c in ipairs(calls) do
      S.spawn(function()
        local T, err = g:run(c[2], { id = c[1] })
        answered[i], got[i] = S.now() - t0, { state = T and T.state, code = err and err.code }
      end)
    end
    S.loop()
    -- one batch ran all four (no call waited for another's batch)
    assert.are.same({ state = "done" }, got[2])
    assert.are.same({ state = "done" }, got[4])
    assert.are.same({ code = "in_progress" }, got[1])
    assert.are.same({ code = "in_progress" }, got[3])
    assert.is_true(answered[2] < 0.5 and answered[4] < 0.5,
      ("the unrelated calls answered after %.2f and %.2f s"):format(answered[2], answered[4]))
    -- the held ones waited once each, side by side
    for _, i in ipairs { 1, 3 } do
      assert.is_true(answered[i] >= 1 and answered[i] < 1.8, ("held call %d answered after %.2f s")
        :format(i, answered[i]))
    end
    assert.are.same({ A = 998, B = 0, C = 470, D = 30 }, balances(accounts))
    assert.are.equal("pending", assert(txs:find_one({ _id = "h1" })).state)
    assert.are.equal("done", assert(txs:find_one({ _id = "x2" })).state)
  end)
end)

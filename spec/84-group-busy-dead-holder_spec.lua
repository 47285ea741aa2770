-- A call meets a holder whose owner died (lease passed) and whose own
-- next op is busy (a live open transaction holds its document).  The call
-- drives the dead holder to its end (Engine:resolve).  Issue 41's rule
-- (nothing waits for someone else's failure) and mongotx.group.busy's (no
-- busy wait in a shared batch): the dead holder's retries are the call's
-- busy wait, handed to its caller in group commit (the other calls of the
-- batch answer before the first backoff is over, no batch sleeps
-- policy.sleep), side by side in a plain batch, never slept by tm:step,
-- slept in its drive by a transaction driven alone (tm:commit).  Each op
-- meeting the dead holder goes on with its apply and its tries, so it
-- ends as recovery would: cancelled `busy` after its retries while the
-- live holder stays, forward once that one went.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local core = helpers.core
local RETRIES, BACKOFF, K = 3, 0.5, 4

describe("#server group commit: a dead holder whose drive waits busy", function()
  local db, accounts, txs, holder, payer, slept, stops

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    local docs = { { _id = "H", balance = 1000 }, { _id = "V", balance = 0 },
                   { _id = "X", balance = 50 }, { _id = "Y", balance = 50 } }
    for i = 1, K do docs[#docs + 1] = { _id = "U" .. i, balance = 50 } end
    assert(accounts:insert_many(docs))
    -- the live holder: its credit on Y applied, left open (txHeld)
    holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
    helpers.hold_open(holder, "Y", "h")
    -- the dead one (lease 0: past at once): its credit on X applied, its
    -- credit on Y (which the live holder holds) not
    local dead = assert(db:manager { application = "dead", lease = 0, escrow = false })
    local d = assert(dead:begin({
      { collection = "accounts", id = "X", update = { ["$inc"] = { balance = 1 } } },
      { collection = "accounts", id = "Y", update = { ["$inc"] = { balance = 1 } } },
    }, { id = "d" }))
    assert(dead:step("claim", d))
    assert(dead:step("apply", d, 1))
    assert.are.same({ "d" }, assert(accounts:find_one({ _id = "X" })).txHeld)
    slept, stops = 0, 0
    payer = assert(db:manager { application = "payer", retries = RETRIES,
      backoff = function() return BACKOFF end,
      sleep = function(s) slept = slept + s core.sleep(s) end,
      -- the dead holder's drive stopped at a retry
      on_event = function(name, info)
        if name == "resolve" and info.reason == "busy" then stops = stops + 1 end
      end })
  end)
  after_each(function() db:close() end)

  local function grouped(meanwhile)
    local S = scheduler()
    local g = group.wrap(payer, { signal = S.signal, spawn = S.spawn, now = S.now, max = 100 })
    local answers, at, start = {}, {}, S.now()
    local function call(k, fn)
      S.spawn(function()
        local T, err = fn()
        answers[k], at[k] = { T = T, err = err }, S.now() - start
      end)
    end
    -- X pays V: its guarded debit meets the dead holder's credit on X
    call(1, function() return g:transfer("accounts", "X", "V", 10, { min = 0, id = "x" }) end)
    for i = 1, K do
      call(i + 1, function() return g:transfer("accounts", "U" .. i, "V", 10, { min = 0, id = "u" .. i }) end)
    end
    if meanwhile then S.spawn(function() meanwhile(S) end) end
    S.loop()
    return answers, at
  end

  -- every call done; the dead holder's state; the balances once the live
  -- holder is gone (rolled back here if still open), no marks left
  local function check(answers, d_state, d_cause, want_xy)
    for k = 1, K + 1 do
      assert.are.equal("done", answers[k].T and answers[k].T.state, tostring(answers[k].err))
    end
    local D = assert(txs:find_one({ _id = "d" }))
    assert.are.same({ d_state, d_cause }, { D.state, D.cause })
    local h = assert(holder:get("h"))
    if h.state ~= "cancelled" then assert(holder:rollback(h)) end
    local want = { H = 1000, V = 10 * (K + 1), X = want_xy[1], Y = want_xy[2] }
    for i = 1, K do want["U" .. i] = 40 end
    assert.are.same(want, helpers.balances(accounts))
    for _, doc in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, doc.pendingTransactions or {}, doc._id .. " keeps a marker")
      assert.are.same({}, doc.txHeld or {}, doc._id .. " keeps a txHeld entry")
    end
  end

  local function check_times(at)
    for k = 2, K + 1 do
      assert.is_true(at[k] < BACKOFF, ("unrelated call %d answered after %.3f s: its batch waited " ..
        "for the dead holder's busy retries"):format(k, at[k]))
    end
    assert.are.equal(0, slept, "the batch slept (policy.sleep) for the dead holder")
  end

  it("answers the unrelated calls before the dead holder's first backoff", function()
    local answers, at = grouped()
    -- the dead holder ended cancelled (busy), its credit on X undone
    check(answers, "cancelled", "busy", { 40, 50 })
    check_times(at)
    assert.is_true(at[1] >= RETRIES * BACKOFF, ("the busy call answered after %.3f s"):format(at[1]))
    assert.are.equal(RETRIES, stops, "the dead holder's drive stopped at each of its retries")
  end)

  it("the live holder goes between retries: the dead holder forward, the call done", function()
    local answers, at = grouped(function(S)
      S.signal():wait(BACKOFF * 1.5) -- between the call's first and second retry
      assert(holder:rollback(assert(holder:get("h"))))
    end)
    -- the dead holder driven forward as recovery would (stale_pending):
    -- its credits on X and Y both committed
    check(answers, "done", nil, { 41, 51 })
    check_times(at)
    assert.is_true(at[1] < RETRIES * BACKOFF, ("the call answered after %.3f s"):format(at[1]))
  end)

  it("tm:commit, one at a time: it sleeps the dead holder's retries in its drive, then applies", function()
    local T, err = payer:commit(assert(payer:begin({
      { collection = "accounts", id = "X", update = { ["$inc"] = { balance = -10 } } },
      { collection = "accounts", id = "V", update = { ["$inc"] = { balance = 10 } } },
    }, { id = "x" })))
    local answers = { { T = T, err = err } }
    for i = 1, K do
      answers[i + 1] = { T = assert(payer:transfer("accounts", "U" .. i, "V", 10, { min = 0, id = "u" .. i })) }
    end
    check(answers, "cancelled", "busy", { 40, 50 })
    assert.is_true(slept > RETRIES * BACKOFF - 0.05 and slept < (RETRIES + 1) * BACKOFF - 0.05,
      ("the call slept %.3f s"):format(slept))
    assert.are.equal(0, stops, "tm:commit stopped the dead holder's drive")
  end)

  it("a plain batch: the dead holder's retries side by side, each item done", function()
    local items = { { collection = "accounts", from = "X", to = "V", amount = 10, min = 0, id = "x" } }
    for i = 1, K do
      items[#items + 1] = { collection = "accounts", from = "U" .. i, to = "V", amount = 10, min = 0, id = "u" .. i }
    end
    local list, errs = payer:transfer_many(items)
    local answers = {}
    for k = 1, K + 1 do answers[k] = { T = list and list[k], err = errs and errs[k] } end
    check(answers, "cancelled", "busy", { 40, 50 })
    -- the dead holder's retries, each slept once (a sleep ends at the
    -- retry due, by the clock: a little under its backoff)
    assert.is_true(slept > RETRIES * BACKOFF - 0.05 and slept < (RETRIES + 1) * BACKOFF - 0.05,
      ("the batch slept %.3f s"):format(slept))
    assert.are.equal(RETRIES, stops, "the dead holder's drive stopped at each of its retries")
  end)

  it("a recovery batch: the dead holder met, its retries side by side, the batch recovered", function()
    -- two stale transactions of another dead owner, recovered together;
    -- r1's debit on X meets d, which this pass does not take itself
    local rdead = assert(db:manager { application = "rdead", lease = 0, escrow = false })
    for _, t in ipairs { { "r1", "X", "V" }, { "r2", "U1", "U2" } } do
      local T = assert(rdead:begin({
        { collection = "accounts", id = t[2], update = { ["$inc"] = { balance = -10 } } },
        { collection = "accounts", id = t[3], update = { ["$inc"] = { balance = 10 } } },
      }, { id = t[1] }))
      assert(rdead:step("claim", T))
    end
    local rec = assert(db:manager { application = "rec", retries = RETRIES,
      backoff = function() return BACKOFF end,
      sleep = function(s) slept = slept + s core.sleep(s) end,
      on_event = function(name, info)
        if name == "resolve" and info.reason == "busy" then stops = stops + 1 end
      end,
      may_recover = function(tx, age) return tx._id ~= "d" and age >= (tonumber(tx.lease) or 0) end })
    local report = assert(rec:recover({ limit = 10, batch = 10 }))
    assert.are.same({ 2, 0 }, { report.done, report.failed })
    for _, id in ipairs { "r1", "r2" } do
      assert.are.equal("done", assert(txs:find_one({ _id = id })).state, id)
    end
    local D = assert(txs:find_one({ _id = "d" }))
    assert.are.same({ "cancelled", "busy" }, { D.state, D.cause })
    assert.are.equal(RETRIES, stops, "the dead holder's drive stopped at each of its retries")
    assert.is_true(slept > RETRIES * BACKOFF - 0.05 and slept < (RETRIES + 1) * BACKOFF - 0.05,
      ("the pass slept %.3f s"):format(slept))
    assert(holder:rollback(assert(holder:get("h"))))
    assert.are.same({ H = 1000, V = 10, X = 40, Y = 50, U1 = 40, U2 = 60, U3 = 50, U4 = 50 },
      helpers.balances(accounts))
    for _, doc in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, doc.pendingTransactions or {}, doc._id .. " keeps a marker")
      assert.are.same({}, doc.txHeld or {}, doc._id .. " keeps a txHeld entry")
    end
  end)

  it("tm:step never sleeps the dead holder's retries: busy at once, its tries kept", function()
    local T = assert(payer:begin({
      { collection = "accounts", id = "X", update = { ["$inc"] = { balance = -10 } } },
    }, { id = "s" }))
    assert(payer:step("claim", T))
    for try = 1, RETRIES + 1 do
      local res, err = payer:step("apply", T, 1)
      assert.are.equal(0, slept, "tm:step slept")
      if try <= RETRIES then
        assert.is_nil(res)
        assert.are.equal("busy", err and err.code, tostring(err))
        assert.are.equal("pending", assert(txs:find_one({ _id = "d" })).state)
      else
        -- its retries spent, the dead holder ended cancelled: the op applies
        assert(res, tostring(err))
        assert.are.same({ "cancelled", "busy" }, { assert(txs:find_one({ _id = "d" })).state,
          assert(txs:find_one({ _id = "d" })).cause })
      end
    end
    assert(payer:step("commit", T))
    assert(payer:step("finish", T, 1))
    assert(payer:step("done", T))
    assert(holder:rollback(assert(holder:get("h"))))
    local want = { H = 1000, V = 0, X = 40, Y = 50 }
    for i = 1, K do want["U" .. i] = 50 end
    assert.are.same(want, helpers.balances(accounts))
  end)
end)

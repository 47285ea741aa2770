-- A batch's busy items hold none of its other items (issue 41): a
-- document another live transaction holds within its lease makes an op
-- wait (`busy`: retries x backoff, then cancelled).  A batch's items on
-- such documents wait together, one backoff for all of them a round, so
-- k of them cost the wait of one, not k; and its items on other
-- documents, by commit_many, transfer_many or group commit, answer as
-- soon as that one wait is over.  Each case checks the balances, that
-- the busy ones ended cancelled (`busy`) and the others done, and that
-- no account keeps a marker or a `txHeld` entry once the holder rolled
-- back.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local core = helpers.core

-- Busy items (documents the holder holds), and unrelated ones.
local K = 4
-- One busy item's wait: RETRIES backoffs of BACKOFF seconds.
local RETRIES, BACKOFF = 3, 0.25
local WAIT = RETRIES * BACKOFF

describe("#server a batch's items on documents a live transaction holds", function()
  local db, accounts, txs, holder, payer, slept

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    local docs = { { _id = "H", balance = 1000 }, { _id = "V", balance = 0 } }
    for i = 1, K do
      docs[#docs + 1] = { _id = "X" .. i, balance = 50 }
      docs[#docs + 1] = { _id = "U" .. i, balance = 50 }
    end
    assert(accounts:insert_many(docs))
    -- the holder: alive (lease an hour), each of its transactions caught
    -- with its credit on X<i> (exclusive: escrow = false puts it in txHeld)
    holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
    for i = 1, K do
      local t = assert(holder:begin({
        { collection = "accounts", id = "H", update = { ["$inc"] = { balance = -1 } } },
        { collection = "accounts", id = "X" .. i, update = { ["$inc"] = { balance = 1 } } },
      }, { id = "h" .. i }))
      assert(holder:step("claim", t))
      assert(holder:step("apply", t, 2))
      assert.are.same({ "h" .. i }, assert(accounts:find_one({ _id = "X" .. i })).txHeld)
    end
    slept = 0
  end)
  after_each(function() db:close() end)

  -- The payer; on_sleep(n, seconds) before its n-th sleep.
  local function new_payer(on_sleep, on_event)
    local n = 0
    payer = assert(db:manager { application = "payer", retries = RETRIES, on_event = on_event,
      backoff = function() return BACKOFF end,
      sleep = function(s)
        n, slept = n + 1, slept + s
        if on_sleep then on_sleep(n, s) end
        core.sleep(s)
      end })
    return payer
  end

  -- The items, busy and unrelated in turn: x<i> pays 10 from X<i> to V,
  -- u<i> from U<i> to V (min 0 each).
  local function items()
    local list = {}
    for i = 1, K do
      list[#list + 1] = { collection = "accounts", from = "X" .. i, to = "V", amount = 10, min = 0,
                          id = "x" .. i }
      list[#list + 1] = { collection = "accounts", from = "U" .. i, to = "V", amount = 10, min = 0,
                          id = "u" .. i }
    end
    return list
  end

  local function state(id) return assert(txs:find_one({ _id = id })).state end

  -- After the holder rolled back: x<i> done for i in `through` (1..through), the others
  -- cancelled `busy`; every u<i> done; balances to match; no marks.
  local function check_db(through)
    for i = 1, K do
      local h = assert(holder:get("h" .. i))
      assert.is_true(h.state == "cancelled" or holder:rollback(h))
    end
    local want = { H = 1000, V = 10 * K + 10 * through }
    for i = 1, K do
      want["U" .. i] = 40
      want["X" .. i] = i <= through and 40 or 50
      assert.are.equal("done", state("u" .. i))
      local T = assert(txs:find_one({ _id = "x" .. i }))
      if i <= through then
        assert.are.equal("done", T.state, "x" .. i)
      else
        assert.are.equal("cancelled", T.state, "x" .. i)
        assert.are.equal("busy", T.cause, "x" .. i)
      end
    end
    assert.are.same(want, helpers.balances(accounts))
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end

  -- The answers of a batch: u<i> done, x<i> as `through` says.
  local function check_answers(results, errs, through)
    for k = 1, 2 * K do
      local i = math.floor((k + 1) / 2)
      if k % 2 == 0 or i <= through then
        assert.are.equal("done", results[k] and results[k].state, tostring(errs[k]))
      else
        assert.is_false(results[k])
        assert.are.equal("busy", errs[k].code, tostring(errs[k]))
      end
    end
  end

  for _, how in ipairs { "transfer_many", "commit_many" } do
    it(("%s: %d busy items cost one wait, not %d"):format(how, K, K), function()
      local tm = new_payer()
      local list = items()
      if how == "commit_many" then
        for k, t in ipairs(list) do
          list[k] = { id = t.id, ops = {
            { collection = "accounts", id = t.from, update = { ["$inc"] = { balance = -10 } },
              where = { balance = { ["$gte"] = 10 } } },
            { collection = "accounts", id = t.to, update = { ["$inc"] = { balance = 10 } } } } }
        end
      end
      local start = core.monotonic_ms()
      local results, errs = tm[how](tm, list)
      local took = (core.monotonic_ms() - start) / 1000
      check_answers(results, errs, 0)
      -- one item alone sleeps WAIT in all: K of them one after the other K x WAIT;
      -- together a little more than WAIT (each waits from its own last try)
      assert.is_true(slept < WAIT + BACKOFF, ("the batch slept %.2f s for %d busy items"):format(slept, K))
      assert.is_true(took < 2 * WAIT, ("the batch took %.2f s (one wait: %.2f s)"):format(took, WAIT))
      assert.is_true(took >= WAIT, ("the busy items waited %.2f s, not their backoffs"):format(took))
      assert.is_true(slept > WAIT / 2, ("the batch slept %.2f s of its wait"):format(slept))
      check_db(0)
    end)
  end

  it("items whose holder ends during the wait go through in the next round", function()
    -- at the first sleep, the holder rolls h1 and h2 back
    local tm = new_payer(function(n)
      if n == 1 then
        for i = 1, 2 do assert.is_true(holder:rollback(assert(holder:get("h" .. i)))) end
      end
    end)
    local start = core.monotonic_ms()
    local results, errs = tm:transfer_many(items())
    local took = (core.monotonic_ms() - start) / 1000
    check_answers(results, errs, 2)
    assert.is_true(took < 2 * WAIT, ("the batch took %.2f s (one wait: %.2f s)"):format(took, WAIT))
    check_db(2)
  end)

  it("an item on a document of an earlier item still waiting waits for it: batch order holds", function()
    -- w1 pays X1 (held) from W, w2 pays V from W; W has 10 for one of them.
    -- In batch order w1 waits, ends busy (W is given back), then w2 pays.
    -- Had w2 gone first, w1 would end `guard`, an answer of the other order.
    assert(accounts:insert_one({ _id = "W", balance = 10 }))
    local tm = new_payer()
    local results, errs = tm:transfer_many {
      { collection = "accounts", from = "W", to = "X1", amount = 10, min = 0, id = "w1" },
      { collection = "accounts", from = "W", to = "V", amount = 10, min = 0, id = "w2" } }
    assert.is_false(results[1])
    assert.are.equal("busy", errs[1].code, tostring(errs[1]))
    assert.are.equal("done", results[2] and results[2].state, tostring(errs[2]))
    assert.are.equal("busy", assert(txs:find_one({ _id = "w1" })).cause)
    for i = 1, K do assert(holder:rollback(assert(holder:get("h" .. i)))) end
    local want = { H = 1000, V = 10, W = 0 }
    for i = 1, K do want["X" .. i], want["U" .. i] = 50, 50 end
    assert.are.same(want, helpers.balances(accounts))
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)

  it(("hold_many: %d holds on busy accounts cost one wait, not %d"):format(K, K), function()
    local tm = new_payer()
    local start = core.monotonic_ms()
    local results, errs = tm:hold_many(items())
    local took = (core.monotonic_ms() - start) / 1000
    for k = 1, 2 * K do
      local id = (k % 2 == 0 and "u" or "x") .. math.floor((k + 1) / 2)
      if k % 2 == 0 then
        assert.are.equal("held", results[k] and results[k].hold.status, tostring(errs[k]))
      else
        assert.is_false(results[k])
        assert.are.equal("busy", errs[k].code, tostring(errs[k]))
        local T = assert(txs:find_one({ _id = id }))
        assert.are.same({ "cancelled", "busy" }, { T.state, T.cause })
      end
    end
    assert.is_true(took < 2 * WAIT, ("hold_many took %.2f s (one wait: %.2f s)"):format(took, WAIT))
    assert.is_true(took >= WAIT, ("the busy holds waited %.2f s, not their backoffs"):format(took))
    -- the held ones hold 10 each of U<i>; voided, everything is back
    local want, now = { H = 1000, V = 0 }, {}
    for i = 1, K do
      want["U" .. i], want["X" .. i] = 40, 51 -- (X<i>: the holder's credit, in place)
    end
    for _, d in ipairs(helpers.dump(accounts)) do now[d._id] = d.balance end
    assert.are.same(want, now)
    for i = 1, K do
      assert(tm:void("u" .. i))
      assert(holder:rollback(assert(holder:get("h" .. i))))
      want["U" .. i], want["X" .. i] = 50, 50
    end
    assert.are.same(want, helpers.balances(accounts))
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
      assert.are.same({}, d.escrow or {}, d._id .. " keeps an escrow")
    end
  end)

  it("group commit: the unrelated callers answer after one wait, not " .. K, function()
    local sizes = {}
    local tm = new_payer(nil, function(name, info)
      if name == "group" then sizes[#sizes + 1] = info.size end
    end)
    local S = scheduler()
    local g = group.wrap(tm, { signal = S.signal, spawn = S.spawn, now = S.now, max = 100 })
    local answers, took = {}, {}
    local start = core.monotonic_ms()
    for k, t in ipairs(items()) do
      S.spawn(function()
        local T, err = g:transfer("accounts", t.from, t.to, t.amount, { min = 0, id = t.id })
        answers[k], took[k] = { T = T or false, err = err }, (core.monotonic_ms() - start) / 1000
      end)
    end
    S.loop()
    local results, errs = {}, {}
    for k = 1, 2 * K do results[k], errs[k] = answers[k].T, answers[k].err end
    assert.are.same({ 2 * K }, sizes, "the calls ran as one batch")
    check_answers(results, errs, 0)
    for k = 2, 2 * K, 2 do
      assert.is_true(took[k] < 2 * WAIT, ("u%d answered after %.2f s (one wait: %.2f s)"):format(
        k / 2, took[k], WAIT))
    end
    assert.is_true(slept < WAIT + BACKOFF, ("the batch slept %.2f s for %d busy items"):format(slept, K))
    check_db(0)
  end)

  it("group commit of begun transactions: the unrelated commits answer after one wait", function()
    local tm = new_payer()
    local S = scheduler()
    local g = group.wrap(tm, { signal = S.signal, spawn = S.spawn, now = S.now, max = 100 })
    local begun = {}
    for k, t in ipairs(items()) do
      begun[k] = assert(tm:begin({
        { collection = "accounts", id = t.from, update = { ["$inc"] = { balance = -10 } },
          where = { balance = { ["$gte"] = 10 } } },
        { collection = "accounts", id = t.to, update = { ["$inc"] = { balance = 10 } } } },
        { id = t.id }))
    end
    local answers, took = {}, {}
    local start = core.monotonic_ms()
    for k, t in ipairs(begun) do
      S.spawn(function()
        local T, err = g:commit(t)
        answers[k], took[k] = { T = T or false, err = err }, (core.monotonic_ms() - start) / 1000
      end)
    end
    S.loop()
    local results, errs = {}, {}
    for k = 1, 2 * K do results[k], errs[k] = answers[k].T, answers[k].err end
    check_answers(results, errs, 0)
    for k = 2, 2 * K, 2 do
      assert.is_true(took[k] < 2 * WAIT, ("u%d answered after %.2f s (one wait: %.2f s)"):format(
        k / 2, took[k], WAIT))
    end
    check_db(0)
  end)
end)

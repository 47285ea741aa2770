-- Group commit: a call whose apply must wait for a retry (an op on a
-- document another open transaction holds: `busy`) holds none of its
-- batch (issue 41).  The batch answers the unrelated calls at once; the
-- busy call's own caller waits its backoffs (here: the scheduler's
-- signal, not a sleep of the Lua state) and goes on with its transaction
-- alone, so it takes the tries the call alone takes and ends as it does:
-- cancelled `busy` after its retries while the holder stays open, `done`
-- when the holder ends between its retries.  For each part of a batch
-- (transfers and runs, commits of begun transactions, holds), each case
-- checks when each caller was answered (the scheduler's clock), the
-- answers against the same call made alone, and what the database holds.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local core = helpers.core

-- The busy call's retries and its fixed backoff: alone it waits RETRIES
-- x BACKOFF in all.
local RETRIES, BACKOFF = 3, 0.5
local WAIT = RETRIES * BACKOFF
-- Unrelated calls.
local K = 4

describe("#server group commit: a busy call holds none of its batch", function()
  local db, accounts, txs, holder, payer, retries, slept

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    local docs = { { _id = "H", balance = 1000 }, { _id = "V", balance = 0 },
                   { _id = "X", balance = 50 }, { _id = "W", balance = 10 } }
    for i = 1, K do docs[#docs + 1] = { _id = "U" .. i, balance = 50 } end
    assert(accounts:insert_many(docs))
    -- the holder: alive (lease an hour), its transaction caught with its
    -- credit on X (exclusive: escrow = false puts it in txHeld)
    holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
    helpers.hold_open(holder, "X", "h")
    assert.are.same({ "h" }, assert(accounts:find_one({ _id = "X" })).txHeld)
    retries, slept = {}, 0
    payer = assert(db:manager { application = "payer", retries = RETRIES,
      backoff = function() return BACKOFF end,
      sleep = function(s) slept = slept + s core.sleep(s) end,
      on_event = function(name, info)
        if name == "retry" then retries[tostring(info.id)] = (retries[tostring(info.id)] or 0) + 1 end
      end })
  end)
  after_each(function() db:close() end)

  local function rollback_holder()
    local h = assert(holder:get("h"))
    if h.state ~= "cancelled" then assert(holder:rollback(h)) end
  end

  -- Runs calls[k] = function(g) -> answer (a table) each in a task of
  -- its own over one group; extra tasks (function(S)) beside them.
  -- Returns the answers and when each came (seconds since the start, by
  -- the scheduler's clock), and the sizes of the batches.
  local function run_grouped(calls, extra)
    local S = scheduler()
    local sizes = {}
    local tm = payer
    local g = group.wrap(tm, { signal = S.signal, spawn = S.spawn, now = S.now, max = 100 })
    local answers, at = {}, {}
    local start = S.now()
    for k, fn in ipairs(calls) do
      S.spawn(function()
        answers[k] = fn(g)
        at[k] = S.now() - start
      end)
    end
    for _, fn in ipairs(extra or {}) do S.spawn(function() fn(S) end) end
    S.loop()
    return answers, at, sizes
  end

  local function pack(T, err) return { T = T or false, err = err } end

  -- The unrelated transfers u<i>: U<i> pays V 10.
  local function unrelated(calls)
    for i = 1, K do
      calls[#calls + 1] = function(g)
        return pack(g:transfer("accounts", "U" .. i, "V", 10, { min = 0, id = "u" .. i }))
      end
    end
    return calls
  end

  -- The database once the holder rolled back: u<i> done, `busy` as
  -- `done` says (X paid V 10, or nothing), no marks anywhere.
  local function check_db(busy_id, done, extra)
    rollback_holder()
    local want = { H = 1000, V = 10 * K + (done and 10 or 0), X = done and 40 or 50, W = 10 }
    for i = 1, K do
      want["U" .. i] = 40
      assert.are.equal("done", assert(txs:find_one({ _id = "u" .. i })).state)
    end
    for k, v in pairs(extra or {}) do want[k] = v end
    local T = assert(txs:find_one({ _id = busy_id }))
    if done then
      assert.are.equal("done", T.state, busy_id)
    else
      assert.are.same({ "cancelled", "busy" }, { T.state, T.cause }, busy_id)
    end
    assert.are.same(want, helpers.balances(accounts))
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
      for path, n in pairs(d.txPending or {}) do
        assert.are.equal(0, n, d._id .. " keeps an escrowed credit to " .. path)
      end
    end
  end

  -- The unrelated callers were answered `done` before the busy call's
  -- first backoff was over; the busy one after its own wait.
  local function check_times(answers, at, busy_k, busy_wait)
    for k, a in ipairs(answers) do
      if k ~= busy_k then
        assert.are.equal("done", a.T and a.T.state, tostring(a.err))
        assert.is_true(at[k] < BACKOFF, ("call %d answered after %.3f s: it waited for the busy " ..
          "call (its first backoff: %.2f s)"):format(k, at[k], BACKOFF))
      end
    end
    assert.is_true(at[busy_k] >= busy_wait, ("the busy call answered after %.3f s, not after its " ..
      "backoffs (%.2f s)"):format(at[busy_k], busy_wait))
  end

  -- What of an answer the same call alone gives too.
  local function shape(a)
    if a.T then return { state = a.T.state, id = a.T._id } end
    local e = a.err
    return { code = e.code, cause = e.cause, message = e.message, op = e.op,
             collection = e.collection, document = e.document }
  end

  it("a transfer on a held document: the others answer at once, it ends busy after its retries", function()
    local calls = { function(g) return pack(g:transfer("accounts", "X", "V", 10, { min = 0, id = "x" })) end }
    local answers, at = run_grouped(unrelated(calls))
    check_times(answers, at, 1, WAIT)
    assert.is_false(answers[1].T)
    assert.are.equal("busy", answers[1].err.code, tostring(answers[1].err))
    assert.are.equal(RETRIES, retries.x, "the busy call's retries")
    assert.are.equal(0, slept, "the batch slept (policy.sleep) for the busy call")
    -- the same call alone answers the same
    local alone = pack(payer:transfer("accounts", "X", "V", 10, { min = 0, id = "x2" }))
    local want, got = shape(alone), shape(answers[1])
    want.message, got.message = want.message:gsub("x2", "x"), got.message
    assert.are.same(want, got)
    assert.are.equal(RETRIES, retries.x2)
    assert.are.same({ "cancelled", "busy" }, { assert(txs:find_one({ _id = "x2" })).state,
      assert(txs:find_one({ _id = "x2" })).cause })
    check_db("x", false)
  end)

  it("a transfer whose holder ends between its retries: done, the others at once", function()
    local calls = { function(g) return pack(g:transfer("accounts", "X", "V", 10, { min = 0, id = "x" })) end }
    local answers, at = run_grouped(unrelated(calls), { function(S)
      S.signal():wait(BACKOFF * 1.5) -- between the busy call's first and second retry
      rollback_holder()
    end })
    check_times(answers, at, 1, 2 * BACKOFF)
    assert.are.equal("done", answers[1].T and answers[1].T.state, tostring(answers[1].err))
    assert.are.equal(2, retries.x, "the busy call's retries")
    check_db("x", true)
  end)

  it("a $set on an account with an open hold: the others answer at once, done once it is voided", function()
    -- the hold (another manager's) holds 5 of W; the run sets W's flag
    local hm = assert(db:manager { application = "hm" })
    assert(hm:hold("accounts", "W", "H", 5, { id = "hw" }))
    local calls = { function(g)
      return pack(g:run({ { collection = "accounts", id = "W", update = { ["$set"] = { flag = 1 } },
        undo = { ["$unset"] = { flag = "" } } } },
        { id = "s" }))
    end }
    local answers, at = run_grouped(unrelated(calls), { function(S)
      S.signal():wait(BACKOFF * 1.5)
      assert(hm:void("hw"))
    end })
    check_times(answers, at, 1, 2 * BACKOFF)
    assert.are.equal("done", answers[1].T and answers[1].T.state, tostring(answers[1].err))
    assert.are.equal(2, retries.s)
    assert.are.equal(1, assert(accounts:find_one({ _id = "W" })).flag)
    assert.are.equal("cancelled", assert(txs:find_one({ _id = "hw" })).state)
    rollback_holder()
    local T = assert(txs:find_one({ _id = "s" }))
    assert.are.equal("done", T.state)
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)

  it("an item behind a busy one on its document goes after it: batch order holds", function()
    -- w1 pays X (held) from W, w2 pays V from W; W has 10 for one of
    -- them.  In batch order w1 ends busy (W given back), then w2 pays;
    -- had w2 gone first, w1 would end `guard`.
    local calls = {
      function(g) return pack(g:transfer("accounts", "W", "X", 10, { min = 0, id = "w1" })) end,
      function(g) return pack(g:transfer("accounts", "W", "V", 10, { min = 0, id = "w2" })) end,
    }
    local answers, at = run_grouped(unrelated(calls))
    assert.is_false(answers[1].T)
    assert.are.equal("busy", answers[1].err.code, tostring(answers[1].err))
    assert.are.equal("done", answers[2].T and answers[2].T.state, tostring(answers[2].err))
    assert.is_true(at[2] >= at[1], "w2 answered before w1, which it goes after")
    for k = 3, 2 + K do
      assert.is_true(at[k] < BACKOFF, ("u%d answered after %.3f s"):format(k - 2, at[k]))
    end
    rollback_holder()
    local want = { H = 1000, V = 10 * K + 10, X = 50, W = 0 }
    for i = 1, K do want["U" .. i] = 40 end
    assert.are.same(want, helpers.balances(accounts))
    assert.are.same({ "cancelled", "busy" }, { assert(txs:find_one({ _id = "w1" })).state,
      assert(txs:find_one({ _id = "w1" })).cause })
    assert.are.equal("done", assert(txs:find_one({ _id = "w2" })).state)
  end)

  it("a commit of a begun transaction on a held document: the others at once, busy after its retries", function()
    local function begin(id, from, to)
      return assert(payer:begin({
        { collection = "accounts", id = from, update = { ["$inc"] = { balance = -10 } },
          where = { balance = { ["$gte"] = 10 } } },
        { collection = "accounts", id = to, update = { ["$inc"] = { balance = 10 } } } }, { id = id }))
    end
    local begun = { begin("x", "X", "V") }
    for i = 1, K do begun[#begun + 1] = begin("u" .. i, "U" .. i, "V") end
    local calls = {}
    for k, t in ipairs(begun) do calls[k] = function(g) return pack(g:commit(t)) end end
    local answers, at = run_grouped(calls)
    check_times(answers, at, 1, WAIT)
    assert.are.equal("busy", answers[1].err and answers[1].err.code, tostring(answers[1].err))
    assert.are.equal(RETRIES, retries.x)
    check_db("x", false)
  end)

  it("a hold on a held account: the other holds open at once, it fails busy after its retries", function()
    local calls = { function(g) return pack(g:hold("accounts", "X", "V", 10, { min = 0, id = "x" })) end }
    for i = 1, K do
      calls[#calls + 1] = function(g) return pack(g:hold("accounts", "U" .. i, "V", 10, { min = 0, id = "u" .. i })) end
    end
    local answers, at = run_grouped(calls)
    for k = 2, 1 + K do
      assert.are.equal("held", answers[k].T and answers[k].T.hold.status, tostring(answers[k].err))
      assert.is_true(at[k] < BACKOFF, ("u%d answered after %.3f s"):format(k - 1, at[k]))
    end
    assert.is_true(at[1] >= WAIT, ("the busy hold answered after %.3f s"):format(at[1]))
    assert.are.equal("busy", answers[1].err and answers[1].err.code, tostring(answers[1].err))
    assert.are.equal(RETRIES, retries.x)
    assert.are.same({ "cancelled", "busy" }, { assert(txs:find_one({ _id = "x" })).state,
      assert(txs:find_one({ _id = "x" })).cause })
    for i = 1, K do assert(payer:void("u" .. i)) end
    rollback_holder()
    local want = { H = 1000, V = 0, X = 50, W = 10 }
    for i = 1, K do want["U" .. i] = 50 end
    assert.are.same(want, helpers.balances(accounts))
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
      for path, n in pairs(d.txPending or {}) do
        assert.are.equal(0, n, d._id .. " keeps an escrowed credit to " .. path)
      end
    end
  end)

  it("a hold whose holder ends between its retries opens, answered as the batch's other holds", function()
    local calls = { function(g) return pack(g:hold("accounts", "X", "V", 10, { min = 0, id = "x" })) end }
    for i = 1, K do
      calls[#calls + 1] = function(g) return pack(g:hold("accounts", "U" .. i, "V", 10, { min = 0, id = "u" .. i })) end
    end
    local answers, at = run_grouped(calls, { function(S)
      S.signal():wait(BACKOFF * 1.5)
      rollback_holder()
    end })
    for k = 2, 1 + K do
      assert.are.equal("held", answers[k].T and answers[k].T.hold.status, tostring(answers[k].err))
      assert.is_true(at[k] < BACKOFF, ("u%d answered after %.3f s"):format(k - 1, at[k]))
    end
    assert.is_true(at[1] >= 2 * BACKOFF, ("the busy hold answered after %.3f s"):format(at[1]))
    local T = answers[1].T
    assert.are.equal("held", T and T.hold.status, tostring(answers[1].err))
    assert.are.equal(2, retries.x)
    -- as the batch's other holds answer (a hold opened in a batch): the
    -- same fields, the same values but its own
    local other = answers[2].T
    local function fields(t)
      local out = {}
      for k in pairs(t) do out[#out + 1] = k end
      table.sort(out)
      return out
    end
    assert.are.same(fields(other), fields(T))
    assert.are.same(fields(other.hold), fields(T.hold))
    assert.are.same({ "pending", 10, "V", 10, 1, "X" }, { T.state, T.value, T.destination, T.hold.amount,
      T.epoch, T.source })
    for i, op in ipairs(other.ops) do assert.are.same(fields(op), fields(T.ops[i])) end
    assert.are.same(other.lastModified, T.lastModified, "the batch's stamp")
    -- captured, V gets X's 10; the others voided
    assert(payer:capture("x"))
    for i = 1, K do assert(payer:void("u" .. i)) end
    rollback_holder()
    local want = { H = 1000, V = 10, X = 40, W = 10 }
    for i = 1, K do want["U" .. i] = 50 end
    assert.are.same(want, helpers.balances(accounts))
    assert.are.equal("done", assert(txs:find_one({ _id = "x" })).state)
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)

  it("a later call on a busy call's document goes after it: a hold of the batch waits for the next", function()
    -- x pays V from X (busy); the hold of the same batch debits X too: its
    -- order with x shows (its guard reads X), so it waits for x to end,
    -- then meets the holder itself and waits its own retries
    local calls = {
      function(g) return pack(g:transfer("accounts", "X", "V", 10, { min = 0, id = "x" })) end,
      function(g) return pack(g:hold("accounts", "X", "V", 10, { min = 0, id = "y" })) end,
    }
    local answers, at = run_grouped(unrelated(calls))
    assert.are.equal("busy", answers[1].err and answers[1].err.code, tostring(answers[1].err))
    assert.are.equal("busy", answers[2].err and answers[2].err.code, tostring(answers[2].err))
    assert.is_true(at[2] >= at[1] + WAIT, ("the hold answered %.3f s after x: it went beside it"):format(
      at[2] - at[1]))
    for k = 3, 2 + K do
      assert.is_true(at[k] < BACKOFF, ("u%d answered after %.3f s"):format(k - 2, at[k]))
    end
    assert.are.equal(RETRIES, retries.x)
    assert.are.equal(RETRIES, retries.y)
    assert.are.same({ "cancelled", "busy" }, { assert(txs:find_one({ _id = "y" })).state,
      assert(txs:find_one({ _id = "y" })).cause })
    check_db("x", false)
  end)

  it("a commit driven alone (claimed already) on a held document: handed to its caller too", function()
    -- x is pending (claimed by step): not a begun transaction the batch
    -- claims, so the batch drives it alone, as tm:commit would
    local function begin(id, from)
      return assert(payer:begin({
        { collection = "accounts", id = from, update = { ["$inc"] = { balance = -10 } },
          where = { balance = { ["$gte"] = 10 } } },
        { collection = "accounts", id = "V", update = { ["$inc"] = { balance = 10 } } } }, { id = id }))
    end
    local x = begin("x", "X")
    assert(payer:step("claim", x))
    local begun = { x }
    for i = 1, K do begun[#begun + 1] = begin("u" .. i, "U" .. i) end
    local calls = {}
    for k, t in ipairs(begun) do calls[k] = function(g) return pack(g:commit(t)) end end
    local answers, at = run_grouped(calls, { function(S)
      S.signal():wait(BACKOFF * 1.5)
      rollback_holder()
    end })
    check_times(answers, at, 1, 2 * BACKOFF)
    assert.are.equal("done", answers[1].T and answers[1].T.state, tostring(answers[1].err))
    assert.are.equal(2, retries.x)
    assert.are.equal(0, slept, "the batch slept (policy.sleep) for the busy call")
    check_db("x", true)
  end)

  it("tm:later('commit') answers a busy commit at once; its caller goes on as tm:commit alone", function()
    local function begin(id)
      return assert(payer:begin({
        { collection = "accounts", id = "X", update = { ["$inc"] = { balance = -10 } },
          where = { balance = { ["$gte"] = 10 } } },
        { collection = "accounts", id = "V", update = { ["$inc"] = { balance = 10 } } } }, { id = id }))
    end
    local x = begin("x")
    local start = core.monotonic_ms()
    local list, T, err = payer:later("commit", x)
    assert.is_true((core.monotonic_ms() - start) / 1000 < BACKOFF, "tm:later waited for the retry")
    assert.is_nil(T)
    assert.is_nil(err)
    assert.is_true(list[1] and list[1].busy ~= nil, "no busy listed")
    assert.are.equal(0, slept)
    -- the handler's part: sleep, go on, until it ends
    local r = { busy = list[1].busy }
    while r.busy do
      core.sleep(r.busy.wait)
      local _
      _, r = payer:later("busy", r.busy)
    end
    local alone = pack(payer:commit(begin("x2")))
    assert.are.equal(RETRIES, retries.x)
    assert.are.equal(RETRIES, retries.x2)
    local got, want = shape({ T = r[1] or false, err = r[2] }), shape(alone)
    want.message = want.message:gsub("x2", "x")
    assert.are.same(want, got)
    assert.are.equal("busy", got.code)
    rollback_holder()
    assert.are.same({ "cancelled", "busy" }, { assert(txs:find_one({ _id = "x" })).state,
      assert(txs:find_one({ _id = "x" })).cause })
    local want_b = { H = 1000, V = 0, X = 50, W = 10 }
    for i = 1, K do want_b["U" .. i] = 50 end
    assert.are.same(want_b, helpers.balances(accounts))
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)

  it("tm:later('transfer_many') answers its busy items at once; its caller goes on with them side by side", function()
    -- a second holder's transaction on Y; x pays V from X, y from Y (side
    -- by side: one wait); w1 pays X from W (after x, on X), w2 V from W
    -- (after w1, on W); u<i> unrelated
    assert(accounts:insert_one({ _id = "Y", balance = 50 }))
    helpers.hold_open(holder, "Y", "h2")
    local list = {
      { collection = "accounts", from = "X", to = "V", amount = 10, min = 0, id = "x" },
      { collection = "accounts", from = "Y", to = "V", amount = 10, min = 0, id = "y" },
      { collection = "accounts", from = "W", to = "X", amount = 10, min = 0, id = "w1" },
      { collection = "accounts", from = "W", to = "V", amount = 10, min = 0, id = "w2" },
    }
    for i = 1, K do
      list[#list + 1] = { collection = "accounts", from = "U" .. i, to = "V", amount = 10, min = 0, id = "u" .. i }
    end
    local start = core.monotonic_ms()
    local held, results, errs = payer:later("transfer_many", list)
    assert.is_true((core.monotonic_ms() - start) / 1000 < BACKOFF, "tm:later waited for a retry")
    assert.are.equal(0, slept)
    for k = 5, 4 + K do assert.are.equal("done", results[k] and results[k].state, tostring(errs[k])) end
    for k = 1, 4 do assert.is_false(results[k]) end
    -- the handler's part (mongotx.resty.held's)
    local busy = require "mongotx.group.busy"
    local ended = {}
    local more = busy.settle_items(held, results, errs, core.sleep, function() return core.monotonic_ms() / 1000 end,
      function(info)
        local _, r = payer:later("busy", info)
        if not r.busy then ended[#ended + 1] = { info.i, (core.monotonic_ms() - start) / 1000 } end
        return r
      end, function(r) return r[1], r[2] end)
    assert.are.same({}, more)
    local order = {}
    for k, e in ipairs(ended) do order[k] = e[1] end
    assert.are.same({ 1, 2, 3, 4 }, order, "the order they ended in")
    -- x and y side by side (one wait), then w1 its own, then w2 at once
    assert.is_true(math.abs(ended[1][2] - ended[2][2]) < BACKOFF, "x and y did not wait side by side")
    assert.is_true(ended[3][2] >= 2 * WAIT and ended[3][2] < 3 * WAIT,
      ("w1 ended after %.2f s, not after x's wait and its own"):format(ended[3][2]))
    assert.is_true(ended[4][2] - ended[3][2] < BACKOFF, "w2 waited after w1")
    for k = 1, 3 do assert.are.equal("busy", errs[k] and errs[k].code, tostring(errs[k])) end
    assert.are.equal("done", results[4] and results[4].state, tostring(errs[4]))
    assert.are.same({ RETRIES, RETRIES, RETRIES }, { retries.x, retries.y, retries.w1 })
    assert.is_nil(retries.w2)
    rollback_holder()
    assert(holder:rollback(assert(holder:get("h2"))))
    local want = { H = 1000, V = 10 * K + 10, X = 50, Y = 50, W = 0 }
    for i = 1, K do want["U" .. i] = 40 end
    assert.are.same(want, helpers.balances(accounts))
    for id, state in pairs { x = "cancelled", y = "cancelled", w1 = "cancelled", w2 = "done" } do
      assert.are.equal(state, assert(txs:find_one({ _id = id })).state, id)
    end
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)
end)

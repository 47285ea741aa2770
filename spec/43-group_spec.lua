-- mongotx.group under a plain-Lua coroutine scheduler (what a mongotx.pool
-- user with its own scheduler would plug in): concurrent callers of
-- tm:transfer and tm:run run as batches, and each gets what the same call
-- alone gets, checked against the same calls run alone, one at a time in
-- the order the batches ran them, on a copy of the database.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"

local core = helpers.core
local unpack = table.unpack or unpack -- luacheck: ignore 143

local scheduler = require "spec.support.scheduler"

describe("#server mongotx.group with a coroutine scheduler", function()
  local function bank(balances)
    local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    local docs = {}
    for id, b in pairs(balances) do docs[#docs + 1] = { _id = id, balance = b } end
    table.sort(docs, function(x, y) return x._id < y._id end)
    assert(db:collection("accounts"):insert_many(docs))
    return db
  end

  local BALANCES = { A = 100, B = 50, C = 0, D = 300, E = 10 }

  -- The calls of the mix: { method, args... }.
  local function mix()
    local calls = {}
    local ids = { "A", "B", "C", "D", "E" }
    math.randomseed(7)
    for i = 1, 60 do
      local from, to = ids[math.random(5)], ids[math.random(5)]
      if to == from then to = ids[(math.random(4) + (from:byte() - 64) - 1) % 5 + 1] end
      local k = math.random(10)
      if k <= 5 then
        calls[i] = { "transfer", "accounts", from, to, math.random(1, 80), { min = 0 } }
      elseif k == 6 then
        calls[i] = { "transfer", "accounts", from, to, -3, { min = 0 } }      -- invalid
      elseif k == 7 then
        calls[i] = { "transfer", "accounts", from, to, 5, { min = 0, id = "key-" .. math.random(3) } }
      elseif k == 8 then
        calls[i] = { "run", {
          { collection = "accounts", id = from, update = { ["$inc"] = { balance = -7 } },
            where = { balance = { ["$gte"] = 7 } } },
          { collection = "accounts", id = to, update = { ["$inc"] = { balance = 7 } } },
        }, { meta = { n = i } } }
      elseif k == 9 then
        calls[i] = { "transfer", "accounts", from, to, 5, { bogus = true } }  -- raises
      else
        calls[i] = { "transfer", "accounts", from, "nobody", 5 }              -- missing
      end
    end
    return calls
  end

  -- What a call returns (or raises), without what differs between two
  -- runs (generated ids, times, instances) nor the raise's position.
  local function outcome(ok, ...)
    if not ok then return { raised = (tostring((...)):gsub("^[^\n]-:%d+: ", "")) } end
    local T, err = ...
    local out = { n = select("#", ...) }
    if T then
      out.state, out.source, out.destination, out.value = T.state, T.source, T.destination, T.value
      if type(T._id) == "string" then out.id = T._id end
    end
    if err then out.code, out.message = err.code, err.message end
    return out
  end

  -- Runs calls[i] = { method, <arguments> } of group g, each in a task
  -- of scheduler S, until all have answered; returns got[i] =
  -- as_outcome(pcall(...)) of each.  Each call's item carries its index
  -- (`item.index`, for the order the batches took): set just before the
  -- call, which reaches the group without yielding.
  local function run_indexed(S, g, calls, as_outcome)
    local got, current, call = {}, nil, g.group.call
    g.group.call = function(self, item, keys)
      item.index = current
      return call(self, item, keys)
    end
    for i, c in ipairs(calls) do
      S.spawn(function()
        current = i
        got[i] = as_outcome(pcall(g[c[1]], g, unpack(c, 2)))
      end)
    end
    S.loop()
    return got
  end

  it("gives each caller what its call alone gives, batch after batch", function()
    local events = {}
    local db = bank(BALANCES)
    local tm = assert(db:manager{ application = "grouped",
      on_event = function(name, info) if name == "group" then events[#events + 1] = info end end })
    local S = scheduler()
    local g = group.wrap(tm, { max = 16, delay = 0.005, signal = S.signal, spawn = S.spawn, now = S.now })
    -- the order the batches answered the calls in
    local order, run = {}, g.group.run
    g.group.run = function(items, info)
      local out, took = run(items, info)
      for _, i in ipairs(took) do order[#order + 1] = items[i].index end
      return out, took
    end
    local calls = mix()
    local got = run_indexed(S, g, calls, outcome)
    assert.are.equal(#calls, #order)
    -- batches held several calls, and one event each says how many
    local calls_in_events, biggest = 0, 0
    for _, e in ipairs(events) do
      calls_in_events, biggest = calls_in_events + e.size, math.max(biggest, e.size)
      assert.are.equal("grouped", e.application)
      assert(e.wait >= 0 and e.wait < 1)
    end
    assert.are.equal(#calls, calls_in_events)
    assert(biggest > 1 and #events < #calls, #events .. " batches")
    -- the same calls alone, in that order, on a copy
    local db2 = bank(BALANCES)
    local tm2 = assert(db2:manager{ application = "alone" })
    for _, i in ipairs(order) do
      local c = calls[i]
      local alone = outcome(pcall(tm2[c[1]], tm2, unpack(c, 2)))
      assert.are.same(alone, got[i], "call " .. i)
    end
    assert.are.same(helpers.balances(db2:collection("accounts")),
                    helpers.balances(db:collection("accounts")))
    -- a raise is reported where the caller called
    local S2 = scheduler()
    local g2 = group.wrap(tm, { signal = S2.signal, spawn = S2.spawn, now = S2.now })
    local raised
    S2.spawn(function()
      local _, err = pcall(function()
        local t = g2:transfer("accounts", "A", "B", 1, { bogus = true })
        return t
      end)
      raised = err
    end)
    S2.loop()
    assert.matches("^spec/43%-group_spec%.lua:%d+: unknown option bogus for transfer", raised)
  end)

  -- Runs `calls` ({ method, args... }) at once through a group of tm;
  -- returns what each got, the batches' sizes, and the tickets.
  local function together(tm, calls, events)
    local S = scheduler()
    local g = group.wrap(tm, { max = 16, delay = 0.01, signal = S.signal, spawn = S.spawn,
                               now = S.now })
    local got, tickets = {}, {}
    for i, c in ipairs(calls) do
      S.spawn(function()
        local r, t = g.group:call({ method = c[1], n = #c - 1, unpack(c, 2) })
        got[i], tickets[i] = r, t
      end)
    end
    local before = #events
    S.loop()
    local sizes = {}
    for k = before + 1, #events do sizes[#sizes + 1] = events[k].size end
    return got, sizes, tickets
  end

  it("puts off a guard on an account an earlier call credits, and a repeated id; " ..
     "a guard tried again after the others comes after them", function()
    local events = {}
    local db = bank({ X = 10, Y = 0, Z = 100, W = 0 })
    local tm = assert(db:manager{ application = "rules",
      on_event = function(name, info) if name == "group" then events[#events + 1] = info end end })
    -- Z credits X, then X pays 30: alone in that order it passes, so it
    -- waits for the next batch (in the same batch its guard would read X
    -- before the credit)
    local got, sizes = together(tm, {
      { "transfer", "accounts", "Z", "X", 50, { min = 0 } },
      { "transfer", "accounts", "X", "Y", 30, { min = 0 } },
    }, events)
    assert.are.same({ 1, 1 }, sizes)
    assert.are.equal("done", got[1][1].state)
    assert.are.equal("done", got[2][1].state)
    -- one id twice: the second waits, and gets the same transaction
    got, sizes = together(tm, {
      { "transfer", "accounts", "Z", "W", 1, { min = 0, id = "twice" } },
      { "transfer", "accounts", "Z", "W", 1, { min = 0, id = "twice" } },
    }, events)
    assert.are.same({ 1, 1 }, sizes)
    assert.are.equal("twice", got[1][1]._id)
    assert.are.equal("twice", got[2][1]._id)
    -- a begun transaction committed twice: the second waits, and gets it
    -- done as a commit of a done one does
    assert(tm:begin({ { collection = "accounts", id = "Z", update = { ["$inc"] = { balance = -1 } } },
                      { collection = "accounts", id = "W", update = { ["$inc"] = { balance = 1 } } } },
                    { id = "begun" }))
    got, sizes = together(tm, { { "commit", { _id = "begun" } }, { "commit", { _id = "begun" } } }, events)
    assert.are.same({ 1, 1 }, sizes)
    assert.are.same({ "done", "done", 1, 1 }, { got[1][1].state, got[2][1].state, got[1][1].epoch,
                                                 got[2][1].epoch })
    -- a commit of the id a transfer before it in the batch creates waits
    -- for the next batch, and finds it done
    got, sizes = together(tm, { { "transfer", "accounts", "Z", "W", 1, { min = 0, id = "made" } },
                                { "commit", { _id = "made" } } }, events)
    assert.are.same({ 1, 1 }, sizes)
    assert.are.same({ "made", "done", "made", "done" }, { got[1][1]._id, got[1][1].state, got[2][1]._id,
                                                         got[2][1].state })
    -- X (now 30) pays 40 first, then Z credits X: in one batch the guard
    -- fails, is tried again after the credit, and passes: its call took
    -- effect second
    local tickets
    got, sizes, tickets = together(tm, {
      { "transfer", "accounts", "X", "W", 40, { min = 0 } },
      { "transfer", "accounts", "Z", "X", 20, { min = 0 } },
    }, events)
    assert.are.same({ 2 }, sizes)
    assert.are.equal("done", got[1][1].state)
    assert.are.same({ 2, 1 }, { tickets[1].position, tickets[2].position })
    assert.are.same({ X = 10, Y = 30, Z = 27, W = 43 }, (helpers.balances(db:collection("accounts"))))
  end)

  it("runs a call alone in its caller when no driver can start, and fails a batch whose runner raises", function()
    local db = bank(BALANCES)
    local tm = assert(db:manager{ application = "solo" })
    local S = scheduler()
    local g = group.wrap(tm, { signal = S.signal, now = S.now,
                               spawn = function() return nil, "no tasks left" end })
    local T, err
    S.spawn(function() T, err = g:transfer("accounts", "D", "C", 10) end)
    S.loop()
    assert.is_nil(err)
    assert.are.equal("done", T.state)
    assert.are.same({ A = 100, B = 50, C = 10, D = 290, E = 10 }, (helpers.balances(db:collection("accounts"))))
    -- a runner that raises: every caller of its batch raises, the next
    -- batch runs
    local runs = 0
    local g2 = group.new { signal = S.signal, spawn = S.spawn, now = S.now, delay = 0.01,
      run = function(items)
        runs = runs + 1
        if runs == 1 then error("broken runner") end
        local out = {}
        for i, item in ipairs(items) do out[i] = item * 2 end
        return out
      end }
    local res = {}
    for i = 1, 3 do
      S.spawn(function() res[i] = { pcall(g2.call, g2, i) } end)
    end
    S.loop()
    for i = 1, 3 do
      assert.are.same({ false, "broken runner" }, { res[i][1], (tostring(res[i][2]):gsub("^.-:%d+: ", "")) })
    end
    local r2
    S.spawn(function() r2 = g2:call(21) end)
    S.loop()
    assert.are.equal(42, r2)
  end)

  -- Begins the same transactions in db (ids b-<i>): list[i] = ops.
  local function begin_all(tm, list)
    for i, ops in ipairs(list) do assert(tm:begin(ops, { id = "b-" .. i })) end
  end

  local function move(from, to, amount, floor)
    return {
      { collection = "accounts", id = from, update = { ["$inc"] = { balance = -amount } },
        where = floor and { balance = { ["$gte"] = floor + amount } } or nil },
      { collection = "accounts", id = to, update = { ["$inc"] = { balance = amount } } },
    }
  end

  -- What a commit answers, for the comparison: outcome's, and the
  -- transaction's epoch, attempts and reason.
  local function commit_outcome(ok, ...)
    local out = outcome(ok, ...)
    local T = ok and (...)
    if T then out.epoch, out.attempts, out.reason = T.epoch, T.attempts, T.reason end
    return out
  end

  -- The begun transactions of the commit mix: good ones, guards that
  -- fail, a missing account, one over the same accounts as another.
  local BEGUN = {
    move("A", "B", 30, 0), move("D", "E", 500, 0), move("B", "C", 10, 0),
    move("E", "nobody", 5), move("D", "A", 40, 0), move("C", "D", 1000, 0),
    move("A", "B", 20, 0), move("E", "C", 3), move("B", "A", 5, 0), move("D", "C", 60, 0),
  }

  for _, inflight in ipairs { 1, 2 } do
  it("drives the queue from a caller when the task its driver was spawned in never runs (inflight " ..
     inflight .. ")", function()
    -- nginx drops a timer it accepted when lua_max_running_timers are
    -- running: spawn says yes and the driver never begins
    local db = bank(BALANCES)
    local events = {}
    local tm = assert(db:manager{ application = "dropped",
      on_event = function(name, info) if name == "group" then events[#events + 1] = info end end })
    local S = scheduler()
    local dropped = 0
    local g = group.wrap(tm, { signal = S.signal, now = S.now, delay = 0, inflight = inflight,
      spawn = function(fn)
        dropped = dropped + 1
        if dropped == 1 then return true end -- the first one only
        return S.spawn(fn)
      end })
    local got, started = {}, S.now()
    for i, to in ipairs { "A", "B", "C", "E" } do
      S.spawn(function() got[i] = { g:transfer("accounts", "D", to, 10, { min = 0 }) } end)
    end
    S.loop()
    local took = S.now() - started
    assert.are.equal(1, dropped)
    for i = 1, 4 do assert.are.equal("done", got[i][1].state, tostring(got[i][2])) end
    assert(took >= group.START and took < group.START + 5, "answered after " .. took .. " s")
    assert.are.same({ 4 }, { events[1].size }) -- the first caller to give up drove them all
    assert.are.same({ A = 110, B = 60, C = 10, D = 260, E = 20 }, (helpers.balances(db:collection("accounts"))))
    -- and the group goes on: the next call's driver runs as usual
    local T
    started = S.now()
    S.spawn(function() T = g:transfer("accounts", "A", "B", 1) end)
    S.loop()
    assert.are.equal("done", T.state)
    assert.are.equal(2, dropped)
    assert(S.now() - started < group.START, "the second batch waited for a take-over")
  end)
  end

  it("commits begun transactions among transfers and runs, each answered as tm:commit alone", function()
    local events = {}
    local db = bank(BALANCES)
    local tm = assert(db:manager{ application = "grouped",
      on_event = function(name, info) if name == "group" then events[#events + 1] = info end end })
    begin_all(tm, BEGUN)
    assert(tm:commit({ _id = "b-10" })) -- already done: answered as commit answers it again
    local db2 = bank(BALANCES)
    local tm2 = assert(db2:manager{ application = "alone" })
    begin_all(tm2, BEGUN)
    assert(tm2:commit({ _id = "b-10" }))
    local calls = mix()
    -- commits between the mix's calls: every begun one, b-3 twice, an
    -- id that is none, one that may not go into a query, and no table
    local commits = {}
    for i = 1, #BEGUN do commits[#commits + 1] = { "commit", { _id = "b-" .. i } } end
    commits[#commits + 1] = { "commit", { _id = "b-3" } }
    commits[#commits + 1] = { "commit", { _id = "nope" } }
    commits[#commits + 1] = { "commit", { _id = { ["$gt"] = "" } } }
    commits[#commits + 1] = { "commit", "b-1" }
    for k, c in ipairs(commits) do table.insert(calls, 3 * k, c) end
    local S = scheduler()
    local g = group.wrap(tm, { max = 16, delay = 0.005, signal = S.signal, spawn = S.spawn, now = S.now })
    local order, run, mixed = {}, g.group.run, 0
    g.group.run = function(items, info)
      local out, took = run(items, info)
      for _, i in ipairs(took) do order[#order + 1] = items[i].index end
      local kinds = {}
      for _, item in ipairs(items) do kinds[item.method == "commit"] = true end
      if kinds[true] and kinds[false] then mixed = mixed + 1 end
      return out, took
    end
    local got = run_indexed(S, g, calls, commit_outcome)
    assert.are.equal(#calls, #order)
    -- batches held commits and other calls together
    assert(mixed > 1 and #events < #calls, #events .. " batches, " .. mixed .. " mixed")
    local codes = {}
    for _, i in ipairs(order) do
      local c = calls[i]
      local alone = commit_outcome(pcall(tm2[c[1]], tm2, unpack(c, 2)))
      assert.are.same(alone, got[i], "call " .. i .. " (" .. c[1] .. ")")
      if c[1] == "commit" then codes[alone.code or alone.raised and "raise" or alone.state] = true end
    end
    -- every kind of commit answer was met
    for _, k in ipairs { "done", "guard", "missing", "state", "invalid", "raise" } do
      assert(codes[k], "no commit answered " .. k)
    end
    assert.are.same(helpers.balances(db2:collection("accounts")),
                    helpers.balances(db:collection("accounts")))
    local txs = assert(db:collection("transactions"):find_all({ _id = { ["$regex"] = "^b-" } }))
    assert.are.equal(#BEGUN, #txs)
    for _, T in ipairs(txs) do
      assert(T.state == "done" or T.state == "cancelled", T._id .. " " .. T.state)
    end
  end)

  it("commits a batch of begun transactions in as many round trips for 24 (12 on FerretDB v1) as for 4",
     function()
    local deadlines
    local function round_trips(n)
      local balances = {}
      for i = 1, 2 * n do balances["acct" .. i] = 100 end
      local db = bank(balances)
      local tm = assert(db:manager{ application = "trips" })
      local list = {}
      for i = 1, n do list[i] = move("acct" .. (2 * i - 1), "acct" .. (2 * i), 10, 0) end
      begin_all(tm, list)
      -- a first batch reads what a manager reads once (the server's
      -- clock, whether it fences by deadline)
      assert(tm:transfer("accounts", "acct1", "acct2", 1, { min = 0 }))
      local S = scheduler()
      local g = group.wrap(tm, { max = 100, delay = 0.05, signal = S.signal, spawn = S.spawn,
                                 now = S.now })
      local got = {}
      db.client:reset_counters()
      for i = 1, n do S.spawn(function() got[i] = { g:commit({ _id = "b-" .. i }) } end) end
      S.loop()
      local c = db.client:counters()
      deadlines = tm.engine:deadlines()
      for i = 1, n do assert.are.equal("done", got[i][1].state, tostring(got[i][2])) end
      local b, sum = helpers.balances(db:collection("accounts"))
      assert.are.equal(200 * n, sum)
      assert.are.same({ 89, 111 }, { b.acct1, b.acct2 })
      assert.are.same({ 90, 110 }, { b["acct" .. (2 * n - 1)], b["acct" .. (2 * n)] })
      return c.commands
    end
    -- FerretDB v1 (no deadlines there) takes at most 25 statements a
    -- command (mongotx.engine.commands): 12 transfers' 24 ops fit in one
    local small = round_trips(4)
    local large = round_trips(deadlines and 24 or 12)
    assert.are.equal(small, large)
    -- load, claim, 2 applies (the guarded debits first), commit, finish,
    -- done; and the versions, where the server cannot fence by deadline
    assert(large <= (deadlines and 7 or 8), large .. " round trips")
  end)

  it("fails only the caller whose policy raised while its entry settled", function()
    local db = bank({ X = 10, Y = 0, Z = 100 })
    local function opts(app)
      return { application = app, lease = 1,
               on_op_failure = function(T, _, reason)
                 if T._id == "boom" or T._id == "b-2" then error("policy bug for " .. T._id) end
                 if reason == "busy" then return "retry" end
                 return "cancel"
               end }
    end
    local tm = assert(db:manager(opts("raises")))
    local begun = { move("Z", "Y", 5, 0), move("X", "Y", 50, 0) }
    begin_all(tm, begun)
    -- four calls in one batch: two guards that fail (one raises), a good
    -- transfer and two commits (the second's guard fails, and raises)
    local calls = {
      { "transfer", "accounts", "X", "Y", 40, { min = 0, id = "boom" } },
      { "transfer", "accounts", "X", "Y", 30, { min = 0, id = "quiet" } },
      { "transfer", "accounts", "Z", "Y", 20, { min = 0, id = "good" } },
      { "commit", { _id = "b-1" } },
      { "commit", { _id = "b-2" } },
    }
    local S = scheduler()
    local g = group.wrap(tm, { max = 16, delay = 0.01, signal = S.signal, spawn = S.spawn, now = S.now })
    local got, sizes = {}, {}
    local run = g.group.run
    g.group.run = function(items, info)
      sizes[#sizes + 1] = #items
      return run(items, info)
    end
    for i, c in ipairs(calls) do
      S.spawn(function()
        got[i] = (function(...) return { n = select("#", ...), ... } end)(pcall(g[c[1]], g, unpack(c, 2)))
      end)
    end
    S.loop()
    assert.are.same({ 5 }, sizes)
    for _, i in ipairs { 1, 5 } do
      local ok, err = got[i][1], got[i][2]
      assert.is_false(ok)
      assert.are.equal("policy", err.code)
      assert.are.equal("on_op_failure", err.policy)
      assert.matches("policy on_op_failure raised: .*policy bug for " .. (i == 1 and "boom" or "b%-2"),
        err.message)
    end
    assert.are.equal("guard", got[2][3].code)
    assert.are.equal("done", got[3][2].state)
    assert.are.equal("done", got[4][2].state)
    -- each call alone answers the same, on a copy
    local db2 = bank({ X = 10, Y = 0, Z = 100 })
    local tm2 = assert(db2:manager(opts("alone")))
    begin_all(tm2, begun)
    for i, c in ipairs(calls) do
      assert.are.same(commit_outcome(pcall(tm2[c[1]], tm2, unpack(c, 2))),
        commit_outcome(unpack(got[i], 1, got[i].n)), "call " .. i)
    end
    -- what the database holds: the good ones moved, the raised ones wait
    -- pending for recovery, which settles them
    local states = {}
    for _, T in ipairs(assert(db:collection("transactions"):find_all({}))) do states[T._id] = T.state end
    assert.are.same({ boom = "pending", quiet = "cancelled", good = "done", ["b-1"] = "done",
                      ["b-2"] = "pending" }, states)
    core.sleep(1.1)
    local rec = assert(db:manager{ application = "rec", stale_after = 0 })
    local report = assert(rec:recover())
    assert.are.equal(2, report.cancelled, tostring(report.errors[1] and report.errors[1].error))
    assert.are.same({ X = 10, Y = 25, Z = 75 }, (helpers.balances(db:collection("accounts"))))
  end)

  it("fails only the commits when a policy raises in a step all the batch's commits share", function()
    -- a transient error in the commits' claim makes the engine retry, and
    -- the caller's backoff raises there: each commit alone raises it, the
    -- transfers that ran first in the batch keep their transactions
    local db = bank({ X = 100, Y = 0, Z = 100 })
    local tm = assert(db:manager{ application = "backoff", retries = 1,
      backoff = function() error("backoff bug") end })
    begin_all(tm, { move("X", "Y", 5, 0), move("Z", "Y", 7, 0) })
    local real = tm.engine.steps
    local failed = 0
    local function transient()
      failed = failed + 1
      return nil, core.error({ code = "stream", transient = true, message = "injected" })
    end
    tm.engine.steps = setmetatable({ claim_many = transient, claim = transient }, { __index = function(_, k)
        local v = real[k]
        if type(v) ~= "function" then return v end
        return function(_, ...) return v(real, ...) end
      end })
    local calls = {
      { "transfer", "accounts", "X", "Z", 10, { min = 0, id = "t-1" } },
      { "commit", { _id = "b-1" } },
      { "transfer", "accounts", "Z", "X", 20, { min = 0, id = "t-2" } },
      { "commit", { _id = "b-2" } },
    }
    local S = scheduler()
    local g = group.wrap(tm, { max = 16, delay = 0.01, signal = S.signal, spawn = S.spawn, now = S.now })
    local got = {}
    for i, c in ipairs(calls) do
      S.spawn(function() got[i] = { pcall(g[c[1]], g, unpack(c, 2)) } end)
    end
    S.loop()
    assert.are.equal(1, failed)
    for _, i in ipairs { 1, 3 } do
      assert.is_true(got[i][1])
      assert.are.equal("done", got[i][2].state, tostring(got[i][3]))
    end
    for _, i in ipairs { 2, 4 } do
      assert.is_false(got[i][1])
      assert.are.equal("policy", got[i][2].code)
      assert.are.equal("backoff", got[i][2].policy)
    end
    -- a commit alone raises the same
    local ok, err = pcall(tm.commit, tm, { _id = "b-1" })
    assert.is_false(ok)
    assert.are.equal("backoff", err.policy)
    assert.are.equal(2, failed)
    -- the transfers moved, the begun ones wait, unclaimed, for a commit
    local states = {}
    for _, T in ipairs(assert(db:collection("transactions"):find_all({}))) do states[T._id] = T.state end
    assert.are.same({ ["t-1"] = "done", ["t-2"] = "done", ["b-1"] = "initial", ["b-2"] = "initial" }, states)
    assert.are.same({ X = 110, Y = 0, Z = 90 }, (helpers.balances(db:collection("accounts"))))
    tm.engine.steps = real
    local g2 = group.wrap(tm, { signal = S.signal, spawn = S.spawn, now = S.now })
    for i = 1, 2 do S.spawn(function() got[i] = { g2:commit({ _id = "b-" .. i }) } end) end
    S.loop()
    assert.are.equal("done", got[1][1].state)
    assert.are.equal("done", got[2][1].state)
    assert.are.same({ X = 105, Y = 12, Z = 83 }, (helpers.balances(db:collection("accounts"))))
  end)

  it("gives transfer_many's item whose policy raised that raise as its error, the others settled", function()
    local db = bank({ X = 10, Y = 0, Z = 100 })
    local tm = assert(db:manager{ application = "many", lease = 1,
      on_op_failure = function(T) if T._id == "boom" then error("policy bug") end return "cancel" end })
    local results, errs = tm:transfer_many {
      { collection = "accounts", from = "X", to = "Y", amount = 40, min = 0, id = "boom" },
      { collection = "accounts", from = "Z", to = "Y", amount = 20, min = 0 },
      { collection = "accounts", from = "X", to = "Z", amount = 30, min = 0 },
    }
    assert.is_false(results[1])
    assert.are.same({ "policy", "on_op_failure", "boom" }, { errs[1].code, errs[1].policy, errs[1].id })
    assert.are.equal("done", results[2].state)
    assert.are.equal("guard", errs[3].code)
    assert.are.same({ X = 10, Y = 20, Z = 80 }, (helpers.balances(db:collection("accounts"))))
    -- tm:transfer alone raises it
    local ok, err = pcall(tm.transfer, tm, "accounts", "X", "Y", 40, { min = 0, id = "boom" })
    assert.is_false(ok)
    assert.are.equal("policy", err.code)
    -- a raise that is not a policy's (an interrupt) goes up from the batch
    local tm2 = assert(db:manager{ application = "interrupted",
      on_op_failure = function() error("interrupted!") end })
    ok, err = pcall(tm2.transfer_many, tm2, {
      { collection = "accounts", from = "X", to = "Y", amount = 40, min = 0 },
      { collection = "accounts", from = "Z", to = "Y", amount = 1, min = 0 },
    })
    assert.is_false(ok)
    assert.matches("interrupted!$", tostring(err))
  end)

  it("groups the calls of a mongotx.pool manager, commits among them", function()
    local db = bank({ P = 100, Q = 0, R = 50 })
    local tm0 = assert(db:manager{ application = "pooled" })
    begin_all(tm0, { move("P", "Q", 10, 0), move("R", "Q", 60, 0) })
    local pdb = assert(require("mongotx.pool").connect(helpers.uri(), { database = db.name }))
    local tm = assert(pdb:manager{ application = "pooled" })
    local S = scheduler()
    local g = group.wrap(tm, { max = 16, delay = 0.01, signal = S.signal, spawn = S.spawn, now = S.now })
    local got, sizes, run = {}, {}, g.group.run
    g.group.run = function(items, info)
      sizes[#sizes + 1] = #items
      return run(items, info)
    end
    local calls = {
      { "commit", { _id = "b-1" } }, { "transfer", "accounts", "R", "Q", 5, { min = 0 } },
      { "commit", { _id = "b-2" } }, { "commit", { _id = "none" } },
    }
    for i, c in ipairs(calls) do
      S.spawn(function() got[i] = { g[c[1]](g, unpack(c, 2)) } end)
    end
    S.loop()
    assert.are.same({ 4 }, sizes)
    assert.are.equal("done", got[1][1].state)
    assert.are.equal("done", got[2][1].state)
    assert.are.same({ "guard", "state" }, { got[3][2].code, got[4][2].code })
    assert.are.same({ P = 90, Q = 15, R = 45 }, (helpers.balances(db:collection("accounts"))))
    local states = {}
    for _, T in ipairs(assert(db:collection("transactions"):find_all({}))) do states[T._id] = T.state end
    assert.are.same({ "done", "cancelled" }, { states["b-1"], states["b-2"] })
  end)

  it("checks its options", function()
    local S = scheduler()
    local base = { run = function() end, signal = S.signal, spawn = S.spawn, now = S.now }
    for k, v in pairs({ max = 0, delay = -1, inflight = 0 }) do
      local o = {}
      for x, y in pairs(base) do o[x] = y end
      o[k] = v
      assert.has_error(function() group.new(o) end)
    end
    assert.has_error(function() group.new({ run = base.run }) end,
      "option signal of group.new must be a function")
    assert.has_error(function() group.new(setmetatable({ inflight = 1.5 }, { __index = base })) end,
      "option inflight of group must be a whole number >= 1")
  end)

  -- A group of tm whose runner yields to S for `hop` seconds before it
  -- runs (the thread hop of mongotx.resty), so batches overlap.  While
  -- they run it checks that no two share a key and that a call without
  -- keys (a commit) runs alone; returns the group and its record
  -- ({ most = <batches at once>, order = <call indices as they took
  -- effect>, bad = <what broke those rules> }).
  local function overlapping(S, tm, o, hop)
    o.signal, o.spawn, o.now = S.signal, S.spawn, S.now
    local g = group.wrap(tm, o)
    local rec, running, run = { most = 0, order = {}, bad = {} }, {}, g.group.run
    g.group.run = function(items, info)
      local mine = { keys = {} }
      for _, item in ipairs(items) do
        local keys = group.keys(item.method, unpack(item, 1, item.n))
        if not keys then mine.alone = true end
        for _, k in ipairs(keys or {}) do mine.keys[k] = true end
      end
      -- (recorded: a raise here would only fail the batch's calls)
      for other in pairs(running) do
        if mine.alone or other.alone then rec.bad[#rec.bad + 1] = "a batch with a commit ran beside another" end
        for k in pairs(mine.keys) do
          if other.keys[k] then rec.bad[#rec.bad + 1] = "two batches at once hold " .. k end
        end
      end
      running[mine] = true
      local n = 0
      for _ in pairs(running) do n = n + 1 end
      rec.most = math.max(rec.most, n)
      S.signal():wait(hop)
      local out, took = run(items, info)
      running[mine] = nil
      for _, i in ipairs(took) do rec.order[#rec.order + 1] = items[i].index end
      return out, took
    end
    return g, rec
  end

  it("runs up to `inflight` batches at once, never two that share a document, an id or a commit", function()
    local db = bank(BALANCES)
    local tm = assert(db:manager{ application = "inflight" })
    begin_all(tm, BEGUN)
    local db2 = bank(BALANCES)
    local tm2 = assert(db2:manager{ application = "alone" })
    begin_all(tm2, BEGUN)
    -- the mix (5 accounts: most calls meet), transfers between accounts
    -- of their own (P1..P24: none meet), and commits
    local calls, fresh = mix(), {}
    for i = 1, 24 do fresh[i] = { _id = "P" .. i, balance = 100 } end
    assert(db:collection("accounts"):insert_many(fresh))
    assert(db2:collection("accounts"):insert_many(fresh))
    for i = 1, 12 do
      table.insert(calls, 2 * i, { "transfer", "accounts", "P" .. (2 * i - 1), "P" .. (2 * i), i, { min = 0 } })
    end
    -- (a commit waits for every batch before it to end, and holds back
    -- every call after it: last, so that the others can overlap)
    for i = 1, #BEGUN do calls[#calls + 1] = { "commit", { _id = "b-" .. i } } end
    local S = scheduler()
    local g, rec = overlapping(S, tm, { max = 6, delay = 0, inflight = 3 }, 0.003)
    local got = run_indexed(S, g, calls, commit_outcome)
    assert.are.same({}, rec.bad)
    assert.are.equal(3, rec.most)
    assert.are.equal(#calls, #rec.order)
    -- batches that overlapped touched nothing in common, so their calls
    -- alone, in the order the batches ended, give the same answers
    for _, i in ipairs(rec.order) do
      local c = calls[i]
      assert.are.same(commit_outcome(pcall(tm2[c[1]], tm2, unpack(c, 2))), got[i], "call " .. i)
    end
    assert.are.same(helpers.balances(db2:collection("accounts")),
                    helpers.balances(db:collection("accounts")))
  end)

  it("keeps a document's calls in their order: one that waits holds back the later ones", function()
    local db = bank({ A = 10, B = 10, C = 10, D = 10, E = 10, F = 10 })
    local tm = assert(db:manager{ application = "order" })
    local S = scheduler()
    local g, rec = overlapping(S, tm, { delay = 0, inflight = 2 }, 0.02)
    local tickets = {}
    local function call(i, from, to, after)
      S.spawn(function()
        if after then S.signal():wait(after) end
        local r, t = g.group:call({ method = "transfer", n = 4, "accounts", from, to, 1 },
                                  group.keys("transfer", "accounts", from, to, 1))
        assert.are.equal("done", r[1].state)
        tickets[i] = t.batch
      end)
    end
    -- 1 runs (A, B); 2 waits for B; 3 (C, D) meets no running batch but
    -- waits behind 2, which holds C; 4 (E, F) runs beside 1
    call(1, "A", "B")
    call(2, "B", "C", 0.005)
    call(3, "C", "D", 0.005)
    call(4, "E", "F", 0.005)
    S.loop()
    assert.are.same({}, rec.bad)
    assert.are.same({ 1, 3, 3, 2 }, tickets)
    assert.are.same({ A = 9, B = 10, C = 10, D = 11, E = 9, F = 11 }, (helpers.balances(db:collection("accounts"))))
  end)

  it("keeps those rules when spawn fails, raises, or drops a driver", function()
    local db = bank({ A = 10, B = 10, C = 10, D = 10, E = 10, F = 10, G = 10, H = 10 })
    local tm = assert(db:manager{ application = "spawns" })
    local function transfer(g, from, to, after, out)
      return function()
        if after then g.S.signal():wait(after) end
        local t0 = g.S.now()
        local T, err = g:transfer("accounts", from, to, 1)
        assert(T, tostring(err))
        out[#out + 1] = { T.state, g.S.now() - t0 }
      end
    end
    -- spawn fails (false, then a raise): the caller drives, and a call on
    -- its accounts that comes meanwhile waits for its batch
    for _, failing in ipairs { function() return false end, function() error("no timers left") end } do
      local S = scheduler()
      local g, rec = overlapping(S, tm, { delay = 0, inflight = 2 }, 0.01)
      g.S, g.group.spawn = S, failing
      local out = {}
      S.spawn(transfer(g, "A", "B", nil, out))
      S.spawn(transfer(g, "B", "A", 0.002, out))
      S.loop()
      assert.are.same({}, rec.bad)
      assert.are.same({ "done", "done" }, { out[1][1], out[2][1] })
    end
    -- a host drops the second driver (accepted, never begun): once START
    -- has passed it holds no place, and two batches run at once again
    local S = scheduler()
    local g, rec = overlapping(S, tm, { delay = 0, inflight = 2 }, 0.02)
    local spawns = 0
    g.S, g.group.spawn = S, function(fn)
      spawns = spawns + 1
      if spawns == 2 then return true end
      return S.spawn(fn)
    end
    local out = {}
    S.spawn(transfer(g, "A", "B", nil, out))
    S.spawn(transfer(g, "C", "D", 0.005, out))
    S.loop()
    assert.are.same({ 2, 1 }, { spawns, rec.most })
    local first = rec.most
    rec.most = 0
    S.spawn(function() S.signal():wait(group.START) end)
    S.loop()
    S.spawn(transfer(g, "E", "F", nil, out))
    S.spawn(transfer(g, "G", "H", 0.005, out))
    S.loop()
    assert.are.same({}, rec.bad)
    assert.are.same({ 1, 2 }, { first, rec.most })
    for _, o in ipairs(out) do
      assert.are.equal("done", o[1])
      assert(o[2] < group.START, "a call waited " .. o[2] .. " s")
    end
    assert.are.same({ A = 9, B = 11, C = 9, D = 11, E = 9, F = 11, G = 9, H = 11 },
                    (helpers.balances(db:collection("accounts"))))
  end)
end)

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

-- A minimal scheduler: runnable coroutines, and waiters on signals with
-- deadlines.  spawn(fn) adds a task; loop() runs until every task ended.
local function scheduler()
  local S = { runnable = {}, waiting = {} }
  local function now() return core.monotonic_ms() / 1000 end
  function S.spawn(fn)
    S.runnable[#S.runnable + 1] = coroutine.create(fn)
    return true
  end
  function S.signal()
    local sig = { posted = 0 }
    function sig.wait(self, seconds)
      if self.posted > 0 then
        self.posted = self.posted - 1
        return true
      end
      local w = { co = coroutine.running(), sig = self, at = now() + seconds }
      S.waiting[#S.waiting + 1] = w
      return coroutine.yield(w)
    end
    function sig.post(self)
      for i, w in ipairs(S.waiting) do
        if w.sig == self then
          table.remove(S.waiting, i)
          w.woken = true
          S.runnable[#S.runnable + 1] = w
          return
        end
      end
      self.posted = self.posted + 1
    end
    return sig
  end
  S.now = now
  function S.loop()
    while #S.runnable > 0 or #S.waiting > 0 do
      if #S.runnable == 0 then
        -- the earliest deadline times out
        local first, k = nil, nil
        for i, w in ipairs(S.waiting) do
          if not first or w.at < first.at then first, k = w, i end
        end
        local left = first.at - now()
        if left > 0 then core.sleep(left) end
        table.remove(S.waiting, k)
        first.woken = false
        S.runnable[#S.runnable + 1] = first
      end
      local item = table.remove(S.runnable, 1)
      local co, arg = item, nil
      if type(item) == "table" then co, arg = item.co, item.woken end
      local ok, err = coroutine.resume(co, arg)
      if not ok then error(debug.traceback(co, err), 0) end
    end
  end
  return S
end

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
    -- each call's item carries its index (for `order`): set just before
    -- the call, which reaches the group without yielding
    local calls, got, current = mix(), {}, nil
    local call = g.group.call
    g.group.call = function(self, item)
      item.index = current
      return call(self, item)
    end
    for i, c in ipairs(calls) do
      S.spawn(function()
        current = i
        got[i] = outcome(pcall(g[c[1]], g, unpack(c, 2)))
      end)
    end
    S.loop()
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
    assert.are.same({ X = 10, Y = 30, Z = 29, W = 41 }, (helpers.balances(db:collection("accounts"))))
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

  it("checks its options", function()
    local S = scheduler()
    local base = { run = function() end, signal = S.signal, spawn = S.spawn, now = S.now }
    for k, v in pairs({ max = 0, delay = -1 }) do
      local o = {}
      for x, y in pairs(base) do o[x] = y end
      o[k] = v
      assert.has_error(function() group.new(o) end)
    end
    assert.has_error(function() group.new({ run = base.run }) end,
      "option signal of group.new must be a function")
  end)
end)

-- Deterministic interleavings of managers in one process, walked with
-- tm:step (or fired from a manager's step events) so that each one happens
-- every run (the kill section only hits them by chance).  Each case ends
-- with the same check as the others; the guard-isolation cases (below)
-- also probe the floors after every step event.
--
-- Each case's comment says what must not happen.

local check = require "torture.check"

local M = {}

local cases = {
  -- remove-twice: two transactions remove one document; both apply (the
  -- document then carries both markers), both pass their commit point,
  -- both finish.  They must not both end done: one removal did not happen.
  { name = "remove-twice",
    fixture = { tokens = { { _id = "K" } } },
    run = function(tm1, tm2)
      local op = { { collection = "tokens", id = "K", kind = "remove" } }
      local T1 = assert(tm1:begin(op, { id = "T1" }))
      local T2 = assert(tm2:begin(op, { id = "T2" }))
      assert(tm1:step("claim", T1))
      assert(tm1:step("apply", T1, 1))
      assert(tm2:step("claim", T2))
      local said = {}
      -- the second apply should find K already being removed
      if tm2:step("apply", T2, 1) then
        tm1:step("commit", T1)
        tm2:step("commit", T2)
      end
      for id, tm in pairs { T1 = tm1, T2 = tm2 } do
        local res, err = tm:commit({ _id = id })
        said[id] = res and "done" or err.code
      end
      return said
    end },
  -- insert-after-undo: the owner claims T (a ledger insert, then the
  -- removal of a token that does not exist) and stalls before its insert;
  -- a recovering manager takes T over, inserts the ledger document, finds
  -- the token missing, cancels and undoes the insert; then the former
  -- owner's prepared insert arrives.  It must not land.
  { name = "insert-after-undo",
    fixture = { ledger = {}, tokens = {} },
    run = function(tm1, tm2)
      local T = assert(tm1:begin({
        { collection = "ledger", id = "L", kind = "insert", doc = { amount = 1 } },
        { collection = "tokens", id = "K", kind = "remove" },
      }, { id = "T" }))
      assert(tm1:step("claim", T))
      assert(tm2:recover())
      tm1:step("apply", T, 1) -- the stalled owner's insert, prepared before
      local res, err = tm1:commit(T)
      return { T = res and "done" or err.code }
    end },
}

-- Guard isolation (issue 8): T1 moves 10 from A to B, T2 10 from B to C
-- with B's floor as its guard (min = 0); A, B and C start at 0 unless
-- said otherwise.  T2 runs the moment T1's apply has reached B (B carries
-- T1's marker; before the fix T1's credit was then in B's balance, free
-- for T2's guard to read): from a hook on T1's manager's step events, so
-- the fast paths and the batches are interleaved as well as the
-- step-by-step ones (where the engine never lets T1's apply reach B
-- before T1 ends, T2 runs after it, and the case says so).  For each way
-- T1 can end cancelled (it cannot pay, is rolled back, or recovery rolls
-- it back; its credit a pure $inc, or one that also $sets a field) and
-- each way T2 can run (its guard a floor, or "strict": a floor and
-- another condition, which waits for any open holder), B must never be
-- seen below 0: T2's guard may not pass on a credit that is then undone.
-- A probe reads the floored accounts after every step event of every
-- manager (the races' floor observer: it sees every state between two
-- writes), and check.lua checks the end.  T1 committed but not finished
-- (its marker still on B) is a committed credit: T2 must then end done
-- (its manager finishes T1's op on B first), and T1 too.

local function inc(id, n, guarded)
  local op = { collection = "accounts", id = id, update = { ["$inc"] = { balance = n } } }
  if guarded then op.where = { balance = { ["$gte"] = -n } } end
  return op
end

local T1_OPS = { inc("A", -10, true), inc("B", 10) }          -- debit first
local T1_CREDIT_FIRST = { inc("B", 10), inc("A", -10, true) }  -- credit first
local T2_OPS = { inc("B", -10, true), inc("C", 10) }
-- a credit that also $sets a field (not a pure $inc: an engine may treat
-- it apart from a credit, as 96febb8 did)
local SET_CREDIT = { collection = "accounts", id = "B",
  update = { ["$inc"] = { balance = 10 }, ["$set"] = { last = "T1" } },
  undo = { ["$inc"] = { balance = -10 }, ["$set"] = { last = "" } } }
local T1_SET = { SET_CREDIT, inc("A", -10, true) }
-- a guard that is not only a floor: it waits for every open holder
local T2_STRICT = { inc("B", -10, true), inc("C", 10) }
T2_STRICT[1].where.last = { ["$ne"] = "frozen" }

local function floored(a, b, c)
  return { accounts = {
    { _id = "A", balance = a, floor = 0 }, { _id = "B", balance = b, floor = 0, last = "" },
    { _id = "C", balance = c, floor = 0 }, { _id = "D", balance = 5, floor = 0 },
    { _id = "E", balance = 0, floor = 0 } } }
end

-- How T1 runs: f(env) with env.tm1 (whose step events may fire T2),
-- env.tm3 (recovery rolling back at once) and env.fire(); T1's credit
-- stays visible while T2 runs.
local t1_ways = {
  { "transfer", function(env)
      return env.tm1:transfer("accounts", "A", "B", 10, { id = "T1", min = 0 }) end },
  { "run", function(env) return env.tm1:run(T1_CREDIT_FIRST, { id = "T1" }) end },
  { "transfer_many", function(env)
      local res, errs = env.tm1:transfer_many {
        { collection = "accounts", from = "A", to = "B", amount = 10, min = 0, id = "T1" },
        { collection = "accounts", from = "D", to = "E", amount = 5, min = 0, id = "T1b" } }
      return res[1], errs[1] end },
  { "commit_many", function(env)
      local res, errs = env.tm1:commit_many {
        { ops = T1_CREDIT_FIRST, id = "T1" },
        { ops = { inc("D", -5, true), inc("E", 5) }, id = "T1b" } }
      return res[1], errs[1] end },
  { "commit", function(env)
      local T = assert(env.tm1:begin(T1_CREDIT_FIRST, { id = "T1" }))
      return env.tm1:commit(T) end },
  { "commit-set", function(env)
      local T = assert(env.tm1:begin(T1_SET, { id = "T1" }))
      return env.tm1:commit(T) end },
  { "run-set", function(env) return env.tm1:run(T1_SET, { id = "T1" }) end },
  { "rollback", function(env)
      local T = assert(env.tm1:begin(T1_OPS, { id = "T1" }))
      assert(env.tm1:step("claim", T))
      assert(env.tm1:step("apply", T, 2))
      env.fire()
      local ok, err = env.tm1:rollback(T, "rolled back by the race")
      if ok then return nil, { code = "cancelled" } end
      return nil, err end },
  -- T1's owner stalls (lease 0: its claim's deadline has passed at once,
  -- so recovery may take T1 over without waiting)
  { "recover-back", function(env)
      local T = assert(env.tm1:begin(T1_OPS, { id = "T1" }))
      assert(env.tm1:step("claim", T))
      assert(env.tm1:step("apply", T, 2))
      env.fire()
      local rep = assert(env.tm3:recover())
      -- (or T2 met T1 past its lease first and took it over: Engine:resolve)
      local now = env.tm3:get("T1")
      local taken = now and (now.epoch or 1) > 1 and (now.state == "done" or now.state == "cancelled")
      if rep.cancelled ~= 1 and not taken then
        error(("recovery rolled back %d transactions, not T1: %s"):format(rep.cancelled,
          rep.errors[1] and tostring(rep.errors[1].error) or "skipped"), 0)
      end
      return nil, nil end, -- nothing told: T1's owner never heard back
    tm1 = { lease = 0 } },
}

-- T1 committed (applied) with its marker still on B: A starts at 10.
local t1_committed = {
  { "committed", function(env)
      local T = assert(env.tm1:begin(T1_OPS, { id = "T1" }))
      assert(env.tm1:step("claim", T))
      assert(env.tm1:step("apply", T, 1))
      assert(env.tm1:step("apply", T, 2))
      assert(env.tm1:step("commit", T))
      env.fire()
      return env.tm1:commit(T) end },
  { "deferred", function(env)
      local T, err = env.tm1:transfer("accounts", "A", "B", 10, { id = "T1", min = 0 })
      if not T then return nil, err end
      env.fire()
      env.tm1:finish()
      return env.tm1:get("T1") end,
    tm1 = { finish = "deferred" } },
}

-- How T2 runs, with manager tm2 (default policies).
local t2_ways = {
  { "transfer", function(tm)
      return tm:transfer("accounts", "B", "C", 10, { id = "T2", min = 0 }) end },
  { "commit", function(tm)
      local T = assert(tm:begin(T2_OPS, { id = "T2" }))
      return tm:commit(T) end },
  { "run", function(tm) return tm:run(T2_OPS, { id = "T2" }) end },
  { "transfer_many", function(tm)
      local res, errs = tm:transfer_many {
        { collection = "accounts", from = "B", to = "C", amount = 10, min = 0, id = "T2" } }
      return res[1], errs[1] end },
  { "commit_many", function(tm)
      local res, errs = tm:commit_many { { ops = T2_OPS, id = "T2" } }
      return res[1], errs[1] end },
  { "strict", function(tm) return tm:run(T2_STRICT, { id = "T2" }) end },
}

local function told(res, err)
  if res then return "done" end
  return err and err.code or nil
end

local function guard_case(t1, t2, committed)
  local name = ("guard %s/%s"):format(t1[1], t2[1])
  return { name = name, guard = true, committed = committed, tm1 = t1.tm1,
    fixture = committed and floored(10, 0, 0) or floored(0, 0, 0),
    allowed = committed and { T1 = { done = true }, T2 = { done = true } }
      or { T1 = { cancelled = true } },
    run = function(env)
      local ok, res, err = pcall(t1[2], env)
      if not ok then error(res, 0) end
      if not env.fired then env.fire(true) end
      if env.hook_error then error(env.hook_error, 0) end
      return { T1 = told(res, err), T2 = env.t2_said }, env.late
    end,
    t2 = t2[2] }
end

for _, t1 in ipairs(t1_ways) do
  for _, t2 in ipairs(t2_ways) do cases[#cases + 1] = guard_case(t1, t2, false) end
end
for _, t1 in ipairs(t1_committed) do
  for _, t2 in ipairs(t2_ways) do cases[#cases + 1] = guard_case(t1, t2, true) end
end

-- The managers of a guard case and its probe.  Each step event of any of
-- them reads the floored accounts; tm1's events also fire T2 once T1's
-- credit is on B (and, for a committed case, T1 is applied).
local function guard_env(db, c, sightings)
  local env = {}
  local accounts = db:collection("accounts")
  local function probe(where)
    local docs = accounts:find_all({ floor = { ["$exists"] = true } })
    for _, d in ipairs(docs or {}) do
      if d.balance < d.floor then
        local k = tostring(d._id) .. " " .. tostring(d.balance)
        if not sightings[k] then
          sightings[k] = true
          sightings[#sightings + 1] = ("%s balance %s below floor %s (after %s)"):format(
            tostring(d._id), tostring(d.balance), tostring(d.floor), where)
        end
      end
    end
  end
  env.probe = probe
  local function ready()
    local B = accounts:find_one({ _id = "B" })
    local marked = false
    for _, m in ipairs(B and B.pendingTransactions or {}) do
      if m == "T1" then marked = true end
    end
    if not marked then return false end
    if not c.committed then return true end
    local T1 = env.tm1:get("T1")
    return T1 and T1.state == "applied"
  end
  function env.fire(late)
    if env.fired then return end
    env.fired, env.late = true, late
    local ok, res, err = pcall(c.t2, env.tm2)
    if not ok then env.hook_error = "T2 raised: " .. tostring(res) return end
    env.t2_said = told(res, err)
    probe("T2")
  end
  local function events(who, extra)
    local o = { application = who, may_recover = function() return true end,
      on_event = function(name, info)
        probe(who .. " " .. name)
        if who == "one" and not env.fired and info and info.id == "T1" and ready() then
          env.fire()
        end
      end }
    for k, v in pairs(extra or {}) do o[k] = v end
    return o
  end
  env.tm1 = assert(db:manager(events("one", c.tm1)))
  env.tm2 = assert(db:manager(events("two")))
  env.tm3 = assert(db:manager(events("three",
    { stale_pending = function() return "back" end })))
  return env
end

function M.run(ctx)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local late, guard_cases, codes = {}, 0, {}
  for i, c in ipairs(cases) do
    local db = check.db(ctx.uri, "race" .. i)
    check.load(db, c.fixture)
    local ok, said, was_late
    local sightings = {}
    if c.guard then
      guard_cases = guard_cases + 1
      local env = guard_env(db, c, sightings)
      ok, said, was_late = pcall(c.run, env)
      if was_late then late[#late + 1] = c.name end
      env.probe("the end")
    else
      local tm1 = assert(db:manager { application = "one" })
      -- the second manager takes over at once when it recovers: the first
      -- one stands for an owner stalled past its lease
      local tm2 = assert(db:manager { application = "two",
        may_recover = function() return true end })
      ok, said = pcall(c.run, tm1, tm2)
    end
    r.cases = r.cases + 1
    if not ok then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = c.name .. ": " .. tostring(said)
      ctx.say("  race %-30s CRASH", c.name)
    else
      local rep = check.database(db, c.fixture, { reported = said, allowed = c.allowed })
      local bad = #rep.violations + #sightings
      r.violations = r.violations + bad
      for _, v in ipairs(sightings) do r.failures[#r.failures + 1] = c.name .. ": " .. v end
      for _, v in ipairs(rep.violations) do r.failures[#r.failures + 1] = c.name .. ": " .. v end
      local t2 = c.guard and said.T2 ~= "done" and said.T2
      if t2 then codes[t2] = (codes[t2] or 0) + 1 end
      ctx.say("  race %-30s %s%s", c.name, bad == 0 and "ok" or "VIOLATION",
        c.guard and ("  T1 %s, T2 %s%s%s"):format(tostring(rep.states.T1),
          tostring(rep.states.T2), t2 and (" (" .. t2 .. ")") or "",
          was_late and " (T1's apply never reached B before it ended: T2 ran after)"
          or "") or "")
    end
  end
  local by_code = {}
  for code, n in pairs(codes) do by_code[#by_code + 1] = ("%s %d"):format(code, n) end
  table.sort(by_code)
  r.notes = ("remove-twice, insert-after-undo, %d guard-isolation cases (%d x %d T1 ending "
    .. "cancelled, %d x %d committed; T2 cancelled: %s)%s"):format(guard_cases, #t1_ways,
    #t2_ways, #t1_committed, #t2_ways, #by_code > 0 and table.concat(by_code, ", ") or "none",
    #late > 0 and ("; T1 never reached B in " .. #late) or "")
  return r
end

return M

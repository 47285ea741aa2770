-- Deterministic interleavings of two managers in one process, walked with
-- tm:step so that each one happens every run (the kill section only hits
-- them by chance).  Each case ends with the same check as the others.
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

function M.run(ctx)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  for i, c in ipairs(cases) do
    local db = check.db(ctx.uri, "race" .. i)
    check.load(db, c.fixture)
    local tm1 = assert(db:manager { application = "one" })
    -- the second manager takes over at once when it recovers: the first
    -- one stands for an owner stalled past its lease
    local tm2 = assert(db:manager { application = "two",
      may_recover = function() return true end })
    local ok, said = pcall(c.run, tm1, tm2)
    r.cases = r.cases + 1
    if not ok then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = c.name .. ": " .. tostring(said)
    else
      local rep = check.database(db, c.fixture, { reported = said })
      r.violations = r.violations + #rep.violations
      for _, v in ipairs(rep.violations) do r.failures[#r.failures + 1] = c.name .. ": " .. v end
      ctx.say("  race %-14s %s", c.name, #rep.violations == 0 and "ok" or "VIOLATION")
    end
  end
  local names = {}
  for i, c in ipairs(cases) do names[i] = c.name end
  r.notes = table.concat(names, ", ")
  return r
end

return M

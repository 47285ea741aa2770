-- The crash matrix's scenarios, as data: torture/crashpoints.lua runs each
-- (scenario, op kind) once cleanly to list the crash points it passes,
-- then once per point with a crash there (torture/worker.lua "run").
--
-- A transaction always moves 100 from account A to B (so the balances'
-- sum is fixed) plus one op of the kind under test, on its own document:
--   update  counters/hits  $inc n by 1     (cancel: where n < 0)
--   insert  ledger/L       a new document  (cancel: L exists already)
--   remove  tokens/K       deleted         (cancel: K is missing)
--   assert  flags/F        open == true    (cancel: F is closed)
-- Fields of a scenario:
--   name, kinds   which op kinds it runs with (default: all four)
--   failing       the kind's op cannot apply (the transaction must cancel)
--   allowed       final states of transaction T after recovery (absent:
--                 it was never created)
--   other         final states allowed for transaction U (the batch
--                 scenarios' second transaction, C -> D)
--   prepare       run(tm, ctx) in a child before the crashing one, with
--                 crash point prepare_fault when set
--   run           run(tm, ctx) in the child that crashes at the point
--   manager       extra manager options for `run`
-- Add scenarios at the end (tm:commit_many, tm:transfer_many, ...).

local M = {}

M.KINDS = { "update", "insert", "remove", "assert" }
M.ID = "T" -- the transaction's id (each case has its own database)
M.AMOUNT = 100

-- Documents before the transaction, by collection.
function M.fixture(kind, failing)
  local f = {
    accounts = { { _id = "A", balance = 1000 }, { _id = "B", balance = 1000 },
                 { _id = "C", balance = 1000 }, { _id = "D", balance = 1000 } },
  }
  if kind == "update" then
    f.counters = { { _id = "hits", n = 0 } }
  elseif kind == "insert" then
    f.ledger = failing and { { _id = "L", amount = 0, note = "in the way" } } or {}
  elseif kind == "remove" then
    f.tokens = failing and {} or { { _id = "K", note = "removed by T" } }
  elseif kind == "assert" then
    f.flags = { { _id = "F", open = not failing } }
  end
  return f
end

function M.ops(kind, failing)
  local ops = {
    { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -M.AMOUNT } },
      where = { balance = { ["$gte"] = M.AMOUNT } } },
    { collection = "accounts", id = "B", update = { ["$inc"] = { balance = M.AMOUNT } } },
  }
  local op
  if kind == "update" then
    op = { collection = "counters", id = "hits", update = { ["$inc"] = { n = 1 } },
           where = { n = failing and { ["$lt"] = 0 } or { ["$gte"] = 0 } } }
  elseif kind == "insert" then
    op = { collection = "ledger", id = "L", kind = "insert",
           doc = { amount = M.AMOUNT, from = "A", to = "B" } }
  elseif kind == "remove" then
    op = { collection = "tokens", id = "K", kind = "remove" }
  else
    op = { collection = "flags", id = "F", kind = "assert", where = { open = true } }
  end
  ops[3] = op
  return ops
end

-- The second transaction of the batch scenarios: 7 from C to D.
M.OTHER = "U"
local other_ops = {
  { collection = "accounts", id = "C", update = { ["$inc"] = { balance = -7 } },
    where = { balance = { ["$gte"] = 7 } } },
  { collection = "accounts", id = "D", update = { ["$inc"] = { balance = 7 } } },
}

local function begin_commit(tm, ctx)
  local T = assert(tm:begin(M.ops(ctx.kind, ctx.failing), { id = M.ID }))
  return tm:commit(T)
end

-- Manager options for recovery in a fresh process, as an operator
-- restarting the application would run it: the crashed owner is known
-- dead, so take over at once.  `extra` adds or replaces options.
function M.recovery_manager(extra)
  local o = { application = "torture", stale_after = 0, lease = 1,
              may_recover = function() return true end }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

-- Recovers until T has settled (a fast-path transaction's deadline may
-- hold claims off for a lease), or gives up after `seconds`.
function M.settle(tm, id, seconds)
  local core = require "mongotx.core"
  local stop = core.monotonic_ms() + (seconds or 15) * 1000
  repeat
    local T = tm:get(id)
    if not T or T.state == "done" or T.state == "cancelled" then return T end
    tm:recover()
    core.sleep(0.05)
  until core.monotonic_ms() > stop
  return tm:get(id)
end

local function recover_once(tm)
  return M.settle(tm, M.ID)
end

local ALL = { done = true, cancelled = true, absent = true }

M.list = {
  { name = "commit", allowed = { done = true, absent = true }, run = begin_commit },
  { name = "transfer", kinds = { "update" }, allowed = { done = true, absent = true },
    run = function(tm)
      return tm:transfer("accounts", "A", "B", M.AMOUNT, { id = M.ID, min = 0 })
    end },
  { name = "rollback", allowed = ALL,
    run = function(tm, ctx)
      local T = assert(tm:begin(M.ops(ctx.kind), { id = M.ID }))
      assert(tm:step("claim", T))
      for i = 1, 3 do assert(tm:step("apply", T, i)) end
      return tm:rollback(T, "torture rollback")
    end },
  { name = "cancel", failing = true, allowed = { cancelled = true, absent = true },
    run = begin_commit },
  { name = "compensate", allowed = { done = true },
    prepare = begin_commit,
    run = function(tm) return tm:compensate({ _id = M.ID }) end },
  -- a crash inside recovery itself: the first owner crashed (prepare_fault),
  -- the recovering process crashes at each point, a third one recovers
  { name = "recover-initial", allowed = { done = true },
    prepare = begin_commit, prepare_fault = "claim:before:1",
    manager = M.recovery_manager(), run = recover_once },
  { name = "recover-forward", allowed = { done = true },
    prepare = begin_commit, prepare_fault = "commit:before:1",
    manager = M.recovery_manager(), run = recover_once },
  -- before its cancel, the final recovery (forward) may still commit it
  { name = "recover-back", allowed = { done = true, cancelled = true },
    prepare = begin_commit, prepare_fault = "apply:after:2",
    manager = M.recovery_manager { stale_pending = function() return "back" end },
    run = recover_once },
  -- the fast path and the batches: created pending and owned, one round
  -- trip per step for the whole batch
  { name = "run", allowed = { done = true, absent = true },
    run = function(tm, ctx)
      return tm:run(M.ops(ctx.kind, ctx.failing), { id = M.ID })
    end },
  { name = "run-cancel", failing = true, allowed = { cancelled = true, absent = true },
    run = function(tm, ctx)
      return tm:run(M.ops(ctx.kind, ctx.failing), { id = M.ID })
    end },
  { name = "run-deferred", allowed = { done = true, absent = true },
    manager = { application = "torture", lease = 1, stale_after = 1, finish = "deferred" },
    run = function(tm, ctx)
      local T, err = tm:run(M.ops(ctx.kind), { id = M.ID })
      if not T then return nil, err end
      return tm:finish()
    end },
  { name = "commit_many", allowed = { done = true, absent = true },
    other = { done = true, absent = true },
    run = function(tm, ctx)
      local res, errs = tm:commit_many {
        { ops = M.ops(ctx.kind), id = M.ID }, { ops = other_ops, id = M.OTHER } }
      return res[1], errs[1] or errs[2] or nil
    end },
  { name = "commit_many-cancel", failing = true, allowed = { cancelled = true, absent = true },
    other = { done = true, absent = true },
    run = function(tm, ctx)
      local res, errs = tm:commit_many {
        { ops = M.ops(ctx.kind, true), id = M.ID }, { ops = other_ops, id = M.OTHER } }
      return res[2], errs[2] or nil
    end },
  { name = "transfer_many", kinds = { "update" }, allowed = { done = true, absent = true },
    other = { done = true, absent = true },
    run = function(tm)
      local res, errs = tm:transfer_many {
        { collection = "accounts", from = "A", to = "B", amount = M.AMOUNT, id = M.ID, min = 0 },
        { collection = "accounts", from = "C", to = "D", amount = 7, id = M.OTHER, min = 0 } }
      return res[1] and res[2], errs[1] or errs[2] or nil
    end },
}

function M.find(name)
  for _, s in ipairs(M.list) do
    if s.name == name then return s end
  end
end

return M

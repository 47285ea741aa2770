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
--   ci_kinds      the kinds of the bounded run (--ci), when fewer
--   failing       the kind's op cannot apply (the transaction must cancel)
--   allowed       final states of transaction T after recovery (absent:
--                 it was never created)
--   other         final states allowed for transaction U (the batch
--                 scenarios' second transaction, C -> D)
--   prepare       run(tm, ctx) in a child before the crashing one, with
--                 crash point prepare_fault when set
--   prepare_manager  manager options for `prepare` (default: lease 1)
--   run           run(tm, ctx) in the child that crashes at the point
--   manager       extra manager options for `run`
--   also          final states allowed for other transactions, by id
--                 (torture/check.lua's keys: "tx2:T" in the other collection)
--   balances      accounts' balances other than 1000 (M.fixture)
--   recover       direction of the final recovery: "forward" (default)
--                 or "back" (stale pending transactions rolled back)
-- Add scenarios at the end (tm:commit_many, tm:transfer_many, ...).

local serial = require "torture.serial"

local M = {}

M.KINDS = { "update", "insert", "remove", "assert" }
M.ID = "T" -- the transaction's id (each case has its own database)
M.AMOUNT = 100

-- Documents before the transaction, by collection; `balances` replaces
-- some accounts' 1000 (a scenario's `balances` field).  Every account has
-- floor 0: check.lua fails a case that ends with a balance below it.
function M.fixture(kind, failing, balances)
  local f = { accounts = {}, [serial.COLLECTION] = serial.fixture() }
  for i, id in ipairs { "A", "B", "C", "D" } do
    f.accounts[i] = { _id = id, balance = balances and balances[id] or 1000, floor = 0 }
  end
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
local SHORT = { application = "torture", lease = 0.2, stale_after = 0.2 }

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
  -- the recovering process crashes at each point, a third one recovers.
  -- Nobody may claim a pending transaction before its owner's deadline
  -- (its lease from the claim): the first owner's lease is 0.2 s, so each
  -- case does not wait a second for it.
  { name = "recover-initial", allowed = { done = true },
    prepare = begin_commit, prepare_fault = "claim:before:1",
    manager = M.recovery_manager(), run = recover_once },
  { name = "recover-forward", allowed = { done = true },
    prepare = begin_commit, prepare_fault = "commit:before:1", prepare_manager = SHORT,
    manager = M.recovery_manager(), run = recover_once },
  -- before its cancel, the final recovery (forward) may still commit it
  { name = "recover-back", allowed = { done = true, cancelled = true },
    prepare = begin_commit, prepare_fault = "apply:after:2", prepare_manager = SHORT,
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

-- Guard isolation (issue 8): a guarded op applies only to a document no
-- other open transaction holds.  The holder, transaction U, moves 100
-- from C to A; `prepare` leaves it on A either committed but not
-- finished (its marker still there: T's guarded debit of A finishes U's
-- op on A first, a `finish` point inside T's run) or open (pending, its
-- credit to A applied, its owner gone: T's debit is busy, retried, then
-- T cancels).  With A at 50 and the final recovery rolling U back, a T
-- that passed on U's credit would leave A at -50 (check.lua: below its
-- floor), so T may only end cancelled.
local HOLDER = {
  { collection = "accounts", id = "C", update = { ["$inc"] = { balance = -M.AMOUNT } },
    where = { balance = { ["$gte"] = M.AMOUNT } } },
  { collection = "accounts", id = "A", update = { ["$inc"] = { balance = M.AMOUNT } } },
}

local function hold_applied(tm)
  local U = assert(tm:begin(HOLDER, { id = M.OTHER }))
  assert(tm:step("claim", U))
  assert(tm:step("apply", U, 1))
  assert(tm:step("apply", U, 2))
  return tm:step("commit", U)
end

local function hold_open(tm)
  local U = assert(tm:begin(HOLDER, { id = M.OTHER }))
  assert(tm:step("claim", U))
  return tm:step("apply", U, 2)
end

local function transfer_T(tm)
  return tm:transfer("accounts", "A", "B", M.AMOUNT, { id = M.ID, min = 0 })
end

-- T from A to B and V from C to D (C is U's debit) in one batch.
local function transfer_many_TV(tm)
  local res, errs = tm:transfer_many {
    { collection = "accounts", from = "A", to = "B", amount = M.AMOUNT, id = M.ID, min = 0 },
    { collection = "accounts", from = "C", to = "D", amount = 7, id = "V", min = 0 } }
  return res[1], errs[1] or nil
end

-- T's manager when the holder is open: the default policy (busy is
-- retried `retries` times, then T cancels), with short backoffs so that
-- the matrix's many cases do not each sleep 0.35 s; the crash points
-- passed are the same.
local BUSY = { application = "torture", lease = 1, stale_after = 1,
               backoff = function() return 0.01 end }

local DONE = { done = true, absent = true }
local CANCELLED = { cancelled = true, absent = true }
local BACK = { A = 50 }

for _, s in ipairs {
  { name = "held-applied", prepare = hold_applied, allowed = DONE, other = { done = true },
    ci_kinds = { "update" }, run = begin_commit },
  { name = "held-applied-transfer", kinds = { "update" }, prepare = hold_applied,
    allowed = DONE, other = { done = true }, run = transfer_T },
  { name = "held-applied-many", kinds = { "update" }, prepare = hold_applied,
    allowed = DONE, other = { done = true }, run = transfer_many_TV },
  -- forward: U is rolled forward by the final recovery, so a T that
  -- crashed pending may be too, once U is done
  { name = "held-open", kinds = { "update" }, prepare = hold_open, allowed = ALL,
    other = { done = true }, manager = BUSY, run = transfer_T },
  { name = "held-open-back", prepare = hold_open, balances = BACK, recover = "back",
    allowed = CANCELLED, other = { cancelled = true }, manager = BUSY, ci_kinds = { "update" },
    run = begin_commit },
  { name = "held-open-back-transfer", kinds = { "update" }, prepare = hold_open,
    balances = BACK, recover = "back", allowed = CANCELLED, other = { cancelled = true },
    manager = BUSY, run = transfer_T },
  { name = "held-open-back-many", kinds = { "update" }, prepare = hold_open,
    balances = BACK, recover = "back", allowed = CANCELLED, other = { cancelled = true },
    manager = BUSY, run = transfer_many_TV },
  -- a guarded debit that cannot pay on the fast path and in a batch
  -- (whatever order the engine applies a transaction's ops in)
  { name = "transfer-cancel", kinds = { "update" }, allowed = CANCELLED,
    run = function(tm)
      return tm:transfer("accounts", "A", "B", 5000, { id = M.ID, min = 0 })
    end },
  { name = "transfer_many-cancel", kinds = { "update" }, allowed = CANCELLED,
    other = { done = true, absent = true },
    run = function(tm)
      local res, errs = tm:transfer_many {
        { collection = "accounts", from = "A", to = "B", amount = 5000, id = M.ID, min = 0 },
        { collection = "accounts", from = "C", to = "D", amount = 7, id = M.OTHER, min = 0 } }
      return res[2], errs[2] or nil
    end },
} do M.list[#M.list + 1] = s end

-- Batched recovery (issue 11): an owner gone left T pending (its credit
-- of B applied) and U applied but not finished; one recover() drives both
-- in one batch (versions, claim, apply, commit, finish, done: one bulk
-- write each), and the recovering process crashes at each of its points.
-- With stale_pending "back", T is cancelled instead (undo, fence and
-- cancelled as bulk writes) while U finishes.
local function leave_TU(tm, ctx)
  local T = assert(tm:begin(M.ops(ctx.kind), { id = M.ID }))
  assert(tm:step("claim", T))
  assert(tm:step("apply", T, 2))
  local U = assert(tm:begin(other_ops, { id = M.OTHER }))
  assert(tm:step("claim", U))
  assert(tm:step("apply", U, 1))
  assert(tm:step("apply", U, 2))
  return tm:step("commit", U)
end

-- Past T's deadline (the owner's lease, SHORT), so that both are claimed
-- in one batch.
local function recover_TU(tm)
  require("mongotx.core").sleep(0.3)
  M.settle(tm, M.OTHER)
  return M.settle(tm, M.ID)
end

for _, s in ipairs {
  { name = "recover-batch", prepare = leave_TU, prepare_manager = SHORT,
    manager = M.recovery_manager(), allowed = { done = true }, other = { done = true },
    ci_kinds = { "update", "insert" }, run = recover_TU },
  -- the final recovery rolls T back too: nobody rolls it forward, so it
  -- only ends cancelled
  { name = "recover-batch-back", prepare = leave_TU, prepare_manager = SHORT,
    manager = M.recovery_manager { stale_pending = function() return "back" end },
    recover = "back", allowed = { cancelled = true }, other = { done = true },
    ci_kinds = { "update", "remove" }, run = recover_TU },
} do M.list[#M.list + 1] = s end

-- Managers configured differently on the same documents (issue 27;
-- torture/check.lua, OTHER).  `mgr-collections`: a transaction of
-- the other transactions collection under T's own id moves 30 from A to
-- D; its owner claimed it, applied its debit of A and is gone.  T then
-- runs in `transactions` (its floor guard reads past an open debit) and
-- the final recovery rolls the other one forward: each applies once.
-- `-held`: the other one's credit of A is applied instead, so T's guard
-- waits for it (busy) and T cancels.  `mgr-marker` (`-back`): T is
-- begun and left pending (its credit of B applied) by a manager with the
-- other marker and version field (by one with the defaults), and a
-- manager configured the other way recovers it, crashing at each point.
local check_other = require("torture.check").OTHER
-- (Its credit is applied in place, escrow = false, so that it holds A:
-- an escrowed one would not, docs/guards.md.)
local OTHER_TX = { application = "other", collection = check_other.collection, lease = 0.2,
                   stale_after = 0.2, escrow = false }
local OTHER_FIELDS = { application = "other", marker = check_other.marker,
                       version_field = check_other.version, lease = 0.2, stale_after = 0.2 }
local OTHER_KEY = check_other.collection .. ":" .. M.ID

-- The other collection's transaction under T's id: 30 from A to D
-- (`sign` -1), or from D to A (1); its owner applied its op on A only.
-- (Not T's 100: an op of one applied in place of the other's shows.)
local function other_holds(sign)
  return function(tm)
    local U = assert(tm:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = sign * 30 } } },
      { collection = "accounts", id = "D", update = { ["$inc"] = { balance = -sign * 30 } } },
    }, { id = M.ID }))
    assert(tm:step("claim", U))
    return tm:step("apply", U, 1)
  end
end

local function leave_T(tm, ctx)
  local T = assert(tm:begin(M.ops(ctx.kind), { id = M.ID }))
  assert(tm:step("claim", T))
  return tm:step("apply", T, 2)
end

local function recover_after_lease(tm)
  require("mongotx.core").sleep(0.3) -- past the first owner's deadline
  return recover_once(tm)
end

local function with_fields(extra)
  local o = M.recovery_manager(extra)
  o.marker, o.version_field = check_other.marker, check_other.version
  return o
end

for _, s in ipairs {
  { name = "mgr-collections", prepare = other_holds(-1), prepare_manager = OTHER_TX,
    allowed = DONE, also = { [OTHER_KEY] = { done = true } }, ci_kinds = { "update" },
    run = begin_commit },
  { name = "mgr-collections-held", kinds = { "update" }, prepare = other_holds(1),
    prepare_manager = OTHER_TX, allowed = CANCELLED, also = { [OTHER_KEY] = { done = true } },
    manager = BUSY, run = begin_commit },
  { name = "mgr-marker", prepare = leave_T, prepare_manager = OTHER_FIELDS,
    manager = M.recovery_manager(), allowed = { done = true },
    ci_kinds = { "update", "insert" }, run = recover_after_lease },
  { name = "mgr-marker-back", prepare = leave_T, prepare_manager = SHORT,
    manager = with_fields { stale_pending = function() return "back" end }, recover = "back",
    allowed = { cancelled = true }, ci_kinds = { "update", "remove" },
    run = recover_after_lease },
} do M.list[#M.list + 1] = s end

-- One serial order (issue 39; torture/serial.lua): U, of an owner gone,
-- pushed its entry onto s1 and not yet onto s2; T pushes onto s2 and s1
-- (exclusive ops: T waits for U, then cancels busy) and the final
-- recovery rolls U forward (T may then be rolled forward after it; U
-- cancels busy where T crashed holding s2) or back (its $pop undo must
-- pop its own entry).  Without isolation T's
-- entry lands after U's on s1 and before it on s2 (a cycle), or U's undo
-- pops T's entry (lost).  In every document's log in the fixture, and
-- checked at the end of every case (torture/check.lua).
local function serial_hold(tm)
  local U = assert(tm:begin({ serial.push(M.OTHER, "s1"), serial.push(M.OTHER, "s2") },
    { id = M.OTHER }))
  assert(tm:step("claim", U))
  return tm:step("apply", U, 1)
end

local function serial_T(tm)
  return tm:run({ serial.push(M.ID, "s2"), serial.push(M.ID, "s1") }, { id = M.ID })
end

for _, s in ipairs {
  { name = "serial-held-open", kinds = { "update" }, prepare = serial_hold,
    prepare_manager = SHORT, allowed = ALL, other = { done = true, cancelled = true },
    manager = BUSY, run = serial_T },
  { name = "serial-held-open-back", kinds = { "update" }, prepare = serial_hold,
    prepare_manager = SHORT, recover = "back", allowed = CANCELLED,
    other = { cancelled = true }, manager = BUSY, run = serial_T },
} do M.list[#M.list + 1] = s end

-- Holds (docs/holds.md): T holds 100 from A to B (expiring in 3 s),
-- then captures 60 of it (40 back to A) or voids it; a crash anywhere
-- leaves it to recovery, which expires a hold nobody decided once its
-- expiry passed (the checks' model replays what a capture took).
local function hold_then(decide)
  return function(tm)
    assert(tm:hold("accounts", "A", "B", M.AMOUNT, { id = M.ID, min = 0, expires = 3 }))
    return decide(tm)
  end
end

for _, s in ipairs {
  { name = "hold-capture", kinds = { "update" }, allowed = ALL,
    run = hold_then(function(tm) return tm:capture(M.ID, 60) end) },
  { name = "hold-void", kinds = { "update" }, allowed = CANCELLED,
    run = hold_then(function(tm) return tm:void(M.ID) end) },
} do M.list[#M.list + 1] = s end

function M.find(name)
  for _, s in ipairs(M.list) do
    if s.name == name then return s end
  end
end

return M

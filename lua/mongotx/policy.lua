-- The policies of a transaction manager, with their defaults written out.
-- Pass any of these keys to db:manager{...} to replace one; every value is
-- plain Lua data or a function, no C involved.

local core = require "mongotx.core"

local _M = {}

-- Seconds after its last change that a transaction counts as stale, and
-- so may be recovered by its own application.
_M.stale_after = 30

-- Seconds an owner holds a transaction without touching it before
-- another application may take it over.
_M.lease = 30

-- Seconds a call waits for the outcome of a transaction that another call
-- runs (two callers of one idempotency key, in any processes; or a commit
-- of a transaction another owner holds) before answering `in_progress`.
_M.holder_wait = 10

-- May the manager `me` recover the stale transaction `tx` (age in seconds
-- by the server's clock)?  Its own (same instance) at once, its
-- application's once stale, others' once their lease expired.  A begun
-- transaction records its creator's application and lease too; one
-- without an owner (begun before they were recorded) is anyone's once
-- stale.
function _M.may_recover(tx, age, me)
  if tx.application == nil then return age >= me.stale_after end
  if tx.instance == me.instance then return true end
  if tx.application == me.application then return age >= me.stale_after end
  return age >= (tonumber(tx.lease) or me.lease)
end

-- What to do when op i cannot apply. reason: "missing" (no document),
-- "guard" (its `where` is false), "conflict" (insert: _id taken),
-- "removing" (another open transaction removes the document),
-- "contention" (the document kept changing), "busy" (the op has a guard
-- and another transaction that has not committed holds the document:
-- the guard may not read its effects, which may still be undone).
-- Returns "cancel" (roll back, end cancelled), "retry" (try again after a
-- backoff, up to `retries` times, then cancel) or "fail" (stop and leave
-- the transaction pending for recovery).  A busy document is usually
-- released within a few milliseconds, so that one is retried.
function _M.on_op_failure(tx, i, reason) -- luacheck: no unused args
  if reason == "busy" then return "retry" end
  return "cancel"
end

-- A stale pending transaction: "forward" (apply the rest and commit) or
-- "back" (roll back).
function _M.stale_pending(tx) -- luacheck: no unused args
  return "forward"
end

-- A stale initial transaction, never started: "run" it or "expire" it.
function _M.stale_initial(tx) -- luacheck: no unused args
  return "run"
end

-- Transient errors (network, failover) are retried this many times, with
-- backoff(attempt) seconds of sleep() between tries.
_M.retries = 3

function _M.backoff(attempt)
  return math.min(0.05 * 2 ^ (attempt - 1), 1)
end

_M.sleep = core.sleep

-- When a transaction run at once (run, transfer, commit_many,
-- transfer_many) has reached `applied`, its commit point, the finishing
-- steps (pull the markers, move it to done) run "inline" before the call
-- returns, or "deferred": queued and done for many transactions together
-- by tm:finish(), which runs by itself every `finish_batch` commits.  A
-- process that exits with a queue leaves those transactions `applied`:
-- committed, and finished by recovery.
_M.finish = "inline"
_M.finish_batch = 100

-- Recovery parks a transaction (flags it `parked` with its reason, and
-- leaves it alone) after this many claims that did not finish it.
_M.max_attempts = 5

-- Seconds finished transactions are kept before prune() deletes them.
_M.retention = 24 * 3600

-- The ops of the transaction that undoes a committed one: each op's undo
-- in reverse order ($inc is inverted automatically when the op was
-- begun; anything else needs an explicit `undo`). Inserts become removes.
-- Returns ops, or nil and a message.
function _M.compensation(tx)
  local ops = {}
  for i = #tx.ops, 1, -1 do
    local op = tx.ops[i]
    if op.kind == "update" then
      ops[#ops + 1] = { collection = op.collection, id = op.id,
                        update = op.undo, undo = op.update }
    elseif op.kind == "insert" then
      ops[#ops + 1] = { collection = op.collection, id = op.id, kind = "remove" }
    elseif op.kind == "remove" then
      return nil, "op " .. i .. " removed a document: it cannot be compensated"
    end
  end
  if #ops == 0 then return nil, "nothing to compensate" end
  return ops
end

-- Called for every step with the event's name and a table (id, op, ...).
function _M.on_event(name, info) end -- luacheck: no unused args

return _M

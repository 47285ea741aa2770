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
-- "contention" (the document kept changing), "busy" (another
-- transaction that has not committed holds the document: a guard may not
-- read its effects, which may still be undone, and an exclusive op waits
-- for it; docs/guards.md, "Isolation").
-- Returns "cancel" (roll back, end cancelled), "retry" (try again after a
-- backoff, up to `retries` times, then cancel) or "fail" (stop and leave
-- the transaction pending for recovery).  A busy document is usually
-- released within a few milliseconds, so that one is retried; so is a
-- document that kept changing (rare: only a takeover's writes move a
-- version out of the band an apply is fenced by, mongotx.engine.bands).
function _M.on_op_failure(tx, i, reason) -- luacheck: no unused args
  if reason == "busy" or reason == "contention" then return "retry" end
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
-- backoff(attempt) seconds of sleep() between tries; so is an op that
-- finds its document held by another open transaction (`busy`, with the
-- default on_op_failure): the bound of that wait, 0.35 s in all by
-- default (docs/guards.md, "Isolation").
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

-- The bounds a where puts on numbers, each as fn(field, x, strict):
-- `field >= x` ($gte) and `field > x` ($gt, strict), at its top and
-- inside `$and` (the floor forms of docs/guards.md).
local function bounds(where, fn)
  if type(where) ~= "table" then return end
  for field, cond in pairs(where) do
    if field == "$and" and type(cond) == "table" then
      for _, part in ipairs(cond) do bounds(part, fn) end
    elseif type(field) == "string" and type(cond) == "table" then
      if type(cond["$gte"]) == "number" then fn(field, cond["$gte"], false) end
      if type(cond["$gt"]) == "number" then fn(field, cond["$gt"], true) end
    end
  end
end

-- The floor each field kept in tx's debits: an op that takes `d` off a
-- field ($inc of -d) under a `where` of `field >= x` keeps it at x - d or
-- above (a transfer's `min`), under `field > x` strictly above.  The
-- highest per field name (at one height, the strict one): { value, strict
-- }.  Only numbers (a guard on anything else is no floor this can carry).
local function floors_of(tx)
  local floors = {}
  for _, op in ipairs(tx.ops) do
    local inc = op.kind == "update" and type(op.update) == "table" and op.update["$inc"]
    if type(inc) == "table" then
      bounds(op.where, function(field, x, strict)
        local d = inc[field]
        if type(d) == "number" and d < 0 then
          local floor, was = x + d, floors[field]
          if was == nil or floor > was[1] or (floor == was[1] and strict) then
            floors[field] = { floor, strict }
          end
        end
      end)
    end
  end
  return floors
end

-- A guard that keeps `floors` on each field `update` takes from; nil when
-- it debits none of them.
local function floor_guard(update, floors)
  local inc = type(update) == "table" and update["$inc"]
  if type(inc) ~= "table" then return nil end
  local where
  for field, d in pairs(inc) do
    local floor = floors[field]
    if type(d) == "number" and d < 0 and floor ~= nil then
      where = where or {}
      where[field] = { [floor[2] and "$gt" or "$gte"] = floor[1] - d }
    end
  end
  return where
end

-- Is undo an $inc of exactly the update's paths, each number negated
-- (as begin derives it)?  Then a compensation leaves its undo to be
-- derived again, so that its credits are escrowed (docs/guards.md).
local function inverse_inc(update, undo)
  local u, v = update["$inc"], undo["$inc"]
  if type(u) ~= "table" or type(v) ~= "table" or next(update, next(update)) ~= nil
      or next(undo, next(undo)) ~= nil then
    return false
  end
  for k, x in pairs(u) do
    if type(x) ~= "number" or v[k] ~= -x then return false end
  end
  for k in pairs(v) do
    if u[k] == nil then return false end
  end
  return true
end

-- The ops of the transaction that undoes a committed one: each op's undo
-- in reverse order ($inc is inverted automatically when the op was
-- begun; anything else needs an explicit `undo`). Inserts become removes.
-- A refund must not overdraw: each of its debits keeps the floor the
-- original's debits of that field had, in every form (a transfer's
-- `min`: B, paid 30 by A with min = 0, gives the 30 back only while B >=
-- 30; `$gt`, inside `$and`), unless opts.floors is false.  Returns ops, or nil and a message.
function _M.compensation(tx, opts)
  local floors = (opts == nil or opts.floors ~= false) and floors_of(tx) or {}
  local ops = {}
  for i = #tx.ops, 1, -1 do
    local op = tx.ops[i]
    if op.kind == "update" then
      ops[#ops + 1] = { collection = op.collection, id = op.id, update = op.undo,
                        undo = not inverse_inc(op.update, op.undo) and op.update or nil,
                        where = floor_guard(op.undo, floors) }
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

-- The stepwise API (tm:step): one protocol step at a time, as in the
-- tutorial, through the engine (mongotx.engine).  Steps obey the rules
-- the other calls do, so a step out of order is refused and writes
-- nothing, and repeating a step that succeeded changes nothing.

local errors = require "mongotx.errors"
local engine = require "mongotx.engine"

local ipairs, tostring, type = ipairs, tostring, type
local format = string.format
local key, op_failure = engine.key, engine.op_failure

local _M = {}

-- One protocol step at a time, as in the tutorial:
--   tm:step("claim", t)        initial -> pending (reads versions first)
--   tm:step("apply", t, i)     op i, with the versions read at the claim
--   tm:step("commit", t)       pending -> applied
--   tm:step("finish", t, i)    pull op i's marker
--   tm:step("done", t)         applied -> done
--   tm:step("cancel", t)       pending -> canceling
--   tm:step("undo", t, i)      undo op i if it was applied
--   tm:step("cancelled", t)    canceling -> cancelled
-- Each returns the step's result table (or false / nil, err).  Steps
-- obey the rules the other calls do: claim follows the ownership policy (a
-- held transaction is claimed again only once its lease expired);
-- apply, commit and cancel need the transaction held by this manager;
-- finish and done need it committed, undo and cancelled canceling; commit
-- needs every op applied, done and cancelled every marker gone.  So a
-- step out of order is refused (`state`, `owned`), and repeating a step
-- that succeeded changes nothing.
local STEP_STATES = {
  apply = "pending", commit = "pending", cancel = "pending",
  finish = "applied", done = "applied", undo = "canceling", cancelled = "canceling",
}
-- The states a step leads to: repeating it there is a no-op, not an error.
local STEP_AFTER = {
  commit = { applied = true, done = true }, cancel = { canceling = true, cancelled = true },
  finish = { done = true }, done = { done = true },
  undo = { cancelled = true }, cancelled = { cancelled = true },
}
-- The steps that move the transaction itself.
local TRANSITIONS = { commit = true, done = true, cancel = true, cancelled = true }

-- step("claim"): an initial transaction is anyone's; an active one held
-- by this manager is returned as it is (claiming again would change its
-- epoch); one held by another needs the ownership policy's leave.
local function step_claim(eng, cache, T, refuse)
  if T.state == "done" or T.state == "cancelled" then
    return refuse("state", "the transaction is " .. T.state .. ": there is nothing to claim")
  end
  if eng:holding(T) then return T end
  local now, err
  if T.state ~= "initial" then
    now, err = eng:server_now()
    if not now then return nil, err end
    local age = T.lastModified and (now - T.lastModified:value()) / 1000 or math.huge
    if not eng.policy.may_recover(T, age, eng:me()) then
      return refuse("owned", format("held by %s until its lease expires",
        tostring(T.application)))
    end
  end
  local versions
  if T.state == "initial" or T.state == "pending" then
    versions, err = eng:versions(T)
    if not versions then return nil, err end
  end
  local claimed
  claimed, err = eng:claim(T, T.state == "initial" and { state = "pending" } or nil, now)
  if claimed and versions then cache.versions[key(T._id)] = versions end
  return claimed, err
end

-- apply: op i, fenced by the versions read at this manager's claim (or
-- read now, while it still holds T).
local function step_apply(eng, cache, T, i, refuse)
  local k = key(T._id)
  local versions = cache.versions[k]
  if not versions then
    local err
    versions, err = eng:confirmed_versions(T)
    if versions == nil then return nil, err end
    if not versions then return refuse("owned", "not held by this manager") end
    cache.versions[k] = versions
  end
  local ok, why, refusal = eng:apply_one(T, i, versions[i])
  if ok == nil then return nil, why end
  if not ok then return nil, op_failure(T, i, why, why == "refused" and refusal or nil) end
  return { applied = true }
end

-- undo: op i, once.  Done before (by this manager), or the transaction
-- is cancelled: a repeat writes nothing (after a takeover an undo
-- fences, and a second fence would write again).
local function step_undo(eng, cache, T, i)
  local k = key(T._id)
  local undone = cache.undone[k] or {}
  if T.state == "cancelled" or undone[i] then return { undone = false } end
  local res, err = eng:undo_op(T, i)
  if res then
    undone[i] = true
    cache.undone[k] = undone
  end
  return res, err
end

-- commit, done, cancel, cancelled: the move, once what it needs holds.
local function step_move(eng, cache, name, T, refuse)
  local k = key(T._id)
  -- after a takeover a former owner may still hold a prepared apply:
  -- cancelled needs every op undone (or fenced) by step("undo"), as the
  -- rollback does
  if name == "cancelled" and (T.epoch or 0) > 1 then
    local undone = cache.undone[k] or {}
    for j in ipairs(T.ops) do
      if not undone[j] then
        return refuse("state", format("op %d is not undone: after a takeover " ..
          "step(\"undo\", t, %d) undoes or fences it first", j, j))
      end
    end
  end
  -- commit needs every op applied; done and cancelled every marker gone
  if name ~= "cancel" then
    local versions, err = eng:versions(T)
    if not versions then return nil, err end
    for j, v in ipairs(versions) do
      if (name == "commit") ~= v.marked then
        return refuse("state", format("op %d is %s", j, name == "commit" and "not applied"
          or (name == "done" and "not finished" or "not undone")))
      end
    end
  end
  if name == "done" or name == "cancelled" then cache.versions[k] = nil end
  local moved, err
  if name == "cancel" then -- by the owner at its epoch, a caller's rollback
    moved, err = eng:step(name, T._id, eng.tx, T._id, T.epoch, nil, "rollback")
  elseif STEP_STATES[name] == "pending" then -- commit: by the owner at its epoch
    moved, err = eng:step(name, T._id, eng.tx, T._id, T.epoch)
  else
    moved, err = eng:step(name, T._id, eng.tx, T._id)
  end
  if moved == nil then return nil, err end
  return { moved = moved and true or false }
end

-- Step `name` (op i for apply, finish and undo) of T, as just loaded;
-- name and i are checked by the caller.  `cache` is what the caller's
-- steps remember: { versions = the versions read at its claims, undone =
-- the ops its undo steps did }, each by key(id).
function _M.step(eng, cache, name, T, i)
  local function refuse(code, message)
    return nil, errors.new(code, message, { step = name, id = T._id })
  end
  local bad = eng:fields_error(T)
  if bad then return nil, bad end
  -- an open hold is decided by capture, void or its expiry (mongotx.holds):
  -- a claim, commit or cancel here would decide it past their conditions
  -- (an expired hold captured); once decided, its steps are anyone's
  if type(T.hold) == "table" and T.state == "pending" then
    return refuse("invalid", "a hold is decided by capture or void, or expires: not by steps")
  end
  if name == "claim" then return step_claim(eng, cache, T, refuse) end
  local want = STEP_STATES[name]
  local again = T.state ~= want and STEP_AFTER[name] and STEP_AFTER[name][T.state]
  if again and TRANSITIONS[name] then return { moved = false } end
  if T.state ~= want and not again then
    return refuse("state", format("the transaction is %s, not %s", tostring(T.state), want))
  end
  if want == "pending" and not eng:holds(T) then
    return refuse("owned", "this manager does not hold the transaction: claim it first")
  end
  if name == "apply" then return step_apply(eng, cache, T, i, refuse) end
  if name == "undo" then return step_undo(eng, cache, T, i) end
  if name == "finish" then
    local op = T.ops[i]
    return eng:op_step(T, "finish", eng:coll(op.collection), op)
  end
  return step_move(eng, cache, name, T, refuse)
end

return _M

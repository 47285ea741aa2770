-- Recovery: finds the transactions that processes left behind (crashed,
-- stalled, gone) and drives each to done or cancelled through the engine
-- (mongotx.engine), under the policies: which may be recovered
-- (may_recover), a stale initial run or expired (stale_initial), a stale
-- pending rolled forward or back (stale_pending), and after
-- policy.max_attempts failed tries parked for an operator.

local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"

local ipairs, tostring, pcall = ipairs, tostring, pcall
local live = stored.live

local _M = {}

local ACTIVE = { "initial", "pending", "applied", "canceling" }

local function park(eng, T, reason)
  local res, err = eng.tx:update_one({ _id = T._id },
    { ["$set"] = { parked = true, reason = reason } }, eng.wopts)
  if not res then return nil, errors.wrap(err, "park", T._id) end
  eng:event("park", { id = T._id, reason = reason })
  return "parked"
end

-- Recovers one stale transaction; returns what happened: "done",
-- "cancelled", "skipped" or "parked", or nil, err.
local function recover_one(eng, T, now, me)
  if (T.attempts or 0) >= eng.policy.max_attempts then
    return park(eng, T, T.reason or "recovery failed too many times")
  end
  local age = T.lastModified and (now - T.lastModified:value()) / 1000 or math.huge
  if not eng.policy.may_recover(T, age, me) then return "skipped" end
  local versions, err
  if T.state == "initial" and eng.policy.stale_initial(T) == "expire" then
    local moved
    moved, err = eng:step("cancelled", T._id, eng.tx, T._id, "initial", T.epoch, "expired")
    if moved == nil then return nil, err end
    return moved and "cancelled" or "skipped"
  end
  if T.state == "initial" or T.state == "pending" then
    versions, err = eng:versions(T)
    if not versions then return nil, err end
  end
  local was = T.state
  local claimed
  claimed, err = eng:claim(T, was == "initial" and { state = "pending" } or nil, now)
  if claimed == nil then return nil, err end
  if not claimed then return "skipped" end
  T = claimed
  -- a stale initial one was never started: stale_initial decided it
  if was == "pending" and eng.policy.stale_pending(T) == "back" then
    T, err = eng:cancel(T, "rolled back by recovery")
    if not T then return nil, err end
    versions = nil
  end
  local final
  final, err = eng:drive(T, versions)
  if final then return "done" end
  if err.code == "cancelled" or err.code == "missing" or err.code == "guard"
      or err.code == "conflict" then
    local again = eng:get(T._id)
    if again and again.state == "cancelled" then return "cancelled" end
  end
  return nil, err
end

-- Up to `limit` well-formed active transactions that are not parked,
-- oldest first, read before recovery writes anything.  A malformed one
-- (validate.malformed) is counted in report.malformed and listed in
-- report.errors (the first `limit` of them), never written: it is evidence
-- for an operator.  Malformed ones do not count against the limit, so
-- however many pile up they cannot starve the well-formed ones behind
-- them; they only cost a read per pass until someone removes them.
local function stale_list(eng, limit, report)
  local cursor = eng.tx:find({
    state = { ["$in"] = ACTIVE },
    parked = { ["$ne"] = true },
  }, { sort = { lastModified = 1 } })
  local list, listed = {}, 0
  while #list < limit do
    local T, err = cursor:next()
    if not T then
      cursor:close()
      if err then return nil, errors.wrap(err, "recover") end
      return list
    end
    local why = validate.malformed(T, eng.vctx)
    if not why then
      list[#list + 1] = T
    else
      report.malformed = report.malformed + 1
      if listed < limit then
        listed = listed + 1
        report.errors[#report.errors + 1] = { id = T._id, error = errors.new("malformed",
          "malformed transaction, left as it is: " .. why, { step = "recover", id = T._id }) }
      end
    end
  end
  cursor:close()
  return list
end

-- Finds up to `limit` stale transactions and drives each to done or
-- cancelled under the policies.  Returns a report: { examined, done, cancelled, skipped,
-- parked, failed, malformed, errors = { {id, error}, ... } }.
function _M.recover(eng, limit)
  local now, err = eng:server_now()
  if not now then return nil, err end
  local me = eng:me()
  local report = { examined = 0, done = 0, cancelled = 0, skipped = 0, parked = 0,
                   failed = 0, malformed = 0, errors = {} }
  -- Oldest first; whether each one is stale enough is the policy's call
  -- (a holder may have declared a shorter lease than this manager's).
  local list
  list, err = stale_list(eng, limit, report)
  if not list then return nil, err end
  for _, T in ipairs(list) do
    report.examined = report.examined + 1
    local ok, outcome, failure = pcall(function()
      return recover_one(eng, live(T), now, me)
    end)
    if ok and outcome then
      report[outcome] = report[outcome] + 1
    else
      local e = ok and failure or errors.new("policy", tostring(outcome), { id = T._id })
      report.failed = report.failed + 1
      report.errors[#report.errors + 1] = { id = T._id, error = e }
      -- count the failure, so that a transaction that keeps failing is
      -- parked (with this reason) instead of blocking every pass
      eng.tx:update_one({ _id = T._id }, { ["$inc"] = { attempts = 1 },
        ["$set"] = { reason = tostring(e) } }, eng.wopts)
    end
  end
  eng:event("recover", report)
  return report
end

return _M

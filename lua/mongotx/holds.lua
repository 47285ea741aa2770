-- mongotx.holds: money reserved now and captured (all or part), voided
-- or expired later (docs/holds.md).  A hold is a transfer's transaction
-- applied and left pending: the debit of `from` in place (its floor
-- guard checked at once), the credit of `to` in escrow (`txPending`), so
-- debits, escrowed credits and floor guards there do not wait for it (no
-- `txHeld`); exclusive ops do (docs/guards.md, "Isolation").  Its outcome is decided by
-- one conditioned write on the transaction document, which moves it out
-- of `pending` and so can be won once:
--
--   capture  pending -> applied (the commit point), with what each op's
--            finish adds (`settle`: the captured part to `to`, the rest
--            back to `from`; csrc/txn_ops.c build_finish) when it is
--            part; only while `hold.expires` is ahead of the server's
--            clock ($$NOW);
--   void     pending -> canceling, cause "voided", the same condition;
--   expire   pending -> canceling, cause "expired", once it passed (a
--            capture or void that meets it, or recovery: recovery.lua
--            asks `triage` and `stale_way` here).
--
-- Opening is the create (pending, its deadline the expiry) and the
-- applies (fenced, as a transfer's, by the opener's deadline: its lease,
-- or the expiry when that comes first), nothing more: a hold costs a
-- transfer's writes.  The opener sends each apply once (Engine:retry,
-- `once`: no resend after a lost answer), so once both marks are on the
-- documents no apply of it can land any more; a capture or void checks
-- that (`opened`, one find) before it decides, and a hold without both
-- marks is `opening`.  Nobody owns an open hold: the decisions are
-- conditioned on its state and epoch, not on an owner, and recovery
-- claims a pending hold only past its expiry and its deadline, so one
-- whose opener died is rolled back then, never forward.  Writes issued
-- here pass the crash points hold.<step> (mongotx.points).

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"
local batch = require "mongotx.batch"
local points = require "mongotx.points"
local views = require "mongotx.holds.views"
local opening = require "mongotx.holds.open"

local live = stored.live
local Date = core.Date
local pairs, ipairs, type, tostring = pairs, ipairs, type, tostring
local floor, format, huge = math.floor, string.format, math.huge

local _M = {}

-- What tm:get, `mongotx show` and `list` say of holds (mongotx.holds.views).
_M.status, _M.view, _M.views = views.status, views.view, views.views

-- Opening holds, alone, by hold_many or by mongotx.group (mongotx.holds.open).
_M.EXPIRES, _M.check, _M.hold = opening.EXPIRES, opening.check, opening.hold
_M.open_entries, _M.hold_many = opening.open_entries, opening.hold_many

-- Tries of a decision that lost to a write not settling the hold (a recovery claim of an expired one).
local MAX_ROUNDS = 10

local function state_error(T, step, status, message)
  return errors.new("state", message, { step = step, id = T._id, status = status,
    captured = T.hold and T.hold.captured })
end

-- The condition on hold.expires of a decision: ahead of the server's clock
-- (past = false) or not (past = true), by $$NOW where the server evaluates
-- it in a write, else by its clock read now (as the engine's claims).
local function expiry(eng, past)
  local op = past and "$lte" or "$gt"
  if eng:server_deadlines() then
    return { ["$expr"] = { [op] = { "$hold.expires", "$$NOW" } } }
  end
  local now, err = eng:server_now()
  if not now then return nil, err end
  return { ["hold.expires"] = { [op] = Date(floor(now)) } }
end

-- The decision `step` (capture, void, expire) on the open hold T as read:
-- one findAndModify conditioned on its state, epoch and `cond`, setting
-- `set` (and this manager as the one that drives it on).  Returns T as
-- the write left it, false when the condition did not hold, or nil, err.
local function decide(eng, T, step, cond, set)
  local query = { _id = T._id, state = "pending", epoch = T.epoch }
  for k, v in pairs(cond) do query[k] = v end
  set.application, set.instance, set.lease = eng.application, eng.instance, eng.policy.lease
  local update = { ["$set"] = set, ["$inc"] = { epoch = 1 },
                   ["$currentDate"] = { lastModified = true } }
  local res, err = eng:retry(step, T._id, points.write, "hold", step, eng.tx.find_and_modify,
    eng.tx, query, { update = update, new = true, write_concern = eng.wopts.write_concern })
  if not res then return nil, err end
  if not res.value then return false end
  return live(res.value)
end

-- canceling -> cancelled: both undos in one bulk write (a hold's ops are
-- on one collection), then cancelled; when an undo matched nothing (done
-- already, by another that drives it too) the engine's way, which fences.
local function unwind(eng, T)
  if eng:form(T) == eng.own and T.ops[1].collection == T.ops[2].collection then
    local tid = stored.mark(T)
    local items = { { tid = tid, op = T.ops[1] }, { tid = tid, op = T.ops[2] } }
    local res = eng:many("undo", eng:coll(T.ops[1].collection), items)
    if res and res.ok and res.matched == #items then
      eng:event("undo", { id = T._id })
      return eng:move(T, "cancelled")
    end
  end
  return eng:unwind(T)
end

-- Drives a decided T to its final state (done, or cancelled); T as it
-- ends, or nil, err (then recovery finishes it: it is decided).
local function settle(eng, T)
  if T.state == "applied" then
    if eng:form(T) ~= eng.own then return eng:finish(T) end
    local _, err = batch.finish(eng, { T })
    if T.state ~= "done" then return nil, err end -- (a finish refused: still applied)
    return T
  end
  if T.state == "canceling" then return unwind(eng, T) end
  return T
end

-- May the decision `step` be taken on the pending hold T as read?  true
-- when it is open (`checked`: seen so before); T as it is now when it
-- was decided meanwhile (its finish or undo may have pulled the marks
-- before the find); nil, err (`state`, status "opening", when it is
-- still pending at that epoch without both marks).
local function may_decide(eng, T, step, checked)
  if checked then return true end
  local open, err = views.opened(eng, T)
  if open then return true end
  if open == nil then return nil, err end
  local now
  now, err = eng:get(T._id)
  if err then return nil, err end
  if now and (now.state ~= "pending" or now.epoch ~= T.epoch) then return now end
  return nil, state_error(T, step, "opening", "the hold is not open yet")
end

-- The expiry decision on T (open and pending): true when T is now
-- decided (by this call or another), or nil, err.
local function expire(eng, T)
  local cond, err = expiry(eng, true)
  if not cond then return nil, err end
  local won
  won, err = decide(eng, T, "expire", cond,
    { state = "canceling", reason = "expired", cause = "expired" })
  if won == nil then return nil, err end
  if won then
    eng:event("expire", { id = T._id, amount = T.hold.amount })
    local _
    _, err = settle(eng, won)
    if err then return nil, err end
  end
  return true
end

-- Reads the hold `id` for `step`: T, or nil, err (`state`: none; `invalid`: no hold).
local function load(tm, id, step, level)
  local T, err = tm:_get(id, step, level + 1)
  if err then return nil, err end
  if not T then
    return nil, errors.new("state", "no such hold", { step = step, id = id })
  end
  if type(T.hold) ~= "table" then
    return nil, errors.new("invalid", "transaction " .. tostring(T._id) ..
      " is not a hold", { step = step, id = T._id })
  end
  return T
end

-- The settle fields of a capture of `amount` of T: the part to `to` (op
-- 2), the rest back to `from` (op 1); none for all of it.
local function settles(T, amount, set)
  local held = T.hold.amount
  if amount == held then return set end
  local field = next(T.ops[2].update["$inc"])
  set["ops.0.settle"] = { [field] = held - amount }
  set["ops.1.settle"] = { [field] = amount }
  return set
end

-- A capture or void whose decision did not win: the hold as it is now.
-- One still pending at the epoch read was decided by nobody: it is past
-- its expiry, so it is expired first.  Returns T, or nil, err.
local function after_lost(eng, T)
  local now, err = eng:get(T._id)
  if not now then
    return nil, err or errors.new("state", "the hold disappeared", { id = T._id })
  end
  if now.state == "pending" and now.epoch == T.epoch then
    local ok
    ok, err = expire(eng, now)
    if not ok then return nil, err end
    now, err = eng:get(T._id)
    if not now then
      return nil, err or errors.new("state", "the hold disappeared", { id = T._id })
    end
  end
  return now
end

-- The decision `step` (capture, void) on the hold T as read, taken or
-- met: until T is decided (by this call, another, or an expiry), at most
-- MAX_ROUNDS times, each a check that it is open (may_decide, once seen
-- open), the conditioned write (decide: `set`; on_event(step, `info`)
-- when it won), or T as it is now when it lost (after_lost).  Returns
-- answer(T) of the decided T (which drives it on and says what the call
-- answers), or nil, err.
local function until_decided(eng, T, step, set, info, answer)
  local checked = false -- both marks seen on (opened): no apply can land any more
  for _ = 1, MAX_ROUNDS do
    local state = T.state
    if state == "applied" or state == "done" or state == "canceling" or state == "cancelled" then
      return answer(T)
    end
    local go, err = may_decide(eng, T, step, checked)
    if not go then return nil, err end
    if go ~= true then
      T = go -- decided meanwhile: answered as it stands
    else
      checked = true
      local cond
      cond, err = expiry(eng, false)
      if not cond then return nil, err end
      local won
      won, err = decide(eng, T, step, cond, set)
      if won == nil then return nil, err end
      if won then
        eng:event(step, info)
        T = won
      else
        T, err = after_lost(eng, T)
        if not T then return nil, err end
      end
    end
  end
  return nil, errors.new("state", "the hold did not settle", { step = step, id = T._id })
end

-- capture(tm, id, amount): see Manager:capture.
function _M.capture(tm, id, amount, level)
  local T, err = load(tm, id, "capture", level + 1)
  if not T then return nil, err end
  if amount ~= nil then
    local ok
    ok, err = validate.amount(amount)
    if not ok then
      err.step, err.id = "capture", T._id
      return nil, err
    end
    if amount > T.hold.amount then
      return nil, errors.new("invalid", format("capture of %s is more than the %s held",
        tostring(amount), tostring(T.hold.amount)), { step = "capture", id = T._id })
    end
  else
    amount = T.hold.amount
  end
  local eng = tm.engine
  return until_decided(eng, T, "capture",
    settles(T, amount, { state = "applied", ["hold.captured"] = amount }),
    { id = T._id, amount = amount, held = T.hold.amount },
    function(D)
      if D.state == "applied" or D.state == "done" then
        if D.hold.captured ~= amount and not (D.hold.captured == nil and amount == D.hold.amount) then
          return nil, state_error(D, "capture", "captured", format("the hold was captured " ..
            "with %s", tostring(D.hold.captured or D.hold.amount)))
        end
        local final, e = settle(eng, D)
        if not final then return nil, e end
        return _M.view(eng, final)
      end
      local _, e = settle(eng, D)
      if e and e.code ~= "cancelled" then return nil, e end
      local status = views.status(D)
      return nil, state_error(D, "capture", status, "the hold was " .. status)
    end)
end

-- void(tm, id): see Manager:void.
function _M.void(tm, id, level)
  local T, err = load(tm, id, "void", level + 1)
  if not T then return nil, err end
  local eng = tm.engine
  return until_decided(eng, T, "void", { state = "canceling", reason = "voided", cause = "voided" },
    { id = T._id, amount = T.hold.amount },
    function(D)
      if D.state == "applied" or D.state == "done" then
        local _, e = settle(eng, D)
        if e then return nil, e end
        return nil, state_error(D, "void", "captured", format("the hold was captured with %s",
          tostring(D.hold.captured or D.hold.amount)))
      end
      local final, e = settle(eng, D)
      if e and e.code ~= "cancelled" then return nil, e end
      return _M.view(eng, final or eng:get(D._id) or D)
    end)
end

-- The captured hold T as the transfer it amounts to (a copy): each op
-- moves the captured amount, the debit's floor guard what it was, so
-- that its compensation (policy.compensation) gives back what was
-- captured, keeping the floors (tm:compensate).
function _M.as_captured(T)
  local c, held = T.hold.captured or T.hold.amount, T.hold.amount
  local out, ops = {}, {}
  for k, v in pairs(T) do out[k] = v end
  for i, op in ipairs(T.ops) do
    local o = {}
    for k, v in pairs(op) do o[k] = v end
    local sign = i == 1 and -1 or 1
    local field = next(op.update["$inc"])
    o.update = { ["$inc"] = { [field] = sign * c } }
    o.undo = { ["$inc"] = { [field] = -sign * c } }
    o.settle = nil
    local floor_ = type(op.where) == "table" and type(op.where[field]) == "table"
      and op.where[field]["$gte"]
    if type(floor_) == "number" then o.where = { [field] = { ["$gte"] = floor_ - held + c } } end
    ops[i] = o
  end
  out.ops = ops
  return out
end

-- Recovery -------------------------------------------------------------------

-- Why an op's `settle` (what the finish of a capture adds) does not fit
-- its update, or nil: finite positive numbers, each on a path of the
-- update's $inc, no more than an escrowed credit holds, no more than a
-- debit took (validate.malformed asks).
function _M.settle_error(op, update)
  if op.kind ~= "update" or core.type(op.settle) ~= "object" then
    return "settle is not a document of an update op"
  end
  local inc = type(update) == "table" and update["$inc"]
  for path, n in pairs(op.settle) do
    local d = type(inc) == "table" and inc[path]
    if type(n) ~= "number" or n ~= n or n <= 0 or n == huge or type(d) ~= "number" then
      return "settle " .. tostring(path) .. " is not a positive number of the update's $inc"
    end
    if (op.effect == "escrow" and n > d) or (op.effect ~= "escrow" and n > -d) then
      return "settle " .. path .. " is more than the update moves"
    end
  end
end

-- What recovery does with the hold T (mongotx.recovery's triage): a
-- pending one (open, or whose opener died) is claimed once past its
-- expiry by `now` (the claim itself waits for its deadline, the expiry,
-- or later where an opener that had to wait renewed it, by the server's
-- clock), whoever holds it, and never by the "own" route; a decided one
-- as any transaction.
function _M.triage(eng, T, now, age, me)
  if T.state ~= "pending" then
    return eng.policy.may_recover(T, age, me) and "claim" or "skipped"
  end
  local at = core.type(T.hold.expires) == "date" and T.hold.expires:value()
  return at and at <= now and "claim" or "skipped"
end

-- How recovery ends a pending hold it claimed: always back (forward
-- would capture it), as expired; the reason and cause of the cancel.
function _M.stale_way()
  return "back", "expired", "expired"
end

-- The part of recovery's filter that leaves out the pending holds not
-- yet past their expiry at `now` (the server's ms): no pass reads them.
function _M.not_due(now)
  return { state = "pending", ["hold.expires"] = { ["$gt"] = Date(floor(now)) } }
end

return _M

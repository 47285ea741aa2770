-- mongotx.engine.holders: a transaction another owner holds, pending:
-- whether its owner's lease passed (lapsed), the answer while it has not
-- (held_error), the wait for its outcome (await, await_many: one read of
-- them all a backoff, at most policy.holder_wait) and its takeover once
-- the lease passed (take_over, as recovery would).  Methods of the Engine
-- class (mongotx.engine adds `methods` to it).

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"

local key, live = validate.tid_key, stored.live
local ipairs, tostring, tonumber = ipairs, tostring, tonumber

local _M = {}

-- The Engine methods of this module.
local Engine = {}
_M.methods = Engine

-- Has the lease of T's owner passed (T pending, another owner's)?  With a
-- deadline (the owner's applies are fenced by it): once the deadline is
-- behind the server's clock, as estimated (a claim checks it again on the
-- server); else once its lease (T's recorded lease, or this manager's)
-- ran since it last moved.  A parked transaction waits for an operator:
-- never.  Returns it, and the seconds left until it passes; nil, err.
function Engine:lapsed(T)
  if T.parked then return false end
  local now, err = self:clock()
  if not now then return nil, err end
  local until_ms
  if T.deadline ~= nil and core.type(T.deadline) == "date" then
    until_ms = T.deadline:value()
  elseif T.lastModified ~= nil and core.type(T.lastModified) == "date" then
    until_ms = T.lastModified:value() + (tonumber(T.lease) or self.policy.lease) * 1000
  else
    return false
  end
  local left = (until_ms - now) / 1000
  return left < 0, math.max(left, 0)
end

-- T is pending and another owner holds it within its lease: two calls of
-- one idempotency key (in any processes) met, or a commit came for a
-- transaction someone else runs.
function Engine:held_error(T)
  return errors.new("in_progress", ("held by %s, which did not finish it in %g s " ..
    "(holder_wait): ask again later; once its lease passed, a retry takes it over"):format(
    tostring(T.application), self.policy.holder_wait), { id = T._id })
end

-- What a caller that waits for T itself (not this engine: a handler in
-- nginx, mongotx.group's caller) needs: T's id, policy.holder_wait, and
-- the seconds until its owner's lease passes (then a call takes it over).
function Engine:held_info(T)
  local lapsed, lapse = self:lapsed(T)
  -- (unknown when the clock could not be read: until holder_wait)
  return { id = T._id, wait = self.policy.holder_wait, lapse = lapsed ~= nil and lapse or nil }
end

-- Waits for the transactions of `list`, pending and held by other owners,
-- all at once: every policy.backoff, one read of them all, until each
-- left pending or its owner's lease passed (lapsed), for at most
-- policy.holder_wait seconds.  Returns out[i]: T as read then, or false
-- and errs[i]: why (held_error when its holder kept it within its lease
-- all that time, the read's failure, or the transaction disappeared).
function Engine:await_many(list)
  local policy = self.policy
  local give_up = core.monotonic_ms() + policy.holder_wait * 1000
  local out, errs, waiting, attempt = {}, {}, {}, 0
  for i, T in ipairs(list) do
    out[i], errs[i] = false, false
    local sent, err = validate.check_tid(T._id)
    if sent == nil then errs[i] = err else waiting[#waiting + 1] = { i = i, sent = sent, T = T } end
  end
  while #waiting > 0 do
    local left = (give_up - core.monotonic_ms()) / 1000
    if left <= 0 then break end
    attempt = attempt + 1
    policy.sleep(math.min(policy.backoff(attempt), left))
    local ids = {}
    for k, w in ipairs(waiting) do ids[k] = w.sent end
    local docs, err = self.tx:find_all({ _id = { ["$in"] = ids } }, { limit = #ids })
    if not docs then
      for _, w in ipairs(waiting) do errs[w.i] = errors.wrap(err, nil, w.T._id) end
      return out, errs
    end
    local by_id = {}
    for _, doc in ipairs(docs) do by_id[key(doc._id)] = live(doc) end
    local still = {}
    for _, w in ipairs(waiting) do
      local now = by_id[key(w.T._id)]
      local lapsed
      if now and now.state == "pending" then
        lapsed, err = self:lapsed(now)
        if lapsed == nil then errs[w.i] = err end
      end
      if not now then
        errs[w.i] = errors.disappeared(w.T._id)
      elseif now.state ~= "pending" or lapsed then
        out[w.i] = now
      elseif lapsed == false then
        w.T, still[#still + 1] = now, w
      end
    end
    waiting = still
  end
  for _, w in ipairs(waiting) do errs[w.i] = self:held_error(w.T) end
  return out, errs
end

-- One transaction, as await_many: T as read once it left pending or its
-- owner's lease passed; nil and `in_progress` after policy.holder_wait
-- seconds (its holder, or after its lease a retry or recovery, still has
-- to finish it).
function Engine:await(T)
  local out, errs = self:await_many({ T })
  if out[1] then return out[1] end
  return nil, errs[1]
end

-- Takes over T, pending and held by an owner whose lease passed (lapsed):
-- as recovery would (recovery.lua, recover_one): its versions read, a
-- claim, then forward (the versions, to apply the rest) or, when
-- policy.stale_pending says so, back (cancelled as recovery cancels).
-- Returns T as it now is and the versions, or T read again (a claim
-- lost: someone else moved it first, or the server's clock says the
-- deadline has not passed yet) and nil; nil, nil, err.
function Engine:take_over(T)
  local versions, err = self:versions(T)
  if not versions then return nil, nil, err end
  local claimed
  claimed, err = self:claim(T)
  if claimed == nil then return nil, nil, err end
  if not claimed then
    self.policy.sleep(self.policy.backoff(1))
    local now
    now, err = self:get(T._id)
    if not now then
      return nil, nil, err or errors.disappeared(T._id)
    end
    return now
  end
  if self.policy.stale_pending(claimed) == "back" then
    local moved
    moved, err = self:cancel(claimed, "rolled back by recovery", "recovery")
    return moved, nil, err
  end
  return claimed, versions
end

-- How many takeovers one call nests: a holder taken over by resolve meets
-- a holder of its own, which it takes over in turn, and so on.  Past this
-- depth a holder is waited for as any open one (`busy`).
local MAX_NESTED = 4

-- H, another owner's transaction whose mark holds a document that T, an
-- op of this engine, needs (Engine:release): open (pending or canceling)
-- or committed (applied).  Once its owner's lease passed (lapsed) it is
-- driven to the end recovery gives it, whoever meets it, and claimed
-- first as recovery claims it (epoch + 1: a takeover, whose undos move
-- each version by a band and fence the documents not applied, so a lost
-- apply of the dead owner can no longer land): a pending one taken over
-- (take_over: forward, or back where policy.stale_pending says so), a
-- canceling one undone, an applied one finished; then nothing of it
-- holds the document.  So an op never waits for, nor is cancelled `busy`
-- by, a holder whose owner died.  The drive retries every step as any
-- would (a hold's opener sends only its own applies once: `once`).  Its
-- apply sleeps a retry only where T's apply sleeps its own (self.waits:
-- Engine:apply_ops alone, without `hand`); anywhere else (a batch, a
-- call handed to its caller, tm:step) it stops there, H stays claimed
-- with its tries, and T waits busy as for a live holder: the next op of
-- this engine that meets H goes on with H's apply, tries and all.
-- Returns true when H ended (done or cancelled), false when it holds on
-- (its lease has not passed; a hold, which capture, void or expiry
-- decides; this engine's own; another owner took it over first; nested
-- past MAX_NESTED; its apply waits a retry; or its drive failed: it is
-- then waited for as a live one, and the next op of this engine that
-- meets it drives it again), or nil, err for an error that is T's own.
function Engine:resolve(H, T)
  local state, k = H.state, key(H._id)
  local stalled = self.stalled[k]
  local again = stalled ~= nil and stalled.epoch == H.epoch and self:holding(H)
  if H.hold ~= nil or (self:holding(H) and not again) or (self.resolving or 0) >= MAX_NESTED
     or not (state == "pending" or state == "canceling" or state == "applied") then
    return false
  end
  local once, mode = self.once, self.waits and true or "hand"
  self.resolving, self.once, self.stalled[k] = (self.resolving or 0) + 1, nil, nil
  local ok, ended, why, _, busy = pcall(function()
    local versions
    if not again then -- (again: claimed by a resolve of this engine that stopped)
      local lapsed, e = self:lapsed(H)
      if not lapsed then return lapsed, e end
      local now, vs
      if state == "pending" then
        now, vs, e = self:take_over(H)
        if not now then return nil, e end
        if now.state == "pending" and not vs and not self:holds(now) then return false end
      else
        now, e = self:claim(H)
        if not now then return now, e end -- false: someone else moved it first
      end
      H, versions = now, vs
    end
    -- later: a holder that another owner took over meanwhile is not waited for
    return self:drive(H, versions, mode, again and stalled.tries or nil)
  end)
  self.resolving, self.once = self.resolving - 1, once
  if not ok then error(ended, 0) end
  if busy then -- its apply waits a retry: not here (T waits busy)
    self.stalled[k] = { epoch = busy.st.T.epoch, tries = busy.st.tries }
    self:event("resolve", { id = H._id, reason = "busy" })
    return false
  end
  if ended then return ended.state == "done" or ended.state == "cancelled" end
  if ended == false then return false end
  local code, id = why and why.code, why and why.id
  -- (H's own op failure, with its cause: drive answers it once H ended
  -- cancelled by it, as for a cancelled_error)
  if (code == "cancelled" or why and why.cause ~= nil) and id ~= nil and key(id) == k then return true end
  if T and id ~= nil and key(id) == key(T._id) then return nil, why end
  if self:holding(H) then self.stalled[k] = { epoch = H.epoch } end
  if code ~= "in_progress" then self:event("resolve", { id = H._id, reason = code }) end
  return false
end

return _M

-- mongotx.batch.settle: the entries of a batch (mongotx.batch's) that
-- could not go the fast way, each settled alone with the engine's
-- one-at-a-time steps, and all of them together (settle_all): one wait
-- for those that wait.  mongotx.batch and mongotx.engine.forward (the
-- grouped tm:commit, batched recovery) settle theirs here.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local canon, id_key = validate.canon, validate.id_key

local ipairs, pairs, pcall, error, next, tostring, tonumber =
  ipairs, pairs, pcall, error, next, tostring, tonumber

local _M = {}

local function fail(e, err) e.err = e.err or err end

-- What a step of entry e alone raised: a policy's raise
-- (errors.guard_policy) fails e only, with that raise as its error (code
-- "policy", and e's id); anything else (an interrupt, out of memory, a
-- bug of mongotx) is not e's failure and goes on up.
local function raised_in(e, raised)
  if not errors.is_policy(raised) then error(raised, 0) end
  fail(e, errors.new("policy", raised.message, { id = e.T._id, policy = raised.policy }))
end

-- fn(eng, e, ...), a step of entry e alone, which may call the policies
-- (on_op_failure, backoff, sleep): one that raises fails e, not the rest
-- of its batch (they settle, commit and finish as usual).
local function guarded(fn, eng, e, ...)
  local ok, raised = pcall(fn, eng, e, ...)
  if not ok then raised_in(e, raised) end
end

-- Did this batch's create insert `existing`, the document under T's id?
-- Untouched since (pending, epoch 1), by this manager, with the
-- lastModified this batch stamped: an earlier call's transaction under
-- the same id has moved on (every move sets lastModified) or carries its
-- own batch's stamp.  The bulk reply cannot say: mongo-java-server counts
-- a failed insert as inserted, FerretDB stops at it.
local function inserted_here(eng, T, existing)
  local at, stamp = existing.lastModified, T.lastModified
  return existing.state == "pending" and existing.epoch == 1
    and existing.instance == eng.instance and at ~= nil and stamp ~= nil
    and core.type(at) == "date" and at:value() == stamp:value()
end

-- The versions an apply of e alone starts from: those read (versions),
-- or none (fenced by the deadline alone); marked where the batch applied
-- it, missed where the batch sent it and it did not match.
local function apply_versions(e, deadline, versions)
  local vs = {}
  for i in ipairs(e.T.ops) do
    local version = false -- none read: fenced by the deadline alone
    if versions then version = versions[i].version end
    vs[i] = { marked = e.applied[i] or false, deadline = deadline, version = version,
              missed = e.sent[i] and not e.applied[i] }
  end
  return vs
end

-- The end of settle for e, whose transaction is now T: committed, it is
-- finished with the others; else driven to its end alone.
local function conclude(eng, e, T)
  if T.state == "applied" then
    eng:hold(T._id, nil)
    e.T = T -- committed: finished with the others, inline or deferred
    return
  end
  local final, err, held, busy = eng:drive(T, nil, e.later)
  -- held by another owner within its lease (with e.later): not waited for
  -- here, so that it holds none of the others (e.held: its caller waits);
  -- nor, with e.later = "hand", an apply's retry (e.busy: the same)
  if held then e.held = held end
  if busy then return _M.handing(e, busy) end
  -- the op failure explains a cancel; when the cancel did not happen (the
  -- transaction was taken over meanwhile) the caller learns what did
  if not final then return fail(e, (not err or err.code == "cancelled") and e.failure or err) end
  e.T = final
end

-- The end of an apply of e alone (apply_all's answer: T committed,
-- cancelled with the op's failure, or taken over; or nil, err).
local function applied(eng, e, moved, err, failure)
  if not moved then return fail(e, err) end
  e.failure = failure
  return conclude(eng, e, moved)
end

-- The one-at-a-time way for an entry the batch could not settle.
local function settle(eng, e, deadline, versions)
  local T = e.T
  if e.slow == "create" then
    local existing, err = eng:get(T._id)
    if err then return fail(e, err) end
    if not existing then
      -- a batch the server cut short: create this one alone
      local doc = {}
      for k, v in pairs(T) do doc[k] = v end
      doc.ops = e.doc.ops
      local res
      res, err = eng:step("create", T._id, eng.tx, doc)
      if not res then return fail(e, err) end
      existing = res.created and T or eng:get(T._id)
    end
    if existing ~= T and canon(existing.ops) ~= canon(T.ops) then
      return fail(e, errors.new("idempotency", "this id was used for other ops",
        { step = "begin", id = T._id }))
    end
    if existing ~= T and inserted_here(eng, T, existing) then
      -- the bulk insert did not say it inserted this one: its create
      -- event is due all the same (metrics count it), once
      eng:event_id("create", T._id)
    end
    T = existing
    if T.state == "pending" and T.instance == eng.instance and T.epoch == 1 then
      eng:hold(T._id, 1) -- ours, from an earlier try of this batch
    end
  elseif e.slow == "apply" then
    return applied(eng, e, eng:apply_all(T, apply_versions(e, deadline, versions)))
  else -- commit: somebody else moved it; see where it stands
    local err
    T, err = eng:get(T._id)
    if not T then return fail(e, err or errors.new("state", "no such transaction", { id = e.T._id })) end
  end
  return conclude(eng, e, T)
end

-- Does op commute with any other such op: an $inc that no guard reads
-- (a debit, or an escrowed credit), whose order nobody sees?
local function commutes(op)
  return op.where == nil and (op.effect == "lowers" or op.effect == "escrow")
end

-- The documents of e's ops, as keys ("collection\0id key") -> whether
-- every op of e on it commutes.
local function documents(e)
  local out = {}
  for _, op in ipairs(e.T.ops) do
    local d = op.collection .. "\0" .. (id_key(op.id) or tostring(op.id))
    out[d] = commutes(op) and out[d] ~= false
  end
  return out
end

-- One step of entry e in settle_all's round (st: its apply's state, or
-- true before it began).  Returns the apply's state and the seconds it
-- waits when its apply waits for a retry, else nothing (settled, or
-- failed).
local function step(eng, e, st, deadline, versions)
  if st == true then
    if e.slow ~= "apply" then return settle(eng, e, deadline, versions) end
    st = eng:apply_start(e.T, apply_versions(e, deadline, versions))
  end
  local moved, err, failure = eng:apply_more(st)
  if moved == false then return st, err end
  if moved == true then moved, err = eng:move(e.T, "commit", e.T.epoch) end
  return applied(eng, e, moved, err, failure)
end

-- Retries of settle_all due within this many ms of the first one due
-- are waited for with it, so that one sleep serves them all.
local SLACK_MS = 20

-- What an entry handed to its caller (e.busy: { st, wait, after }) needs
-- to go on there (mongotx.group.busy): its transaction's id and epoch,
-- the seconds until its next try, each op's tries so far and the
-- versions its applies go on from (marked where applied), and the
-- entries (indices of its list) it goes after.  Lists of one value an
-- op, so that it crosses to an nginx worker thread as BSON.
local function handed(e, deadline, versions)
  local b = e.busy
  local T = b.st == true and e.T or b.st.T
  local tries, vs = {}, b.st == true and apply_versions(e, deadline, versions) or b.st.versions
  for i in ipairs(T.ops) do
    tries[i] = b.st ~= true and b.st.tries[i] or 0
    if b.st ~= true then vs[i].marked = b.st.held[i] or false end
  end
  return { id = T._id, epoch = T.epoch, wait = b.wait, after = b.after, tries = tries, versions = vs,
           drive = b.drive }
end

-- Entry e's drive (Engine:drive with e.later = "hand") stopped at an
-- apply's retry (busy: apply_ops's): e is handed to its caller, who goes
-- on with it as drive would (drive: mongotx.group.busy's kind "drive").
function _M.handing(e, busy)
  e.busy = { st = busy.st, wait = busy.wait, after = {}, drive = true }
end

-- settle_all's way for a batch whose callers wait for themselves
-- (mongotx.group): one pass, in batch order, that sleeps nowhere.  An
-- entry whose apply must wait for a retry is handed to its caller
-- (e.busy: { st = <its apply's state>, wait = <seconds> }, the engine's
-- hold of it given up: the caller goes on with it by its epoch), and so
-- is one on a document of an entry handed over before it, unless both
-- only add to it (documents): it goes on after them (after: their
-- indices), so batch order stays their order.  (Only an entry still to
-- apply is handed over so; one to create or commit alone settles here.)
local function hand_all(eng, list, deadline, vs, step_fn)
  local gone = {} -- document -> { free = <all its entries only add>, <their indices> }
  for n, e in ipairs(list) do
    if e.slow and not e.err then
      local docs, after = documents(e), {}
      for d, free in pairs(docs) do
        local g = gone[d]
        if g and not (g.free and free) then
          for _, m in ipairs(g) do after[#after + 1] = m end
        end
      end
      if after[1] and e.slow == "apply" then
        table.sort(after)
        e.busy = { st = true, wait = 0, after = after }
      else
        local ok, st, wait = pcall(step_fn, eng, e, true, deadline, vs and vs[n])
        if not ok then
          raised_in(e, st)
        elseif st then
          e.busy = { st = st, wait = tonumber(wait) or 0, after = {} }
        end -- (or its drive handed it: handing)
      end
      if e.busy then
        eng:hold(e.T._id, nil) -- (its id: a drive's claim moves the epoch only)
        for d, free in pairs(docs) do
          local g = gone[d] or { free = true }
          g.free, g[#g + 1], gone[d] = g.free and free, n, g
        end
      end
    end
  end
end

-- The entries a batch left behind (list; vs[n] the versions read for
-- list[n], when read), each settled as settle settles it, but together,
-- so that one whose apply waits (a document another open transaction
-- holds: `busy`, retried after a backoff) holds none of the others.
-- Each round steps every entry not yet settled whose retry is due, in
-- batch order, then sleeps until the next retry is due: each entry waits
-- its own backoffs, and k entries waiting on held documents cost the
-- wait of one, not k.  An entry that touches a document of an earlier one
-- not yet settled waits for it, as one at a time it would, unless both
-- only add to it (documents: their order shows nowhere): so none reads
-- an effect of an earlier one that may still be undone, nor applies one
-- an earlier one would read, and batch order stays their order
-- (mongotx.group reports it).  A policy's raise fails its entry only; one
-- of a sleep, every entry that waited on it.  step_fn(eng, e, st,
-- deadline, versions) steps one entry as `step` does (mongotx.holds
-- opens its holds so).  With `hand`, nothing sleeps: hand_all.
local function settle_all(eng, list, deadline, vs, step_fn, hand)
  step_fn = step_fn or step
  if hand then return hand_all(eng, list, deadline, vs, step_fn) end
  local open, due, ms = {}, {}, core.monotonic_ms
  for n, e in ipairs(list) do
    if e.slow and not e.err then open[n] = true end
  end
  while next(open) do
    local taken, now = {}, ms()
    for n, e in ipairs(list) do
      local st, docs = open[n], nil
      if st then
        docs = documents(e)
        local blocked = st ~= true and due[n] > now -- (its retry is not due yet)
        for d, free in pairs(docs) do
          local t = taken[d]
          blocked = blocked or (t ~= nil and not (t and free))
        end
        if not blocked then
          local ok, moved, wait = pcall(step_fn, eng, e, st, deadline, vs and vs[n])
          if not ok then
            raised_in(e, moved)
            moved = nil
          end
          open[n] = moved
          if moved then due[n] = ms() + (tonumber(wait) or 0) * 1000 end
        end
      end
      if open[n] then
        for d, free in pairs(docs) do taken[d] = free and taken[d] ~= false end
      end
    end
    -- until the first retry due, and those due just after it
    local first, until_ms
    for n, st in pairs(open) do
      if st ~= true and (first == nil or due[n] < first) then first = due[n] end
    end
    for n, st in pairs(open) do
      if st ~= true and due[n] <= first + SLACK_MS then
        until_ms = math.max(until_ms or due[n], due[n])
      end
    end
    local left = until_ms and (until_ms - ms()) / 1000
    if left and left > 0 then
      local ok, raised = pcall(eng.policy.sleep, left)
      if not ok then
        for n, st in pairs(open) do
          if st ~= true then
            open[n] = nil
            raised_in(list[n], raised)
          end
        end
      end
      for n, st in pairs(open) do
        if st ~= true and due[n] <= until_ms then due[n] = 0 end -- (due now: the sleep said so)
      end
    end
  end
end

_M.fail, _M.raised_in, _M.guarded, _M.settle_all = fail, raised_in, guarded, settle_all
_M.inserted_here, _M.handed, _M.step, _M.conclude = inserted_here, handed, step, conclude
_M.commutes = commutes

return _M

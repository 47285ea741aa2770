-- mongotx.engine.phases: the phases of one transaction once claimed:
-- apply (apply_one and apply_all, with refence, renew and release for the
-- documents other transactions hold; the retries between are
-- mongotx.engine.applies), the moves of its state (move,
-- cancel, finish), the way back (undo_op, unwind) and drive, which runs
-- them from whatever state T is in.  Methods of the Engine class
-- (mongotx.engine adds `methods` to it), and the text of an op's failure.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"
local bands = require "mongotx.engine.bands"

local key, id_key = validate.tid_key, validate.id_key
local live, has_marker, mark = stored.live, stored.has_marker, stored.mark
local REMOVING, HELD, ESCROW, PENDING = stored.REMOVING, stored.HELD, stored.ESCROW, stored.PENDING
local ipairs, pairs, tostring, type = ipairs, pairs, tostring, type
local format = string.format

local _M = {}

-- The Engine methods of this module.
local Engine = {}
_M.methods = Engine

-- Keep settling a transaction at most this many rounds (each round moves
-- it a state forward or re-reads it), and retry an apply whose document
-- keeps changing under it at most this many times.
local MAX_ROUNDS = 50
local MAX_CONTENTION = 20

local function op_name(op)
  return format("%s %s of %s", op.kind, tostring(op.id), op.collection)
end

local failure_text = {
  missing = "the document does not exist",
  guard = "its where condition is false",
  conflict = "another document has its _id",
  contention = "the document kept changing",
  removing = "another transaction is removing the document",
  busy = "another open transaction holds the document",
  refused = "the server refused its write",
}

-- The error of op i's failure `reason`; `refusal`: the server's error of
-- a refused apply (its number and words go along), or has_room's (its
-- words instead).
local function op_failure(T, i, reason, refusal)
  local op = T.ops[i]
  local text = failure_text[reason] or reason
  local server_code
  if refusal and refusal.room then
    text = refusal.message
  elseif refusal then
    text, server_code = format("%s (%s)", text, tostring(refusal.message)), refusal.server_code
  end
  return errors.new(reason, format("op %d (%s): %s", i, op_name(op), text),
    { step = "apply", id = T._id, op = i, collection = op.collection, document = op.id,
      server_code = server_code })
end

-- Why a cancelled transaction was cancelled, as a code: the `cause` its
-- cancel stored (docs/errors.md).  A transaction cancelled before causes
-- were stored has only its reason's text, read as the metrics read it
-- then: an op failure's text, recovery's and expiry's words, any other
-- text a caller's rollback.
local OP_FAILURE = { ["another open transaction holds the document its guard reads"] = "busy" }
for code, text in pairs(failure_text) do OP_FAILURE[text] = code end

local function cause_of(reason, cause)
  if type(cause) == "string" then return cause end
  if type(reason) ~= "string" then return "unknown" end
  if reason == "expired" then return "expired" end
  if reason == "rolled back by recovery" then return "recovery" end
  local text = reason:match("^op %d+ %(.*%): (.-)$")
  return text and OP_FAILURE[text] or "rollback"
end


-- Phases ------------------------------------------------------------------

-- Applies op i, fenced by v.version (false: none read; the band of the
-- version read, mongotx.engine.bands) and by v.deadline (this owner's,
-- T's by default where deadlines fence); returns true, or
-- false and why it cannot (for "busy", and whether an open holder
-- outranks T: Engine:apply_all; for "refused", the server's error), or
-- nil, err.  v.missed: this very apply was just sent and did not match
-- (a batch's), so the first try reads first.
-- Has the escrowed op the room its apply requires (csrc/txn.h, "Room")?
-- Counted with the same conditions: true, or false and the error that
-- says which paths lack it (a refusal, as the server's is), or nil, err.
local function has_room(coll, op)
  local filter, paths = { _id = op.id }, {}
  for path, n in pairs(op.update["$inc"]) do
    if n > 0 then
      filter[path] = { ["$not"] = { ["$gt"] = core.ROOM_FIELD } }
      filter[PENDING .. "." .. path] = { ["$not"] = { ["$gt"] = core.ROOM - n } }
      paths[#paths + 1] = path
    end
  end
  local n, err = coll:count(filter)
  if not n then return nil, err end
  if n > 0 then return true end
  table.sort(paths)
  return false, errors.new("refused", format("no room for the credit of %s: a field keeps at most " ..
    "2^62 - 4096, and with the credits waiting for it at most 2^62", table.concat(paths, ", ")),
    { room = true })
end

function Engine:apply_one(T, i, v)
  local op = T.ops[i]
  local coll = self:coll(op.collection)
  if v.deadline == nil and self:deadlines() then v.deadline = T.deadline end
  for try = 1, MAX_CONTENTION do
    local res, err
    if v.missed then
      v.missed = nil
    else
      res, err = self:op_step(T, "apply", coll, op, v.version, v.deadline, bands.takeover(T))
      -- the server refused this write: a definite answer, as a false guard
      if not res and errors.refused(err) then return false, "refused", err end
      if not res then return nil, err end
      if res.applied then return true end
    end
    -- Why not? Read the document, then (if its version left the band)
    -- check that T is still ours before trying with the version just read.
    local doc
    doc, err = coll:find_one({ _id = op.id })
    if err then return nil, errors.wrap(err, "apply", T._id) end
    if has_marker(doc, self:form(T).marker, mark(T)) then return true end
    if doc and doc[REMOVING] ~= nil then return false, "removing" end
    if op.kind == "insert" then
      if doc then return false, "conflict" end
    elseif not doc then
      return false, "missing"
    else
      -- a guard reads no effect that may still be undone, an exclusive
      -- op follows no effect that may still be undone (csrc/txn.h):
      -- committed holders are finished first, open ones make it wait
      local finished = 0
      if op.where or #self:blockers(T, op, doc) > 0 then
        local open, outranked
        finished, open, outranked = self:release(T, op, doc)
        if finished == nil then return nil, open end
        if finished == 0 and open then return false, "busy", outranked end
      end
      -- (on the first miss a version that left the band explains it:
      -- the guard is read on the next miss, after a try with the version
      -- just read; so a false guard on a hot document is still found at
      -- once)
      local moved = not bands.in_band(v.version, doc[self:form(T).version])
      if finished == 0 and op.where and not (moved and try == 1) then
        local filter = { _id = op.id }
        for k, x in pairs(op.where) do filter[k] = x end
        local n
        n, err = coll:count(filter)
        if not n then return nil, errors.wrap(err, "apply", T._id) end
        if n == 0 then return false, "guard" end
      end
      -- an escrowed credit without room (its finish could overflow the
      -- field): refused, as the server refuses an $inc it cannot apply
      if finished == 0 and op.effect == "escrow" and not (moved and try == 1) then
        local room, refusal = has_room(coll, op)
        if room == nil then return nil, errors.wrap(refusal, "apply", T._id) end
        if not room then return false, "refused", refusal end
      end
      -- the document moved: the next try needs a fence that still holds
      -- (a deadline renewed, unless only the finished holders moved it
      -- and no version fences the apply: refence dropped it; without
      -- deadlines, a version read again once it left the band: ordinary
      -- writes leave it in the band, and the fence as it is)
      local refresh
      if v.deadline then
        refresh = finished == 0 or v.version ~= false
      else
        refresh = moved or (v.version == false and finished == 0)
      end
      if refresh then
        local ok
        ok, err = self:refence(T, i, v, doc)
        if not ok then return nil, err end
      end
    end
  end
  return false, "contention"
end

-- The document of op i moved under T's apply: if T is still this
-- manager's, fence the next try by a renewed deadline (it may have passed:
-- an owner past its deadline must not apply, whoever else might be
-- driving T) or, without deadlines, by the version just read.  With a
-- deadline the version is dropped: the deadline alone keeps a former
-- owner out (nobody claims T before it passed).  Returns true, or nil,
-- err (`fenced` when another owner took T over).
function Engine:refence(T, i, v, doc)
  local now, err = self:get(T._id)
  if err then return nil, err end
  local fenced = errors.new("fenced", "another owner took the transaction over",
    { step = "apply", id = T._id, op = i })
  if not now or not self:holds(now) then return nil, fenced end
  if not v.deadline then
    v.version = doc[self:form(T).version]
  else
    v.version = false
    local renewed
    renewed, err = self:renew(now)
    if renewed == nil then return nil, err end
    if not renewed then return nil, fenced end
    v.deadline = renewed
  end
  return true
end

-- Moves T's deadline (and lastModified) a lease on while this manager
-- still holds it, so that an owner working past its deadline still fences
-- every apply by the server's clock.  Returns the new deadline, false when
-- T was taken over meanwhile, or nil, err.
function Engine:renew(T)
  local deadline, err = self:new_deadline()
  if not deadline then return nil, err end
  local moved
  moved, err = self:step("renew", T._id, self.tx, T._id, T.epoch, deadline)
  if moved == nil then return nil, err end
  return moved and deadline
end

-- The transaction of this collection that `holder` (a mark read on a
-- document) names, or nil (another collection's, or none), and then
-- whether it names one of this collection that is not there (pruned);
-- nil, err.
function Engine:holder(holder)
  local coll, id = stored.named(holder)
  if id == nil or (coll ~= nil and coll ~= self.vctx.collection) then return nil end
  local H, err = self:get(id)
  if err then return nil, err.code ~= "invalid" and err or nil end
  if H and key(mark(H)) == key(holder) then return H end
  return nil, nil, H == nil and (coll ~= nil or self.vctx.collection == stored.HOME)
end

-- Pulls `holder` (the mark of a transaction: an id, no operator in it)
-- from the `held` array of document id in coll where the marker array of
-- its form (its transaction's fields) no longer names it, with the
-- version moved as by every write of mongotx.  (A $pull of the value
-- itself, which FerretDB v1 needs, where it is no document: a document
-- there would be a condition on the elements.)  Returns whether it did,
-- or nil, err.
local function unhold(coll, id, holder, form)
  local pull = holder
  if type(holder) == "table" then pull = { ["$in"] = { holder } } end
  local res, err = coll:update_one(
    { _id = id, [HELD] = { ["$in"] = { holder } }, [form.marker] = { ["$nin"] = { holder } } },
    { ["$pull"] = { [HELD] = pull }, ["$inc"] = { [form.version] = 1 } })
  if not res then return nil, errors.wrap(err, "apply") end
  return res.matched > 0
end

-- The marks of other transactions on doc that keep op of T from
-- applying (docs/guards.md, "Isolation"; csrc/txn.h): every exclusive
-- holder (in `held`, whatever its marker); for an exclusive op (anything
-- but a debit, an escrowed credit or an assert) or a guard other than a
-- floor, every holder in T's marker array too.  A list, empty when none.
function Engine:blockers(T, op, doc)
  local tm, marker = mark(T), self:form(T).marker
  local out, seen = {}, {}
  local function add(x)
    if not seen[key(x)] then seen[key(x)], out[#out + 1] = true, x end
  end
  for _, x in ipairs(stored.holders(doc, HELD, tm)) do add(x) end
  local exclusive = op.kind == "remove" or op.kind == "insert"
    or (op.kind == "update" and op.effect ~= "lowers" and op.effect ~= "escrow")
  if exclusive or (op.where and not op.floor) then
    for _, x in ipairs(stored.holders(doc, marker, tm)) do add(x) end
  end
  return out
end

-- The document of op carries the marks of other transactions (in T's
-- marker array, in `held`, or in `escrow`, which every manager shares:
-- another marker's escrowed credits).  Those of this collection that have
-- committed (applied or done) are final: this finishes them on the
-- document (any manager may help a committed transaction along), so that
-- the op reads (a guard) or follows (an exclusive op) their effect.  A
-- `held` entry whose marker is gone (the tutorial's recipe finished it)
-- is pulled.  One whose owner's lease passed is driven to its end here,
-- as recovery would (Engine:resolve).  The others hold it: those
-- blockers names (their effect may still be undone).  Returns how many were finished or pulled, whether an
-- open one that matters is left and whether one of those outranks T (an
-- older mark: Engine:apply_all), or nil, err.
function Engine:release(T, op, doc)
  local coll, k, tm = self:coll(op.collection), id_key(op.id), mark(T)
  local marker = self:form(T).marker
  local matters, seen, all = {}, {}, {}
  for _, x in ipairs(self:blockers(T, op, doc)) do matters[key(x)] = true end
  for _, field in ipairs { marker, HELD, ESCROW } do
    for _, x in ipairs(stored.holders(doc, field, tm)) do
      if not seen[key(x)] then seen[key(x)], all[#all + 1] = true, x end
    end
  end
  local finished, open, outranked, mine = 0, false, false, key(tm)
  for _, holder in ipairs(all) do
    local H, err, gone = self:holder(holder)
    if err then return nil, err end
    if H and validate.malformed(H, self.vctx) then H = nil end
    local form = H and self:form(H) or gone and self:form(T)
    local hop, stale, resolved
    if form and has_marker(doc, HELD, holder) and not has_marker(doc, form.marker, holder) then
      -- its marker is gone (a writer following the tutorial's recipe
      -- finished or undid it), or its transaction (pruned since):
      -- nothing of it is left to wait for
      stale, err = unhold(coll, op.id, holder, form)
      if stale == nil then return nil, err end
      if stale then finished = finished + 1 end
    elseif H and (matters[key(holder)] or H.state == "applied") then
      -- its owner's lease passed: driven to its end here (resolve)
      resolved, err = self:resolve(H, T)
      if resolved == nil then return nil, err end
    end
    if resolved then
      finished = finished + 1
    elseif stale == nil and H and (H.state == "applied" or H.state == "done") then
      for _, o in ipairs(H.ops) do
        if o.collection == op.collection and id_key(o.id) == k then hop = o end
      end
    end
    if hop then
      local res
      res, err = self:op_step(H, "finish", coll, hop)
      if not res then return nil, err end
      if res.finished then finished = finished + 1 end
    elseif matters[key(holder)] and stale == nil and not resolved then
      open = true
      if key(holder) < mine then outranked = true end
    end
  end
  return finished, open, outranked
end

-- Runs the state-changing step `name` (commit, done, cancel, cancelled)
-- on T with the step's further arguments; returns T as it now is: as
-- moved (the step returns it), or as read when somebody else moved it
-- first.
function Engine:move(T, name, ...)
  local moved, err = self:step(name, T._id, self.tx, T._id, ...)
  if moved == nil then return nil, err end
  if moved then return live(moved) end
  local now
  now, err = self:get(T._id)
  if now then return now end
  return nil, err or errors.new("state", "no such transaction", { step = name, id = T._id })
end

-- pending (held) -> canceling, recording why: in words (reason), as
-- a code (cause, cause_of's) and, for an op failure, the op's index
-- (failedOp: every later answer names the op, its collection and id).
function Engine:cancel(T, reason, cause, failed_op)
  return self:move(T, "cancel", T.epoch, reason, cause, failed_op)
end

-- applied -> done: pull every marker (delete removed documents), then done.
function Engine:finish(T)
  for _, op in ipairs(T.ops) do
    local res, err = self:op_step(T, "finish", self:coll(op.collection), op)
    if not res then return nil, err end
  end
  return self:move(T, "done")
end

-- Undoes op i of a canceling T where it was applied; after a takeover
-- (epoch > 1) fences the document too.  Returns undo's result, or nil,
-- err.
function Engine:undo_op(T, i)
  local op, coll = T.ops[i], self:coll(T.ops[i].collection)
  local undone
  for _ = 1, 3 do
    local res, err = self:op_step(T, "undo", coll, op, nil, bands.takeover(T))
    if not res then return nil, err end
    undone = undone or res
    -- an insert a former owner prepared would land after this undo
    -- deleted the document: fence it too (a placeholder takes the _id)
    if (T.epoch or 0) <= 1 or res.undone and op.kind ~= "insert" then break end
    res, err = self:op_step(T, "fence", coll, op)
    if not res then return nil, err end
    if res.fenced then break end
    -- the marker appeared between undo and fence: undo again
  end
  return undone
end

-- canceling -> cancelled: undo the applied ops in reverse order.  After a
-- takeover (epoch > 1) a former owner may still hold a prepared apply, so
-- documents not applied are fenced (their version moved) as well.
function Engine:unwind(T)
  for i = #T.ops, 1, -1 do
    local _, err = self:undo_op(T, i)
    if err then return nil, err end
  end
  return self:move(T, "cancelled")
end

-- The answer for a cancelled T: its cause and, when an op failed, that
-- op (its index, collection and document id), as the first answer gave.
local function cancelled_error(T)
  local i = T.failedOp
  local op = type(i) == "number" and type(T.ops) == "table" and T.ops[i] or nil
  return errors.new("cancelled", "the transaction was cancelled: " ..
    tostring(T.reason or "no reason recorded"),
    { id = T._id, reason = T.reason, cause = cause_of(T.reason, T.cause),
      op = op and i or nil, collection = op and op.collection or nil,
      document = op and op.id or nil })
end

-- Drives T to done or cancelled from whatever state it is in.  `versions`
-- are those read before this manager claimed T, when it just did.  With
-- `later`, a T another owner holds within its lease is not waited for:
-- nil, held_error, and T as read (a batch waits for its held ones after
-- the others answered, or has its callers wait: mongotx.manager.batches,
-- mongotx.group).  With later = "hand", an apply that must wait for a
-- retry is not waited for either: nil, nil, nil, <apply_ops's>.
-- `tries`: each op's tries so far, for its apply (Engine:resolve's).
function Engine:drive(T, versions, later, tries)
  local failure, err = self:fields_error(T)
  if failure then return nil, failure end
  for _ = 1, MAX_ROUNDS do
    local state = T.state
    if state == "done" or state == "cancelled" then
      self.held[key(T._id)] = nil -- nothing left to fence
      if state == "done" then return T end
      return nil, failure or cancelled_error(T)
    end
    if state == "initial" then
      versions, err = self:versions(T)
      if not versions then return nil, err end
      local claimed
      claimed, err = self:claim(T, { state = "pending" })
      if claimed == nil then return nil, err end
      if not claimed then versions = nil end
      T = claimed or self:get(T._id)
    elseif state == "pending" and T.hold ~= nil then
      -- a hold (mongotx.holds) is decided by capture, void or expiry,
      -- never driven forward
      return nil, errors.new("invalid", "a hold is decided by capture or void",
        { id = T._id })
    elseif state == "pending" then
      if not self:holds(T) then
        -- another owner holds it: past its lease, taken over as recovery
        -- would (Engine:take_over); within it, its outcome is this
        -- call's (Engine:await), or with `later` an answer at once
        local lapsed
        lapsed, err = self:lapsed(T)
        if lapsed == nil then return nil, err end
        if lapsed then
          T, versions, err = self:take_over(T)
        elseif later then
          return nil, self:held_error(T), T
        else
          T, err = self:await(T)
          versions = nil
        end
        if not T then return nil, err end
      elseif not versions then
        local now
        versions, now = self:confirmed_versions(T)
        if versions == nil then return nil, now end
        if not versions then T, versions = now, nil end
      end
      if versions then
        local f, busy
        T, err, f, busy = self:apply_all(T, versions, later == "hand", tries)
        if busy then return nil, nil, nil, busy end
        tries = nil
        failure = failure or f
        versions = nil
      end
    elseif state == "applied" then
      T, err = self:finish(T)
    elseif state == "canceling" and not self:holding(T) and T.hold == nil then
      -- another owner's (a rollback or commit of it): claimed first, as
      -- recovery and resolve claim it, so that its undos move each
      -- version by a band and fence the documents not applied (a lost
      -- apply of its owner cannot land after it ended cancelled); a
      -- claim lost: read again (a hold: holds.lua unwinds its own)
      local claimed
      claimed, err = self:claim(T)
      if claimed == nil then return nil, err end
      if claimed then
        T = claimed
      else
        local id = T._id
        T, err = self:get(id)
        if not T and not err then err = errors.disappeared(id) end
      end
    elseif state == "canceling" then
      T, err = self:unwind(T)
    else
      return nil, errors.new("state", "unknown state " .. tostring(state), { id = T._id })
    end
    if not T then return nil, err end
  end
  return nil, errors.new("state", "the transaction did not settle", { id = T._id })
end

_M.op_failure, _M.failure_text, _M.cause_of = op_failure, failure_text, cause_of
_M.cancelled_error = cancelled_error

return _M

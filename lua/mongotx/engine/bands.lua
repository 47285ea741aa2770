-- mongotx.engine.bands: the version bands that fence an apply where no
-- deadline does (csrc/txn.c, "Fencing"; docs/ownership.md).  Every write
-- of mongotx moves a document's version by 1; a takeover's writes (an
-- owner at epoch > 1: its applies, undos and fences) move it by a band
-- (core.VERSION_BAND), and an apply matches only while the version is
-- still in the band of the version its owner read.  So other owners'
-- applies and finishes do not fence it; a takeover does.
--
-- The other way an apply could land twice is a copy of it still on its
-- way: an apply whose reply never came (a transient error) may land
-- later, after the owner's retry applied and even finished.  So before
-- this engine sends another apply to that document, it moves the
-- document's version by a band (bump) and waits for the reply: the copy
-- then no longer matches.  A document stays `unsure` until a bump got
-- its reply; a process that dies meanwhile leaves the transaction to a
-- takeover (a claim at a higher epoch: recovery, or an op that meets it
-- once its lease passed, Engine:resolve), which moves the band anyway.
-- Where deadlines fence instead, an apply carries no version and no bump
-- can stop its copy: docs/ownership.md says what fences it there.

local core = require "mongotx.core"
local validate = require "mongotx.validate"

local id_key = validate.id_key
local ipairs, type = ipairs, type
local floor = math.floor

local BAND = core.VERSION_BAND

local _M = {}

-- Does a write of T's owner move versions by a band (a takeover)?
function _M.takeover(T)
  return (T.epoch or 0) > 1
end

-- Is `now` (a document's version) still in the band of `read`, the
-- version an apply is fenced by (false: none; nil: the document had
-- none)?  As the C step's filter (txn_ops.c, append_version_fence).
function _M.in_band(read, now)
  if read == false then return true end
  if type(read) ~= "number" or read < 0 or read ~= floor(read) then return read == now end
  return type(now) == "number" and now >= read and now < (floor(read / BAND) + 1) * BAND
end

local function unsure_key(name, id)
  return name .. "\0" .. id_key(id)
end

-- Moves the versions of documents `ids` of collection handle `coll` by a
-- band, in field `field`, with the engine's write concern (the bump is
-- the fence: one a failover rolls back would let the copy match again).
-- Returns true, or nil, err.
local function bump(eng, coll, ids, field)
  local res, err = coll:update_many({ _id = { ["$in"] = ids } },
    { ["$inc"] = { [field] = core.Int64(BAND) } }, eng.wopts)
  if not res then return nil, err end
  return true
end

-- Is an apply of op fenced by the version `version`?
local function fenced(op, version)
  return version ~= false and op.kind ~= "insert"
end

-- steps.apply wrapped for Engine:op_step: eng.unsure documents are bumped
-- before anything is sent to them (then nothing is sent: { applied =
-- false }, and the caller reads the document, Engine:apply_one), and a
-- transient error leaves the document unsure.
function _M.apply_one(eng, name, field, apply)
  return function(steps, coll, tid, op, version, ...)
    if not fenced(op, version) then return apply(steps, coll, tid, op, version, ...) end
    local k = unsure_key(name, op.id)
    if eng.unsure[k] then
      local ok, err = bump(eng, coll, { op.id }, field)
      if not ok then return nil, err end
      eng.unsure[k] = nil
      return { applied = false }
    end
    local res, err = apply(steps, coll, tid, op, version, ...)
    if not res and err and err.transient then eng.unsure[k] = true end
    return res, err
  end
end

-- steps.undo wrapped the same way: an unsure document is bumped before
-- the undo goes (an owner that rolls back rather than applying again:
-- the copy still on its way must not land after the transaction ended).
function _M.undo_one(eng, name, field, undo)
  return function(steps, coll, tid, op, ...)
    local k = unsure_key(name, op.id)
    if eng.unsure[k] then
      local ok, err = bump(eng, coll, { op.id }, field)
      if not ok then return nil, err end
      eng.unsure[k] = nil
    end
    return undo(steps, coll, tid, op, ...)
  end
end

-- steps.apply_many wrapped for Engine:many the same way: the unsure
-- documents among items are bumped first (in one write), and then the
-- batch is sent (their applies no longer match: the caller reads the
-- markers, mongotx.batch); a transient error leaves every document of a
-- fenced item unsure.
function _M.apply_many(eng, field, apply)
  return function(steps, coll, items, ...)
    -- (made only for fenced items: where deadlines fence, none is)
    local ids, keys, bumped
    for _, item in ipairs(items) do
      local op = item.op
      if fenced(op, item.version) then
        local k = unsure_key(op.collection, op.id)
        keys = keys or {}
        keys[#keys + 1] = k
        if eng.unsure[k] then
          ids, bumped = ids or {}, bumped or {}
          ids[#ids + 1] = op.id
          bumped[#bumped + 1] = k
        end
      end
    end
    if ids then
      local ok, err = bump(eng, coll, ids, field)
      if not ok then return nil, err end
      for _, k in ipairs(bumped) do eng.unsure[k] = nil end
    end
    local res, err = apply(steps, coll, items, ...)
    if not res and err and err.transient and keys then
      for _, k in ipairs(keys) do eng.unsure[k] = true end
    end
    return res, err
  end
end

return _M

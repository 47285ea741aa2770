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
-- `unsure` is this engine's only: a call handed to its caller
-- (mongotx.group.busy) goes on in any Lua state, and leaves with none of
-- its documents unsure (busy.lua says why).
-- Where deadlines fence instead, an apply carries no version and no bump
-- can stop its copy: docs/ownership.md says what fences it there.
-- The versions an owner reads before its applies are read here too
-- (methods of the engine: versions_many, versions, confirmed_versions).

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"

local id_key, key = validate.id_key, validate.tid_key
local has_marker, mark = stored.has_marker, stored.mark
local ipairs, pairs, type = ipairs, pairs, type
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

-- steps.apply_many behind the bands, as Engine:many sends it: made once
-- per steps object (a spec may stand other steps in).
function _M.banded_apply(eng)
  local steps = eng.steps
  if eng.banded_of ~= steps then
    eng.banded, eng.banded_of = _M.apply_many(eng, eng.version_field, steps.apply_many), steps
  end
  return eng.banded
end

-- The documents' versions, methods of the engine (mongotx.engine).
local methods = {}

-- For each transaction of the list and each of its ops: { version = <the
-- document's version>, marked = <the transaction's marker is on it> } (nil
-- version for a missing document); one find per collection for them all.
function methods:versions_many(list)
  local by_coll, found, projection = {}, {}, {}
  for _, T in ipairs(list) do
    local f = self:form(T)
    projection[f.marker], projection[f.version] = 1, 1
    for _, op in ipairs(T.ops) do
      local ids = by_coll[op.collection] or {}
      ids[#ids + 1] = op.id
      by_coll[op.collection] = ids
    end
  end
  for name, ids in pairs(by_coll) do
    local docs, err = self:coll(name):find_all({ _id = { ["$in"] = ids } },
      { projection = projection, sort = { _id = 1 } })
    if not docs then return nil, errors.wrap(err, "versions", #list == 1 and list[1]._id or nil) end
    for _, doc in ipairs(docs) do found[name .. "\0" .. key(doc._id)] = doc end
  end
  local out = {}
  for t, T in ipairs(list) do
    local vs, f, m = {}, self:form(T), mark(T)
    for i, op in ipairs(T.ops) do
      local doc = found[op.collection .. "\0" .. key(op.id)]
      vs[i] = { marked = false }
      if doc then
        vs[i].version = doc[f.version]
        vs[i].marked = has_marker(doc, f.marker, m)
      end
    end
    out[t] = vs
  end
  return out
end

function methods:versions(T)
  local all, err = self:versions_many({ T })
  if not all then return nil, err end
  return all[1]
end


-- Versions read while this manager holds T: read, then check T is still
-- held, so any later owner's writes come after the read.
function methods:confirmed_versions(T)
  local versions, err = self:versions(T)
  if not versions then return nil, err end
  local now
  now, err = self:get(T._id)
  if err then return nil, err end
  if not now or not self:holds(now) then return false, now end
  return versions
end

_M.methods = methods

return _M

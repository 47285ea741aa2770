-- Versioned structures (seed 002, the fifth pattern): isolation for a
-- structure of many documents, such as a tree, without a transaction.
-- A writer never updates an item: it inserts new versions of the items it
-- changes (a tombstone for one it deletes), numbered with a version no
-- other writer uses, and then publishes them all by raising the root's
-- version in one atomic write, conditioned on the version it started
-- from.  Readers see, for each item, its highest version up to the
-- root's published one, so a half-written change is invisible and of two
-- writers that started from the same version exactly one publishes.
--
--   local trees = assert(db:versioned{ roots = "trees", items = "nodes" })
--   local w = assert(trees:begin("docs"))
--   assert(w:put("readme", { parent = "docs", name = "README" }))
--   assert(w:delete("old"))
--   assert(w:publish())          -- or nil, conflict: begin again
--   local tree = trees:read("docs")
--
-- The root document: { _id, version = the published version, next = the
-- last version number handed out, open = { v, ... } the writers'
-- versions that may still publish, with started<v> = when the writer of
-- v began ($currentDate: the server's clock), dead = { v, ... } versions
-- that never will }.  (Plain numbers in `open` and a top-level field per
-- start: FerretDB v1 neither $pulls array elements that are documents by
-- a condition nor takes $currentDate of a dotted path.)  An item
-- version: { _id, root, itemId, version, doc } or { ..., deleted = true }.
--
-- Why `open` and `dead`: version numbers come from `next`, so two writers
-- never share one, but they are not published in order: a writer that
-- lost (or crashed) holds a number below a later published version, and
-- "highest version up to the published one" would show its items.  So
-- a version is visible only when it is neither open nor dead, and a
-- version leaves `open` in one of two atomic writes only: its publish
-- (which needs it in `open`) or its abort (which moves it to `dead`).
-- gc deletes the items of dead versions only.  That answers the race
-- between gc and a writer about to publish: gc aborts a writer's version
-- only when it is below the published one (such a writer's base is gone,
-- it can never publish) or older than gc's older_than; the abort and the
-- publish are each conditioned on the version being in `open`, so exactly
-- one of them happens, and a writer that was aborted gets `conflict` from
-- publish instead of publishing items gc may be deleting.  A stalled
-- writer may still insert items of its dead version after gc ran: they
-- are invisible (dead) and the next gc deletes them, which is why dead
-- version numbers stay listed in the root (a few bytes each).

--- Versioned structures: `db:versioned(opts)` (docs/versioned.md).
-- @module mongotx.versioned

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local clock = require "mongotx.clock"
local points = require "mongotx.points"

local type, ipairs, tostring, setmetatable = type, ipairs, tostring, setmetatable
local id_key = validate.id_key

local _M = {}

local Versioned = {}
Versioned.__index = Versioned

local Writer = {}
Writer.__index = Writer

-- Levels for error(): the caller of the public method (see manager.lua).
local CALLER, HELPER_CALLER = 2, 3

-- The prefix of a root's field holding when the writer of a version began.
local STARTED = "started"

-- Contended begins (another writer took the same number between the read
-- and the write) are retried this many times.
local MAX_CONTENTION = 50

local versioned_options = { roots = true, items = true, write_concern = true }

-- db:versioned{ roots = "roots", items = "items", write_concern }: creates
-- the items' indexes: unique { root, itemId, version } (two versions of
-- an item never share a number, and a writer's insert that would is
-- refused) and { root, version } for reads and gc.
function _M.new(db, opts)
  local why
  opts, why = validate.options(opts, versioned_options, "versioned", HELPER_CALLER)
  if not opts then return nil, why end
  local roots, items = opts.roots or "roots", opts.items or "items"
  if roots == items then
    return nil, errors.new("invalid", "options roots and items of versioned must be " ..
      "different collections", { step = "versioned" })
  end
  local self = setmetatable({
    db = db,
    clock = clock.new(db),
    roots = db.client:collection(db.name, roots),
    items = db.client:collection(db.name, items),
    wopts = { write_concern = opts.write_concern or { w = "majority", j = true } },
  }, Versioned)
  local ok, err = self.items:create_index(core.doc("root", 1, "itemId", 1, "version", 1),
    { unique = true })
  if ok then ok, err = self.items:create_index(core.doc("root", 1, "version", 1)) end
  if not ok then return nil, errors.wrap(err, "versioned") end
  return self
end

-- One write of this module, between its crash points versioned.<step>.
local function write(step, fn, ...)
  return points.write("versioned", step, fn, ...)
end

local function is_duplicate(err)
  return err.server_code == 11000 or err.server_code == 11001
      or tostring(err.message):find("duplicate key", 1, true) ~= nil
end

-- A root id from a caller: raises for a type no id can have, nil, invalid
-- for a value that cannot be one.
local function root_id(id, step)
  local kind = type(id)
  if id == nil or kind == "function" or kind == "thread" then
    error(step .. " needs a root id, not a " .. kind, HELPER_CALLER)
  end
  return validate.module_id(id, step)
end

-- Takes the next version number of the root and registers it as open,
-- in one write (after one more creating the root at version 0 when it
-- does not exist).  Returns a writer that started from the root's published
-- version, or nil, err.

--- @type Versioned

--- A writer: takes a version number of the root and registers it as open.
-- @syntax w, err = v:begin(root)
-- @param root the root's id
-- @treturn table the writer (`w.base`, `w.version`)
-- @errors `invalid`, `malformed`, `contention`, database errors
-- @usage local w = assert(trees:begin("home"))
function Versioned:begin(root)
  local sent, err = root_id(root, "begin")
  if sent == nil then return nil, err end
  for _ = 1, MAX_CONTENTION do
    local doc
    doc, err = self.roots:find_one({ _id = sent })
    if err then return nil, errors.wrap(err, "begin") end
    local res, base, v
    if not doc then
      -- the root at version 0, then (next round) this writer's number
      local created
      created, err = write("create", self.roots.insert_one, self.roots,
        { _id = sent, version = 0, next = 0, open = core.array(),
          dead = core.array() }, self.wopts)
      if not created and not is_duplicate(err) then return nil, err end
    elseif type(doc.version) == "number" and type(doc.next) == "number"
        -- (a double from 2^53 on, or math.maxinteger, has no exact
        -- successor: the same number would go to every writer)
        and doc.next + 1 > doc.next then
      base, v = doc.version, doc.next + 1
      res, err = write("begin", self.roots.update_one, self.roots,
        { _id = sent, version = base, next = doc.next },
        { ["$set"] = { next = v }, ["$push"] = { open = v },
          ["$currentDate"] = { [STARTED .. v] = true } }, self.wopts)
      if err then return nil, err end
      if res.matched == 0 then res = nil end
    else
      return nil, errors.new("malformed", "the root has no numeric version and next " ..
        "(next below 2^53 for doubles)",
        { step = "begin", id = root })
    end
    if res then
      return setmetatable({ v = self, root = sent, base = base, version = v,
                            written = {}, state = "open" }, Writer)
    end
  end
  return nil, errors.new("contention", "other writers kept taking the version numbers",
    { step = "begin", id = root })
end

local function usable(w, step)
  if w.state ~= "open" then
    return nil, errors.new("state", "this writer has " .. w.state, { step = step, id = w.root })
  end
  return true
end

-- Inserts a version of the item (its content `doc`, or a tombstone).
function Writer:_insert(step, item, doc)
  local ok, err = usable(self, step)
  if not ok then return nil, err end
  local kind = type(item)
  if item == nil or kind == "function" or kind == "thread" then
    error(step .. " needs an item id, not a " .. kind, HELPER_CALLER)
  end
  local sent, key = validate.module_id(item, step)
  if sent == nil then return nil, key end
  if self.written[key] then
    return nil, errors.new("invalid", "this writer already wrote this item",
      { step = step, id = item })
  end
  -- the _id given here, not added by the insert: fits() sees what is sent
  local version = core.doc("_id", core.ObjectId(), "root", self.root, "itemId", sent,
    "version", self.version)
  if doc then
    -- stored whole under `doc`: the content may use any field name
    local why
    doc, why = validate.value(doc)
    if not doc then
      return nil, errors.new("invalid", "the document: " .. why, { step = step, id = item })
    end
    version.doc = doc
    ok, err = validate.fits(version, "the document", "versioned", step, item)
    if not ok then return nil, err end
  else
    version.deleted = true
  end
  local res
  res, err = write("put", self.v.items.insert_one, self.v.items, version, self.v.wopts)
  if not res then
    if is_duplicate(err) then
      return nil, errors.new("conflict", "this version of the item exists already",
        { step = step, id = item })
    end
    return nil, err
  end
  self.written[key] = true
  return true
end

-- w:put(item, doc): the item's new content (a table, read raw; keys may
-- not be operators or hold dots).  true, or nil, err.

--- @type Writer

--- Inserts this writer's version of an item.
-- @syntax ok, err = w:put(item, doc)
-- @param item the item's id
-- @tparam table doc its content
-- @treturn boolean true
-- @errors `invalid` (also a document that does not fit in 16 MiB with the item's fields; nothing written),
--   `state`, database errors
-- @usage assert(w:put("notes", { name = "notes.txt" }))
function Writer:put(item, doc)
  if type(doc) ~= "table" then error("put needs a document table", CALLER) end
  local ok, err = self:_insert("put", item, doc)
  return ok, err
end

-- w:delete(item): the item is absent from this version on (a tombstone).

--- A tombstone: the item is absent from this version on.
-- @syntax ok, err = w:delete(item)
-- @param item the item's id
-- @treturn boolean true
-- @errors as put
-- @usage assert(w:delete("readme"))
function Writer:delete(item)
  local ok, err = self:_insert("delete", item, nil)
  return ok, err
end

-- Moves this writer's version from open to dead and deletes its items:
-- they can never be published.  true, or nil, err.
-- nil, `state` when the version turns out published (by a publish whose
-- reply was lost): its items stay.  Again after an error, or after a
-- publish that lost: does what is left (the abort is conditioned on the
-- version being open, the delete deletes what is there).

--- Gives the version up: moved to dead, its items deleted.
-- @syntax ok, err = w:abandon()
-- @treturn boolean true
-- @errors `state` (it was published), database errors (call abandon again: it finishes the clean-up)
-- @usage w:abandon()
function Writer:abandon()
  local ok, err = true, nil
  if self.state ~= "abandoned" and self.state ~= "lost" then ok, err = usable(self, "abandon") end
  if not ok then return nil, err end
  self.state = "abandoned"
  local killed
  killed, err = self.v:_abort(self.root, self.version)
  if not killed then return nil, err end
  if killed == 0 then
    local done
    done, err = self.v:_published(self.root, self.version, "abandon")
    if done == nil then return nil, err end
    if done then
      self.state = "published"
      return nil, errors.new("state", "version " .. self.version .. " was published " ..
        "(by a publish whose reply was lost)", { step = "abandon", id = self.root })
    end
    -- dead already (an earlier call that an error cut short, or gc)
    ok, err = self.v:_discard(self.root, { self.version })
    if not ok then return nil, err end
  end
  return true
end

-- Publishes: the root's version becomes this writer's, on condition
-- that it is still the one the writer started from and the writer's
-- version is still open.  Returns the published version, or nil,
-- `conflict` (another writer published first, gc aborted this one, or
-- this writer abandoned it; its items are discarded: begin again) or
-- the database's error (then the outcome is unknown: publish again, which
-- tells, or leave the version to gc).  Called again it answers the same:
-- the version once published, `conflict` once lost or abandoned (a
-- clean-up an error cut short is done again first).

--- Publishes the version: one write to the root, on condition it is still at `w.base`.
-- @syntax version, err = w:publish()
-- @treturn integer the published version
-- @errors `conflict` (another writer published first, gc aborted it, or this writer abandoned it: begin again),
--   database errors (call publish again: it answers as if the error had not happened; again after an answer,
--   the same answer)
-- @usage local version, err = w:publish()
function Writer:publish()
  if self.state == "published" then return self.version end
  if self.state == "abandoned" then
    return nil, errors.new("conflict", "this writer abandoned version " .. self.version ..
      ": begin again", { step = "publish", id = self.root, version = self.version })
  end
  if self.state == "lost" then return self:_lost() end
  local ok, err = usable(self, "publish")
  if not ok then return nil, err end
  local res
  res, err = write("publish", self.v.roots.update_one, self.v.roots,
    { _id = self.root, version = self.base, open = self.version },
    { ["$set"] = { version = self.version }, ["$pull"] = { open = self.version },
      ["$unset"] = { [STARTED .. self.version] = "" } },
    self.v.wopts)
  if not res then return nil, err end
  if res.matched == 1 then
    self.state = "published"
    return self.version
  end
  -- lost to another writer or gc, or published by an earlier call
  -- whose reply was lost
  local done
  done, err = self.v:_published(self.root, self.version, "publish")
  if done == nil then return nil, err end
  if done then
    self.state = "published"
    return self.version
  end
  self.state = "lost"
  return self:_lost()
end

-- publish's answer once the writer lost: its version is made dead and its
-- items deleted (again, after an error), then `conflict`.
function Writer:_lost()
  local ok, err = self.v:_kill(self.root, self.version)
  -- dead now, by this kill or before (neither open nor published)
  if ok then ok, err = self.v:_discard(self.root, { self.version }) end
  if not ok then return nil, err end
  return nil, errors.new("conflict", "the root moved on from version " .. self.base ..
    " (another writer published, or gc aborted this one)",
    { step = "publish", id = self.root, version = self.version })
end

-- Makes version v of root unpublishable: open -> dead, in one write
-- that matches only while v is open, so that of this and v's publish
-- exactly one happens.  The number of roots changed (0 or 1), or nil, err.
function Versioned:_kill(root, v)
  local res, err = write("abort", self.roots.update_one, self.roots,
    { _id = root, open = v },
    { ["$pull"] = { open = v }, ["$unset"] = { [STARTED .. v] = "" },
      ["$addToSet"] = { dead = v } }, self.wopts)
  if not res then return nil, err end
  return res.matched
end

-- _kill, then deletes v's items if it was v's kill (else v is dead
-- already, its items gc's, or published).  The number of roots changed
-- (0 or 1), or nil, err.
function Versioned:_abort(root, v)
  local n, err = self:_kill(root, v)
  if n == 1 then
    local ok
    ok, err = self:_discard(root, { v })
    if not ok then return nil, err end
  end
  return n, err
end

-- Deletes the items of the dead versions `vs` of root.
function Versioned:_discard(root, vs)
  local res, err = write("discard", self.items.delete_many, self.items,
    { root = root, version = { ["$in"] = vs } }, self.wopts)
  if not res then return nil, err end
  return res.deleted or 0
end

-- The versions of a root document that readers must skip.
local function hidden(doc)
  local out = {}
  for _, list in ipairs { doc.open, doc.dead } do
    for _, v in ipairs(type(list) == "table" and list or {}) do out[v] = true end
  end
  return out
end

-- Whether version v of root left `open` by its publish rather than by
-- an abort (which lists it in `dead`): how a writer learns the outcome
-- of a publish whose reply it did not get.  true or false, or nil, err.
function Versioned:_published(root, v, step)
  local doc, err = self.roots:find_one({ _id = root })
  if err then return nil, errors.wrap(err, step) end
  return doc ~= nil and not hidden(doc)[v]
end

-- The structure as of the root's published version: { version, items =
-- { { id, version, doc }, ... } in item order }, each item at its highest
-- visible version, deleted items left out.  A root nobody published is
-- version 0 with no items.  nil, err.  The stored versions up to the
-- published one come from a cursor READ at a time, and only each item's
-- visible head is kept: memory is the structure plus one reply, however
-- long the history.
_M.READ = 1000

--- The structure as of the root's published version, read from a cursor 1000 item versions a reply.
-- @syntax tree, err = v:read(root)
-- @param root the root's id
-- @treturn table `{ version, items = { { id, version, doc }, ... } }`
-- @errors database errors
-- @usage local tree = assert(trees:read("home"))
function Versioned:read(root)
  local sent, err = root_id(root, "read")
  if sent == nil then return nil, err end
  local doc
  doc, err = self.roots:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, "read") end
  local out = { version = doc and doc.version or 0, items = {} }
  if out.version == 0 then return out end
  local skip = hidden(doc)
  local cursor = self.items:find({ root = sent, version = { ["$lte"] = out.version } },
    { sort = core.doc("itemId", 1, "version", -1), batch_size = _M.READ })
  local seen = {}
  while true do
    local iv
    iv, err = cursor:next()
    if not iv then
      cursor:close()
      if err then return nil, errors.wrap(err, "read") end
      return out
    end
    local key = id_key(iv.itemId)
    if not skip[iv.version] and key and not seen[key] then
      seen[key] = true
      if not iv.deleted then
        out.items[#out.items + 1] = { id = iv.itemId, version = iv.version, doc = iv.doc }
      end
    end
  end
end

-- gc's work on one root document: aborts its open versions that can no
-- longer publish or began before `cutoff` (ms, server's clock), then
-- deletes the items of all its dead versions; counts into report.
function Versioned:_gc_root(doc, cutoff, report)
  local dead = {}
  for _, v in ipairs(type(doc.dead) == "table" and doc.dead or {}) do dead[#dead + 1] = v end
  for _, v in ipairs(type(doc.open) == "table" and doc.open or {}) do
    local at = doc[STARTED .. tostring(v)]
    local stale = core.type(at) ~= "date" or at:value() <= cutoff
    -- (a root without a numeric version, not written by this module,
    -- has only the second reason)
    local below = type(v) == "number" and type(doc.version) == "number" and v < doc.version
    if type(v) == "number" and (below or stale) then
      local n, err = self:_kill(doc._id, v)
      if not n then return nil, err end
      if n == 1 then report.aborted, dead[#dead + 1] = report.aborted + 1, v end
    end
  end
  if #dead > 0 then
    local n, err = self:_discard(doc._id, dead)
    if not n then return nil, err end
    report.removed = report.removed + n
  end
  return true
end

local gc_options = { older_than = true }

-- Aborts the open versions that can no longer publish (below their
-- root's published version) or whose writer began more than older_than
-- seconds ago (server's clock; default 3600), and deletes the items of
-- every dead version, for every root that has open or dead versions
-- (dead numbers stay listed, so every pass visits those roots: a
-- stalled writer may have inserted since).  Returns { aborted = n,
-- removed = n item versions }, or nil, err.

--- Aborts versions that can never publish or are older than `older_than`; deletes dead items.
-- @syntax report, err = v:gc([{ older_than = 3600 }])
-- @tparam[opt] table opts `older_than` seconds
-- @treturn table `{ aborted, removed }`
-- @errors database errors
-- @usage trees:gc{ older_than = 3600 }
function Versioned:gc(opts)
  local err
  opts, err = validate.options(opts, gc_options, "gc", CALLER)
  if not opts then return nil, err end
  local cutoff
  cutoff, err = self.clock:ago(opts.older_than or 3600)
  if not cutoff then return nil, err end
  local cursor = self.roots:find({ ["$or"] = { { ["open.0"] = { ["$exists"] = true } },
                                               { ["dead.0"] = { ["$exists"] = true } } } },
                                 { sort = { _id = 1 }, batch_size = _M.READ })
  local report = { aborted = 0, removed = 0 }
  while true do
    local doc, ok
    doc, err = cursor:next()
    if doc then ok, err = self:_gc_root(doc, cutoff, report) end
    if not ok then
      cursor:close()
      if err then return nil, errors.wrap(err, "gc") end
      return report
    end
  end
end

return _M

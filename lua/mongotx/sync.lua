-- Sync flags (seed 002, the first pattern): a change to a master document
-- is copied into the documents that depend on it (a user's name into
-- their comments) without a transaction.  The change and the flag are one
-- single-document write: `syncing` set to the server's time, `syncSeq`
-- raised by one and `syncId` set to a new ObjectId.  Then the master is
-- read back, the caller's propagate(master) rewrites the dependents, and
-- the flag is cleared on condition that syncId is still the one this
-- change set: a later change made meanwhile keeps its flag until its own
-- propagation clears it.  A crash between the steps leaves the flag;
-- repair{ older_than } finds old flags through a sparse index and
-- propagates again.
--
--   local users = assert(db:sync{ collection = "users", propagate = fn })
--   assert(users:change("u1", { ["$set"] = { name = "Ann" } }))
--   users:repair{ older_than = 60 }
--
-- Why syncId and a read back rather than the flag's time and the
-- document findAndModify returns: two changes may carry the same
-- millisecond, and some servers (mongo-java-server) may return another
-- writer's state from a findAndModify under concurrency.  A clear that
-- matches proves no change came after the read that was propagated.
--
-- propagate(master) must be idempotent (it may run again after a crash,
-- and repair may run it while the writer still does) and should be
-- monotone: condition each dependent write on master.syncSeq being newer
-- than the one the dependent holds, so that a late run for an older
-- state cannot overwrite a newer one (examples/10-sync.lua).  One that
-- is not is made safe at a cost: a run whose clear finds the master
-- changed since its read may have written its older state over a later
-- change's propagation, so the master is flagged again under a new
-- syncId (which also voids the clear of any run from an older read) and
-- propagated as it is now (`rerun`, at most RERUNS times, then the flag
-- is left to repair).  It returns
-- true, or nil and a message; a raise counts as nil, message (but an
-- interrupt or out of memory goes up, counted nowhere).  A failed
-- propagation leaves the flag, counts an attempt (syncAttempts, with the
-- message in syncError) and is retried by repair; after max_attempts
-- failures repair leaves the document flagged (parked) for a person to
-- look at, until a new change to it starts the count again.

--- Sync flags: `db:sync(opts)` returns a handle on a master collection (docs/sync.md).
-- @module mongotx.sync

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local clock = require "mongotx.clock"
local points = require "mongotx.points"

local type, pairs, ipairs, pcall, tostring, setmetatable = type, pairs, ipairs, pcall, tostring, setmetatable

local _M = {}

local Sync = {}
Sync.__index = Sync

-- Levels for error(): the caller of the public method (see manager.lua).
local CALLER, HELPER_CALLER = 2, 3

-- The fields this module keeps on a master besides the flag (whose name
-- is an option): the change's number and id, the failed propagations
-- since it and the last failure's message.
local SEQ, ID, ATTEMPTS, FAILURE = "syncSeq", "syncId", "syncAttempts", "syncError"

local sync_options = { collection = true, propagate = true, flag = true,
                       write_concern = true, max_attempts = true }

-- Defaults, written out: the flag's field, and how many failed
-- propagations of one change repair tries before it parks the master.
_M.flag = "syncing"
_M.max_attempts = 5
-- How many masters a repair reads a reply (a cursor: memory is one reply).
_M.READ = 1000

-- db:sync{ collection, propagate, flag, write_concern, max_attempts }:
-- creates the sparse index on the flag.  Missing or mistyped options
-- raise; bad values give nil, invalid.
function _M.new(db, opts)
  local why
  opts, why = validate.options(opts, sync_options, "sync", HELPER_CALLER)
  if not opts then return nil, why end
  if opts.collection == nil or opts.propagate == nil then
    error("db:sync needs the options collection and propagate", HELPER_CALLER)
  end
  local flag = opts.flag or _M.flag
  if flag == SEQ or flag == ID or flag == ATTEMPTS or flag == FAILURE then
    return nil, errors.new("invalid", "option flag of sync may not be " .. flag,
      { step = "sync" })
  end
  local self = setmetatable({
    db = db,
    clock = clock.new(db),
    coll = db.client:collection(db.name, opts.collection),
    propagate = opts.propagate,
    flag = flag,
    owned = { "_id", flag, SEQ, ID, ATTEMPTS, FAILURE },
    max_attempts = opts.max_attempts or _M.max_attempts,
    wopts = { write_concern = opts.write_concern or { w = "majority", j = true } },
  }, Sync)
  local ok, err = self.coll:create_index({ [flag] = 1 }, { sparse = true })
  if not ok then return nil, errors.wrap(err, "sync") end
  return self
end

-- One write of this module, between its crash points sync.<step>.
local function write(step, fn, ...)
  return points.write("sync", step, fn, ...)
end

-- How many times in a row a propagation whose clear found the master
-- changed runs again before it leaves the flag to repair (each round
-- lost means yet another writer changed the master meanwhile).
local RERUNS = 3

local function is_token(v, token)
  return core.type(v) == "objectId" and v:value() == token:value()
end

-- Runs propagate(master) and ends the change master.syncId: clears the
-- flag, or counts a failed attempt.  true, or nil, err
-- (`propagation` with the reason, or the database's error).  `reruns`:
-- how many rounds of rerun led here.

--- @type Sync

--- Internal (used by change and repair): runs propagate(master) and clears the flag.
-- @local
-- @syntax ok, err = s:settle(master [, reruns])
-- @tparam table master the master as read
-- @int[opt] reruns rounds of rerun so far
-- @treturn boolean true
-- @errors `propagation`, database errors
-- @usage -- see change
function Sync:settle(master, reruns)
  local ok, done, reason = pcall(self.propagate, master)
  if not ok then
    -- an interrupt is not propagate's failure: it goes up, the flag stays
    if errors.is_interrupt(done) then error(done, 0) end
    done, reason = nil, tostring(done)
  end
  -- The state propagated, as the condition of the writes that end it:
  -- syncId says no change came after the read; syncSeq too, and catches
  -- a read that saw a change half applied (mongo-java-server returns one
  -- now and then): it is propagated again (rerun).  A flag set by a writer
  -- that knows nothing of these fields (seed 002's recipe) is cleared
  -- only while no change of ours came after it.
  local mine = { _id = master._id }
  for _, f in ipairs { ID, SEQ } do
    if master[f] == nil then mine[f] = { ["$exists"] = false } else mine[f] = master[f] end
  end
  if done then
    local res, err = write("clear", self.coll.update_one, self.coll, mine,
      { ["$unset"] = { [self.flag] = "", [ID] = "", [ATTEMPTS] = "", [FAILURE] = "" } }, self.wopts)
    if not res then return nil, err end
    if res.matched == 0 then return self:rerun(master._id, reruns or 0) end
    return true
  end
  reason = tostring(reason or "propagate returned nothing")
  local _, err = write("fail", self.coll.update_one, self.coll, mine,
    { ["$inc"] = { [ATTEMPTS] = 1 }, ["$set"] = { [FAILURE] = reason } }, self.wopts)
  if err then return nil, err end
  return nil, errors.new("propagation", "propagate failed: " .. reason,
    { step = "propagate", id = master._id, seq = master[SEQ], reason = reason })
end

-- After a propagation whose clear found the master changed since its
-- read (see the head of this file): flags the master again under a new
-- syncId, in one write, and unless this is round RERUNS, reads it back
-- and settles it as it is now.  true when it is settled, gone, or left
-- flagged for repair or a later change; nil, err as settle.

--- Internal: flags a master that changed during its propagation again and settles it.
-- @local
-- @syntax ok, err = s:rerun(id, round)
-- @param id the master's id
-- @int round the round
-- @treturn boolean true
-- @errors as settle
-- @usage -- see change
function Sync:rerun(id, round)
  local token = core.ObjectId()
  local res, err = write("rerun", self.coll.update_one, self.coll, { _id = id },
    { ["$currentDate"] = { [self.flag] = true }, ["$set"] = { [ID] = token } }, self.wopts)
  if not res then return nil, err end
  if res.matched == 0 or round >= RERUNS then return true end
  local master
  master, err = self.coll:find_one({ _id = id })
  if err then return nil, errors.wrap(err, "rerun", id) end
  -- gone, or changed again: that change's own propagation covers it
  if not master or not is_token(master[ID], token) then return true end
  return self:settle(master, round + 1)
end

-- Applies `update` (update operators, none touching the module's fields)
-- to the master with this id, flagging it in the same write, then
-- propagates and clears the flag.  Returns the master as read back, or
-- nil, err: `invalid` (nothing written), `missing` (no such master,
-- nothing written), `propagation` (the change is made and stays flagged
-- for repair), or the database's error.

--- Applies an update to a master and flags it, then propagates and clears the flag.
-- @syntax master, err = s:change(id, update)
-- @param id the master's id
-- @tparam table update update operators (none on the module's fields)
-- @treturn table the master as read back
-- @errors `invalid`, `missing` (nothing written), `propagation` (changed, stays flagged for repair), database errors
-- @usage local user, err = users:change("ada", { ["$set"] = { name = "Ada King" } })
function Sync:change(id, update)
  local kind = type(id)
  if id == nil or kind == "function" or kind == "thread" then
    error("change needs a document id, not a " .. kind, CALLER)
  end
  if type(update) ~= "table" then error("change needs an update table", CALLER) end
  local sent, err = validate.module_id(id, "change")
  if sent == nil then return nil, err end
  update, err = validate.update(update, self.owned, "change")
  if not update then return nil, err end
  local full = {}
  for op, fields in pairs(update) do full[op] = fields end
  local function into(op, k, v)
    full[op] = full[op] or {}
    full[op][k] = v
  end
  into("$currentDate", self.flag, true)
  into("$inc", SEQ, 1)
  local token = core.ObjectId()
  into("$set", ID, token)
  into("$set", ATTEMPTS, 0)
  into("$unset", FAILURE, "")
  local ok
  ok, err = validate.fits({ q = { _id = sent }, u = full }, "the update", "sync", "change", id)
  if not ok then return nil, err end
  local res
  res, err = write("change", self.coll.update_one, self.coll, { _id = sent }, full, self.wopts)
  if not res then return nil, err end
  if res.matched == 0 then
    return nil, errors.new("missing", "no document with this id", { step = "change", id = id })
  end
  local master
  master, err = self.coll:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, "change", id) end
  if not master then
    return nil, errors.new("missing", "the document was removed after the change",
      { step = "change", id = id })
  end
  if not is_token(master[ID], token) then
    -- a later change came first: its own propagation covers this one
    return master
  end
  ok, err = self:settle(master)
  if not ok then return nil, err end
  return master
end

local repair_options = { older_than = true, limit = true }

-- Propagates again for the masters flagged more than older_than seconds
-- ago (by the server's clock; default 60) and not parked, oldest first, at
-- most `limit` (default 100).  Returns { repaired = n, failed = { err,
-- ... }, parked = masters left flagged after max_attempts }, or nil, err.

--- Propagates again for the masters flagged more than `older_than` seconds ago.
-- @syntax report, err = s:repair([{ older_than = 60, limit = 100 }])
-- @tparam[opt] table opts `older_than`, `limit`
-- @treturn table `{ repaired, failed = { err, ... }, parked }`
-- @errors `invalid`, database errors
-- @usage local report = assert(users:repair{ older_than = 60 })
function Sync:repair(opts)
  local err
  opts, err = validate.options(opts, repair_options, "repair", CALLER)
  if not opts then return nil, err end
  local cutoff
  cutoff, err = self.clock:ago(opts.older_than or 60)
  if not cutoff then return nil, err end
  -- flagged at the cutoff's millisecond or before: mongo-java-server
  -- keeps $currentDate finer than a millisecond, so $lte of the
  -- millisecond would miss a flag set within it
  cutoff = core.Date(math.floor(cutoff) + 1)
  -- from a cursor, READ a reply: memory is one reply, whatever the limit
  -- (a settled master leaves the flag's index, a failed one keeps its
  -- place, a flag set meanwhile is after the cutoff: none comes back)
  local limit = opts.limit or 100
  local cursor = self.coll:find({ [self.flag] = { ["$lt"] = cutoff },
                                  -- also flags set without syncAttempts
                                  [ATTEMPTS] = { ["$not"] = { ["$gte"] = self.max_attempts } } },
                                { sort = { [self.flag] = 1 }, limit = limit,
                                  batch_size = math.min(limit, _M.READ) })
  local report = { repaired = 0, failed = {} }
  while true do
    local master
    master, err = cursor:next()
    if not master then
      cursor:close()
      if err then return nil, errors.wrap(err, "repair") end
      break
    end
    local ok, why = self:settle(master)
    if ok then
      report.repaired = report.repaired + 1
    elseif why.code == "propagation" then
      report.failed[#report.failed + 1] = why
    else
      cursor:close()
      return nil, why
    end
  end
  -- syncAttempts exists only on flagged masters
  report.parked, err = self.coll:count({ [ATTEMPTS] = { ["$gte"] = self.max_attempts } })
  if not report.parked then return nil, errors.wrap(err, "repair") end
  return report
end

return _M

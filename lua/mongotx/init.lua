-- mongotx: two-phase-commit transactions across MongoDB documents and
-- collections.
--
--   local mongotx = require "mongotx"
--   local db = assert(mongotx.connect("mongodb://127.0.0.1/bank"))
--   local tm = assert(db:manager{ application = "app-1" })
--   assert(tm:transfer("accounts", "A", "B", 100))
--
-- The BSON constructors of the C core are re-exported (mongotx.ObjectId,
-- mongotx.Date, mongotx.null, mongotx.array, mongotx.doc, ...).

--- Two-phase-commit transactions across MongoDB documents: connect, then
-- `db:manager()` (docs/transactions.md). The BSON constructors of
-- `mongotx.core` are re-exported.
-- @module mongotx

local core = require "mongotx.core"
local manager = require "mongotx.manager"
local ledger = require "mongotx.ledger"
local options = require "mongotx.options"
local sync = require "mongotx.sync"
local versioned = require "mongotx.versioned"
local queue = require "mongotx.queue"

local _M = { _VERSION = core._VERSION, core = core }

for _, name in ipairs { "ObjectId", "Date", "Int64", "Decimal128", "Binary", "Regex",
                        "Timestamp", "MinKey", "MaxKey", "null", "array", "doc",
                        "type", "encode", "decode" } do
  _M[name] = core[name]
end

local Database = {}
Database.__index = Database

-- connect(uri [, { database, appname, write_concern, read_preference, tls }]):
-- a database handle, or nil, err (an `invalid` one for an option's bad
-- value, see mongotx.options).  The database is opts.database, else the
-- one in the URI's path, else "test".

--- Connects to a deployment and returns a database handle.
-- @syntax db, err = mongotx.connect(uri [, { database, appname, write_concern, read_preference, tls }])
-- @string uri a MongoDB URI
-- @tparam[opt] table opts `database` (default the URI's path, else "test"), `appname`, `write_concern`,
--   `read_preference`, `tls` (docs/transactions.md#connect)
-- @treturn table the database handle
-- @errors `invalid` (an option's bad value); a wrong type or unknown option raises
-- @usage local db = assert(mongotx.connect("mongodb://127.0.0.1:27017", { database = "bank" }))
function _M.connect(uri, opts)
  local name, core_opts = options.connect_args(uri, opts, 2)
  if not name then return nil, core_opts end
  local client, err = options.connected(core.connect(uri, core_opts))
  if not client then return nil, err end
  return setmetatable({ client = client, name = name }, Database)
end

--- @type Database

--- A collection handle of the C core (`mongotx.core`'s Collection).
-- @syntax coll = db:collection(name)
-- @string name the collection
-- @treturn userdata the collection
-- @usage local accounts = db:collection("accounts")
function Database:collection(name)
  return self.client:collection(self.name, name)
end

-- db:manager{ collection, application, marker, version_field,
-- write_concern, fencing, escrow, <policies of mongotx.policy> }

--- A transaction manager; creates the index `{ state = 1, lastModified = 1 }` on its collection.
-- @syntax tm, err = db:manager([opts])
-- @tparam[opt] table opts `collection`, `application`, `marker`, `version_field`, `write_concern`, `fencing`,
--   `escrow` (default true: credits wait in `txPending` until their finish, docs/guards.md#escrow) and
--   the policies (docs/ownership.md#policies)
-- @treturn mongotx.manager the manager
-- @errors `invalid` (an option's bad value; nothing created), database errors
-- @usage local tm = assert(db:manager{ application = "shop" })
function Database:manager(opts)
  local tm, err = manager.new(self, opts) -- not a tail call: its errors name our caller
  return tm, err
end

-- db:sync{ collection, propagate, flag, write_concern, max_attempts }:
-- sync flags (mongotx.sync).

--- Sync flags on a master collection (docs/sync.md).
-- @syntax s, err = db:sync{ collection, propagate [, flag, max_attempts, write_concern] }
-- @tparam table opts `collection`, `propagate(master)`, ...
-- @treturn mongotx.sync the handle
-- @errors `invalid`, database errors
-- @usage local users = assert(db:sync{ collection = "users", propagate = copy_name })
function Database:sync(opts)
  local s, err = sync.new(self, opts) -- not a tail call: its errors name our caller
  return s, err
end

-- db:versioned{ roots, items, write_concern }: versioned structures
-- (mongotx.versioned).

--- Versioned structures: roots and their item versions (docs/versioned.md).
-- @syntax v, err = db:versioned{ roots, items [, write_concern] }
-- @tparam table opts the collections of the roots and of the items
-- @treturn mongotx.versioned the handle
-- @errors `invalid`, database errors
-- @usage local trees = assert(db:versioned{ roots = "trees", items = "nodes" })
function Database:versioned(opts)
  local v, err = versioned.new(self, opts) -- not a tail call: its errors name our caller
  return v, err
end

-- db:ledger{ collection, accounts, write_concern, retries }: transfers as
-- log entries with per-account sequence ids (mongotx.ledger)

--- A ledger: transfers as log entries with per-account sequence ids (docs/ledger.md).
-- @syntax L, err = db:ledger{ collection [, accounts, write_concern, retries] }
-- @tparam table opts the entries' collection, ...
-- @treturn mongotx.ledger the ledger
-- @errors `invalid`, database errors
-- @usage local L = assert(db:ledger{ collection = "ledger" })
function Database:ledger(opts)
  local l, err = ledger.new(self, opts) -- not a tail call: its errors name our caller
  return l, err
end

-- db:queue{ collection, write_concern, lease, max_attempts, backoff }
-- (mongotx.queue)

--- A job queue (docs/queue.md).
-- @syntax q, err = db:queue{ collection [, write_concern, lease, max_attempts, backoff] }
-- @tparam table opts the jobs' collection (default "jobs"), the policies
-- @treturn mongotx.queue the queue
-- @errors `invalid`, database errors
-- @usage local q = assert(db:queue{ collection = "jobs" })
function Database:queue(opts)
  local q, err = queue.new(self, opts) -- not a tail call: its errors name our caller
  return q, err
end

--- Closes the connection.
-- @syntax db:close()
-- @usage db:close()
function Database:close()
  self.client:close()
end

return _M

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
function _M.connect(uri, opts)
  local name, core_opts = options.connect_args(uri, opts, 2)
  if not name then return nil, core_opts end
  local client, err = options.connected(core.connect(uri, core_opts))
  if not client then return nil, err end
  return setmetatable({ client = client, name = name }, Database)
end

function Database:collection(name)
  return self.client:collection(self.name, name)
end

-- db:manager{ collection, application, marker, version_field,
-- write_concern, <policies of mongotx.policy> }
function Database:manager(opts)
  local tm, err = manager.new(self, opts) -- not a tail call: its errors name our caller
  return tm, err
end

-- db:sync{ collection, propagate, flag, write_concern, max_attempts }:
-- sync flags (mongotx.sync).
function Database:sync(opts)
  local s, err = sync.new(self, opts) -- not a tail call: its errors name our caller
  return s, err
end

-- db:versioned{ roots, items, write_concern }: versioned structures
-- (mongotx.versioned).
function Database:versioned(opts)
  local v, err = versioned.new(self, opts) -- not a tail call: its errors name our caller
  return v, err
end

-- db:ledger{ collection, accounts, write_concern, retries }: transfers as
-- log entries with per-account sequence ids (mongotx.ledger)
function Database:ledger(opts)
  local l, err = ledger.new(self, opts) -- not a tail call: its errors name our caller
  return l, err
end

-- db:queue{ collection, write_concern, lease, max_attempts, backoff }
-- (mongotx.queue)
function Database:queue(opts)
  local q, err = queue.new(self, opts) -- not a tail call: its errors name our caller
  return q, err
end

function Database:close()
  self.client:close()
end

return _M

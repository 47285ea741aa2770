-- The options of every public call (connect, db:manager, begin, run,
-- transfer, the batches, recover, prune, db:queue and its calls, db:sync,
-- db:versioned and theirs), checked in one place before anything is
-- written.
--
-- A wrong type or an unknown name is a programming error and raises
-- ("option lease of manager must be a number, not string").  A value of
-- the right type that cannot work (NaN, infinite, out of range, a field
-- name that clashes with one mongotx writes, an unknown mode) is bad
-- input like a bad op: check returns nil and an `invalid` error naming the
-- option and what it must be.  Options the C core takes (write_concern,
-- read_preference, tls) are checked here as well, so that connect and
-- db:manager answer the same way; the core checks them again, raising.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local default_policy = require "mongotx.policy"

local type, pairs, tostring, floor, pcall = type, pairs, tostring, math.floor, pcall
local format = string.format

local _M = {}

-- The largest number of seconds a duration may have: 10 years, so that
-- the engine's arithmetic in milliseconds (Dates) stays exact.
local MAX_SECONDS = 10 * 365 * 24 * 3600
_M.MAX_SECONDS = MAX_SECONDS

-- Fields mongotx writes on the documents of a transaction besides the
-- marker and the version field (csrc/txn.c), with the defaults of those
-- two (manager.lua): a marker or version field may be none of them.
local DEFAULT_MARKER, DEFAULT_VERSION = "pendingTransactions", "txVersion"
local RESERVED = { _id = true, txRemoving = true, txHeld = true, txPlaceholder = true,
                   txPending = true }

local INT32_MAX = 2147483647

-- Each check takes the value and returns nothing when it is fine, else
-- "type" or "value" and what the value must be, and for a field of a table
-- option its name and value ("write_concern.w", -1); or "unknown", nil and
-- the name of a key the option does not take.

local function typed(t, must, ok)
  return function(v)
    if type(v) ~= t then return "type", "a " .. t end
    if ok and not ok(v) then return "value", must end
  end
end

-- Comparisons written so that NaN (false for every comparison) fails.
local function whole(lo, hi)
  return function(v) return v >= lo and v <= hi and floor(v) == v end
end

local function seconds(v) return v >= 0 and v <= MAX_SECONDS end

local function one_of(set)
  return function(v) return set[v] == true end
end

local function name_ok(s, bad)
  return s ~= "" and not s:find(bad) and not s:find("%z")
end

-- (UTF-8 as the encoder checks keys: the steps' updates that libmongoc
-- does not validate again carry these names, csrc/txn.c "Built here")
local function field_ok(s)
  return name_ok(s, "^%$") and not s:find(".", 1, true) and not RESERVED[s]
    and pcall(core.encode, { [s] = true })
end
_M.field_ok = field_ok -- (a transaction's recorded fields: validate.fields_error)

-- A name mongotx stores as a value (an application, a worker): not empty,
-- and UTF-8 as every stored string (core.check_value).
local function text_ok(v)
  return v ~= "" and core.check_value(v) == nil
end
_M.text_ok = text_ok

-- A collection name, by the rules of an op's collection (one function
-- for both: core.check_collection); the namespace's length, which needs
-- the database's name, is the caller's to check (db:manager).
local function collection_name(v)
  if type(v) ~= "string" then return "type", "a string" end
  local ok, why = core.check_collection(v)
  if not ok then return "value", "a collection name (" .. why .. ")" end
end

local write_concern_keys = { w = true, j = true, wtimeout = true }

local function write_concern(v)
  if type(v) ~= "table" then return "type", "a table" end
  for k in pairs(v) do
    if not write_concern_keys[k] then return "unknown", nil, "write_concern." .. tostring(k) end
  end
  local w, j, wtimeout = v.w, v.j, v.wtimeout
  if w ~= nil and type(w) ~= "number" and type(w) ~= "string" then
    return "type", "a number or a string", "write_concern.w", w
  end
  if j ~= nil and type(j) ~= "boolean" then return "type", "a boolean", "write_concern.j", j end
  if wtimeout ~= nil and type(wtimeout) ~= "number" then
    return "type", "a number", "write_concern.wtimeout", wtimeout
  end
  if type(w) == "number" and not whole(0, INT32_MAX)(w) or w == "" then
    return "value", 'a whole number >= 0 or a tag such as "majority"', "write_concern.w", w
  end
  if j == true and w == 0 then
    return "value", "false or absent with w = 0", "write_concern.j", j
  end
  if wtimeout ~= nil and not whole(0, INT32_MAX)(wtimeout) then
    return "value", "a whole number of milliseconds >= 0", "write_concern.wtimeout", wtimeout
  end
end

local tls_keys = { ca_file = "string", pem_file = "string", pem_password = "string",
                   allow_invalid_certificates = "boolean", allow_invalid_hostname = "boolean" }

local function tls(v)
  if type(v) ~= "table" then return "type", "a table" end
  for k, x in pairs(v) do
    if not tls_keys[k] then return "unknown", nil, "tls." .. tostring(k) end
    if type(x) ~= tls_keys[k] then return "type", "a " .. tls_keys[k], "tls." .. k, x end
  end
end

local checks = {
  -- connect
  database = typed("string", "a database name (not empty, UTF-8, none of /\\. \"$*<>:|?)",
    function(v) return name_ok(v, "[/\\. \"%$%*<>:|%?]") and text_ok(v) end),
  appname = typed("string", "at most 128 bytes", function(v) return #v <= 128 end),
  write_concern = write_concern,
  read_preference = typed("string", '"primary", "secondary", "primaryPreferred", ' ..
    '"secondaryPreferred" or "nearest"', one_of { primary = true, secondary = true,
      primaryPreferred = true, secondaryPreferred = true, nearest = true }),
  tls = tls,
  -- db:manager (and transfer_many's collection)
  collection = collection_name,
  application = typed("string", "a non-empty UTF-8 string", text_ok),
  marker = typed("string", "a top-level field name (UTF-8, not empty, no $ first, no dots, " ..
    "not _id, txRemoving, txHeld, txPlaceholder or txPending)", field_ok),
  escrow = typed("boolean"),
  fencing = typed("string", '"auto", "deadline" or "version"',
    one_of { auto = true, deadline = true, version = true }),
  single_writer = typed("boolean"),
  -- policies (mongotx.policy)
  stale_after = typed("number", "a number of seconds from 0 to " .. MAX_SECONDS, seconds),
  retries = typed("number", "a whole number from 0 to 1000", whole(0, 1000)),
  max_attempts = typed("number", "a whole number from 1 to 1000000", whole(1, 1e6)),
  finish = typed("string", '"inline" or "deferred"', one_of { inline = true, deferred = true }),
  finish_batch = typed("number", "a whole number from 1 to 100000", whole(1, 100000)),
  -- begin, run, transfer, the batches
  meta = typed("table"),
  field = typed("string"),
  min = typed("number"),
  expires = typed("number", "a number of seconds from 0 to " .. MAX_SECONDS, seconds),
  -- db:sync and db:versioned (mongotx.sync, mongotx.versioned)
  propagate = typed("function"),
  -- recover, prune, and the repairs of the modules beside transactions
  limit = typed("number", "a whole number from 1 to " .. INT32_MAX, whole(1, INT32_MAX)),
  older_than = typed("number", "a number of seconds from 0 to " .. MAX_SECONDS, seconds),
  dry_run = typed("boolean"),
  -- L:history (mongotx.ledger): a seqId, whole within 2^53 like amounts
  after = typed("number", "a whole number from 0 to 2^53", whole(0, 2 ^ 53)),
  -- compensate
  floors = typed("boolean"),
  -- tm:find (the rest of the core's find options only need their type)
  skip = typed("number", "a whole number from 0 to " .. INT32_MAX, whole(0, INT32_MAX)),
  batch_size = typed("number", "a whole number from 0 to " .. INT32_MAX, whole(0, INT32_MAX)),
  -- mongotx.queue: push, work
  priority = typed("number", "a whole number from -1000000 to 1000000", whole(-1e6, 1e6)),
  worker = typed("string", "a non-empty UTF-8 string", text_ok),
  types = typed("table"),
  max_jobs = typed("number", "a whole number from 1 to " .. INT32_MAX, whole(1, INT32_MAX)),
  stop = typed("function"),
  -- each (mongotx.each), recover
  batch = typed("number", "a whole number from 1 to 100000", whole(1, 100000)),
  key = typed("function"),
  progress = typed("function"),
  wait = typed("number", "a number of seconds from 0 to " .. MAX_SECONDS, seconds),
}
checks.version_field, checks.flag = checks.marker, checks.marker
checks.roots, checks.items = checks.collection, checks.collection
checks.accounts = checks.collection -- db:ledger's heads (mongotx.ledger)
checks.lease, checks.retention = checks.stale_after, checks.stale_after
checks.holder_wait = checks.stale_after
checks.at, checks.idle, checks.poll = checks.older_than, checks.older_than, checks.older_than
-- Any other policy (the functions) only needs the type of its default.
for k, v in pairs(default_policy) do
  if not checks[k] then checks[k] = typed(type(v)) end
end

local function shown(v)
  if type(v) == "string" then return format("%q", v) end
  if type(v) == "number" and v == floor(v) and v > -2 ^ 63 and v < 2 ^ 63 then
    return format("%d", v)
  end
  if type(v) == "table" then return "a table" end
  return tostring(v)
end

-- marker and version_field of a manager: two different fields.
local function clash(opts)
  local marker = opts.marker or DEFAULT_MARKER
  local version = opts.version_field or DEFAULT_VERSION
  if marker == version then
    return format("options marker and version_field must be different fields, " ..
      "not both %q", marker)
  end
end

-- check(opts, names, what, level): opts (a table, or nil for none) may
-- hold the keys of `names`; `what` names the call in messages ("manager",
-- "transfer_many item 3"); raises at `level` for unknown names and wrong
-- types.  Returns a plain copy of opts' raw contents ({} for nil), which
-- is what the caller must use (a metatable's __index or __pairs cannot
-- show the checks one value and the caller another), or nil and an
-- `invalid` error for the first bad value.
local connect_options = { database = true, appname = true, write_concern = true,
                          read_preference = true, tls = true }

-- Every writer of mongotx reads the server's replies to its writes (the
-- matched count that fences a step, the document a claim returns, the
-- duplicate key that tells a ledger's seqId is taken): under w = 0 none
-- comes back and every write would look lost.  Only a connection's
-- default may be unacknowledged, for the C core's own calls; the engine
-- and the modules always name their write concern.
local function unacknowledged(opts, names)
  local wc = opts.write_concern
  return names ~= connect_options and type(wc) == "table" and rawget(wc, "w") == 0
end

function _M.check(opts, names, what, level)
  if opts == nil then return {} end
  if type(opts) ~= "table" then
    error(format("options of %s must be a table, not %s", what, type(opts)), level + 1)
  end
  local raw = {}
  for k, v in next, opts do raw[k] = v end
  opts = raw
  local bad
  for k, v in pairs(opts) do
    if not names[k] then
      error(format("unknown option %s for %s", tostring(k), what), level + 1)
    end
    local check = checks[k]
    if check then
      local kind, must, name, x = check(v)
      if name == nil then name, x = k, v end
      if kind == "unknown" then
        error(format("unknown option %s for %s", name, what), level + 1)
      elseif kind == "type" then
        error(format("option %s of %s must be %s, not %s", name, what, must, type(x)), level + 1)
      elseif kind == "value" and not bad then
        bad = format("option %s of %s must be %s, not %s", name, what, must, shown(x))
      end
    end
  end
  if not bad and unacknowledged(opts, names) then
    bad = format("option write_concern.w of %s must be acknowledged (not 0): " ..
                 "mongotx reads the server's replies to its writes", what)
  end
  if not bad and (names.marker or names.version_field) then bad = clash(opts) end
  if bad then
    return nil, errors.new("invalid", bad, { step = what:match("^[%w_]+") })
  end
  return opts
end

-- The options of tm:find and mongotx.resty's db:find: the core's
-- find_all's, whose values check() checks first.
_M.FIND = { sort = true, limit = true, projection = true, skip = true, batch_size = true,
            read_preference = true }

-- tm:find and db:find hand back a list held in memory: FIND_LIMIT
-- documents unless the caller asks for another limit, FIND_MAX at most
-- (the largest batch of recover and each); past that a caller pages
-- (skip, or a filter on where the last page ended).
_M.FIND_LIMIT, _M.FIND_MAX = 1000, 100000

-- The options of a find that returns a list (FIND, checked), its limit
-- set: FIND_LIMIT by default, `invalid` above FIND_MAX.
function _M.find(opts, what, level)
  local err
  opts, err = _M.check(opts, _M.FIND, what, level + 1)
  if not opts then return nil, err end
  if opts.limit == nil then
    opts.limit = _M.FIND_LIMIT
  elseif opts.limit > _M.FIND_MAX then
    return nil, errors.new("invalid", format("option limit of %s must be a whole number " ..
      "from 1 to %d (a list held in memory: page with skip or a filter), not %s", what,
      _M.FIND_MAX, shown(opts.limit)), { step = what })
  end
  return opts
end

-- What connect(uri, opts) needs of its arguments, for mongotx.connect and
-- mongotx.pool alike: the database's name (opts.database, else the URI's
-- path, else "test") and the C core's options (the rest).  A wrong type
-- raises at `level`; a bad value returns nil, err.
function _M.connect_args(uri, opts, level)
  if type(uri) ~= "string" then error("uri must be a string", level + 1) end
  local why
  opts, why = _M.check(opts, connect_options, "connect", level + 1)
  if not opts then return nil, why end
  local core_opts = {}
  for k, v in pairs(opts) do
    if k ~= "database" then core_opts[k] = v end
  end
  return opts.database or _M.uri_database(uri) or "test", core_opts
end

-- core.connect's answer as mongotx.connect and mongotx.pool give it: a
-- URI libmongoc refuses to parse (MONGOC_ERROR_COMMAND_INVALID_ARG, 22)
-- is bad input, `invalid` (libmongoc's number stays in server_code).
function _M.connected(client, err)
  if not client and err.code == "command" and err.server_code == 22 then err.code = "invalid" end
  return client, err
end

-- The database a URI names in its path, or nil.
function _M.uri_database(uri)
  return uri:match("^mongodb[^:]*://[^/]*/([^?]+)")
end

-- What a transaction's ops and meta may take of its 16 MiB document,
-- leaving the rest to its state, owner, ids and the like (the same room
-- validate.ops leaves for the ops alone).  A rollback's reason gets as
-- much.
local MAX_CONTENT = 16 * 1024 * 1024 - 64 * 1024
_M.MAX_REASON = MAX_CONTENT

-- The content of `meta` (already a table) next to the ops as stored
-- (validate.ops' second result): it must encode (no table containing
-- itself, at most 100 levels, only values BSON has), hold no key the
-- driver refuses in a stored document (`$` first, a dot, empty) nor a NaN
-- or infinite number (core.check_value, as for a job's details), and fit
-- in the transaction with them.  Returns true, or nil and an `invalid`
-- error; `what` is the call (the error's step).
function _M.meta(meta, stored_ops, what)
  local ok, bytes = pcall(core.encode, { ops = stored_ops, meta = meta })
  if ok then
    local why = core.check_value(meta)
    if why then ok, bytes = false, why end
  end
  if not ok then
    return nil, errors.new("invalid", "meta cannot be stored: " ..
      tostring(bytes):gsub("^mongotx: ", ""), { step = what })
  end
  if #bytes > MAX_CONTENT then
    return nil, errors.new("invalid", format("the ops and meta take %d bytes: a " ..
      "transaction is one document of at most 16 MiB", #bytes), { step = what })
  end
  return true
end

return _M

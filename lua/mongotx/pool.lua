-- mongotx.pool: the engine over this process's pool of connections to a
-- URI.  mongotx.core keeps one libmongoc client pool per URI (and appname
-- and TLS options) per process, shared by every Lua state of the process
-- (core.connect with pool = true); here every manager call takes a client
-- from it and gives it back when the call returns, so a process holds as
-- many connections as it has calls in flight (at most the URI's
-- maxPoolSize, default 100), not one per Lua state.  mongotx.resty runs it
-- in nginx's worker threads; a plain Lua program, or a host that runs
-- several Lua states on threads, may use it directly:
--
--   local pool = require "mongotx.pool"
--   local db = assert(pool.connect(uri [, opts]))  -- opts of mongotx.connect
--   local tm = assert(db:manager{ application = "app-1" })
--   assert(tm:transfer("accounts", "A", "B", 100))
--
-- A pooled manager has the methods of a manager (mongotx.manager) and
-- answers the same.  Behind it are one or more managers ("slots") of its
-- Lua state, each bound to a client for the length of a call: a call that
-- comes while every slot is in a call (a coroutine that yields inside one,
-- through a sleep policy) gets a new slot.  Each slot is a manager of its
-- own (its own `instance`; with finish = "deferred" its own queue, which
-- tm:finish() drains for the slot the call lands on).

--- One connection pool per process, for hosts with several Lua states (docs/openresty.md#one-pool-per-worker-process).
-- @module mongotx.pool

local core = require "mongotx.core"
local options = require "mongotx.options"
local manager = require "mongotx.manager"

local type, pcall, error, select, setmetatable = type, pcall, error, select, setmetatable
local unpack = table.unpack or unpack -- luacheck: ignore 143

local _M = { _VERSION = core._VERSION }

-- The manager's methods, each run on a slot bound to a client of the pool.
_M.METHODS = { "begin", "commit", "run", "transfer", "commit_many", "transfer_many",
               "finish", "rollback", "compensate", "recover", "prune", "get", "find",
               "stats", "step", "server_now", "run_calls", "later", "hold", "hold_many", "capture", "void" }

local Database = {}
Database.__index = Database

local Pooled = {}
Pooled.__index = Pooled

-- connect(uri [, { database, appname, write_concern, read_preference,
-- tls }]): checks the options as mongotx.connect does (a wrong type
-- raises, a bad value is nil, err), and takes and gives back one client,
-- which makes the pool on first use and reports a URI libmongoc refuses.

--- A database handle whose calls each take a client of the process's pool.
-- @syntax db, err = pool.connect(uri [, opts])
-- @string uri a MongoDB URI
-- @tparam[opt] table opts as `mongotx.connect`
-- @treturn table the handle
-- @errors `invalid`, `client` (after the process's exit), database errors
-- @usage local db = assert(require("mongotx.pool").connect(uri, { database = "bank" }))
function _M.connect(uri, opts)
  local name, core_opts = options.connect_args(uri, opts, 2)
  if not name then return nil, core_opts end
  core_opts.pool = true
  local client, err = options.connected(core.connect(uri, core_opts))
  if not client then return nil, err end
  client:close()
  return setmetatable({ uri = uri, name = name, core_opts = core_opts }, Database)
end

-- A client of the pool, the caller's until it closes it (a core client:
-- collection, command, ...).  nil, err when none came free within the
-- URI's waitQueueTimeoutMS.

--- @type Database

--- A client of the pool, the caller's until it closes it.
-- @syntax client, err = db:client()
-- @treturn userdata a core client
-- @errors none came free within the URI's waitQueueTimeoutMS
-- @usage local c = assert(db:client()); c:close()
function Database:client()
  return core.connect(self.uri, self.core_opts)
end

-- The pool's figures (mongotx.core client:pool()), in_use not counting
-- the client taken to read them.

--- The pool's figures.
-- @syntax figures, err = db:pool()
-- @treturn table `{ id, pid, max_size, in_use, peak, pops }`
-- @usage print(db:pool().in_use)
function Database:pool()
  local client, err = self:client()
  if not client then return nil, err end
  local info = client:pool()
  client:close()
  info.in_use = info.in_use - 1
  return info
end

--- Does nothing: the pool lives as long as the process.
-- @syntax db:close()
-- @usage db:close()
-- @function Database:close
function Database.close() end -- the pool lives as long as the process

-- Points slot's manager at client (Manager:use): the handles it made
-- from the client of another call are dropped, so a handle is never used
-- from two threads; one kept by mistake would raise "attempt to use a
-- closed client" (its client was given back).
local function bind(slot, client)
  slot.tm:use(client)
end

-- A new slot, bound to client: a manager made as db:manager makes one.
-- Raises (at the caller of db:manager) on a wrong option type.
local function new_slot(db, opts, client)
  local slot = { db = { client = client, name = db.name } }
  local ok, tm, err = pcall(manager.new, slot.db, opts)
  if not ok then return nil, nil, tm end
  if not tm then return nil, err end
  slot.tm = tm
  return slot
end

-- Re-raises err (a raise inside a call) at level: a message that carries
-- no position, or one in this file, gets the caller's.
local function reraise(err, level)
  if type(err) == "string" then
    err = err:gsub("^[^\n]-mongotx/pool%.lua:%d+: ", "")
    if not err:find("^[^\n]-:%d+: ") then error(err, level + 1) end
  end
  error(err, 0)
end

-- db:manager(opts): a pooled manager (opts as db:manager), or nil, err.

--- A manager whose calls each run on a client of the pool; it has every method of mongotx's manager.
-- @syntax tm, err = db:manager(opts)
-- @tparam[opt] table opts as `db:manager`
-- @treturn table the pooled manager
-- @errors as `db:manager`
-- @usage local tm = assert(db:manager{ application = "app" })
function Database:manager(opts)
  local client, err = self:client()
  if not client then return nil, err end
  local slot, raised
  slot, err, raised = new_slot(self, opts, client)
  client:close()
  if raised then reraise(raised, 2) end
  if not slot then return nil, err end
  return setmetatable({ db = self, opts = opts, free = { slot }, slots = 1,
                        application = slot.tm.application, instance = slot.tm.instance,
                        namespace = slot.tm.namespace, policy = slot.tm.policy },
                      Pooled)
end

local function pack(...)
  return { n = select("#", ...), ... }
end

-- Runs slot.tm[method](slot.tm, ...) with a client of the pool; the
-- results as a packed list, or nil, err when no client came free, or
-- false and what the call raised.
function Pooled:_call(method, ...)
  local client, err = self.db:client()
  if not client then return nil, err end
  local free = self.free
  local slot = free[#free]
  if slot then
    free[#free] = nil
    bind(slot, client)
  else
    local raised
    slot, err, raised = new_slot(self.db, self.opts, client)
    if not slot then
      client:close()
      if raised then return false, raised end
      return nil, err
    end
    self.slots = self.slots + 1
  end
  local res = pack(pcall(slot.tm[method], slot.tm, ...))
  client:close()
  free[#free + 1] = slot
  if not res[1] then return false, res[2] end
  return res
end

for _, method in ipairs(_M.METHODS) do
  Pooled[method] = function(self, ...)
    local res, err = self:_call(method, ...)
    if res == nil then return nil, err end
    if res == false then reraise(err, 2) end
    return unpack(res, 2, res.n)
  end
end

return _M

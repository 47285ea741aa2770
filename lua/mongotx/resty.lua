-- mongotx.resty: the engine's API for OpenResty handlers, without blocking
-- the nginx worker.  Every call that can touch the network runs in a
-- thread of an nginx thread_pool (ngx.run_worker_thread) while the
-- handler's coroutine yields, on this worker process's pool of
-- connections (mongotx.pool); a handler gets back exactly what
-- require "mongotx" would return, nil, err included.
--
--   -- nginx.conf: thread_pool mongotx threads=8;  (main context)
--   --             lua_worker_thread_vm_pool_size 16;  (http context)
--   local resty = require "mongotx.resty"
--   local db = assert(resty.connect(uri, { database = "bank" }))
--   local tm = assert(db:manager{ application = "shop" })
--   local t, err = tm:transfer("accounts", "A", "B", 100, { min = 0, id = key })
--
-- A call's arguments and results cross as one BSON document each
-- (mongotx.resty.wire: run_worker_thread copies plain values only).  The
-- thread side, thread() below, keeps per worker-thread VM the pooled
-- databases and managers made for each connect and db:manager (by their
-- options), and runs every call on a client of the process's pool.
--
-- Limits (docs/openresty.md): calls work where a handler may yield
-- (rewrite, access, content, ngx.timer); options of db:manager must be
-- data (policy functions come from a module named by `policies`); each
-- worker-thread VM holds its own managers (each its own `instance`).
--
-- This module owns the thread side (thread()), the handles a handler
-- holds (connect, db, tm) and recovery inside nginx; mongotx.resty.wire
-- owns the crossing (pack, call), .group group commit, .held a handler's
-- wait for a key another call holds, .thread what a worker thread runs.

--- The engine for nginx handlers, without blocking the worker (docs/openresty.md).
-- @module mongotx.resty

local core = require "mongotx.core"
local pool = require "mongotx.pool"
local catalog = require "mongotx.catalog"
local options = require "mongotx.options"
local validate = require "mongotx.validate"
local group = require "mongotx.group"
local wire = require "mongotx.resty.wire"
local resty_group = require "mongotx.resty.group"
local held = require "mongotx.resty.held"

local type, pairs, ipairs, select, tostring, error, pcall, setmetatable =
  type, pairs, ipairs, select, tostring, error, pcall, setmetatable
local format = string.format
local encode, decode = core.encode, core.decode
local pack, unpack, call = wire.pack, wire.unpack, wire.call
local run_group, new_group, grouped, group_option =
  resty_group.run_group, resty_group.new_group, resty_group.grouped, resty_group.group_option

local _M = { _VERSION = core._VERSION }

-- The thread_pool a call runs in unless connect's `thread_pool` says
-- otherwise, and how long a call waits for a free worker-thread VM.
_M.THREAD_POOL = "mongotx"
_M.WAIT = 5

-- The thread side ----------------------------------------------------------

-- Per Lua state (each worker-thread VM, or the worker itself with offload
-- = false): the pooled databases and managers by their spec (the BSON of
-- what made them).
local dbs, managers = {}, {}

local function policies_of(name)
  local ok, mod = pcall(require, name)
  if not ok then error(format("policies module %s: %s", name, mod), 0) end
  if type(mod) ~= "table" then
    error(format("policies module %s returned a %s, not a table", name, type(mod)), 0)
  end
  return mod
end

local function get_db(spec)
  local db = dbs[spec]
  if db then return db end
  local s = decode(spec)
  local err
  db, err = pool.connect(s.uri, s.connect)
  if db then dbs[spec] = db end
  return db, err
end

local function get_manager(spec)
  local tm = managers[spec]
  if tm then return tm end
  local s = decode(spec)
  local db, err = get_db(s.db)
  if not db then return nil, err end
  local opts = s.manager
  if opts and opts.policies ~= nil then
    local extra = policies_of(opts.policies)
    opts.policies = nil
    for k, v in pairs(extra) do
      if opts[k] == nil then opts[k] = v end
    end
  end
  -- (here, where a policies module's finish is known too, before the index)
  if s.grouped and opts and opts.finish == "deferred" then
    return nil, core.error({ code = "invalid", step = "manager", message = "option finish = " ..
      "\"deferred\" of manager does not go with group commit: a batch finishes its own, a thread's " ..
      "queue would leave them applied until recovery; drop finish, or set group = false" })
  end
  -- metrics = "<lua_shared_dict>": the events counted there (mongotx.metrics.shared)
  if opts and opts.metrics ~= nil then opts = require("mongotx.metrics.shared").wrap(opts) end
  tm, err = db:manager(opts)
  if tm then managers[spec] = tm end
  return tm, err
end

local DB_CALLS = {}

-- The collection, filter and options of db:find and db:count, checked as
-- tm:find checks its own: a bad value is `invalid`, a wrong type raises.
local function read_args(collection, filter, opts)
  local ok, err = options.check({ collection = collection }, { collection = true }, "find", 3)
  if not ok then return nil, err end
  if filter ~= nil and type(filter) ~= "table" then error("filter must be a table", 0) end
  filter, err = validate.filter(filter or {})
  if not filter then return nil, err end
  opts, err = options.find(opts, "find", 3)
  if not opts then return nil, err end
  return filter, opts
end

function DB_CALLS.find(db, collection, filter, opts)
  local err
  filter, opts = read_args(collection, filter, opts)
  if not filter then return nil, opts end
  local client
  client, err = db:client()
  if not client then return nil, err end
  local ok, list, ferr = pcall(function()
    return client:collection(db.name, collection):find_all(filter, opts)
  end)
  client:close()
  if not ok then error(list, 0) end
  return list, ferr
end

function DB_CALLS.count(db, collection, filter)
  local err
  filter, err = read_args(collection, filter)
  if not filter then return nil, err end
  local client
  client, err = db:client()
  if not client then return nil, err end
  local ok, n, cerr = pcall(function()
    return client:collection(db.name, collection):count(filter)
  end)
  client:close()
  if not ok then error(n, 0) end
  return n, cerr
end

-- Is there a collection `name` (mongotx.catalog, which creates nothing)?
-- And the database's name.  For recovery's first pass.
function DB_CALLS.has_collection(db, name)
  local client, err = db:client()
  if not client then return nil, err end
  local ok, exists, herr = pcall(catalog.has_collection, client, db.name, name)
  client:close()
  if not ok then error(exists, 0) end
  return exists, herr, db.name
end

-- The pool's figures, and `vm`: which Lua state ran the call.
function DB_CALLS.pool(db)
  local info, err = db:pool()
  if info then info.vm = tostring(dbs):match("0x%x+") end
  return info, err
end

local function pack_all(...)
  return pack(select("#", ...), ...)
end

local METHOD = {}
for _, m in ipairs(pool.METHODS) do METHOD[m] = true end


local function run(kind, spec, method, args)
  local a = decode(args)
  local n = a.n
  local list = {}
  for i = 1, n do list[i] = a[tostring(i)] end
  if kind == "connect" then
    local db, err = get_db(spec)
    return pack(2, db and true or nil, err)
  elseif kind == "manager" then
    local tm, err = get_manager(spec)
    return pack(2, tm and { application = tm.application, namespace = tm.namespace,
                            stale_after = tm.policy.stale_after } or nil, err)
  elseif kind == "db" then
    local db, err = get_db(spec)
    if not db then return pack(2, nil, err) end
    return pack_all(DB_CALLS[method](db, unpack(list, 1, n)))
  end
  local tm, err = get_manager(spec)
  if not tm then return pack(2, nil, err) end
  if kind == "group" then return run_group(tm, list[1], list[2]) end
  if not METHOD[method] then error("no method " .. tostring(method), 0) end
  return pack_all(tm[method](tm, unpack(list, 1, n)))
end

-- thread(kind, spec, method, args): what ngx.run_worker_thread runs in a
-- worker-thread VM (and a worker runs itself with offload = false).
-- Returns "ok" and the results pack()ed, or "raise" and the message of
-- what the call raised (a misuse: a wrong argument type, an unknown
-- option).

--- Internal: what `ngx.run_worker_thread` runs in a worker-thread VM
-- (kind, the handle's description, the method, its arguments as BSON).
-- @local
function _M.thread(kind, spec, method, args)
  local ok, res = pcall(run, kind, spec, method, args)
  if ok then return "ok", res end
  return "raise", type(res) == "string" and res or tostring(res)
end

-- The worker side ----------------------------------------------------------

local Database = {}
Database.__index = Database

local Manager = {}
Manager.__index = Manager

local resty_options = { thread_pool = true, wait = true, offload = true }

-- connect(uri [, opts]): opts are mongotx.connect's (database, appname,
-- write_concern, read_preference, tls) plus thread_pool (default
-- "mongotx"), wait (seconds a call waits for a free worker thread, default
-- 5) and offload (false: run every call in the worker itself, blocking it,
-- as require "mongotx" does; for comparisons).  Makes this worker
-- process's pool for the URI on first use (in a worker thread).

--- A database handle for nginx handlers: every call runs in a worker thread.
-- @syntax db, err = resty.connect(uri [, opts])
-- @string uri a MongoDB URI
-- @tparam[opt] table opts `mongotx.connect`'s plus `thread_pool` (default "mongotx"), `wait` (5 s), `offload` (true)
-- @treturn table the handle
-- @errors `invalid`, database errors
-- @usage local db = assert(resty.connect(os.getenv("MONGOTX_URI"), { database = "bank" }))
function _M.connect(uri, opts)
  if type(uri) ~= "string" then error("uri must be a string", 2) end
  if opts ~= nil and type(opts) ~= "table" then
    error("options of connect must be a table, not " .. type(opts), 2)
  end
  local self = setmetatable({ thread_pool = _M.THREAD_POOL, wait = _M.WAIT, offload = true },
                            Database)
  local connect = {}
  for k, v in pairs(opts or {}) do
    if resty_options[k] then self[k] = v else connect[k] = v end
  end
  if type(self.thread_pool) ~= "string" then error("option thread_pool must be a string", 2) end
  if type(self.wait) ~= "number" then error("option wait must be a number of seconds", 2) end
  if not (self.wait >= 0 and self.wait <= options.MAX_SECONDS) then
    return nil, core.error({ code = "invalid", step = "connect", message = format("option wait " ..
      "of connect must be a number of seconds from 0 to %d, not %s", options.MAX_SECONDS,
      tostring(self.wait)) })
  end
  if type(self.offload) ~= "boolean" then error("option offload must be a boolean", 2) end
  self.spec = encode({ uri = uri, connect = connect })
  local ok, err = call(self, 2, "connect", self.spec, nil)
  if not ok then return nil, err end
  return self
end


-- The groups of this worker, by manager (and thread pool and options).
local groups = {}

-- db:manager(opts): opts are db:manager's, as data: a function cannot
-- reach a worker thread, so policies that are functions come from a
-- module named by `policies` (a module that returns a table of them, which
-- each worker-thread VM requires; options given here win).  Plus `group`:
-- { max = 100, delay = 0, inflight = 1 } (the default; true is the same), or false:
-- tm:transfer, tm:run and tm:commit of concurrent handlers of this worker
-- run as one batch (mongotx.group).

--- @type Database

--- A manager whose calls run in worker threads; every method of mongotx's manager but `step`.
-- @syntax tm, err = db:manager(opts)
-- @tparam[opt] table opts `db:manager`'s, as data; `policies` names a module of policy functions;
--   `metrics` names a `lua_shared_dict` the events are counted in (`mongotx.metrics.shared`);
--   `group`: `{ max = 100, delay = 0, inflight = 1 }` (the default; `true` is the same) or `false`, group
--   commit of this worker's concurrent `tm:transfer`, `tm:run` and `tm:commit` calls (docs/openresty.md)
-- @treturn table the manager
-- @errors as `db:manager`; `invalid` for `finish = "deferred"` with group commit on;
--   `overloaded` (every thread busy for `wait` seconds) from its calls; a bad `group` or `metrics` raises
-- @usage local tm = assert(db:manager{ application = "bank", group = { max = 100, delay = 0 } })
function Database:manager(opts)
  if opts ~= nil and type(opts) ~= "table" then
    error("options of manager must be a table, not " .. type(opts), 2)
  end
  local g
  if opts then
    local copy = {}
    for k, v in pairs(opts) do copy[k] = v end
    g, copy.group = copy.group, nil
    opts = copy
  end
  g = group_option(g)
  for k, v in pairs(opts or {}) do
    if type(v) == "function" then
      error(format("option %s of manager is a function, which cannot reach a worker thread: " ..
        "put it in a module and name the module with policies = \"<module>\"", tostring(k)), 2)
    end
  end
  if opts and opts.policies ~= nil and type(opts.policies) ~= "string" then
    error("option policies of manager must be a module name (a string)", 2)
  end
  if opts and opts.metrics ~= nil and type(opts.metrics) ~= "string" then
    error("option metrics of manager must name a lua_shared_dict (a string)", 2)
  end
  -- grouped: the worker thread refuses finish = "deferred" (get_manager)
  local ok, spec = pcall(encode, { db = self.spec, manager = opts, grouped = g and self.offload or nil })
  if not ok then error("options of manager must be BSON data: " .. tostring(spec), 2) end
  local info, err = call(self, 2, "manager", spec, nil)
  if not info then return nil, err end
  local tm = setmetatable({ db = self, spec = spec, application = info.application,
    namespace = info.namespace, policy = { stale_after = info.stale_after } }, Manager)
  if g and self.offload then
    -- one group per manager (its spec) and worker: managers made for the
    -- same options, as by concurrent first requests, share it
    local gkey = format("%s\0%s\0%.17g\0%.17g\0%.17g", self.thread_pool, spec, g.max, g.delay, g.inflight)
    local made, group_obj = true, groups[gkey]
    if not group_obj then made, group_obj = pcall(new_group, tm, g) end
    if not made then error(group_obj, 2) end
    groups[gkey], tm.group = group_obj, group_obj
  end
  return tm
end

-- db:find(collection, filter [, opts]) -> list, db:count(collection,
-- filter) -> n: reads of any collection of the database (opts as the
-- core's find_all, the limit as tm:find's), for handlers that check input
-- before a transaction.

--- Reads documents of any collection, in a worker thread.
-- @syntax list, err = db:find(collection, filter [, opts])
-- @string collection the collection
-- @tparam table filter the query
-- @tparam[opt] table opts as `find_all`; `limit` as tm:find's (default 1000, at most 100000)
-- @treturn table at most `limit` documents
-- @errors `invalid`, `overloaded`, database errors
-- @usage local found = assert(db:find("accounts", { _id = "A" }, { limit = 1 }))
function Database:find(collection, filter, opts)
  if type(collection) ~= "string" then error("collection must be a string", 2) end
  return call(self, 1, "db", self.spec, "find", collection, filter, opts)
end

--- Counts documents of any collection, in a worker thread.
-- @syntax n, err = db:count(collection, filter)
-- @string collection the collection
-- @tparam table filter the query
-- @treturn integer the count
-- @errors `overloaded`, database errors
-- @usage local n = assert(db:count("accounts", {}))
function Database:count(collection, filter)
  if type(collection) ~= "string" then error("collection must be a string", 2) end
  return call(self, 1, "db", self.spec, "count", collection, filter)
end

-- db:pool() -> the figures of the pool of the worker process (or of the
-- process, with offload = false) that the call ran on: mongotx.core's
-- client:pool() (id, pid, max_size, in_use, peak, pops).

--- The worker process's pool figures.
-- @syntax figures, err = db:pool()
-- @treturn table as `mongotx.pool`'s
-- @usage print(db:pool().in_use)
function Database:pool()
  return call(self, 1, "db", self.spec, "pool")
end

--- Does nothing: the pool lives as long as the worker process.
-- @syntax db:close()
-- @usage db:close()
-- @function Database:close
function Database.close() end -- the pool lives as long as the worker process

-- tm:<method>(...) for every method of a manager but step (a stepwise
-- walk holds versions in one manager, and calls land on any VM); a held
-- key is waited for here, not in a thread (mongotx.resty.held).
for _, method in ipairs(pool.METHODS) do
  if method ~= "step" and method ~= "run_calls" and method ~= "later" then
    Manager[method] = function(self, ...)
      if held.LATER[method] and self.db.offload and held.YIELDS[ngx.get_phase()] then -- luacheck: ignore 113
        return held.call(self, method, 1, ...)
      end
      return call(self.db, 1, "call", self.spec, method, ...)
    end
  end
end

for _, method in ipairs(group.METHODS) do
  local alone = Manager[method]
  Manager[method] = function(self, ...)
    if not self.group or not held.YIELDS[ngx.get_phase()] then return alone(self, ...) end -- luacheck: ignore 113
    return grouped(self, method, alone, ...)
  end
end

-- Recovery inside nginx ----------------------------------------------------

local recovery_options = { uri = true, connect = true, manager = true, every = true,
                           limit = true, dict = true, key = true, ttl = true,
                           on_report = true }

-- recovery{ uri, connect, manager, dict, every, limit, key, ttl,
-- on_report }, for init_worker_by_lua: every `every` seconds (default 5)
-- one worker of the nginx instance runs tm:recover{ limit = limit } in a
-- worker thread, with the manager `manager` (db:manager's options) on
-- resty.connect(uri, connect).  The worker is elected through the
-- lua_shared_dict `dict`: the first to add `key` (default
-- "mongotx:recovery:<application>") with a TTL of `ttl` seconds (default 3
-- x every) holds it and renews it at every turn, so while it lives no
-- other worker runs recovery, and when it dies (kill -9 included) its
-- entry expires and the next worker to try takes over.  (Should a leader
-- stall past its TTL, two workers may run one pass each at once; recovery
-- is safe under that, claims being atomic.)  on_report(report, err, pid)
-- is called in the leader after each pass.  Returns a handle with
-- :stop() (this worker stops trying; a leader gives its turn up), or
-- raises on a misuse.

--- Recovery inside nginx.
-- @section recovery

--- Runs `tm:recover` every `every` seconds in exactly one worker of the nginx instance.
-- @syntax handle = resty.recovery{ uri, connect, manager, dict, every, limit, key, ttl, on_report }
-- @tparam table opts `uri`, `connect` and `manager` options, `dict` (a lua_shared_dict), `every` (5 s), `limit`,
--   `key`, `ttl`, `on_report(report, err, pid)`
-- @treturn table a handle with `:stop()`
-- @errors raises on a misuse
-- @usage resty.recovery{ uri = os.getenv("MONGOTX_URI"), connect = { database = "bank" }, dict = "mongotx" }
function _M.recovery(opts)
  local ngx = ngx -- luacheck: ignore 113
  if type(opts) ~= "table" then error("recovery takes a table of options", 2) end
  for k in pairs(opts) do
    if not recovery_options[k] then error("unknown option " .. tostring(k) .. " for recovery", 2) end
  end
  if type(opts.uri) ~= "string" then error("option uri of recovery must be a string", 2) end
  local dict = type(opts.dict) == "string" and ngx.shared[opts.dict]
  if not dict then
    error("option dict of recovery must name a lua_shared_dict (nginx.conf: " ..
          "lua_shared_dict <name> 1m;)", 2)
  end
  local every = opts.every or 5
  if type(every) ~= "number" or every ~= every or every <= 0 then
    error("option every of recovery must be a number of seconds > 0", 2)
  end
  local ttl = opts.ttl or 3 * every
  if type(ttl) ~= "number" or ttl ~= ttl or ttl <= every then
    error("option ttl of recovery must be a number of seconds > every", 2)
  end
  local mopts = opts.manager or {}
  -- connect's `database`, else the URI's: not mongotx.connect's "test",
  -- which a URI that names no database would have swept in silence
  if (type(opts.connect) ~= "table" or opts.connect.database == nil)
      and not options.uri_database(opts.uri) then
    error("recovery needs a database: in the uri (mongodb://host/<database>) or " ..
          "connect = { database = ... }", 2)
  end
  local key = opts.key or ("mongotx:recovery:" .. tostring(mopts.application or "mongotx"))
  local me = tostring(ngx.worker.pid())
  local tm, running, stopped, told

  -- Is this worker the one (adding the key, or renewing its own)?
  local function elected()
    local ok, err = dict:add(key, me, ttl)
    if ok then return true end
    if err ~= "exists" then
      ngx.log(ngx.ERR, "mongotx recovery: shared dict ", opts.dict, ": ", err)
      return false
    end
    if dict:get(key) ~= me then return false end
    dict:set(key, me, ttl)
    return true
  end

  local function resign()
    if dict:get(key) == me then dict:delete(key) end
  end

  -- The manager, made once its transactions collection is there (one for
  -- a mistyped name would create it): until then a pass answers an error
  -- naming both and creates nothing; a fresh deploy's is logged at info,
  -- once a worker (on_report gets it every pass).
  local function pass()
    if not tm then
      local db, err = _M.connect(opts.uri, opts.connect)
      if not db then return nil, err end
      local collection = mopts.collection or "transactions"
      local exists, name
      exists, err, name = call(db, 1, "db", db.spec, "has_collection", collection)
      if exists == nil then return nil, err end
      if not exists then
        return nil, core.error({ code = "invalid", step = "recovery", message = format(
          "database %s has no collection %s: nothing to recover, nothing created (no " ..
          "transaction begun yet, or a wrong database in uri or connect, or collection in " ..
          "manager?)", name, collection) }), "absent"
      end
      tm, err = db:manager(mopts)
      if not tm then return nil, err end
    end
    return tm:recover({ limit = opts.limit })
  end

  local function tick(premature)
    if premature or stopped then return resign() end
    if running or not elected() then return end
    running = true
    local ok, report, err, absent = pcall(pass)
    running = false
    if stopped then return resign() end
    if dict:get(key) == me then dict:set(key, me, ttl) end -- a long pass keeps its turn
    if not ok then
      report, err = nil, report
      ngx.log(ngx.ERR, "mongotx recovery: ", tostring(err))
    elseif absent then
      if not told then ngx.log(ngx.INFO, "mongotx recovery: ", tostring(err)) end
      told = true
    elseif not report then
      ngx.log(ngx.ERR, "mongotx recovery: ", tostring(err))
    elseif report.done + report.cancelled + report.failed + report.parked > 0 then
      ngx.log(ngx.NOTICE, format("mongotx recovery: %d done, %d cancelled, %d failed, %d parked",
        report.done, report.cancelled, report.failed, report.parked))
    end
    if opts.on_report then
      local cb_ok, cb_err = pcall(opts.on_report, report, err, me)
      if not cb_ok then ngx.log(ngx.ERR, "mongotx recovery: on_report: ", tostring(cb_err)) end
    end
  end

  local ok, err = ngx.timer.every(every, tick)
  if not ok then error("mongotx recovery: ngx.timer.every: " .. tostring(err), 2) end
  ngx.timer.at(0, tick)
  return {
    stop = function()
      stopped = true
      if not running then resign() end
    end,
  }
end

return _M

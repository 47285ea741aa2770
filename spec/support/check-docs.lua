-- make docs' check: every public function and method has an LDoc comment
-- (config.ld's files), and every documented one still exists.
--
-- The public names come from the modules themselves: each is required,
-- its objects are made on the test server (a manager, a queue, ...), and
-- their tables and metatables are walked; names starting with "_" are
-- private.  The documented ones come from LDoc (spec/support/ldoc_names.lua).
--
--   spec/support/with-server memory -- lua5.4 spec/support/check-docs.lua
-- Exits 1, naming each difference, when they differ.

package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path
package.cpath = (os.getenv("MONGOTX_CPATH") or "./build/lua54/?.so") .. ";" .. package.cpath

local mongotx = require "mongotx"
local core = require "mongotx.core"
local pool = require "mongotx.pool"
local resty = require "mongotx.resty"

-- Functions of mongotx.core that are the engine's building blocks, not an
-- API for callers (the Lua layer calls them); they need no entry.
local CORE_INTERNAL = {
  check_collection = true, check_id = true, check_ops = true, check_update = true,
  check_value = true, operator_key = true, touched = true, crash_point = true, fault = true,
  snapshot = true, stored_ops = true, steps = true, error = true, monotonic_ms = true,
}

-- Public functions not documented yet: each must lack an entry (a name
-- documented since fails the check until it leaves this list), so the
-- list only shrinks.  Empty it, then delete it.
local PENDING = {}
for name in ([[
mongotx.core.Client:close mongotx.core.Client:collection mongotx.core.Client:command
mongotx.core.Client:counters mongotx.core.Client:pool mongotx.core.Client:reset_counters
mongotx.core.Client:set_read_preference mongotx.core.Client:set_write_concern
mongotx.core.Collection:bulk_write mongotx.core.Collection:close mongotx.core.Collection:count
mongotx.core.Collection:create_index mongotx.core.Collection:delete_many
mongotx.core.Collection:delete_one mongotx.core.Collection:drop mongotx.core.Collection:find
mongotx.core.Collection:find_all mongotx.core.Collection:find_and_modify
mongotx.core.Collection:find_one mongotx.core.Collection:insert_many
mongotx.core.Collection:insert_one mongotx.core.Collection:name mongotx.core.Collection:replace_one
mongotx.core.Collection:update_many mongotx.core.Collection:update_one mongotx.core.Cursor:close
mongotx.core.Cursor:next mongotx.core.connect mongotx.core.id_key mongotx.core.sleep
mongotx.ledger.Ledger:balance mongotx.ledger.Ledger:commit mongotx.ledger.Ledger:get
mongotx.ledger.Ledger:post mongotx.ledger.Ledger:reconcile mongotx.ledger.Ledger:reverse
mongotx.ledger.Ledger:transfer mongotx.ledger.Ledger:transfer_many mongotx.pool.Database:client
mongotx.pool.Database:close mongotx.pool.Database:manager mongotx.pool.Database:pool
mongotx.pool.connect mongotx.queue.Queue:at mongotx.queue.Queue:claim mongotx.queue.Queue:counts
mongotx.queue.Queue:done mongotx.queue.Queue:fail mongotx.queue.Queue:fenced mongotx.queue.Queue:get
mongotx.queue.Queue:heartbeat mongotx.queue.Queue:held_write mongotx.queue.Queue:push
mongotx.queue.Queue:requeue_stale mongotx.queue.Queue:run_one mongotx.queue.Queue:work
mongotx.queue.Queue:write mongotx.resty.Database:close mongotx.resty.Database:count
mongotx.resty.Database:find mongotx.resty.Database:manager mongotx.resty.Database:pool
mongotx.resty.connect mongotx.resty.recovery mongotx.resty.thread mongotx.sync.Sync:change
mongotx.sync.Sync:repair mongotx.sync.Sync:rerun mongotx.sync.Sync:settle
mongotx.versioned.Versioned:begin mongotx.versioned.Versioned:gc mongotx.versioned.Versioned:read
mongotx.versioned.Writer:abandon mongotx.versioned.Writer:delete mongotx.versioned.Writer:publish
mongotx.versioned.Writer:put
]]):gmatch("%S+") do PENDING[name] = true end

local expected = {} -- "module<TAB>name" -> true
local function expect(module, prefix, t, skip)
  for k, v in pairs(t) do
    if type(k) == "string" and type(v) == "function" and not k:match("^_") and not (skip and skip[k]) then
      expected[module .. "\t" .. prefix .. k] = true
    end
  end
end
local function methods(obj)
  local mt = getmetatable(obj)
  return type(mt.__index) == "table" and mt.__index or mt
end

local uri = assert(os.getenv("MONGOTX_TEST_URI"), "run under spec/support/with-server")
local db = assert(mongotx.connect(uri, { database = "mtx_check_docs" }))
local tm = assert(db:manager{})

local reexported = {} -- the core's functions mongotx re-exports are documented in mongotx.core
for k, f in pairs(core) do reexported[k] = mongotx[k] == f or nil end
expect("mongotx", "", mongotx, reexported)
expect("mongotx", "Database:", methods(db))
expect("mongotx.manager", "Manager:", methods(tm))
expect("mongotx.core", "", core, CORE_INTERNAL)
local reg = debug.getregistry()
expect("mongotx.core", "Client:", reg["mongotx.Client"].__index)
expect("mongotx.core", "Collection:", reg["mongotx.Collection"].__index)
expect("mongotx.core", "Cursor:", reg["mongotx.Cursor"].__index)
expect("mongotx.core", "Value:", reg["mongotx.Value"].__index)
expect("mongotx.queue", "Queue:", methods(assert(db:queue{ collection = "jobs" })))
expect("mongotx.ledger", "Ledger:", methods(assert(db:ledger{ collection = "ledger" })))
local function propagate() return true end
expect("mongotx.sync", "Sync:", methods(assert(db:sync{ collection = "users", propagate = propagate })))
local v = assert(db:versioned{ roots = "roots", items = "items" })
expect("mongotx.versioned", "Versioned:", methods(v))
expect("mongotx.versioned", "Writer:", methods(assert(v:begin("r"))))
expect("mongotx.pool", "", pool)
local pdb = assert(pool.connect(uri, { database = "mtx_check_docs" }))
expect("mongotx.pool", "Database:", methods(pdb))
expect("mongotx.resty", "", resty)
local rdb = assert(resty.connect(uri, { database = "mtx_check_docs", offload = false }))
expect("mongotx.resty", "Database:", methods(rdb))
-- The managers of mongotx.pool and mongotx.resty forward pool.METHODS to
-- mongotx's manager: those are documented there.
for _, m in ipairs(pool.METHODS) do
  if not expected["mongotx.manager\tManager:" .. m] then
    print("pool.METHODS names " .. m .. ", which mongotx's manager does not have")
    os.exit(1)
  end
end
assert(db.client:command("mtx_check_docs", mongotx.doc("dropDatabase", 1)))

local documented = {}
local p = assert(io.popen("LUA_PATH='spec/support/?.lua;;' ldoc --filter ldoc_names.dump . 2>/dev/null"))
for line in p:lines() do
  local module, name, kind = line:match("^(%S+)\t(%S+)\t(%S+)")
  if module and kind == "function" then documented[module .. "\t" .. name] = true end
end
assert(p:close(), "ldoc failed")

local problems = {}
local function sorted(t) local l = {} for k in pairs(t) do l[#l + 1] = k end table.sort(l) return l end
for _, k in ipairs(sorted(expected)) do
  local name = k:gsub("\t", " ")
  if not documented[k] and not PENDING[name:gsub(" ", ".")] then
    problems[#problems + 1] = "no doc comment: " .. name
  elseif documented[k] and PENDING[name:gsub(" ", ".")] then
    problems[#problems + 1] = "documented now, remove it from PENDING: " .. name
  end
end
for _, k in ipairs(sorted(documented)) do
  if not expected[k] then problems[#problems + 1] = "documented but not public: " .. k:gsub("\t", " ") end
end
local pending = 0
for _ in pairs(PENDING) do pending = pending + 1 end
for _, m in ipairs(problems) do print("check-docs: " .. m) end
print(("check-docs: %d public functions, %d documented, %d pending (not yet documented), %d problems")
  :format(#sorted(expected), #sorted(documented), pending, #problems))
os.exit(#problems == 0 and 0 or 1)

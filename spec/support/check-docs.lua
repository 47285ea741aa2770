-- make docs' check: every public function and method has an LDoc comment
-- (config.ld's files), and every documented one still exists.
--
-- The public names come from the modules themselves: each is required,
-- its objects are made on the test server (a manager, a queue, ...), and
-- their tables and metatables are walked; names starting with "_" are
-- private.  The documented ones come from LDoc (spec/support/ldoc_names.lua).
-- A public name whose doc comment says `@local` is an internal one other
-- modules of mongotx call (the reference leaves it out): it needs that
-- comment, and is not reported as missing.
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
  check_value = true, escrowable = true, operator_key = true, touched = true, crash_point = true,
  fault = true, refuse_now = true, -- (the specs' stand-in for a server that refuses $$NOW in writes)
  snapshot = true, stored_ops = true, steps = true, error = true, monotonic_ms = true,
  catch_signals = true, signal_caught = true, -- the command's (mongotx.cli) signal flag
}

-- Functions other modules of mongotx call, exported for them (and the
-- specs), not for callers: the manager's side of a group-commit batch
-- (tm:run_calls calls it) and the metrics' reading of a stored reason.
local MODULE_INTERNAL = {
  ["mongotx.group"] = { run_calls = true },
  ["mongotx.metrics"] = { cancel_reason = true },
}

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
expect("mongotx.manager", "Scan:", methods(assert(tm:scan({}))))
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
expect("mongotx.each", "", require "mongotx.each")
expect("mongotx.cli", "", require "mongotx.cli")
local group = require "mongotx.group"
expect("mongotx.group", "", group, MODULE_INTERNAL["mongotx.group"])
local function noop() end
expect("mongotx.group", "Group:", methods(group.new { run = noop, signal = noop, spawn = noop, now = noop }))
local metrics = require "mongotx.metrics"
expect("mongotx.metrics", "", metrics, MODULE_INTERNAL["mongotx.metrics"])
expect("mongotx.metrics", "Metrics:", methods(metrics.new()))
-- (its store's methods need nginx's shared dict: the module's functions only)
expect("mongotx.metrics.shared", "", require "mongotx.metrics.shared")
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
local internal = {} -- documented with @local (ldoc --all lists them as lfunction)
local documented_internal = {} -- "Internal: ..." without @local: in the reference
local p = assert(io.popen("LUA_PATH='spec/support/?.lua;;' ldoc --all --filter ldoc_names.dump . 2>/dev/null"))
for line in p:lines() do
  local module, name, kind, summary = line:match("^(%S+)\t(%S+)\t(%S+)\t?(.*)")
  if module and kind == "function" then documented[module .. "\t" .. name] = true end
  if kind == "function" and summary:match("^Internal") then
    documented_internal[#documented_internal + 1] = module .. " " .. name
  end
  if module and kind == "lfunction" then internal[module .. "\t" .. name] = true end
end
assert(p:close(), "ldoc failed")

local problems = {}
local function sorted(t) local l = {} for k in pairs(t) do l[#l + 1] = k end table.sort(l) return l end
for _, k in ipairs(sorted(expected)) do
  local name = k:gsub("\t", " ")
  if not documented[k] and not internal[k] then problems[#problems + 1] = "no doc comment: " .. name end
end
for _, k in ipairs(sorted(documented)) do
  if not expected[k] then problems[#problems + 1] = "documented but not public: " .. k:gsub("\t", " ") end
end
for _, name in ipairs(documented_internal) do
  problems[#problems + 1] = "an internal in the reference (give its comment @local): " .. name
end
for _, m in ipairs(problems) do print("check-docs: " .. m) end
print(("check-docs: %d public functions, %d documented, %d problems")
  :format(#sorted(expected), #sorted(documented), #problems))
os.exit(#problems == 0 and 0 or 1)

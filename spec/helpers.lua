-- Shared by every spec: finds the built C module, starts (once per busted
-- run) or finds the MongoDB-wire server, and hands out fresh databases.
--
--   MONGOTX_TEST_URI     use this server instead of starting one (a real
--                        MongoDB, or one spec/support/with-server started)
--   MONGOTX_TEST_SERVER  what kind of server that is: memory | h2 |
--                        ferretdb | mongodb (decides which specs skip)
--   MONGOTX_CPATH        where mongotx/core.so is (build/lua54 by default)

local cpath = os.getenv("MONGOTX_CPATH") or "./build/lua54/?.so"
if not package.cpath:find(cpath, 1, true) then
  package.cpath = cpath .. ";" .. package.cpath
end

local core = require "mongotx.core"
local luassert = require "luassert" -- busted's assert, which specs see as assert

local helpers = { core = core }

local started -- a server this process started, stopped when it exits

function helpers.server_kind()
  if os.getenv("MONGOTX_TEST_URI") then
    return os.getenv("MONGOTX_TEST_SERVER") or "mongodb"
  end
  return "memory"
end

function helpers.uri()
  local uri = os.getenv("MONGOTX_TEST_URI")
  if uri then return uri end
  if not started then
    local server = require "spec.support.server"
    started = assert(server.start { kind = "memory" })
  end
  return started.uri
end

function helpers.client()
  return assert(core.connect(helpers.uri()))
end

-- A database name no other spec (or earlier run against a real server)
-- uses: specs never share state.  A fresh ObjectId's hex (time, a
-- per-process random value, a counter).  The time, math.random and a
-- counter were not enough: busted loads this module again for each spec
-- file, which resets the counter and reseeds math.random from the time
-- and a table's address (below), and a LuaJIT CI run found spec/02's
-- document ({ _id = 1 }) in spec/03's collection.
function helpers.db_name()
  return "mtx_" .. core.ObjectId():value()
end

-- Why concurrency specs cannot run on this server, or nil when they can.
function helpers.no_concurrency()
  if helpers.server_kind() == "ferretdb" then
    return "FerretDB v1 does not isolate concurrent read-modify-write " ..
           "updates of one document (FerretDB issue #3040)"
  end
end

-- Why a spec cannot run on FerretDB v1.24 (a feature it lacks), or nil.
function helpers.ferretdb_lacks(what)
  if helpers.server_kind() == "ferretdb" then
    return "FerretDB v1.24 does not implement " .. what
  end
end

-- Why a spec that needs fencing by deadlines cannot run here, or nil:
-- the server does not evaluate $$NOW in a write's filter (FerretDB v1,
-- FerretDB v2 without its write-variables setting).  A manager's probe
-- answers, once a process.
local no_deadlines
function helpers.no_deadlines()
  if no_deadlines == nil then
    local db = assert(require("mongotx").connect(helpers.uri(), { database = helpers.db_name() }))
    no_deadlines = not assert(db:manager {}).engine:deadlines() and
      "the server does not evaluate $$NOW in a write's filter, so creators read versions"
    assert(db.client:command(db.name, { dropDatabase = 1 }))
    db:close()
  end
  return no_deadlines or nil
end

-- Why MongoDB would refuse `filter` (a find or update filter), or nil:
-- its rules for the operators mongotx and its recipes send, which
-- mongo-java-server and FerretDB v1 do not all enforce.  `$not` takes a
-- regex or a non-empty document of operators ("$not cannot be empty");
-- `$and`, `$or` and `$nor` a non-empty array of filters; `$in`, `$nin`
-- and `$all` an array.
function helpers.filter_refusal(filter, path)
  path = path or "filter"
  if core.type(filter) ~= "object" then return path .. " is no document" end
  local condition
  local function operators(cond, at)
    for op, arg in pairs(cond) do
      local here = at .. "." .. tostring(op)
      if op == "$not" then
        if core.type(arg) ~= "regex" then
          if core.type(arg) ~= "object" or next(arg) == nil then
            return here .. " takes a regex or a non-empty document"
          end
          local why = condition(arg, here)
          if why then return why end
        end
      elseif op == "$in" or op == "$nin" or op == "$all" then
        if core.type(arg) ~= "array" then return here .. " takes an array" end
      end
    end
  end
  function condition(cond, at)
    if core.type(cond) ~= "object" then return nil end
    local k = next(cond)
    if type(k) ~= "string" or k:sub(1, 1) ~= "$" then return nil end -- a value
    return operators(cond, at)
  end
  for k, v in pairs(filter) do
    local here = path .. "." .. tostring(k)
    if k == "$and" or k == "$or" or k == "$nor" then
      if core.type(v) ~= "array" or #v == 0 then return here .. " takes a non-empty array" end
      for i, branch in ipairs(v) do
        local why = helpers.filter_refusal(branch, here .. "[" .. i .. "]")
        if why then return why end
      end
    elseif k ~= "$expr" and k ~= "$comment" then
      local why = condition(v, here)
      if why then return why end
    end
  end
  return nil
end

-- All documents of a collection sorted by _id, for asserting what the
-- database holds.
function helpers.dump(coll)
  return assert(coll:find_all({}, { sort = { _id = 1 } }))
end

-- The balances of an accounts collection by _id, and their sum, asserting
-- that no document still carries a transaction's marker.
function helpers.balances(coll)
  local out, sum = {}, 0
  for _, d in ipairs(helpers.dump(coll)) do
    out[d._id], sum = d.balance, sum + d.balance
    luassert.are.same({}, d.pendingTransactions or {}, "markers left on " .. d._id)
  end
  return out, sum
end

-- The whole database `name` as one string: a line per collection (in name
-- order) and then a line per document (in _id order) with the collection's
-- name and the document `core.encode`d, in hex.  Two dumps are equal only
-- when the database holds the same documents byte for byte (decoding keeps
-- what re-encoding needs: key order and number types).  opts.skip lists
-- collections to leave out and opts.without fields to leave out of every
-- document, for the cases where mongotx's own bookkeeping is expected to
-- change.
function helpers.db_dump(client, name, opts)
  opts = opts or {}
  local reply = assert(client:command(name, { listCollections = 1 }))
  -- every spec database is small enough to come back in the first batch
  assert(reply.cursor.id == 0, "listCollections needs more than one batch")
  local names, skip = {}, {}
  for _, c in ipairs(opts.skip or {}) do skip[c] = true end
  for _, c in ipairs(reply.cursor.firstBatch) do
    if not skip[c.name] then names[#names + 1] = c.name end
  end
  table.sort(names)
  local projection
  for _, f in ipairs(opts.without or {}) do
    projection = projection or {}
    projection[f] = 0
  end
  local lines = {}
  for _, c in ipairs(names) do
    lines[#lines + 1] = c
    local docs = assert(client:collection(name, c):find_all({},
      { sort = { _id = 1 }, projection = projection }))
    for _, d in ipairs(docs) do
      lines[#lines + 1] = c .. " " .. core.encode(d):gsub(".", function(ch)
        return string.format("%02x", ch:byte())
      end)
    end
  end
  return table.concat(lines, "\n")
end

-- Asserts that the database holds what `before` (a db_dump with the same
-- opts) held; a difference is reported as the first line that differs.
function helpers.assert_dump_unchanged(before, client, name, opts)
  local after = helpers.db_dump(client, name, opts)
  if after == before then return end
  local a, b = {}, {}
  for l in (before .. "\n"):gmatch("(.-)\n") do a[#a + 1] = l end
  for l in (after .. "\n"):gmatch("(.-)\n") do b[#b + 1] = l end
  local i = 1
  while a[i] == b[i] do i = i + 1 end
  error(string.format("the database changed (line %d of the dump):\n  before: %s\n  after:  %s",
    i, tostring(a[i]), tostring(b[i])), 2)
end

-- Asserts that fn() returns nil and an `invalid` error of call `step`
-- whose message holds msg, and that database `db` (a mongotx database
-- handle) is unchanged.
function helpers.assert_invalid(db, step, fn, msg)
  local before = helpers.db_dump(db.client, db.name)
  local res, err = fn()
  luassert.is_nil(res)
  luassert.is_table(err, "expected an error, got " .. tostring(err))
  luassert.are.equal("invalid", err.code, tostring(err))
  luassert.truthy(err.message:find(msg, 1, true), err.message)
  luassert.are.equal(step, err.step)
  helpers.assert_dump_unchanged(before, db.client, db.name)
end

-- The Lua interpreter running the specs, for worker processes.
function helpers.lua()
  return os.getenv("MONGOTX_LUA") or (type(jit) == "table" and "luajit" or "lua5.4")
end

-- Starts the Lua program at `path` with args in the background; returns
-- its pid and the file collecting its output.
function helpers.spawn_file(path, ...)
  local out = os.tmpname()
  local args = {}
  for i, a in ipairs { ... } do args[i] = "'" .. tostring(a):gsub("'", "'\\''") .. "'" end
  local p = assert(io.popen(string.format("%s %s %s > %s 2>&1 & echo $!",
    helpers.lua(), path, table.concat(args, " "), out)))
  local pid = tonumber(p:read("*l"))
  p:close()
  return pid, out
end

-- Starts spec/support/worker.lua with args, like spawn_file.
function helpers.spawn_worker(...)
  return helpers.spawn_file("spec/support/worker.lua", ...)
end

-- Starts the Lua program `source` (a string, written to a temporary file)
-- with args in the background, like spawn_worker, for a spec whose
-- workers are its own; returns its pid, the file collecting its output
-- and the program's file (remove both when done).
function helpers.spawn_script(source, ...)
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write(source)
  f:close()
  local pid, out = helpers.spawn_file(script, ...)
  return pid, out, script
end

-- Waits (up to `seconds`, default 60) for a program spawn_script
-- started, asserting that it ended; returns its output and removes its
-- files.
function helpers.script_output(pid, out, script, seconds)
  luassert.is_true(helpers.wait_exit(pid, seconds or 60))
  local output = helpers.read_file(out)
  os.remove(out)
  os.remove(script)
  return output
end

-- Is the process still running?
function helpers.alive(pid)
  return require("spec.support.server").execute(
    string.format("kill -0 %d 2>/dev/null", pid)) == 0
end

function helpers.signal(pid, sig)
  os.execute(string.format("kill -%s %d 2>/dev/null", sig, pid))
end

-- Waits (up to `seconds`) until the process exits; true when it did.
function helpers.wait_exit(pid, seconds)
  for _ = 1, seconds * 20 do
    -- os.execute answers true/nil on 5.4 but a status number on LuaJIT
    if require("spec.support.server").execute(
        string.format("kill -0 %d 2>/dev/null", pid)) ~= 0 then
      return true
    end
    core.sleep(0.05)
  end
  return false
end

function helpers.wait_file(path, seconds)
  for _ = 1, seconds * 50 do
    local f = io.open(path)
    if f then f:close() return true end
    core.sleep(0.02)
  end
  return false
end

function helpers.read_file(path)
  local f = assert(io.open(path))
  local s = f:read("*a")
  f:close()
  return s
end

-- Ages transaction `id` of the collection `txs` by `secs`: its
-- lastModified and its owner's deadline moved back, as if written that
-- long ago.  A check of age is then decided by what the database holds,
-- with a margin no load on the machine eats up, instead of by how long
-- the spec slept.
function helpers.age(txs, id, secs)
  local T = assert(txs:find_one({ _id = id }))
  local set = { lastModified = core.Date(T.lastModified:value() - secs * 1000) }
  if T.deadline then set.deadline = core.Date(T.deadline:value() - secs * 1000) end
  luassert.are.equal(1, assert(txs:update_one({ _id = id }, { ["$set"] = set })).matched)
end

-- A fresh database with accounts A and B (1000 each) and a worker
-- (spec/support/worker.lua stall, lease 1 s) moving 100 from A to B that
-- is stopped (SIGSTOP) after its first apply and left so past its lease.
-- Returns the database handle and the worker: { pid, out, ready }.
function helpers.stalled_owner()
  local dbname = helpers.db_name()
  local mongotx = require "mongotx"
  local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
  assert(db:collection("accounts"):insert_many {
    { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
    { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
  })
  local ready = os.tmpname()
  os.remove(ready)
  local pid, out = helpers.spawn_worker("stall", helpers.uri(), dbname, ready, 3, "A", "B", 100)
  luassert.is_true(helpers.wait_file(ready, 20), "the worker never reached its first apply")
  helpers.signal(pid, "STOP")
  core.sleep(1.5) -- past the worker's 1 s lease: others may take over
  return db, { pid = pid, out = out, ready = ready }
end

-- Continues a stalled_owner's worker (SIGCONT) and returns what it
-- printed once it exited.
function helpers.resume_owner(w)
  helpers.signal(w.pid, "CONT")
  luassert.is_true(helpers.wait_exit(w.pid, 20), "the worker did not finish")
  local said = helpers.read_file(w.out)
  os.remove(w.out)
  os.remove(w.ready)
  return said
end

-- The tutorial's recovery of a pending transaction `tid`, as a writer
-- that knows nothing of mongotx would run it (PyMongo, the mongo shell:
-- no txVersion, no epoch) on db's accounts and transactions: apply each
-- op ({ account, amount }) where the marker is absent and commit ...
function helpers.recipe_apply(db, tid, ops)
  local accounts, txs = db:collection("accounts"), db:collection("transactions")
  for _, op in ipairs(ops) do
    assert(accounts:update_one({ _id = op[1], pendingTransactions = { ["$ne"] = tid } },
      { ["$inc"] = { balance = op[2] }, ["$push"] = { pendingTransactions = tid } }))
  end
  local res = assert(txs:update_one({ _id = tid, state = "pending" },
    { ["$set"] = { state = "applied" }, ["$currentDate"] = { lastModified = true } }))
  luassert.are.equal(1, res.matched)
end

-- ... then pull the markers and move it to done.
function helpers.recipe_finish(db, tid, ops)
  local accounts, txs = db:collection("accounts"), db:collection("transactions")
  for _, op in ipairs(ops) do
    assert(accounts:update_one({ _id = op[1], pendingTransactions = tid },
      { ["$pull"] = { pendingTransactions = tid } }))
  end
  assert(txs:update_one({ _id = tid, state = "applied" },
    { ["$set"] = { state = "done" }, ["$currentDate"] = { lastModified = true } }))
end

math.randomseed(os.time() + tonumber(tostring({}):match("0x(%x+)") or "0", 16) % 100000)

-- An open holder for the busy specs: transaction `id` of manager `holder`
-- (made with escrow = false) with its credit of 1 on `doc` applied, so
-- that it sits in the document's txHeld, and its debit of H not yet:
-- every exclusive op on `doc` waits for it (busy).  Returns it.
function helpers.hold_open(holder, doc, id)
  local t = assert(holder:begin({
    { collection = "accounts", id = "H", update = { ["$inc"] = { balance = -1 } } },
    { collection = "accounts", id = doc, update = { ["$inc"] = { balance = 1 } } },
  }, { id = id }))
  assert(holder:step("claim", t))
  assert(holder:step("apply", t, 2))
  return t
end

return helpers

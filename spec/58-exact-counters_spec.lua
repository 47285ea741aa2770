-- The transaction counters across kills and processes (issue 40, item
-- 10; docs/metrics.md): each transaction is counted begun, then done or
-- cancelled, once, in the registry that counted it begun, whoever ends it
-- (a worker, another process, recovery); begun - done - cancelled (in
-- flight) is never below 0 and back to 0 once everything is finished and
-- the registry reconciled its marks (the end of a recovery pass, or
-- m:reconcile). Checked after every event and every step.
--
-- A registry that outlives the process whose events it counts is what
-- the shared dict is in nginx (spec/45 kills workers there); here a real
-- child process sends its events, one line each, to a registry of this
-- process, and is killed (MONGOTX_FAULT, the torture suite's crash points:
-- an _exit, like a kill -9) right after the write that ends a
-- transaction, before its event.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local metrics = require "mongotx.metrics"
local pool = require "mongotx.pool"

-- The child: transfers and a begun transaction it abandons, then a
-- transfer during which it dies after the done write; every event of
-- application "app" printed as "<name>\t<id>\t<moved 1|0>\t<cause>".
local CHILD = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local uri, dbname = arg[1], arg[2]
io.stdout:setvbuf("line")
local function send(name, info)
  local res = info.result
  local moved = not (res == false or type(res) == "table" and res.created == false)
  local from = type(res) == "table" and res or info
  io.stdout:write(name, "\t", tostring(info.id), "\t", moved and "1" or "0", "\t",
    type(from.cause) == "string" and from.cause or "", "\n")
end
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = "app", on_event = send })
for i = 1, 3 do assert(tm:transfer("accounts", "A", "B", 1, { id = "c" .. i })) end
assert(not tm:transfer("accounts", "A", "B", 5000, { min = 0, id = "c4" })) -- a guard: cancelled
local t = assert(tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } },
  { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 1 } } } }, { id = "c5" }))
assert(tm:step("claim", t))
assert(tm:step("apply", t, 1))
mongotx.core.fault("done:after:1")
tm:transfer("accounts", "A", "B", 1, { id = "c6" })
io.stdout:write("not killed\n")
]]

describe("#server exact transaction counters", function()
  local db, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many { { _id = "A", balance = 1000 }, { _id = "B", balance = 0 } })
  end)
  after_each(function() if db then db:close() end db = nil end)

  -- { begun, done, cancelled } of application "app" in registry m, and
  -- the cancelled ones by reason
  local function figures(m)
    local text, out = m:render(), {}
    for _, what in ipairs { "begun", "done" } do
      out[#out + 1] = tonumber(text:match("mongotx_transactions_" .. what ..
        "_total{application=\"app\"} (%S+)")) or 0
    end
    local cancelled, by = 0, {}
    local pattern = 'mongotx_transactions_cancelled_total{application="app",reason="([^"]*)"} (%S+)'
    for reason, n in text:gmatch(pattern) do
      cancelled, by[reason] = cancelled + tonumber(n), tonumber(n)
    end
    out[3] = cancelled
    return out, by
  end

  -- in flight of each registry, asserted never below 0
  local function flying(...)
    local out = {}
    for i, m in ipairs { ... } do
      local f = figures(m)
      out[i] = f[1] - f[2] - f[3]
      assert.is_true(out[i] >= 0, "in flight below 0: " .. table.concat(f, " "))
    end
    return table.unpack(out)
  end

  local function state(id) return assert(txs:find_one({ _id = id })).state end

  it("a process killed between the write that ends a transaction and its count", function()
    local pid, out, script = helpers.spawn_script(CHILD, helpers.uri(), db.name)
    local said = helpers.script_output(pid, out, script, 60)
    assert.is_nil(said:find("not killed", 1, true), said)
    assert.are.equal("done", state("c6")) -- its done was written, its event never sent
    assert.are.equal("pending", state("c5"))
    -- its events, into a registry of this process, in flight checked after each
    local m = metrics.new()
    local count = m:on_event("app")
    local n = 0
    for name, id, moved, cause in said:gmatch("([%w_]+)\t([^\t]*)\t([01])\t([^\n]*)\n") do
      count(name, { id = id, result = moved == "1" and { cause = cause ~= "" and cause or nil } },
        db.name .. ".transactions")
      flying(m)
      n = n + 1
    end
    assert.is_true(n > 10, said)
    assert.are.same({ 6, 3, 1 }, (figures(m))) -- c5 and c6 in flight
    -- another registry's recovery ends c5 and counts nothing
    local other = metrics.new()
    local back = assert(db:manager(other:wrap { application = "app", stale_after = 1,
      stale_pending = function() return "back" end }))
    helpers.age(txs, "c5", 3600)
    assert.are.equal(1, assert(back:recover()).cancelled)
    assert.are.equal("cancelled", state("c5"))
    assert.are.same({ 0, 0, 0 }, (figures(other)))
    assert.are.equal(2, flying(m))
    -- the first registry's own recovery pass reconciles its marks: c6
    -- done, c5 cancelled by recovery, each once
    local tm = assert(db:manager(m:wrap { application = "app", stale_after = 0 }))
    assert(tm:recover())
    local f, by = figures(m)
    assert.are.same({ 6, 4, 2 }, f)
    assert.are.same({ guard = 1, recovery = 1 }, by)
    assert.are.equal(0, flying(m, other))
    assert(tm:recover())
    assert.are.same({ 6, 4, 2 }, (figures(m)))
    -- an end event that comes after the reconcile counted it (a slow
    -- driver's) counts nothing
    count("done", { id = "c6", result = {} })
    assert.are.same({ 6, 4, 2 }, (figures(m)))
    assert.are.same({ A = 996, B = 4 }, (helpers.balances(accounts)))
  end)

  it("a transaction begun in one registry and ended by another's recovery", function()
    local m1, m2 = metrics.new(), metrics.new()
    local tm1 = assert(db:manager(m1:wrap { application = "app", finish = "deferred" }))
    for i = 1, 3 do -- committed, their finish left to whoever comes
      assert.are.equal("applied", assert(tm1:transfer("accounts", "A", "B", 1, { id = "d" .. i })).state)
    end
    local t = assert(tm1:begin({ { collection = "accounts", id = "A",
      update = { ["$inc"] = { balance = -1 } } } }, { id = "p1" }))
    assert(tm1:step("claim", t))
    assert(tm1:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } } },
      { id = "i1" })) -- left initial
    assert.are.equal(5, flying(m1))
    -- the second registry's recovery (another manager) ends all five
    local tm2 = assert(db:manager(m2:wrap { application = "app", stale_after = 1,
      stale_pending = function() return "back" end, stale_initial = function() return "expire" end }))
    for _, id in ipairs { "d1", "d2", "d3", "p1", "i1" } do helpers.age(txs, id, 3600) end
    local report = assert(tm2:recover { batch = 2 })
    assert.are.same({ 3, 2 }, { report.done, report.cancelled })
    assert.are.equal(0, flying(m2))
    assert.are.same({ 0, 0, 0 }, (figures(m2)))
    assert.are.equal(5, flying(m1))
    -- m1 reconciles: nothing sent while its marks are younger than the age
    local commands = db.client:counters().commands
    assert.are.equal(0, assert(m1:reconcile(tm1, { age = 3600 })))
    assert.are.equal(commands, db.client:counters().commands)
    -- then, once they are old enough, all five in one read, each once
    assert.are.equal(5, assert(m1:reconcile(tm1, { age = 0 })))
    assert.are.equal(commands + 1, db.client:counters().commands)
    local f, by = figures(m1)
    assert.are.same({ 5, 3, 2 }, f)
    assert.are.same({ recovery = 1, expired = 1 }, by)
    assert.are.equal(0, flying(m1, m2))
    -- nothing marked: a reconcile reads nothing
    commands = db.client:counters().commands
    assert.are.equal(0, assert(m1:reconcile(tm1, { age = 0 })))
    assert.are.equal(commands, db.client:counters().commands)
  end)

  it("reads back at most its batch at a time, and counts a transaction gone as cancelled", function()
    local m = metrics.new()
    local tm = assert(db:manager(m:wrap { application = "app" }))
    local n = metrics.RECONCILE + 20
    local ops = { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } } }
    for i = 1, n do assert(tm:begin(ops, { id = "g" .. i })) end
    -- removed under it (a prune, or by hand): nothing says how it ended
    assert.are.equal(n, assert(txs:delete_many({})).deleted)
    assert.are.equal(n, flying(m))
    local commands = db.client:counters().commands
    assert.are.equal(metrics.RECONCILE, assert(m:reconcile(tm, { age = 0 })))
    assert.are.equal(20, flying(m))
    assert.are.equal(20, assert(m:reconcile(tm, { age = 0 })))
    assert.are.equal(commands + 2, db.client:counters().commands)
    local f, by = figures(m)
    assert.are.same({ n, 0, n }, f)
    assert.are.same({ unknown = n }, by)
    assert.are.equal(0, flying(m))
  end)

  it("an open transaction stays in flight, looked at again only after the age", function()
    local m = metrics.new()
    local tm = assert(db:manager(m:wrap { application = "app" }))
    local t = assert(tm:begin({ { collection = "accounts", id = "A",
      update = { ["$inc"] = { balance = -1 } } } }, { id = "o1" }))
    local commands = db.client:counters().commands
    assert.are.equal(0, assert(m:reconcile(tm, { age = 0 })))
    assert.are.equal(commands + 1, db.client:counters().commands)
    assert.are.equal(1, flying(m))
    -- looked at: not again before the age has passed once more
    assert.are.equal(0, assert(m:reconcile(tm, { age = 3600 })))
    assert.are.equal(commands + 1, db.client:counters().commands)
    assert(tm:commit(t))
    assert.are.same({ 1, 1, 0 }, (figures(m)))
    assert.are.equal(0, assert(m:reconcile(tm, { age = 0 })))
    assert.are.equal(0, flying(m))
  end)
  it("keeps the marks of each transactions namespace apart: one application, two collections, two databases", function()
    local m = metrics.new()
    local other = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() .. "b" }))
    assert(other:collection("accounts"):insert_many { { _id = "A", balance = 100 } })
    local tm1 = assert(db:manager(m:wrap { application = "app" }))
    local tm2 = assert(db:manager(m:wrap { application = "app", collection = "orders_tx" }))
    local tm3 = assert(other:manager(m:wrap { application = "app" }))
    local ops = { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } } }
    local t2 = assert(tm2:begin(ops, { id = "same" }))
    local t3 = assert(tm3:begin(ops, { id = "same" })) -- the same id, in another database
    assert.are.equal(2, flying(m))
    -- tm1 reads back only its own namespace's marks: none, nothing sent
    local commands = db.client:counters().commands
    assert.are.equal(0, assert(m:reconcile(tm1, { age = 0 })))
    assert.are.equal(commands, db.client:counters().commands)
    assert.are.same({ 2, 0, 0 }, (figures(m)))
    -- each end counts once, in its own namespace
    assert(tm2:commit(t2))
    assert.are.same({ 2, 1, 0 }, (figures(m)))
    assert.are.equal(0, assert(m:reconcile(tm2, { age = 0 })))
    assert.are.equal(0, assert(m:reconcile(tm3, { age = 0 }))) -- open there
    assert.are.same({ 2, 1, 0 }, (figures(m)))
    assert(tm3:rollback(t3))
    local f, by = figures(m)
    assert.are.same({ 2, 1, 1 }, f)
    assert.are.same({ rollback = 1 }, by)
    assert.are.equal("done", assert(db:collection("orders_tx"):find_one({ _id = "same" })).state)
    assert.are.equal("cancelled", assert(other:collection("transactions"):find_one({ _id = "same" })).state)
    assert(other.client:command(other.name, { dropDatabase = 1 }))
    other:close()
  end)

  it("reconciles through a pooled manager (no engine of its own)", function()
    local m = metrics.new()
    local pdb = assert(pool.connect(helpers.uri(), { database = db.name }))
    local ptm = assert(pdb:manager(m:wrap { application = "app" }))
    assert.is_nil(ptm.engine)
    local ops = { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } } }
    assert(ptm:begin(ops, { id = "p1" }))
    assert(ptm:transfer("accounts", "A", "B", 1, { id = "p2" }))
    assert.are.equal(1, assert(txs:delete_many({ _id = "p1" })).deleted)
    assert.are.equal(1, assert(m:reconcile(ptm, { age = 0 })))
    local f, by = figures(m)
    assert.are.same({ 2, 1, 1 }, f)
    assert.are.same({ unknown = 1 }, by)
  end)

  it("an open hold's mark is read back only after its expiry, even when its event was lost", function()
    local m = metrics.new()
    local count = m:on_event("app")
    local lost = false
    local tm = assert(db:manager { application = "app", on_event = function(name, info, ns)
      if name == "hold" and lost then return end -- a kill between the open and its event
      return count(name, info, ns)
    end })
    -- the hold event moves its mark to the expiry: nothing to read before
    local h2 = assert(tm:hold("accounts", "A", "B", 10, { id = "h2", expires = 3600 }))
    local commands = db.client:counters().commands
    assert.are.equal(0, assert(m:reconcile(tm, { age = 0 })))
    assert.are.equal(commands, db.client:counters().commands)
    lost = true
    local h1 = assert(tm:hold("accounts", "A", "B", 10, { id = "h1", expires = 3600 }))
    assert.are.equal(2, flying(m))
    -- h1's mark is read once, found open, moved to its stored deadline (the expiry)
    commands = db.client:counters().commands
    assert.are.equal(0, assert(m:reconcile(tm, { age = 0 })))
    assert.is_true(db.client:counters().commands > commands)
    commands = db.client:counters().commands
    for _ = 1, 3 do assert.are.equal(0, assert(m:reconcile(tm, { age = 0 }))) end
    assert.are.equal(commands, db.client:counters().commands)
    assert(tm:void(h1._id))
    assert(tm:capture(h2._id))
    local f, by = figures(m)
    assert.are.same({ 2, 1, 1 }, f)
    assert.are.same({ voided = 1 }, by)
    assert.are.equal("cancelled", state("h1"))
    assert.are.equal("done", state("h2"))
  end)
end)

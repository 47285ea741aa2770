-- mongotx beside a service that follows the tutorial's recipe
-- (docs/recipes.md, "Beside a service on the tutorial's recipe").
--
-- mongotx's default names are the tutorial's (`transactions`,
-- `pendingTransactions`).  Documents in its transactions collection that
-- it did not write (no `ops`) are foreign: recovery does not read them,
-- `status` counts them apart (not stale, not active), prune keeps them.
-- With a collection and marker of its own, mongotx and a PyMongo writer on
-- the tutorial's recipe share accounts through kill -9 of both.

local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local cli = require "spec.support.cli"
local server = require "spec.support.server"
local PYTHON = require("spec.support.prometheus").PYTHON
local core = helpers.core

local HOUR = 3600

-- A transaction document as the tutorial's recipe writes it.
local function tutorial_tx(id, state, from, to, value)
  return { _id = id, source = from, destination = to, value = value, state = state,
           lastModified = core.Date(os.time() * 1000 - HOUR * 1000) }
end

describe("#server foreign documents", function()
  local db, dbname, tm, txs, accounts

  before_each(function()
    dbname = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    tm = assert(db:manager { application = "shop" }) -- the default names
    txs, accounts = db:collection("transactions"), db:collection("accounts")
    assert(accounts:insert_many {
      { _id = "A", balance = 100 }, { _id = "B", balance = 100 },
      { _id = "C", balance = 90, pendingTransactions = { "t-pending", "t-applied" } },
      { _id = "D", balance = 110, pendingTransactions = { "t-pending", "t-applied" } },
    })
    -- the tutorial's documents, an hour old: one of each state
    assert(txs:insert_many {
      tutorial_tx("t-initial", "initial", "C", "D", 5),
      tutorial_tx("t-pending", "pending", "C", "D", 5),
      tutorial_tx("t-applied", "applied", "C", "D", 5),
      tutorial_tx("t-done", "done", "C", "D", 5),
    })
  end)

  after_each(function()
    assert(db.client:command(dbname, { dropDatabase = 1 }))
    db:close()
  end)

  -- mongotx's own transaction A -> B, begun and left pending an hour ago
  local function own_stale()
    local T = assert(tm:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -10 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 10 } } },
    }, { id = "own" }))
    helpers.age(txs, T._id, HOUR)
  end

  local function foreign_dump()
    return {
      txs = assert(txs:find_all({ ops = { ["$exists"] = false } }, { sort = { _id = 1 } })),
      cd = assert(accounts:find_all({ _id = { ["$in"] = { "C", "D" } } }, { sort = { _id = 1 } })),
    }
  end

  it("recovery drives its own stale transaction and leaves the tutorial's alone", function()
    own_stale()
    local before = foreign_dump()
    local b = assert(tm:backlog())
    assert.are.equal(1, b.active)
    assert.are.equal(1, b.stale)
    assert.are.equal("own", b.oldest_id)
    assert.are.equal(4, b.foreign)
    local s = assert(tm:stats())
    assert.are.same({ initial = 1, pending = 0, applied = 0, done = 0, canceling = 0,
                      cancelled = 0, parked = 0 }, s)

    local report = assert(tm:recover())
    assert.are.equal(1, report.examined)
    assert.are.equal(0, report.malformed)
    assert.are.same({}, report.errors)
    assert.are.equal(1, report.done + report.cancelled)

    assert.are.same(before, foreign_dump())
    assert.are.equal(report.done == 1 and 90 or 100, accounts:find_one({ _id = "A" }).balance)
    b = assert(tm:backlog())
    assert.are.equal(0, b.active)
    assert.are.equal(0, b.stale)
    assert.is_nil(b.oldest)
    assert.are.equal(4, b.foreign)

    -- prune deletes mongotx's finished transaction, not the tutorial's
    assert.are.equal(1, assert(tm:prune { older_than = 0 }))
    assert.is_nil(txs:find_one({ _id = "own" }))
    assert.are.same(before, foreign_dump())
  end)

  it("the command: recover exits 0, status counts them as foreign, not stale", function()
    if cli.no_build then pending(cli.no_build) return end
    own_stale()
    local before = foreign_dump()
    local code, out, err = cli.run({ "--database", dbname, "status" })
    assert.are.equal(0, code, err)
    assert.truthy(out:find("stale:%s+1 "), out)
    assert.truthy(out:find("initial:%s+1\n"), out)
    assert.truthy(out:find("foreign:%s+4 "), out)
    code, out, err = cli.run({ "--database", dbname, "recover" })
    assert.are.equal(0, code, out .. err)
    assert.truthy(out:find("malformed:%s+0"), out)
    code, out, err = cli.run({ "--database", dbname, "status", "--prometheus" })
    assert.are.equal(0, code, err)
    assert.truthy(out:find('\nmongotx_stale_transactions{[^\n]*} 0\n'), out)
    assert.truthy(out:find('\nmongotx_foreign_documents{[^\n]*} 4\n'), out)
    code, out, err = cli.run({ "--database", dbname, "show", "t-pending" })
    assert.are.equal(0, code, err)
    assert.truthy(out:find("another writer's document (foreign)", 1, true), out)
    assert.are.same(before, foreign_dump())
    assert.are.equal("done", txs:find_one({ _id = "own" }).state)
  end)
end)

-- The recipe of docs/recipes.md: mongotx with a transactions collection
-- and marker of its own, a PyMongo writer on the tutorial's recipe, both
-- moving money among the same accounts, both killed with SIGKILL, each
-- side's recovery run: the sum holds and nothing is left in a marker or
-- in escrow.
local N, START = 6, 1000

local function no_python()
  if not server.exists(PYTHON) then return "no " .. PYTHON .. ": run spec/support/setup.sh prometheus" end
  if server.execute(server.quote(PYTHON) .. " -c 'import pymongo' 2>/dev/null") ~= 0 then
    return "no pymongo in " .. PYTHON .. ": run spec/support/setup.sh prometheus"
  end
end

describe("#server #concurrency a recipe writer beside mongotx", function()
  local reason = helpers.no_concurrency() or no_python()
  if reason then
    it("runs where Python's pymongo is installed and the server isolates writers",
      function() pending(reason) end)
    return
  end

  it("shares the accounts through kill -9 of both: the sum holds, nothing is stranded", function()
    local dbname = helpers.db_name()
    local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    local accounts = db:collection("accounts")
    local names, docs = {}, {}
    for i = 1, N do
      names[i] = "acct-" .. i
      docs[i] = { _id = names[i], balance = START }
    end
    assert(accounts:insert_many(docs))
    local list = table.concat(names, ",")

    local python = server.quote(PYTHON) .. " spec/support/recipe_writer.py"
    local out = os.tmpname()
    local p = assert(io.popen(string.format("%s %s %s run 100000 %s 7 >%s 2>&1 & echo $!",
      python, server.quote(helpers.uri()), dbname, list, out)))
    local writer = tonumber(p:read("*l"))
    p:close()
    local workers = {}
    for seed = 1, 2 do
      local pid, wout = helpers.spawn_worker("transfers", helpers.uri(), dbname, 100000, list,
        seed, "mtx_transactions", "mtxPending")
      workers[seed] = { pid = pid, out = wout }
    end

    -- while they run: each marker holds its own side's marks only
    local function count(file, word)
      local n = 0
      for _ in helpers.read_file(file):gmatch(word) do n = n + 1 end
      return n
    end
    local deadline = core.monotonic_ms() + 30000
    repeat
      for _, a in ipairs(assert(accounts:find_all({}))) do
        for _, m in ipairs(a.pendingTransactions or {}) do
          assert.are.equal("objectId", core.type(m), "a mongotx mark in the tutorial's marker")
        end
        for _, m in ipairs(a.mtxPending or {}) do
          assert.truthy(type(m) == "string" and m:find("$mongotx:mtx_transactions$", 1, true),
            "not a mark of mtx_transactions in mongotx's marker")
        end
      end
      core.sleep(0.1)
    until (count(out, "done") >= 30 and count(workers[1].out, "done") >= 30
           and count(workers[2].out, "done") >= 30) or core.monotonic_ms() > deadline
    helpers.signal(writer, "KILL")
    for _, w in ipairs(workers) do helpers.signal(w.pid, "KILL") end
    assert.is_true(helpers.wait_exit(writer, 10))
    for _, w in ipairs(workers) do assert.is_true(helpers.wait_exit(w.pid, 10)) end
    assert.is_true(count(out, "done") >= 30, helpers.read_file(out))

    -- each side's recovery: the tutorial's in Python, mongotx's after the
    -- killed owners' leases (their transactions aged past them)
    local r = assert(io.popen(string.format("%s %s %s recover 2>&1", python,
      server.quote(helpers.uri()), dbname)))
    local said = r:read("*a")
    r:close()
    assert.truthy(said:find("exit"), said)
    local mtx = db:collection("mtx_transactions")
    for _, T in ipairs(assert(mtx:find_all({ state = { ["$nin"] = { "done", "cancelled" } } }))) do
      helpers.age(mtx, T._id, HOUR)
    end
    local tm = assert(db:manager { application = "recovery", collection = "mtx_transactions",
                                  marker = "mtxPending" })
    local report = assert(tm:recover())
    assert.are.same({}, report.errors)
    assert.are.equal(0, assert(tm:backlog()).foreign)

    local sum = 0
    for _, a in ipairs(assert(accounts:find_all({}))) do
      sum = sum + a.balance
      assert.are.same({}, a.pendingTransactions or {}, a._id)
      assert.are.same({}, a.mtxPending or {}, a._id)
      for _, v in pairs(a.txPending or {}) do assert.are.equal(0, v, a._id) end
    end
    assert.are.equal(N * START, sum)
    assert.are.equal(0, db:collection("transactions"):count({ state = { ["$ne"] = "done" } }))
    assert.are.equal(0, mtx:count({ state = { ["$nin"] = { "done", "cancelled" } } }))
    assert.is_true(mtx:count({ state = "done" }) >= 60)

    os.remove(out)
    for _, w in ipairs(workers) do os.remove(w.out) end
    assert(db.client:command(dbname, { dropDatabase = 1 }))
    db:close()
  end)
end)

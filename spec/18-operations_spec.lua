-- The manager's calls for operators (what the `mongotx` command uses):
-- tm:backlog (stale count, oldest open transaction by the server's
-- clock), tm:inspect (a transaction and its documents' markers and
-- versions), tm:unpark, and tm:prune's limit and dry_run.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local function age(s) mongotx.core.sleep(s or 0.01) end

describe("#server operator calls", function()
  local db, dbname, tm, accounts, txs

  before_each(function()
    dbname = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    tm = assert(db:manager{ application = "app-1", lease = 0 })
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
    })
  end)

  local function transfer(n, id)
    return assert(tm:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -n } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = n } } },
    }, { id = id }))
  end

  -- A pending transaction, claimed, parked as recovery parks one.
  local function parked(id)
    local t = transfer(5, id)
    assert(tm:step("claim", t))
    age()
    local rec = assert(db:manager{ application = "rec", stale_after = 0, max_attempts = 1 })
    local r = assert(rec:recover())
    assert.are.equal(1, r.parked)
    return t
  end

  it("backlog counts active and stale ones and ages the oldest by the server's clock", function()
    local empty = assert(tm:backlog())
    assert.are.same({ active = 0, stale = 0, foreign = 0 }, empty)
    local old = transfer(1, "old")
    age(1.2)
    transfer(2, "new")
    assert(tm:run({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 1 } } } }))
    local slow = assert(db:manager{ application = "app-1", stale_after = 1 })
    local b = assert(slow:backlog())
    assert.are.equal(2, b.active)
    assert.are.equal(1, b.stale) -- "old" only: "new" is younger than 1 s, the run is done
    assert.are.equal(old._id, b.oldest_id)
    assert.is_true(b.oldest >= 1.1 and b.oldest < 60, tostring(b.oldest))
    -- a parked one is open (oldest) but not active
    assert(txs:update_one({ _id = "old" }, { ["$set"] = { parked = true } }))
    b = assert(slow:backlog())
    assert.are.equal(1, b.active)
    assert.are.equal(0, b.stale)
    assert.are.equal("old", b.oldest_id)
  end)

  it("inspect shows each op's document marker and version, and reads nothing for a " ..
     "malformed transaction", function()
    local t = transfer(10, "t")
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    local T, docs = tm:inspect("t")
    assert.are.equal("pending", T.state)
    assert.are.equal(2, #docs)
    assert.are.same({ "t" }, docs[1].marker)
    assert.are.equal(1, docs[1].version)
    assert.is_true(docs[1].exists)
    assert.are.same({}, docs[2].marker)
    assert.is_nil(docs[2].version)
    -- op 2's credit applied into escrow: B holds it in txPending, and
    -- the transaction's id in txEscrow
    assert(tm:step("apply", t, 2))
    docs = select(2, tm:inspect("t"))
    assert.are.same({ "t" }, docs[2].escrow)
    assert.are.same({ balance = 10 }, docs[2].pending)
    assert.are.same({ "t" }, docs[2].marker)
    assert.is_nil(docs[1].escrow)
    assert.are.same({ "t" }, assert(accounts:find_one({ _id = "B" })).txEscrow)
    assert.is_nil(tm:inspect("none"))
    local none, err = tm:inspect({ ["$gt"] = "" })
    assert.is_nil(none)
    assert.are.equal("invalid", err.code)
    -- a hand-edited op id that would match many documents (a Regex) must
    -- not be used in a query
    assert(txs:insert_one({ _id = "bad", state = "pending",
      ops = { { collection = "accounts", id = mongotx.Regex(".*"), kind = "update" } } }))
    local B, bdocs, why = tm:inspect("bad")
    assert.are.equal("bad", B._id)
    assert.are.same({}, bdocs)
    assert.truthy(why:find("op 1", 1, true), why)
  end)

  it("unpark clears parked and attempts, and recovery then finishes the transaction", function()
    local t = parked("p")
    local before = helpers.db_dump(db.client, dbname)
    local ok, err = tm:unpark("missing")
    assert.is_nil(ok)
    assert.are.equal("state", err.code)
    ok, err = tm:unpark({ ["$ne"] = "x" })
    assert.is_nil(ok)
    assert.are.equal("invalid", err.code)
    helpers.assert_dump_unchanged(before, db.client, dbname)
    assert.is_true(tm:unpark(t._id))
    local T = assert(tm:get(t._id))
    assert.is_nil(T.parked)
    assert.are.equal(0, T.attempts)
    ok, err = tm:unpark(t._id)
    assert.is_nil(ok)
    assert.are.equal("state", err.code) -- not parked any more
    age()
    local rec = assert(db:manager{ application = "rec", stale_after = 0 })
    assert.are.equal(1, assert(rec:recover()).done)
    assert.are.equal("done", assert(tm:get(t._id)).state)
    local balances = helpers.balances(accounts)
    assert.are.same({ A = 995, B = 1005 }, balances)
  end)

  it("rollback and compensate of a parked transaction clear parked; stats and unpark " ..
     "count only unfinished ones", function()
    local r = parked("r")
    local c = transfer(7, "c")
    assert(tm:step("claim", c))
    assert(tm:step("apply", c, 1)); assert(tm:step("apply", c, 2))
    assert(tm:step("commit", c))
    -- parked as recovery parks one (an applied one whose finish kept failing)
    assert(txs:update_one({ _id = "c" }, { ["$set"] = { parked = true, reason = "finish failed" } }))
    assert.are.equal(2, assert(tm:stats()).parked)
    assert(tm:rollback({ _id = r._id }, "operator"))
    local R = assert(tm:get(r._id))
    assert.are.equal("cancelled", R.state)
    assert.is_nil(R.parked)
    assert.are.equal("operator", R.reason)
    assert.are.equal(1, assert(tm:stats()).parked)
    assert(tm:compensate({ _id = "c" }))
    local C = assert(tm:get("c"))
    assert.are.equal("done", C.state)
    assert.is_nil(C.parked)
    assert.are.equal("finish failed", C.reason) -- the evidence stays
    assert.are.equal(0, assert(tm:stats()).parked)
    assert.are.same({ A = 1000, B = 1000 }, (helpers.balances(accounts)))
    -- a finished one flagged by an older version is not counted, nor unparked
    assert(txs:update_one({ _id = "c" }, { ["$set"] = { parked = true } }))
    assert.are.equal(0, assert(tm:stats()).parked)
    local before = helpers.db_dump(db.client, dbname)
    local ok, err = tm:unpark("c")
    assert.is_nil(ok)
    assert.are.equal("state", err.code)
    helpers.assert_dump_unchanged(before, db.client, dbname)
  end)

  it("prune with limit deletes the oldest finished ones in steps, dry_run only counts", function()
    for i = 1, 5 do
      assert(tm:run({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = i } } } },
        { id = "old" .. i }))
    end
    transfer(1, "open") -- not finished: never pruned
    age(1.2)
    assert(tm:run({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 1 } } } },
      { id = "young" }))
    local before = helpers.db_dump(db.client, dbname)
    assert.are.equal(5, assert(tm:prune{ older_than = 1, dry_run = true }))
    assert.are.equal(2, assert(tm:prune{ older_than = 1, dry_run = true, limit = 2 }))
    helpers.assert_dump_unchanged(before, db.client, dbname)
    assert.are.equal(2, assert(tm:prune{ older_than = 1, limit = 2 }))
    assert.are.equal(2, assert(tm:prune{ older_than = 1, limit = 2 }))
    assert.are.equal(1, assert(tm:prune{ older_than = 1, limit = 2 }))
    assert.are.equal(0, assert(tm:prune{ older_than = 1, limit = 2 }))
    local left = {}
    for _, T in ipairs(helpers.dump(txs)) do left[#left + 1] = T._id end
    assert.are.same({ "open", "young" }, left)
  end)

  it("prune{ older_than = 0 } deletes a transaction that ended in the ms it reads the clock", function()
    -- the server's clock is read in ms: a transaction that ended in that
    -- ms is 0 s old, and older_than = 0 takes it; many tries, as the
    -- end and the read only sometimes share their ms
    for i = 1, 60 do
      assert(tm:run({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 1 } } } },
        { id = "t" .. i }))
      assert.are.equal(1, assert(tm:prune{ older_than = 0 }), "try " .. i)
      assert.is_nil(txs:find_one({ _id = "t" .. i }))
    end
  end)
end)

-- A recovery pass reads what it drives (lua/mongotx/recovery.lua, issue
-- 28): at most its limit plus recovery.MARGIN documents, whatever the
-- backlog and however the server cuts its replies, read in replies of at
-- most recovery.READ and driven a batch at a time; and tm:stats() is one
-- aggregation.  What a read brought is counted from the server's replies
-- (client:returned(): the documents of every find, getMore and aggregate
-- reply), not from what the caller took from its cursor.
--
-- The backlog is `applied` transactions (committed, not finished: the
-- recipe's finish and done are left), so recovery reads nothing but the
-- stale list: an applied one has no versions to read before its claim.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local recovery = require "mongotx.recovery"

local core = mongotx.core

describe("#server a recovery pass", function()
  local db, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
  end)
  after_each(function() db:close() end)

  -- n applied transactions left by a process that is gone (lease 0), each
  -- moving 10 from a<i> to b<i>; oldest first.  Returns their ids.
  local function leave_applied(n)
    local docs = {}
    for i = 1, n do
      docs[#docs + 1] = { _id = "a" .. i, balance = 1000 }
      docs[#docs + 1] = { _id = "b" .. i, balance = 1000 }
    end
    assert(accounts:insert_many(docs, {}))
    local gone = assert(db:manager { application = "gone", lease = 0, finish = "deferred",
                                     finish_batch = 100000 })
    local ids = {}
    for first = 1, n, 100 do
      local list = {}
      for i = first, math.min(first + 99, n) do
        list[#list + 1] = { { collection = "accounts", id = "a" .. i, update = { ["$inc"] = { balance = -10 } } },
                            { collection = "accounts", id = "b" .. i, update = { ["$inc"] = { balance = 10 } } } }
      end
      local res = assert(gone:commit_many(list))
      for k = 1, #list do ids[#ids + 1] = assert(res[k])._id end
    end
    core.sleep(0.01) -- lastModified strictly older than the server's clock
    return ids
  end

  local function recoverer()
    return assert(db:manager { application = "recoverer", stale_after = 0, lease = 5 })
  end

  -- The transactions of `ids`: n_done of them done, the others still
  -- applied; every debit taken and every credit in (done) or still in
  -- escrow (applied: docs/guards.md, Escrow); the accounts of a done one
  -- unmarked, of an applied one marked.
  local function assert_settled(ids, n_done)
    local state, doc = {}, {}
    for _, T in ipairs(helpers.dump(txs)) do state[core.id_key(T._id)] = T.state end
    for _, d in ipairs(helpers.dump(accounts)) do doc[d._id] = d end
    local count = { done = 0, applied = 0 }
    for i, id in ipairs(ids) do
      local s = state[core.id_key(id)]
      count[s] = count[s] + 1
      for _, acc in ipairs { "a" .. i, "b" .. i } do
        local d = doc[acc]
        local escrowed = acc:sub(1, 1) == "b" and s == "applied" and 10 or 0
        assert.are.equal(acc:sub(1, 1) == "a" and 990 or 1010 - escrowed, d.balance)
        if acc:sub(1, 1) == "b" then assert.are.equal(escrowed, d.txPending.balance, acc) end
        local marked = d.pendingTransactions and #d.pendingTransactions or 0
        assert.are.equal(s == "done" and 0 or 1, marked, acc)
      end
    end
    assert.are.same({ done = n_done, applied = #ids - n_done }, count)
  end

  it("reads at most its limit plus the margin, whatever the backlog", function()
    local ids = leave_applied(300)
    local tm = recoverer()
    db.client:reset_counters()
    local r = assert(tm:recover { limit = 40, batch = 10 })
    local read = db.client:returned()
    assert.are.equal(40, r.done)
    -- 300 stale ones, 40 + MARGIN read
    assert.is_true(read >= 40 and read <= 40 + recovery.MARGIN, read .. " documents read")
    assert_settled(ids, 40)
    db.client:reset_counters()
    r = assert(tm:recover { limit = 40, batch = 10 })
    assert.are.equal(40, r.done)
    assert.are.equal(read, db.client:returned())
    assert_settled(ids, 80)
  end)

  it("streams a limit larger than one reply: read as it drives, a batch at a time", function()
    local ids = leave_applied(260)
    local was = recovery.READ
    finally(function() recovery.READ = was end)
    recovery.READ = 50
    -- the documents read when each transaction is done
    local read_at = {}
    local tm = assert(db:manager { application = "recoverer", stale_after = 0, lease = 5,
      on_event = function(name)
        if name == "done" then read_at[#read_at + 1] = db.client:returned() end
      end })
    db.client:reset_counters()
    local r = assert(tm:recover { limit = 220, batch = 20 })
    local read = db.client:returned()
    assert.are.equal(220, r.done)
    assert.is_true(read >= 220 and read <= 220 + recovery.MARGIN, read .. " documents read")
    -- the k-th one is done before more than its batch and one reply
    -- beyond it is read
    assert.are.equal(220, #read_at)
    for k, n in ipairs(read_at) do
      assert.is_true(n <= k + 20 + recovery.READ, ("%d read when %d were done"):format(n, k))
    end
    assert_settled(ids, 220)
  end)

  it("reads past up to MARGIN malformed transactions, and no further", function()
    local ids = leave_applied(3)
    -- older than the good ones: an op list that is a string
    local function bad(i)
      return { _id = "bad" .. i, state = "pending", ops = "x", epoch = 1,
               lastModified = mongotx.Date(i) }
    end
    local was = recovery.MARGIN
    finally(function() recovery.MARGIN = was end)
    recovery.MARGIN = 4
    local tm = recoverer()
    local function pass()
      db.client:reset_counters()
      local r = assert(tm:recover { limit = 1 })
      return { r.examined, r.done, r.malformed, db.client:returned() }
    end
    assert(txs:insert_many({ bad(1), bad(2), bad(3) }, {}))
    -- three malformed ones fit in the margin: the oldest good one is
    -- driven (limit + MARGIN = 5 documents read)
    assert.are.same({ 1, 1, 3, 5 }, pass())
    assert_settled(ids, 1)
    -- five fill it: the good ones wait, nothing more is read
    assert(txs:insert_many({ bad(4), bad(5) }, {}))
    assert.are.same({ 0, 0, 5, 5 }, pass())
    assert_settled(ids, 1)
    for i = 1, 5 do
      assert.are.equal("x", assert(txs:find_one({ _id = "bad" .. i }, {})).ops, "never written")
    end
  end)

  -- The round trips of a pass of 200 applied ones in batches of 100, once
  -- the manager has read the server's clock and tried $$NOW (its first
  -- pass): the read, then per batch claim, finish and done.  Where claims
  -- compare deadlines on the server ($$NOW), the pass takes its time from
  -- the clock's estimate, not a read; FerretDB v1 has no $$NOW, so the
  -- pass reads the clock there, and sends 25 statements a command
  -- (engine.commands): claim 100 in 4, finish 200 in 8.
  it("takes 7 round trips for 200 applied ones, no clock read among them", function()
    local ids = leave_applied(400)
    local tm = recoverer()
    assert.are.equal(200, assert(tm:recover { limit = 200, batch = 100 }).done)
    db.client:reset_counters()
    assert.are.equal(200, assert(tm:recover { limit = 200, batch = 100 }).done)
    local want = helpers.server_kind() == "ferretdb" and 1 + 1 + 2 * (4 + 8 + 1)
      or helpers.no_deadlines() and 1 + 1 + 2 * 3 -- (FerretDB v2, its setting off)
      or 1 + 2 * 3
    assert.are.equal(want, db.client:counters().commands)
    assert_settled(ids, 400)
  end)
end)

-- A pass judges ages by the engine's estimate of the server's clock
-- (mongotx.clock: measured at most a minute ago), not by a read of its
-- own.  An estimate that runs behind only delays a pass (the transactions
-- look younger, the stale filter leaves the newest out until the next
-- measure); one that runs ahead lets a pass look at transactions early,
-- but its claims compare an owner's deadline with the server's clock as
-- they run ($$NOW), so none is taken from a live owner.
describe("#server a recovery pass whose clock estimate runs an hour ahead", function()
  local db, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    assert(accounts:insert_many({ { _id = "A1", balance = 1000 }, { _id = "A2", balance = 1000 } }, {}))
  end)
  after_each(function() db:close() end)

  local lacks = helpers.no_deadlines()

  for _, batch in ipairs { 1, 100 } do
    it("claims no pending transaction before its owner's deadline (batch " .. batch .. ")", function()
      if lacks then return pending(lacks) end
      local rescuer = assert(db:manager { application = "rescuer", stale_after = 0, lease = 5 })
      local clock = rescuer.engine.server_clock
      assert(clock:now())
      clock.offset = clock.offset + 3600000
      local report
      local tm = assert(db:manager { application = "slow", lease = 30, stale_after = 0,
        on_event = function(name)
          if name == "apply" and not report then report = assert(rescuer:recover { batch = batch }) end
        end })
      local T = assert(tm:transfer("accounts", "A1", "A2", 100))
      assert.are.equal(1, report.examined)
      assert.are.equal(1, report.skipped)
      assert.are.equal("done", T.state)
      assert.are.equal(1, assert(tm:get(T._id)).epoch, "never claimed")
      local b = helpers.balances(accounts)
      assert.are.same({ 900, 1100 }, { b.A1, b.A2 })
    end)
  end
end)

describe("#server tm:stats()", function()
  local db, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    txs = db:collection("transactions")
  end)
  after_each(function() db:close() end)

  it("is one round trip that counts what count() counts, parked ones only if open", function()
    local tm = assert(db:manager {})
    local docs, i = {}, 0
    local function add(state, n, parked)
      for _ = 1, n do
        i = i + 1
        docs[#docs + 1] = { _id = "t" .. i, state = state, parked = parked, ops = core.array() }
      end
    end
    add("initial", 3); add("pending", 2, true); add("applied", 4); add("applied", 1, true)
    add("done", 5); add("done", 2, true); add("canceling", 1, "yes"); add("cancelled", 6)
    add("odd", 2); add(7, 1)
    -- another writer's (no ops): not counted
    docs[#docs + 1] = { _id = "foreign-1", state = "pending" }
    docs[#docs + 1] = { _id = "foreign-2", state = "done", parked = true }
    assert(txs:insert_many(docs, {}))
    local before = helpers.db_dump(db.client, db.name)
    db.client:reset_counters()
    local stats = assert(tm:stats())
    assert.are.equal(1, db.client:counters().commands)
    local own = { ["$exists"] = true }
    local want = { parked = assert(txs:count({ parked = true, ops = own,
      state = { ["$in"] = { "initial", "pending", "applied", "canceling" } } })) }
    for _, state in ipairs { "initial", "pending", "applied", "done", "canceling", "cancelled" } do
      want[state] = assert(txs:count({ state = state, ops = own }))
    end
    assert.are.same({ initial = 3, pending = 2, applied = 5, done = 7, canceling = 1,
                      cancelled = 6, parked = 3 }, want)
    assert.are.same(want, stats)
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end)

  it("says so when the documents carry more kinds of `parked` than one reply holds", function()
    local tm = assert(db:manager {})
    local docs = {}
    for i = 1, 1000 do docs[i] = { _id = i, state = "done", parked = i, ops = core.array() } end
    assert(txs:insert_many(docs, {}))
    local stats, err = tm:stats()
    assert.is_nil(stats)
    assert.are.equal("server", err.code)
    assert.truthy(err.message:find("kinds of `parked`", 1, true), err.message)
    assert.are.equal(1000, assert(txs:count({})))
  end)
end)

-- Several processes run transfers on the same few accounts while another
-- keeps recovering (taking over) every transaction it finds in flight.
-- Whatever interleaving happens: the sum of balances is unchanged, every
-- transaction ends done or cancelled, no marker is left behind, and each
-- account's balance is exactly what its done transactions say.

local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local reason = helpers.no_concurrency()
local WORKERS, TRANSFERS, ACCOUNTS = 4, 40, { "A", "B", "C", "D", "E" }

describe("#server #concurrency concurrent transfers and recoveries", function()
  if reason then
    it("runs on servers that isolate concurrent writers", function() pending(reason) end)
    return
  end

  it("never lose or double an amount", function()
    local dbname = helpers.db_name()
    local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    local accounts = db:collection("accounts")
    local docs = {}
    for i, id in ipairs(ACCOUNTS) do
      docs[i] = { _id = id, balance = 1000, pendingTransactions = mongotx.array() }
    end
    assert(accounts:insert_many(docs))

    local pids = {}
    for w = 1, WORKERS do
      pids[#pids + 1] = { helpers.spawn_worker("transfers", helpers.uri(), dbname, TRANSFERS,
        table.concat(ACCOUNTS, ","), w) }
    end
    pids[#pids + 1] = { helpers.spawn_worker("recoverer", helpers.uri(), dbname, 4) }
    for _, p in ipairs(pids) do
      assert.is_true(helpers.wait_exit(p[1], 120), "a worker did not finish")
    end
    local outcomes = { done = 0, cancelled = 0 }
    for _, p in ipairs(pids) do
      local said = helpers.read_file(p[2])
      os.remove(p[2])
      assert.truthy(said:find("exit"), said)
      for word in said:gmatch("(%a+)[^\n]*\n") do
        if outcomes[word] then outcomes[word] = outcomes[word] + 1 end
      end
    end

    -- a last recovery pass settles what a taken-over worker left
    local tm = assert(db:manager { application = "final", stale_after = 0, lease = 0 })
    assert(tm:recover())

    local txs = assert(tm:find())
    assert.equal(WORKERS * TRANSFERS, #txs)
    local expected, done = {}, 0
    for _, id in ipairs(ACCOUNTS) do expected[id] = 1000 end
    for _, t in ipairs(txs) do
      assert.truthy(t.state == "done" or t.state == "cancelled", t.state)
      if t.state == "done" then
        done = done + 1
        expected[t.source] = expected[t.source] - t.value
        expected[t.destination] = expected[t.destination] + t.value
      end
    end
    local sum = 0
    for _, a in ipairs(helpers.dump(accounts)) do
      assert.equal(0, #a.pendingTransactions)
      assert.equal(expected[a._id], a.balance)
      assert.truthy(a.balance >= 0)
      sum = sum + a.balance
    end
    assert.equal(1000 * #ACCOUNTS, sum)
    assert.truthy(done > 0)
    print(string.format("\n  concurrency: %d processes + 1 recoverer, %d transfers, " ..
      "%d done, %d cancelled, %d balances checked, sum %d",
      WORKERS, #txs, done, #txs - done, #ACCOUNTS, sum))
  end)
end)

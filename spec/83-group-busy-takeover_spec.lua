-- Group commit, a call handed to its caller `busy` (mongotx.group.busy):
-- while its caller waits a backoff, its owner's lease passes and another
-- manager takes its transaction over.  The call alone then waits for the
-- new owner's outcome and answers it (mongotx.manager.batches,
-- await_held: the same transaction).  Grouped, its answer must be that
-- outcome too: one transfer, not a second transaction run afresh.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local BACKOFF, LEASE = 0.6, 1

describe("#server group commit: a busy call taken over while its caller waits", function()
  local db, accounts, txs, holder, payer, taker

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    assert(accounts:insert_many({ { _id = "H", balance = 1000 }, { _id = "X", balance = 50 },
                                  { _id = "U", balance = 50 } }))
    -- the holder: its credit on X applied, left open (exclusive: txHeld)
    holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
    local t = assert(holder:begin({
      { collection = "accounts", id = "H", update = { ["$inc"] = { balance = -1 } } },
      { collection = "accounts", id = "X", update = { ["$inc"] = { balance = 1 } } },
    }, { id = "h" }))
    assert(holder:step("claim", t))
    assert(holder:step("apply", t, 2))
    payer = assert(db:manager { application = "payer", lease = LEASE, retries = 5,
      backoff = function() return BACKOFF end })
    taker = assert(db:manager { application = "taker", lease = 3600 })
  end)
  after_each(function() db:close() end)

  it("answers the outcome of its own transaction, taken over, and transfers once", function()
    local S = scheduler()
    local g = group.wrap(payer, { signal = S.signal, spawn = S.spawn, now = S.now })
    local T, err, id
    S.spawn(function() T, err = g:transfer("accounts", "U", "X", 10, { min = 0 }) end)
    S.spawn(function()
      -- past the payer's lease (its second backoff): the holder rolls
      -- back, the taker claims the payer's transaction
      S.signal():wait(LEASE + 0.1)
      assert(holder:rollback(assert(holder:get("h"))))
      local mine = assert(txs:find_one({ _id = { ["$ne"] = "h" } }))
      id = mine._id
      assert.are.equal("pending", mine.state)
      assert(taker:step("claim", { _id = id }))
      -- the payer's caller meets it held (its next try), then it ends
      S.signal():wait(BACKOFF)
      assert(taker:commit({ _id = id }))
    end)
    S.loop()
    assert.is_truthy(T, tostring(err))
    assert.are.equal("done", T.state)
    assert.are.same({ H = 1000, X = 60, U = 40 }, helpers.balances(accounts))
    assert.are.equal(tostring(id), tostring(T._id), "the answer is another transaction than the call's")
    assert.are.equal(2, #helpers.dump(txs)) -- "h" and the call's, no second one
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, d._id .. " keeps a marker")
      assert.are.same({}, d.txHeld or {}, d._id .. " keeps a txHeld entry")
    end
  end)
end)

-- Group commit: a call meets a holder whose owner died (lease passed)
-- and whose own next op is busy (a live open transaction holds its
-- document).  The call drives the dead holder to its end (Engine:resolve)
-- and that drive waits its busy retries; issue 41's rule (nothing waits
-- for someone else's failure) and mongotx.group.busy's (no busy wait in
-- a shared batch) say the other calls of the batch do not wait for it:
-- they answer before the first backoff is over, and no batch sleeps
-- policy.sleep.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local core = helpers.core
local RETRIES, BACKOFF, K = 3, 0.25, 4

describe("#server group commit: a dead holder whose drive waits busy", function()
  local db, accounts, txs, holder, payer, slept

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    local docs = { { _id = "H", balance = 1000 }, { _id = "V", balance = 0 },
                   { _id = "X", balance = 50 }, { _id = "Y", balance = 50 } }
    for i = 1, K do docs[#docs + 1] = { _id = "U" .. i, balance = 50 } end
    assert(accounts:insert_many(docs))
    -- the live holder: its credit on Y applied, left open (txHeld)
    holder = assert(db:manager { application = "holder", lease = 3600, escrow = false })
    local h = assert(holder:begin({
      { collection = "accounts", id = "H", update = { ["$inc"] = { balance = -1 } } },
      { collection = "accounts", id = "Y", update = { ["$inc"] = { balance = 1 } } },
    }, { id = "h" }))
    assert(holder:step("claim", h))
    assert(holder:step("apply", h, 2))
    -- the dead one (lease 0: past at once): its credit on X applied, its
    -- credit on Y (which the live holder holds) not
    local dead = assert(db:manager { application = "dead", lease = 0, escrow = false })
    local d = assert(dead:begin({
      { collection = "accounts", id = "X", update = { ["$inc"] = { balance = 1 } } },
      { collection = "accounts", id = "Y", update = { ["$inc"] = { balance = 1 } } },
    }, { id = "d" }))
    assert(dead:step("claim", d))
    assert(dead:step("apply", d, 1))
    assert.are.same({ "d" }, assert(accounts:find_one({ _id = "X" })).txHeld)
    slept = 0
    payer = assert(db:manager { application = "payer", retries = RETRIES,
      backoff = function() return BACKOFF end,
      sleep = function(s) slept = slept + s core.sleep(s) end })
  end)
  after_each(function() db:close() end)

  it("answers the unrelated calls before the dead holder's first backoff", function()
    local S = scheduler()
    local g = group.wrap(payer, { signal = S.signal, spawn = S.spawn, now = S.now, max = 100 })
    local answers, at, start = {}, {}, S.now()
    local function call(k, fn)
      S.spawn(function()
        local T, err = fn()
        answers[k], at[k] = { T = T, err = err }, S.now() - start
      end)
    end
    -- X pays V: its guarded debit meets the dead holder's credit on X
    call(1, function() return g:transfer("accounts", "X", "V", 10, { min = 0, id = "x" }) end)
    for i = 1, K do
      call(i + 1, function() return g:transfer("accounts", "U" .. i, "V", 10, { min = 0, id = "u" .. i }) end)
    end
    S.loop()
    for k = 2, K + 1 do
      assert.are.equal("done", answers[k].T and answers[k].T.state, tostring(answers[k].err))
    end
    assert.are.equal("done", answers[1].T and answers[1].T.state, tostring(answers[1].err))
    -- the dead holder ended cancelled (busy), its credit on X undone
    local D = assert(txs:find_one({ _id = "d" }))
    assert.are.same({ "cancelled", "busy" }, { D.state, D.cause })
    assert(holder:rollback(assert(holder:get("h"))))
    local want = { H = 1000, V = 10 * (K + 1), X = 40, Y = 50 }
    for i = 1, K do want["U" .. i] = 40 end
    assert.are.same(want, helpers.balances(accounts))
    for _, doc in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, doc.pendingTransactions or {}, doc._id .. " keeps a marker")
      assert.are.same({}, doc.txHeld or {}, doc._id .. " keeps a txHeld entry")
    end
    -- the unrelated calls did not wait for the dead holder's retries
    for k = 2, K + 1 do
      assert.is_true(at[k] < BACKOFF, ("unrelated call %d answered after %.3f s: its batch waited " ..
        "for the dead holder's busy retries"):format(k, at[k]))
    end
    assert.are.equal(0, slept, "the batch slept (policy.sleep) for the dead holder")
  end)
end)

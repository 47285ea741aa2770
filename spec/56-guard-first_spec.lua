-- No credit shows whose guarded debit did not apply (docs/guards.md,
-- "Guards"): a transaction run at once (tm:transfer, tm:run) applies its
-- guarded ops first, with either fencing, so the credit's document is
-- never written when the debit's guard fails.  The version-fenced path
-- under contention is spec/29's ("escrow on hot accounts", run with
-- fencing = "version" too).
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local deadline_reason = helpers.no_deadlines()
local concurrency = helpers.no_concurrency()

-- A process moving money between H and I as fast as it can: every write
-- moves their versions.
local BUSY = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local db = assert(mongotx.connect(arg[1], { database = arg[2] }))
local tm = assert(db:manager { application = "busy", fencing = "version" })
local stop = arg[3]
local n = 0
while not io.open(stop) and n < 2000 do
  assert(tm:transfer("accounts", n % 2 == 0 and "H" or "I", n % 2 == 0 and "I" or "H", 1))
  n = n + 1
end
print("moved " .. n)
]]

describe("#server guarded ops first in a transaction run at once", function()
  local db, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    assert(accounts:insert_many {
      { _id = "A", balance = 10, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 0, pendingTransactions = mongotx.array() } })
  end)

  after_each(function() db:close() end)

  local function doc(id) return assert(accounts:find_one({ _id = id })) end

  for _, fencing in ipairs { "deadline", "version" } do
    describe("fencing " .. fencing, function()
      local function manager()
        if fencing == "deadline" and deadline_reason then return nil, deadline_reason end
        return assert(db:manager { fencing = fencing })
      end

      it("a transfer whose floor is false never writes the credit's document", function()
        local tm, why = manager()
        if not tm then return pending(why) end
        local before = doc("B")
        local T, err = tm:transfer("accounts", "A", "B", 30, { min = 0 })
        assert.is_nil(T)
        assert.are.equal("guard", err.code)
        local after = doc("B")
        -- the credit was never sent: no apply, no undo moved B's version
        assert.are.equal(before.txVersion, after.txVersion)
        assert.are.equal(0, after.balance)
        assert.is_nil(after.txPending)
        assert.are.same({}, after.pendingTransactions)
        assert.are.equal(10, doc("A").balance)
      end)

      it("tm:run with a failing assert applies none of its other ops", function()
        local tm, why = manager()
        if not tm then return pending(why) end
        local T, err = tm:run({
          { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 5 } } },
          { collection = "accounts", id = "A", kind = "assert", where = { balance = { ["$gte"] = 100 } } } })
        assert.is_nil(T)
        assert.are.equal("guard", err.code)
        local b = doc("B")
        assert.is_nil(b.txVersion)
        assert.are.equal(0, b.balance)
        assert.is_nil(b.txPending)
      end)

      it("a transfer whose floor holds sends the debit, then the credit: one more round trip", function()
        local tm, why = manager()
        if not tm then return pending(why) end
        -- a first transfer learns the server's clock and what it supports
        assert(tm:transfer("accounts", "A", "B", 1))
        db.client:reset_counters()
        local T = assert(tm:transfer("accounts", "A", "B", 4, { min = 0 }))
        local n = db.client:counters().commands
        -- create, debit, credit, commit, finish, done (and the versions first)
        assert.are.equal(fencing == "version" and 7 or 6, n)
        assert.are.equal("done", T.state)
        assert.are.same({ 5, 5 }, { doc("A").balance, doc("B").balance })
      end)
    end)
  end

  describe("#concurrency on a hot account fenced by versions", function()
    if concurrency then
      it("runs on servers that isolate concurrent writers", function() pending(concurrency) end)
      return
    end

    it("a floor that is false is refused with guard at once, not after contention", function()
      assert(accounts:insert_many { { _id = "H", balance = 100 }, { _id = "I", balance = 100 } })
      local stop = os.tmpname()
      os.remove(stop)
      local procs = {}
      for k = 1, 4 do
        local pid, out, script = helpers.spawn_script(BUSY, helpers.uri(), db.name, stop)
        procs[k] = { pid = pid, out = out, script = script }
      end
      -- an op failure is answered at once (no retry hides a contention);
      -- transient errors are still retried (FerretDB v2: a finish of a
      -- committed holder that PostgreSQL aborted as a deadlock)
      local tm = assert(db:manager { fencing = "version",
                                     on_op_failure = function() return "cancel" end })
      local codes = {}
      for _ = 1, 20 do
        local T, err = tm:transfer("accounts", "H", "B", 1000, { min = 0 })
        assert.is_nil(T)
        codes[err.code] = (codes[err.code] or 0) + 1
      end
      assert(io.open(stop, "w")):close()
      local moved = 0
      for _, p in ipairs(procs) do
        local said = helpers.script_output(p.pid, p.out, p.script, 60)
        moved = moved + assert(tonumber(said:match("moved (%d+)")), said)
      end
      os.remove(stop)
      assert.are.same({ guard = 20 }, codes)
      assert.truthy(moved > 0, "the busy processes moved nothing: the spec tested nothing")
      assert.are.equal(0, doc("B").balance)
      local _, sum = helpers.balances(accounts)
      assert.are.equal(210, sum) -- A 10, B 0, H and I 200
    end)
  end)
end)

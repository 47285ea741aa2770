-- Recovery never drives a hold forward (docs/holds.md), even when its
-- cancel of a hold it claimed loses to a later claim: a recovery pass
-- claims expired holds (lease 0: its claim ends at once), another
-- recovery claims them after it and dies there (kill -9 at its claim),
-- then the first one's cancel no longer matches.  It must leave them
-- (skipped: the later claim's owner, or the next pass, ends them), not
-- apply and commit them: before, the batched pass captured both holds in
-- full and the single one answered `invalid`.  The next pass then
-- expires them, the money back.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local Date = mongotx.core.Date

-- A second recovery that ends at once after its claim.
local SECOND = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local db = assert(mongotx.connect(arg[1], { database = arg[2] }))
local tm = assert(db:manager { application = "second", lease = 0, stale_after = 0 })
mongotx.core.fault("claim:after:1")
tm:recover()
print("no crash")
]]

describe("#server a recovery whose cancel of a claimed hold lost to a later claim", function()
  local db

  after_each(function() if db then db:close() end db = nil end)

  for _, n in ipairs { 1, 2 } do
    it(("leaves it to the later claim, never captures it (%d hold%s: %s)"):format(n,
        n == 1 and "" or "s", n == 1 and "one at a time" or "batched"), function()
      local dbname = helpers.db_name()
      db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
      local accounts, txs = db:collection("accounts"), db:collection("transactions")
      assert(accounts:insert_many({ { _id = "A1", balance = 100 }, { _id = "B1", balance = 0 },
                                    { _id = "A2", balance = 100 }, { _id = "B2", balance = 0 } }))
      local tm = assert(db:manager { application = "opener" })
      for i = 1, n do
        assert(tm:hold("accounts", "A" .. i, "B" .. i, 80, { min = 0, id = "h" .. i, expires = 600 }))
      end
      -- past their expiry and deadline, as if opened long ago
      local at = Date(math.floor(assert(tm:server_now()) - 5000))
      assert(txs:update_many({}, { ["$set"] = { ["hold.expires"] = at, deadline = at } }))
      local said
      local first = assert(db:manager { application = "first", lease = 0, stale_after = 0,
        on_event = function(name, info)
          if name == "claim" and not said and info.id == "h1" then
            local pid, out, script = helpers.spawn_script(SECOND, helpers.uri(), dbname)
            said = helpers.script_output(pid, out, script)
          end
        end })
      local report = assert(first:recover())
      assert.truthy(said and said:find("fault injected", 1, true),
        "the second recovery did not die at its claim: " .. tostring(said))
      assert.are.equal(0, report.done)
      assert.are.equal(n, report.skipped)
      for i = 1, n do
        local T = assert(txs:find_one({ _id = "h" .. i }))
        assert.are.equal("pending", T.state)
        assert.is_nil(T.hold.captured)
        assert.are.same({ 20, 0 }, { accounts:find_one({ _id = "A" .. i }).balance,
                                     accounts:find_one({ _id = "B" .. i }).balance })
      end
      -- the next pass (the dead claim's deadline passed: lease 0) expires them
      local third = assert(db:manager { application = "third", lease = 0, stale_after = 0 })
      assert(third:recover())
      for i = 1, n do
        local T = assert(txs:find_one({ _id = "h" .. i }))
        assert.are.equal("cancelled", T.state)
        assert.are.equal("expired", T.cause)
        local a, b = accounts:find_one({ _id = "A" .. i }), accounts:find_one({ _id = "B" .. i })
        assert.are.same({ 100, 0, 0, 0 }, { a.balance, b.balance,
          b.txPending and b.txPending.balance or 0, #(a.pendingTransactions or {}) + #(b.pendingTransactions or {}) })
      end
    end)
  end
end)

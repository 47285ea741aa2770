-- An op that meets a holder whose owner died takes it over once the
-- owner's lease passed (issue 41): the owner, another process, is killed
-- with SIGKILL while its transaction "dead" (A pays 10 to B, an
-- exclusive credit: B's txHeld names it) is pending, or applied; after
-- its lease, another manager's guarded transfer from B, or a `$set` of
-- B (exclusive), by every path that applies (transfer, run,
-- transfer_many, group commit, each), drives "dead" to the end recovery
-- gives (forward, or back where stale_pending says so) and ends `done`
-- at once: not `busy` after retries x backoff.  Afterwards no marker is
-- left anywhere and the balances are those of both outcomes.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local group = require "mongotx.group"
local scheduler = require "spec.support.scheduler"

local core = helpers.core

-- The owner: transfers 10 from A to B (its credit exclusive: escrow =
-- false) under id "dead", and stops for good at event arg[4] ("apply":
-- pending, both ops applied; "commit": applied), having written arg[3].
local OWNER = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local db = assert(mongotx.connect(arg[1], { database = arg[2] }))
local tm = assert(db:manager { application = "owner", lease = tonumber(arg[5]), escrow = false,
  on_event = function(name)
    if name == arg[4] then
      local f = assert(io.open(arg[3], "w")); f:write("ready\n"); f:close()
      mongotx.core.sleep(600)
    end
  end })
tm:transfer("accounts", "A", "B", 10, { min = 0, id = "dead" })
print("not killed")
]]

-- The owner's lease, seconds.
local LEASE = 2

describe("#server an op meeting a dead owner's holder after its lease", function()
  local db, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts, txs = db:collection("accounts"), db:collection("transactions")
    assert(accounts:insert_many({ { _id = "A", balance = 100 }, { _id = "B", balance = 0 },
                                  { _id = "C", balance = 0 } }))
  end)
  after_each(function() db:close() end)

  -- The owner (lease `lease`, LEASE by default) killed (SIGKILL) at
  -- `event` with "dead" in `state`; a short lease waited out (its
  -- deadline, or lastModified + lease, behind the clock by a margin).
  local function killed_at(event, state, lease)
    lease = lease or LEASE
    local ready = os.tmpname()
    os.remove(ready)
    local pid, out, script = helpers.spawn_script(OWNER, helpers.uri(), db.name, ready, event, lease)
    local came = helpers.wait_file(ready, 30)
    helpers.signal(pid, "KILL")
    assert.is_true(helpers.wait_exit(pid, 10))
    local said = helpers.read_file(out)
    os.remove(out)
    os.remove(script)
    os.remove(ready)
    assert.is_true(came, "the owner never reached " .. event .. ": " .. said)
    local dead = assert(txs:find_one({ _id = "dead" }))
    assert.are.equal(state, dead.state)
    -- B held: the credit's marker and txHeld entry are there
    local b = assert(accounts:find_one({ _id = "B" }))
    assert.are.equal(1, #b.txHeld)
    if lease == LEASE then core.sleep(LEASE + 0.5) end
  end

  -- No marker of any transaction is left on any account.
  local function no_markers()
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.equal(0, #(d.pendingTransactions or {}), d._id .. " keeps a marker")
      assert.are.equal(0, #(d.txHeld or {}), d._id .. " keeps a txHeld entry")
      for path, x in pairs(d.txPending or {}) do
        assert.are.equal(0, x, d._id .. " keeps an escrowed credit of " .. path)
      end
    end
  end

  -- Times fn(tm) on a fresh manager of another application (opts added).
  local function timed(fn, opts)
    local o = { application = "payer" }
    for k, v in pairs(opts or {}) do o[k] = v end
    local tm = assert(db:manager(o))
    local t0 = core.monotonic_ms()
    local T, err = fn(tm)
    return T, err, (core.monotonic_ms() - t0) / 1000
  end

  local function prompt(took)
    -- busy would answer after retries x backoff (0.35 s) with `busy`; a
    -- takeover is a few round trips
    assert.is_true(took < 1, ("the call took %.2f s"):format(took))
  end

  -- The transfer B -> C of 5, min 0, by each path that applies.
  local PATHS = {
    transfer = function(tm) return tm:transfer("accounts", "B", "C", 5, { min = 0, id = "pay" }) end,
    transfer_many = function(tm)
      local results, errs = tm:transfer_many {
        { collection = "accounts", from = "B", to = "C", amount = 5, min = 0, id = "pay" },
        { collection = "accounts", from = "A", to = "C", amount = 1, min = 0, id = "other" } }
      assert.are.equal("done", results[2] and results[2].state, tostring(errs[2]))
      return results[1], errs[1] or nil
    end,
    group = function(tm)
      local S = scheduler()
      local g = group.wrap(tm, { signal = S.signal, spawn = S.spawn, now = S.now, max = 10 })
      local T, err
      S.spawn(function() T, err = g:transfer("accounts", "B", "C", 5, { min = 0, id = "pay" }) end)
      S.loop()
      return T, err
    end,
    each = function(tm)
      local report, err = tm:each({ "pay" }, function()
        return { { collection = "accounts", id = "B", update = { ["$inc"] = { balance = -5 } },
                   where = { balance = { ["$gte"] = 5 } } },
                 { collection = "accounts", id = "C", update = { ["$inc"] = { balance = 5 } } } }
      end, { id = "job", key = function(x) return x end })
      if not report then return nil, err end
      assert.are.equal(1, report.committed, "each committed nothing")
      return assert(txs:find_one({ state = "done", _id = { ["$ne"] = "dead" } }))
    end,
  }

  for _, how in ipairs { "transfer", "transfer_many", "group", "each" } do
    it(("a guarded transfer from B by %s takes over the owner killed pending"):format(how), function()
      killed_at("apply", "pending")
      local T, err, took = timed(PATHS[how])
      assert.are.equal("done", T and T.state, tostring(err))
      prompt(took)
      local dead = assert(txs:find_one({ _id = "dead" }))
      assert.are.equal("done", dead.state)
      assert.are.equal(2, dead.epoch) -- claimed again: taken over
      local other = how == "transfer_many" and 1 or 0 -- its other item: A -> C 1
      assert.are.same({ A = 90 - other, B = 5, C = 5 + other }, (helpers.balances(accounts)))
      no_markers()
    end)
  end

  it("a guarded transfer from B rolls back the owner killed pending (stale_pending back)", function()
    killed_at("apply", "pending")
    local T, err, took = timed(PATHS.transfer, { stale_pending = function() return "back" end })
    -- B never had the dead credit: the guard is false on what B holds
    assert.is_nil(T)
    assert.are.equal("guard", err.code, tostring(err))
    prompt(took)
    local dead = assert(txs:find_one({ _id = "dead" }))
    assert.are.equal("cancelled", dead.state)
    assert.are.equal("recovery", dead.cause)
    assert.are.same({ A = 100, B = 0, C = 0 }, (helpers.balances(accounts)))
    no_markers()
  end)

  it("a guarded transfer from B finishes the owner killed applied", function()
    killed_at("commit", "applied")
    local T, err, took = timed(PATHS.transfer)
    assert.are.equal("done", T and T.state, tostring(err))
    prompt(took)
    assert.are.equal("done", assert(txs:find_one({ _id = "dead" })).state)
    assert.are.same({ A = 90, B = 5, C = 5 }, (helpers.balances(accounts)))
    no_markers()
  end)

  for _, case in ipairs { { "apply", "pending" }, { "commit", "applied" } } do
    it(("a $set of B (exclusive) takes over the owner killed %s"):format(case[2]), function()
      killed_at(case[1], case[2])
      local T, err, took = timed(function(tm)
        return tm:run({ { collection = "accounts", id = "B", update = { ["$set"] = { frozen = true } },
                          undo = { ["$unset"] = { frozen = "" } } } })
      end)
      assert.are.equal("done", T and T.state, tostring(err))
      prompt(took)
      assert.are.equal("done", assert(txs:find_one({ _id = "dead" })).state)
      assert.are.same({ A = 90, B = 10, C = 0 }, (helpers.balances(accounts)))
      assert.is_true(assert(accounts:find_one({ _id = "B" })).frozen)
      no_markers()
    end)
  end

  it("within the lease, a guarded transfer from B answers busy and leaves the holder", function()
    killed_at("apply", "pending", 3600) -- as if killed a moment ago
    local T, err, took = timed(PATHS.transfer)
    assert.is_nil(T)
    assert.are.equal("busy", err.code, tostring(err))
    assert.is_true(took < 2, ("the call took %.2f s"):format(took))
    local dead = assert(txs:find_one({ _id = "dead" }))
    assert.are.same({ "pending", 1 }, { dead.state, dead.epoch })
    assert.are.equal("cancelled", assert(txs:find_one({ _id = "pay" })).state)
    local b = assert(accounts:find_one({ _id = "B" }))
    assert.are.same({ 90, 10, 0 }, { assert(accounts:find_one({ _id = "A" })).balance, b.balance,
                                     assert(accounts:find_one({ _id = "C" })).balance })
    assert.are.same({ { "dead" }, { "dead" } }, { b.pendingTransactions, b.txHeld })
  end)
end)

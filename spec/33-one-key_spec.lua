-- Concurrent calls with one idempotency key (issue 33 item 3): separate
-- Lua processes of one application call tm:transfer, or tm:begin +
-- tm:commit, with the same ids at the same moment.  The calls that find
-- the transaction held by another wait for its outcome (policy
-- holder_wait) and answer what a retry after it would: never `owned`,
-- and every answer agrees with the transaction's final state in the
-- database.  A holder that never finishes: the waiter answers
-- `in_progress` after holder_wait, and writes nothing.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local KEYS, PROCESSES = 30, 3

-- One process: waits for the go file, then calls `mode` for ids k1..kN
-- in order, every third beyond A's balance (its guard refuses it), and
-- prints "<id> <state>" or "<id> error <code>" for each.
local CALLER = [[
package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path
package.cpath = os.getenv("MONGOTX_CPATH") .. ";" .. package.cpath
local mongotx = require "mongotx"
local uri, dbname, go, n, mode = arg[1], arg[2], arg[3], tonumber(arg[4]), arg[5]
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = "shop" })
repeat
  local f = io.open(go)
  if f then f:close() else mongotx.core.sleep(0.002) end
until f
for k = 1, n do
  local id, amount = "k" .. k, k % 3 == 0 and 5000 or 10
  local T, err
  if mode == "transfer" then
    T, err = tm:transfer("accounts", "A", "B", amount, { id = id, min = 0 })
  else
    local t
    t, err = tm:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -amount } },
        where = { balance = { ["$gte"] = amount } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = amount } } },
    }, { id = id })
    if t then T, err = tm:commit(t) end
  end
  io.write(id, " ", T and T.state or ("error " .. tostring(err.code)), "\n")
end
io.write("exit\n")
]]

describe("#server #concurrency calls with one idempotency key", function()
  local db, accounts, txs

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many({ { _id = "A", balance = 1000 }, { _id = "B", balance = 0 } }, {}))
  end)
  after_each(function() db:close() end)

  for _, mode in ipairs { "transfer", "begin+commit" } do
    it("in " .. PROCESSES .. " processes at once (" .. mode .. ") answer as the database ends", function()
      local why = helpers.no_concurrency()
      if why then pending(why) return end
      local go = os.tmpname()
      os.remove(go)
      local procs = {}
      for p = 1, PROCESSES do
        local pid, out, script = helpers.spawn_script(CALLER, helpers.uri(), db.name, go, KEYS, mode)
        procs[p] = { pid = pid, out = out, script = script }
      end
      mongotx.core.sleep(0.5) -- all connected and waiting
      assert(io.open(go, "w")):close()
      local answers = {}
      for _, p in ipairs(procs) do
        local output = helpers.script_output(p.pid, p.out, p.script, 120)
        assert.truthy(output:find("exit\n", 1, true), output)
        for id, answer in output:gmatch("(k%d+) ([^\n]+)\n") do
          answers[id] = answers[id] or {}
          table.insert(answers[id], answer)
        end
      end
      os.remove(go)
      local done = 0
      for k = 1, KEYS do
        local id = "k" .. k
        local T = assert(txs:find_one({ _id = id }))
        -- what a retry after the fact answers: done, or a cancel
        local expected = k % 3 == 0 and "cancelled" or "done"
        assert.are.equal(expected, T.state, id)
        if expected == "done" then done = done + 1 end
        assert.are.equal(PROCESSES, #answers[id], id)
        for _, answer in ipairs(answers[id]) do
          assert.are_not.equal("error owned", answer, id)
          if expected == "done" then
            assert.are.equal("done", answer, id)
          else
            -- the call that ran it names the guard, the others the cancel
            assert.truthy(answer == "error guard" or answer == "error cancelled",
              id .. ": " .. answer)
          end
        end
      end
      assert.are.same({ A = 1000 - 10 * done, B = 10 * done }, (helpers.balances(accounts)))
      assert.are.equal(KEYS, txs:count({}))
    end)
  end

  it("wait for a holder that never finishes at most holder_wait, then answer in_progress", function()
    local holder = assert(db:manager { application = "shop", lease = 3600 })
    local t = assert(holder:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -10 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 10 } } },
    }, { id = "held" }))
    assert(holder:step("claim", t))
    assert(holder:step("apply", t, 1))
    local before = helpers.db_dump(db.client, db.name)
    local waiter = assert(db:manager { application = "shop", holder_wait = 1 })
    local t0 = mongotx.core.monotonic_ms()
    local T, err = waiter:commit({ _id = "held" })
    local waited = (mongotx.core.monotonic_ms() - t0) / 1000
    assert.is_nil(T)
    assert.are.equal("in_progress", err.code, tostring(err))
    assert.are.equal("held", err.id)
    assert.truthy(err.message:find("holder_wait", 1, true), err.message)
    assert.is_true(waited >= 1 and waited < 5, "waited " .. waited .. " s")
    helpers.assert_dump_unchanged(before, db.client, db.name)
    -- its holder finishes it; the waiter's retry then answers done
    assert.are.equal("done", assert(holder:commit(t)).state)
    assert.are.equal("done", assert(waiter:commit({ _id = "held" })).state)
    assert.are.same({ A = 990, B = 10 }, (helpers.balances(accounts)))
  end)
end)

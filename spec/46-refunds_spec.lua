-- Refunds (tm:compensate) under the contract of issue 40: every floor
-- form of docs/guards.md is kept ($gt, $gte, inside $and), racing refused
-- refunds answer one code, and a refused refund costs the same reads on
-- its thousandth attempt as on its first.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

describe("#server refunds", function()
  local db, accounts, txs, tm

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many { { _id = "A", balance = 100 }, { _id = "B", balance = 0 },
                                  { _id = "C", balance = 0 } })
    tm = assert(db:manager {})
  end)
  after_each(function() db:close() end)

  local function balances() return (helpers.balances(accounts)) end
  local function inc(id, n, where)
    return { collection = "accounts", id = id, update = { ["$inc"] = { balance = n } },
             where = where }
  end

  -- A pays B 50 under `where`, B spends 40: a refund would take B to -40
  local floors = {
    ["$gt"] = { balance = { ["$gt"] = 60 } },
    ["$gte inside $and"] = { ["$and"] = { { balance = { ["$gte"] = 60 } },
                                          { balance = { ["$lte"] = 1000 } } } },
    ["$gt inside $and"] = { ["$and"] = { { balance = { ["$gt"] = 60 } } } },
  }
  for name, where in pairs(floors) do
    it("keeps a " .. name .. " floor", function()
      local T = assert(tm:run({ inc("A", -50, where), inc("B", 50) }, { id = "pay" }))
      assert(tm:transfer("accounts", "B", "C", 40, { min = 0 }))
      local C, err = tm:compensate(T)
      assert.is_nil(C)
      assert.are.same({ "guard", "guard" }, { err.code, err.cause })
      assert.are.same({ A = 50, B = 10, C = 40 }, balances())
      -- once B keeps A's floor (10) after the refund, it goes through
      assert(accounts:update_one({ _id = "B" }, { ["$inc"] = { balance = 51 } }))
      C = assert(tm:compensate(T))
      assert.are.equal("done", C.state)
      assert.are.same({ A = 100, B = 11, C = 40 }, balances())
    end)
  end

  it("a $gt floor stays strict: B may not go down to it", function()
    local T = assert(tm:run({ inc("A", -50, { balance = { ["$gt"] = 60 } }), inc("B", 50) }))
    -- A's debit kept A > 10: B, refunding 50, must keep more than 10 + 50
    assert(accounts:update_one({ _id = "B" }, { ["$set"] = { balance = 60 } }))
    local _, err = tm:compensate(T)
    assert.are.equal("guard", err.code)
    assert(accounts:update_one({ _id = "B" }, { ["$set"] = { balance = 61 } }))
    assert.are.equal("done", assert(tm:compensate(T)).state)
    assert.are.equal(11, assert(accounts:find_one({ _id = "B" })).balance)
  end)

  it("racing refused refunds all answer guard", function()
    local concurrency = helpers.no_concurrency()
    if concurrency then return pending(concurrency) end
    assert(tm:transfer("accounts", "A", "B", 30, { min = 0, id = "pay" }))
    assert(tm:transfer("accounts", "B", "C", 20, { min = 0 }))
    local start = os.tmpname()
    os.remove(start)
    local procs = {}
    for i = 1, 6 do
      local pid, out, script = helpers.spawn_script([[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local core = require "mongotx.core"
local uri, dbname, name, start = arg[1], arg[2], arg[3], arg[4]
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = name })
while not io.open(start) do core.sleep(0.002) end
for _ = 1, 10 do
  local C, err = tm:compensate({ _id = "pay" })
  io.write(C and "done/none" or (err.code .. "/" .. tostring(err.cause)), " ")
end
print("end")
]], helpers.uri(), db.name, "p" .. i, start)
      procs[i] = { pid = pid, out = out, script = script }
    end
    assert(io.open(start, "w")):close()
    local codes = {}
    for _, p in ipairs(procs) do
      local output = helpers.script_output(p.pid, p.out, p.script, 60)
      assert.truthy(output:find("end"), output)
      -- (code/cause words only: a library may warn on the same output)
      for code in output:gmatch("(%l+/%l+) ") do codes[code] = (codes[code] or 0) + 1 end
    end
    os.remove(start)
    assert.are.same({ ["guard/guard"] = 60 }, codes)
    assert.are.equal(0, txs:count({ compensates = "pay", state = { ["$ne"] = "cancelled" } }))
    assert.are.same({ A = 70, B = 10, C = 20 }, balances())
  end)

  it("a refused refund costs the same on its 60th attempt as on its second", function()
    local T = assert(tm:transfer("accounts", "A", "B", 30, { min = 0, id = "pay" }))
    assert(tm:transfer("accounts", "B", "C", 20, { min = 0 }))
    local function cost()
      db.client:reset_counters()
      local _, err = tm:compensate(T)
      assert.are.equal("guard", err.code)
      return db.client:counters().commands, db.client:returned()
    end
    cost() -- the first reads no attempt before it
    local commands, returned = cost()
    for _ = 3, 59 do cost() end
    local commands60, returned60 = cost()
    assert.are.same({ commands, returned }, { commands60, returned60 })
    assert.are.equal(60, txs:count({ compensates = "pay", state = "cancelled" }))
    assert.are.equal(60, assert(txs:find_one({ _id = "pay" })).compensations)
    assert.are.same({ A = 70, B = 10, C = 20 }, balances())
  end)
end)

-- A compensation (a refund) keeps the floors of the debits it undoes, a
-- refused one can be tried again, and of a transaction's compensations at
-- most one ends done, however many callers race (issue 34, item 2).
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local manager = require "mongotx.manager"

describe("#server compensate", function()
  local db, accounts, txs, tm

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many { { _id = "A", balance = 100 }, { _id = "B", balance = 0 },
                                  { _id = "C", balance = 0 } })
    tm = assert(db:manager {})
  end)

  local function balances() return (helpers.balances(accounts)) end

  -- B spends what A paid it: a refund of A's transfer would overdraw B
  local function paid_and_spent()
    local T = assert(tm:transfer("accounts", "A", "B", 30, { min = 0, id = "pay" }))
    assert(tm:transfer("accounts", "B", "C", 20, { min = 0 }))
    assert.are.same({ A = 70, B = 10, C = 20 }, balances())
    return T
  end

  it("keeps a transfer's min on the account it now debits", function()
    local T = paid_and_spent()
    local C, err = tm:compensate(T)
    assert.is_nil(C)
    assert.are.same({ "guard", "guard" }, { err.code, err.cause })
    assert.are.same({ A = 70, B = 10, C = 20 }, balances())
    local stored = assert(tm:get(manager.compensation_id("pay")))
    assert.are.same({ "cancelled", "guard" }, { stored.state, stored.cause })
    assert.are.same({ balance = { ["$gte"] = 30 } }, stored.ops[1].where)
  end)

  it("keeps an op's where floor, the highest of a field's", function()
    local T = assert(tm:run({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -40 } },
        where = { balance = { ["$gte"] = 50 } } }, -- keeps A at 10 or above
      { collection = "accounts", id = "C", update = { ["$inc"] = { balance = -5 } },
        where = { balance = { ["$gte"] = -10 } } }, -- keeps C at -15 or above
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 40 } } },
    }))
    assert(tm:transfer("accounts", "B", "C", 35))
    -- B holds 5: giving back 40 would leave it at -35, below 10 (and -15)
    local _, err = tm:compensate(T)
    assert.are.equal("guard", err.code)
    assert(accounts:update_one({ _id = "B" }, { ["$inc"] = { balance = 44 } }))
    assert.are.equal("guard", select(2, tm:compensate(T)).code) -- 49: 9 would be left, below 10
    assert(accounts:update_one({ _id = "B" }, { ["$inc"] = { balance = 1 } }))
    assert.are.equal("done", assert(tm:compensate(T)).state)
    assert.are.same({ A = 100, B = 10, C = 35 }, balances())
  end)

  it("compensates below the floor when the caller says so (floors = false)", function()
    local T = paid_and_spent()
    local C = assert(tm:compensate(T, { floors = false }))
    assert.are.equal("done", C.state)
    assert.are.same({ A = 100, B = -20, C = 20 }, balances())
    assert.is_nil(assert(tm:get(C._id)).ops[1].where)
  end)

  it("tries again after a refusal, and only one compensation is ever done", function()
    local T = paid_and_spent()
    assert.are.equal("guard", select(2, tm:compensate(T)).code)
    assert.are.equal("guard", select(2, tm:compensate(T)).code) -- refused again, tried again
    assert(accounts:update_one({ _id = "B" }, { ["$inc"] = { balance = 20 } }))
    local C = assert(tm:compensate(T))
    assert.are.equal("done", C.state)
    assert.are.equal(manager.compensation_id("pay", 3), C._id)
    -- again: the done one, nothing new
    local again = assert(tm:compensate(T))
    assert.are.equal(C._id, again._id)
    assert.are.equal(3, txs:count({ compensates = "pay" }))
    assert.are.equal(1, txs:count({ compensates = "pay", state = "done" }))
    assert.are.same({ A = 100, B = 0, C = 20 }, balances())
  end)

  it("two managers compensating at once meet on one attempt", function()
    local T = paid_and_spent()
    assert(accounts:update_one({ _id = "B" }, { ["$inc"] = { balance = 20 } }))
    -- the other manager calls while the first has created its attempt
    -- and before it runs it
    local other_tm, theirs, their_err = assert(db:manager { application = "other" }), nil, nil
    local racing = assert(db:manager { application = "mine", on_event = function(name)
      if name == "compensate" and theirs == nil then
        theirs, their_err = other_tm:compensate(T)
        theirs = theirs or false
      end
    end })
    local mine, err = racing:compensate(T)
    -- whichever ran it, one compensation, done once
    local C = mine or theirs
    assert(C, tostring(err or their_err))
    assert.are.equal("done", C.state)
    assert.are.equal(1, txs:count({ compensates = "pay" }))
    assert.are.equal(1, txs:count({ compensates = "pay", state = "done" }))
    assert.are.same({ A = 100, B = 0, C = 20 }, balances())
  end)

  it("a call that finds its attempt begun meanwhile with other ops drives that one", function()
    local T = paid_and_spent()
    assert(accounts:update_one({ _id = "B" }, { ["$inc"] = { balance = 20 } }))
    local cid = manager.compensation_id("pay")
    local other = assert(db:manager { application = "other" })
    local ops = assert(other.policy.compensation(assert(tm:get("pay")), { floors = false }))
    -- between this call's read of the attempt and its begin, another
    -- caller (floors = false) begins the same attempt
    local get = tm.engine.get
    tm.engine.get = function(self, id)
      local found, err = get(self, id)
      if id == cid and not found and not err then
        assert(other:_begin(ops, { id = cid }, { compensates = "pay" }))
      end
      return found, err
    end
    local C, err = tm:compensate(T)
    tm.engine.get = nil
    assert(C, tostring(err))
    assert.are.same({ cid, "done" }, { C._id, C.state })
    assert.is_nil(assert(tm:get(cid)).ops[1].where) -- the other caller's ops
    assert.are.equal(1, txs:count({ compensates = "pay" }))
    assert.are.same({ A = 100, B = 0, C = 20 }, balances())
  end)

  it("processes racing retries of refused compensations: at most one is done", function()
    local concurrency = helpers.no_concurrency()
    if concurrency then return pending(concurrency) end
    paid_and_spent()
    local start = os.tmpname()
    os.remove(start)
    local procs = {}
    for i = 1, 4 do
      local pid, out, script = helpers.spawn_script([[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local core = require "mongotx.core"
local uri, dbname, name, start = arg[1], arg[2], arg[3], arg[4]
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = name })
while not io.open(start) do core.sleep(0.005) end
for _ = 1, 400 do
  local C, err = tm:compensate({ _id = "pay" })
  if C then print("done " .. C._id) break end
  io.write(err.code, " ")
  core.sleep(0.01)
end
]], helpers.uri(), db.name, "p" .. i, start)
      procs[i] = { pid = pid, out = out, script = script }
    end
    local f = assert(io.open(start, "w"))
    f:close()
    -- a few refusals, then B can pay
    local refused = 0
    for _ = 1, 3000 do
      refused = txs:count({ compensates = "pay", state = "cancelled" })
      if refused >= 4 then break end
      helpers.core.sleep(0.01)
    end
    -- (enough for two refunds: the floor alone would not stop a second)
    assert(accounts:update_one({ _id = "B" }, { ["$inc"] = { balance = 50 } }))
    local ids = {}
    for _, p in ipairs(procs) do
      local output = helpers.script_output(p.pid, p.out, p.script, 60)
      ids[#ids + 1] = output:match("done (%S+)")
      assert(ids[#ids], output)
    end
    os.remove(start)
    for _, id in ipairs(ids) do assert.are.equal(ids[1], id) end
    assert.truthy(refused >= 4, "fewer refusals than wanted before B could pay")
    assert.are.equal(1, txs:count({ compensates = "pay", state = "done" }))
    assert.are.equal(txs:count({ compensates = "pay" }) - 1,
      txs:count({ compensates = "pay", state = "cancelled" }))
    assert.are.same({ A = 100, B = 30, C = 20 }, balances())
  end)

  it("rejects a bad option, writing nothing", function()
    local T = paid_and_spent()
    local before = helpers.db_dump(db.client, db.name)
    assert.has_error(function() tm:compensate(T, { floor = false }) end)
    assert.has_error(function() tm:compensate(T, { floors = "no" }) end)
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end)
end)

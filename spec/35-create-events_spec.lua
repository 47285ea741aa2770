-- Every transaction created emits `create` exactly once, on every path
-- (issue 34, item 4): the events a manager's on_event saw, counted by id,
-- against the transactions the database holds afterwards.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local core = helpers.core

describe("#server create events", function()
  local db, accounts, creates

  -- A manager whose on_event counts `create` by transaction id, as the
  -- metrics do (a create that found the id taken is no create).
  local function manager(opts)
    opts = opts or {}
    opts.on_event = function(name, info)
      if name ~= "create" then return end
      local res = info.result
      if res == false or type(res) == "table" and res.created == false then return end
      local k = tostring(info.id)
      creates[k] = (creates[k] or 0) + 1
    end
    return assert(db:manager(opts))
  end

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    local docs = {}
    for i = 1, 6 do docs[i] = { _id = "A" .. i, balance = 1000 } end
    assert(accounts:insert_many(docs))
    creates = {}
  end)

  -- Every transaction in the database was announced once, and no other.
  local function assert_once_each()
    local want = {}
    for _, T in ipairs(assert(db:collection("transactions"):find_all({}, { limit = 1000 }))) do
      want[tostring(T._id)] = 1
    end
    assert.are.same(want, creates)
    return want
  end

  local function count(t)
    local n = 0
    for _ in pairs(t) do n = n + 1 end
    return n
  end

  local function credit(id, amount)
    return { { collection = "accounts", id = id, update = { ["$inc"] = { balance = amount } } } }
  end

  it("one at a time: begin+commit, run, transfer, stepwise", function()
    local tm = manager()
    assert(tm:commit(assert(tm:begin(credit("A1", 1)))))
    assert(tm:run(credit("A2", 1)))
    assert(tm:transfer("accounts", "A1", "A2", 5, { id = "t-1" }))
    assert(tm:transfer("accounts", "A1", "A2", 5, { id = "t-1" })) -- a retried key
    local T = assert(tm:begin(credit("A3", 1)))
    assert(tm:step("claim", T))
    assert(tm:step("apply", T, 1))
    assert(tm:step("commit", T))
    assert.are.equal(4, count(assert_once_each()))
  end)

  it("batches whose items repeat an earlier key: transfer_many and commit_many", function()
    local tm = manager()
    assert(tm:transfer("accounts", "A1", "A2", 1, { id = "k-1" }))
    local list = { { collection = "accounts", from = "A1", to = "A2", amount = 1, id = "k-1" } }
    for i = 2, 5 do
      list[i] = { collection = "accounts", from = "A" .. i, to = "A6", amount = 1, id = "k-" .. i }
    end
    local results, errs = tm:transfer_many(list)
    for i = 1, 5 do assert(results[i], tostring(errs[i])) end
    assert(tm:commit(assert(tm:begin(credit("A1", 1), { id = "c-1" }))))
    local items = { { ops = credit("A1", 1), id = "c-1" } }
    for i = 2, 5 do items[i] = { ops = credit("A" .. i, 1), id = "c-" .. i } end
    results, errs = tm:commit_many(items)
    for i = 1, 5 do assert(results[i], tostring(errs[i])) end
    assert.are.equal(10, count(assert_once_each()))
  end)

  it("a batch repeating the key of an earlier call left pending by this manager", function()
    -- on_op_failure "fail" leaves a refused transaction pending, epoch 1,
    -- this manager's: the batch must not take it for one it inserted
    local tm = manager { on_op_failure = function() return "fail" end }
    local _, err = tm:transfer("accounts", "A1", "A2", 5000, { id = "p-1", min = 0 })
    assert.are.equal("guard", err.code)
    assert.are.equal("pending", assert(tm:get("p-1")).state)
    local results, errs = tm:transfer_many {
      { collection = "accounts", from = "A1", to = "A2", amount = 5000, id = "p-1", min = 0 },
      { collection = "accounts", from = "A3", to = "A4", amount = 1, id = "p-2" },
    }
    assert.are.equal("guard", errs[1].code)
    assert(results[2], tostring(errs[2]))
    assert.are.equal(2, count(assert_once_each()))
  end)

  it("the same when the clock's estimate stepped back between the two calls", function()
    -- the estimate of the server's clock can step back when it is measured
    -- again; frozen here, both calls stamp the same estimate
    local tm = manager { on_op_failure = function() return "fail" end }
    local clock = tm.engine.server_clock
    local frozen = assert(clock:now())
    clock.now = function() return frozen end
    local _, err = tm:transfer_many {
      { collection = "accounts", from = "A1", to = "A2", amount = 5000, id = "p-1", min = 0 } }
    assert.are.equal("guard", err[1].code)
    local results, errs = tm:transfer_many {
      { collection = "accounts", from = "A1", to = "A2", amount = 5000, id = "p-1", min = 0 },
      { collection = "accounts", from = "A3", to = "A4", amount = 1, id = "p-2" },
    }
    assert.are.equal("guard", errs[1].code)
    assert(results[2], tostring(errs[2]))
    assert.are.equal("pending", assert(tm:get("p-1")).state)
    assert.are.equal(2, count(assert_once_each()))
  end)

  it("group commit (run_calls), each and recovery of a begun transaction", function()
    local tm = manager()
    assert(tm:transfer("accounts", "A1", "A2", 1, { id = "g-1" }))
    local calls = {}
    for i = 1, 4 do
      calls[i] = { method = "transfer", n = 5, "accounts", "A" .. i, "A6", 1, { id = "g-" .. i } }
    end
    calls[5] = { method = "run", n = 1, credit("A5", 1) }
    local out = assert(tm:run_calls(calls, 0))
    assert.are.equal(5, #out)
    local report = assert(tm:each({ 1, 2, 3 }, function(i) return credit("A" .. i, 1) end,
      { id = "job", key = function(i) return i end, batch = 2 }))
    assert.are.equal(3, report.committed)
    -- begun, never run: recovery runs it once it is stale
    local owner = manager { application = "gone", lease = 1, stale_after = 1 }
    local T = assert(owner:begin(credit("A4", 1), { id = "r-1" }))
    core.sleep(1.2)
    local recoverer = manager { application = "gone", lease = 1, stale_after = 1 }
    local r = assert(recoverer:recover())
    assert.are.equal(1, r.done)
    assert.are.equal("done", assert(tm:get(T._id)).state)
    assert.are.equal(9, count(assert_once_each()))
  end)
end)

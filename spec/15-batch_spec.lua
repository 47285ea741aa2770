-- Transactions run at once (tm:run, tm:transfer, tm:commit_many,
-- tm:transfer_many): created pending and owned, applied with one bulk
-- write per collection, committed with one update, finished inline or by
-- the deferred finisher; round trips counted by the client.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local deadline_reason = helpers.no_deadlines()

describe("#server transactions run at once", function()
  local db, accounts

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    local docs = {}
    for i = 1, 10 do docs[i] = { _id = "A" .. i, balance = 1000 } end
    assert(accounts:insert_many(docs))
  end)

  local function balances() return helpers.balances(accounts) end

  local function states(tm)
    local s = assert(tm:stats())
    s.parked = nil
    for k, v in pairs(s) do if v == 0 then s[k] = nil end end
    return s
  end

  -- Round trips of fn() after a first transfer has learnt the server's
  -- clock and what it supports.
  local function round_trips(tm, fn)
    assert(tm:transfer("accounts", "A9", "A10", 1))
    db.client:reset_counters()
    local a, b = fn()
    return db.client:counters().commands, a, b
  end

  describe("a single transfer", function()
    it("commits in 3 round trips and finishes later with deferred finishing", function()
      if deadline_reason then return pending(deadline_reason) end
      local tm = assert(db:manager { finish = "deferred" })
      local n, T = round_trips(tm, function() return tm:transfer("accounts", "A1", "A2", 100) end)
      assert.are.equal(3, n)
      assert.are.equal("applied", T.state)
      local stored = assert(tm:get(T._id))
      assert.are.equal("applied", stored.state)
      assert.are.equal("date", mongotx.core.type(stored.deadline))
      assert.are.same({ "A1", "A2", 100 }, { stored.source, stored.destination, stored.value })
      local doc = assert(accounts:find_one({ _id = "A1" }))
      assert.are.equal(900, doc.balance)
      assert.are.same({ T._id }, doc.pendingTransactions)

      assert.are.equal(2, assert(tm:finish()))
      assert.are.same({ done = 2 }, states(tm))
      local b, sum = balances()
      assert.are.same({ 900, 1100 }, { b.A1, b.A2 })
      assert.are.equal(10000, sum)
      assert.are.equal(0, assert(tm:finish()), "nothing left to finish")
    end)

    it("finishes before returning by default: 5 round trips, done", function()
      if deadline_reason then return pending(deadline_reason) end
      local tm = assert(db:manager {})
      local n, T = round_trips(tm, function() return tm:transfer("accounts", "A1", "A2", 100) end)
      assert.are.equal(5, n)
      assert.are.equal("done", T.state)
      assert.are.same({ done = 2 }, states(tm))
      local b = balances()
      assert.are.same({ 900, 1100 }, { b.A1, b.A2 })
    end)

    it("reads versions first where deadlines are off: one more round trip", function()
      local tm = assert(db:manager { fencing = "version", finish = "deferred" })
      local n, T = round_trips(tm, function() return tm:transfer("accounts", "A1", "A2", 100) end)
      assert.are.equal(4, n)
      assert.is_nil(assert(tm:get(T._id)).deadline)
      assert(tm:finish())
      local b, sum = balances()
      assert.are.same({ 900, 1100 }, { b.A1, b.A2 })
      assert.are.equal(10000, sum)
    end)

    it("tm:run takes ops over several collections", function()
      local tm = assert(db:manager {})
      local T = assert(tm:run({
        { collection = "accounts", id = "A1", update = { ["$inc"] = { balance = -5 } } },
        { collection = "orders", id = "o1", kind = "insert", doc = { item = "pen" } },
      }))
      assert.are.equal("done", T.state)
      assert.are.equal(995, assert(accounts:find_one({ _id = "A1" })).balance)
      local order = assert(db:collection("orders"):find_one({ _id = "o1" }))
      assert.are.equal("pen", order.item)
      assert.are.same({}, order.pendingTransactions)
    end)

    it("a guard that fails cancels it with every document as it was", function()
      local tm = assert(db:manager {})
      local T, err = tm:transfer("accounts", "A1", "A2", 5000, { min = 0 })
      assert.is_nil(T)
      assert.are.equal("guard", err.code)
      assert.are.same({ cancelled = 1 }, states(tm))
      local b, sum = balances()
      assert.are.same({ 1000, 1000 }, { b.A1, b.A2 })
      assert.are.equal(10000, sum)
    end)

    it("an overdraft floor below zero lets the balance go negative down to it", function()
      local tm = assert(db:manager {})
      assert(tm:transfer("accounts", "A1", "A2", 1200, { min = -500 }))
      local T, err = tm:transfer("accounts", "A1", "A2", 400, { min = -500 })
      assert.is_nil(T)
      assert.are.equal("guard", err.code)
      local b = balances()
      assert.are.same({ -200, 2200 }, { b.A1, b.A2 })
    end)

    it("repeating an id returns the first outcome; other ops are refused", function()
      local tm = assert(db:manager {})
      local first = assert(tm:transfer("accounts", "A1", "A2", 10, { id = "pay-1" }))
      local again = assert(tm:transfer("accounts", "A1", "A2", 10, { id = "pay-1" }))
      assert.are.equal(first._id, again._id)
      assert.are.equal("done", again.state)
      local T, err = tm:transfer("accounts", "A1", "A3", 10, { id = "pay-1" })
      assert.is_nil(T)
      assert.are.equal("idempotency", err.code)
      local b = balances()
      assert.are.same({ 990, 1010, 1000 }, { b.A1, b.A2, b.A3 })
    end)
  end)

  -- DocumentDB (FerretDB v2) evaluates $$NOW in a find or a count but
  -- refuses it in update and findAndModify (code 9) unless
  -- documentdb.enableVariablesSupportForWriteCommands is on;
  -- core.refuse_now makes this process's single writes refuse it the same
  -- way (csrc/fault.c), on any server.
  describe("a server that refuses $$NOW in writes", function()
    after_each(function() mongotx.core.refuse_now(false) end)

    it("is asked with a write, and gets fencing by versions: nothing fails", function()
      mongotx.core.refuse_now(true)
      -- the stand-in refuses what the server would
      local _, refused = db:collection("transactions"):update_one(
        { ["$expr"] = { ["$lt"] = { "$$NOW", mongotx.Date(0) } } }, { ["$set"] = { x = 1 } })
      assert.are.equal(9, refused.server_code)
      if not deadline_reason then -- and reads it as the server would
        assert.are.equal(1, accounts:count({ ["$expr"] = { ["$lt"] = { mongotx.Date(0), "$$NOW" } },
                                             _id = "A1" }))
      end
      local tm = assert(db:manager {})
      local T = assert(tm:begin({
        { collection = "accounts", id = "A1", update = { ["$inc"] = { balance = -100 } } },
        { collection = "accounts", id = "A2", update = { ["$inc"] = { balance = 100 } } },
      }))
      assert.are.equal("done", assert(tm:commit(T)).state)
      local stored = assert(tm:get(T._id))
      assert.are.same({ "done", nil }, { stored.state, stored.deadline })
      assert(tm:transfer("accounts", "A3", "A4", 50))
      local b, sum = balances()
      assert.are.same({ 900, 1100, 950, 1050 }, { b.A1, b.A2, b.A3, b.A4 })
      assert.are.equal(10000, sum)
      assert.are.equal(0, accounts:count({ ["pendingTransactions.0"] = { ["$exists"] = true } }))
    end)

    it("fails at the first apply when told to fence by deadline", function()
      if deadline_reason then return pending(deadline_reason) end
      mongotx.core.refuse_now(true)
      local tm = assert(db:manager { fencing = "deadline" })
      local T = assert(tm:begin({
        { collection = "accounts", id = "A1", update = { ["$inc"] = { balance = -100 } } },
      }))
      local ok, err = tm:commit(T)
      assert.is_nil(ok)
      assert.are.equal(9, err.server_code)
      assert.are.equal(1000, assert(accounts:find_one({ _id = "A1" })).balance)
    end)
  end)

  describe("ops that collide", function()
    it("an insert whose _id is taken cancels, the document untouched", function()
      local tm = assert(db:manager {})
      local T, err = tm:run({
        { collection = "accounts", id = "A1", update = { ["$inc"] = { balance = -5 } } },
        { collection = "accounts", id = "A2", kind = "insert", doc = { balance = 5 } },
      })
      assert.is_nil(T)
      assert.are.equal("conflict", err.code)
      assert.are.same({ cancelled = 1 }, states(tm))
      local b = balances()
      assert.are.same({ 1000, 1000 }, { b.A1, b.A2 })
    end)

    it("a document another open transaction removes takes no other op", function()
      local tm = assert(db:manager {})
      local first = assert(tm:begin { { collection = "accounts", id = "A3", kind = "remove" } })
      assert(tm:step("claim", first))
      assert(tm:step("apply", first, 1))
      local marked = assert(accounts:find_one({ _id = "A3" }))
      assert.are.equal(first._id, marked.txRemoving)

      for _, op in ipairs {
        { collection = "accounts", id = "A3", kind = "remove" },
        { collection = "accounts", id = "A3", update = { ["$inc"] = { balance = 1 } } },
      } do
        local T, err = tm:run({ op })
        assert.is_nil(T)
        assert.are.equal("removing", err.code)
      end
      assert(tm:commit(first))
      assert.is_nil(accounts:find_one({ _id = "A3" }))
      assert.are.same({ done = 1, cancelled = 2 }, states(tm))
    end)

    it("a remove rolled back clears its mark", function()
      local tm = assert(db:manager {})
      local t = assert(tm:begin { { collection = "accounts", id = "A3", kind = "remove" } })
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      assert(tm:rollback(t))
      local doc = assert(accounts:find_one({ _id = "A3" }))
      assert.is_nil(doc.txRemoving)
      assert(tm:transfer("accounts", "A3", "A4", 1))
    end)
  end)

  describe("batches", function()
    local function ring(n, amount)
      local list = {}
      for i = 1, n do
        list[i] = { collection = "accounts", from = "A" .. (i % 10 + 1),
                    to = "A" .. ((i + 3) % 10 + 1), amount = amount, min = 0 }
      end
      return list
    end

    it("transfer_many: 100 transfers, one round trip per step", function()
      if deadline_reason then return pending(deadline_reason) end
      local tm = assert(db:manager {})
      local n, results, errs = round_trips(tm, function() return tm:transfer_many(ring(100, 1)) end)
      -- create, the guarded debits, the credits, commit, finish, done
      -- (a batch applies its guarded ops first: README, "Guards")
      assert.are.equal(6, n)
      for i = 1, 100 do
        assert.is_false(errs[i])
        assert.are.equal("done", results[i].state)
      end
      assert.are.same({ done = 101 }, states(tm))
      local _, sum = balances()
      assert.are.equal(10000, sum)
    end)

    it("transfer_many gives the same balances on every server", function()
      local tm = assert(db:manager {})
      local results = tm:transfer_many(ring(40, 7))
      for i = 1, 40 do assert.are.equal("done", results[i].state) end
      local b, sum = balances()
      assert.are.equal(10000, sum)
      -- each account sends 4 and receives 4 transfers of 7
      for i = 1, 10 do assert.are.equal(1000, b["A" .. i]) end
    end)

    it("finishes each op in its own collection, where two collections share ids", function()
      -- finish_many reads a collection's ops from the transactions: an op
      -- sent to the other collection would match a document of the same id
      -- there, or nothing
      local savings = db:collection("savings")
      local docs = {}
      for i = 1, 10 do docs[i] = { _id = "A" .. i, balance = 50 } end
      assert(savings:insert_many(docs))
      local tm = assert(db:manager {})
      local list = {}
      for i = 1, 10 do
        list[i] = {
          { collection = "accounts", id = "A" .. i, update = { ["$inc"] = { balance = -i } } },
          { collection = "savings", id = "A" .. i, update = { ["$inc"] = { balance = i } } },
        }
      end
      db.client:reset_counters()
      local results, errs = tm:commit_many(list)
      for i = 1, 10 do
        assert.is_false(errs[i])
        assert.are.equal("done", results[i].state)
      end
      -- the $$NOW probe (two updates, once per manager), 10 creates, 20
      -- applies, the commit, 20 finishes (one per op, each sent to its own
      -- collection once), done
      assert.are.equal(54, db.client:counters().writes)
      assert.are.same({ done = 10 }, states(tm))
      for _, c in ipairs { { accounts, 1000, -1 }, { savings, 50, 1 } } do
        for _, doc in ipairs(helpers.dump(c[1])) do
          local i = tonumber(doc._id:sub(2))
          assert.are.equal(c[2] + c[3] * i, doc.balance)
          assert.are.same({}, doc.pendingTransactions, doc._id)
          assert.are.equal(2, doc.txVersion, doc._id) -- the apply's and the finish's
        end
      end
    end)

    it("an op that cannot apply cancels only its own transaction", function()
      local tm = assert(db:manager {})
      local results, errs = tm:transfer_many {
        { collection = "accounts", from = "A1", to = "A2", amount = 10 },
        { collection = "accounts", from = "A3", to = "A4", amount = 5000, min = 0 },
        { collection = "accounts", from = "A5", to = "nobody", amount = 10 },
        { collection = "accounts", from = "A6", to = "A7", amount = 10 },
      }
      assert.are.equal("done", results[1].state)
      assert.are.equal("done", results[4].state)
      assert.is_false(results[2])
      assert.are.equal("guard", errs[2].code)
      assert.is_false(results[3])
      assert.are.equal("missing", errs[3].code)
      assert.are.same({ done = 2, cancelled = 2 }, states(tm))
      local b, sum = balances()
      assert.are.same({ 990, 1010, 1000, 1000, 1000, 990, 1010 },
        { b.A1, b.A2, b.A3, b.A4, b.A5, b.A6, b.A7 })
      assert.are.equal(10000, sum)
    end)

    it("a bad item gets its error and nothing written; the rest run", function()
      local tm = assert(db:manager {})
      local results, errs = tm:commit_many {
        { { collection = "accounts", id = "A1", update = { ["$inc"] = { balance = -1 } } } },
        { ops = { { collection = "accounts", id = "A2", update = { balance = 0 } } } },
        { ops = { { collection = "accounts", id = "A3", update = { ["$inc"] = { balance = 1 } } } },
          id = "k1" },
        { ops = { { collection = "accounts", id = "A4", update = { ["$inc"] = { balance = 1 } } } },
          id = "k1" },
      }
      assert.are.equal("done", results[1].state)
      assert.is_false(results[2])
      assert.are.equal("invalid", errs[2].code)
      assert.are.equal("done", results[3].state)
      assert.is_false(results[4])
      assert.matches("repeats the id of item 3", errs[4].message)
      assert.are.same({ done = 2 }, states(tm))
      local b = balances()
      assert.are.same({ 999, 1000, 1001, 1000 }, { b.A1, b.A2, b.A3, b.A4 })
    end)

    it("refuses what is not a list, or unknown keys, before writing", function()
      local tm = assert(db:manager {})
      assert.has_error(function() tm:commit_many("x") end, "commit_many takes a list")
      assert.has_error(function() tm:transfer_many { { collection = "accounts", from = "A1",
        to = "A2", amount = 1, colour = "red" } } end)
      assert.are.same({}, states(tm))
    end)

    it("a batch over 100 runs as batches of 100, each item keeping its own outcome", function()
      if deadline_reason then return pending(deadline_reason) end
      local tm = assert(db:manager {})
      -- three batches of the six round trips each (mongotx.manager.batches.run_batch)
      local n, results = round_trips(tm, function() return tm:transfer_many(ring(250, 1)) end)
      assert.are.equal(18, n)
      for i = 1, 250 do assert.are.equal("done", results[i].state) end
      -- items that fail, in every batch and across their edges: each
      -- result sits at its own index, the others ran
      local list = ring(250, 2)
      list[100].to = "nobody"       -- last of the first batch
      list[101].amount = -1         -- first of the second: invalid, left out
      list[150].amount = 5000       -- its guard (min = 0) fails
      list[201].from = { ["$gt"] = "" }
      local errs
      results, errs = tm:transfer_many(list)
      local expected = { [100] = "missing", [101] = "invalid", [150] = "guard", [201] = "invalid" }
      local moved = { A9 = -1, A10 = 1 } -- round_trips' first transfer
      for i = 1, 250 do
        if expected[i] then
          assert.is_false(results[i], i)
          assert.are.equal(expected[i], errs[i].code, i)
        else
          assert.is_false(errs[i], i)
          assert.are.equal("done", results[i].state, i)
          assert.are.same({ list[i].from, list[i].to }, { results[i].source, results[i].destination })
          moved[list[i].from] = (moved[list[i].from] or 0) - 2
          moved[list[i].to] = (moved[list[i].to] or 0) + 2
        end
      end
      assert.are.same({ done = 251 + 246, cancelled = 2 }, states(tm))
      local b, sum = balances()
      for i = 1, 10 do
        local id = "A" .. i
        assert.are.equal(1000 + (moved[id] or 0), b[id], id)
      end
      assert.are.equal(10000, sum)
    end)

    it("the deferred finisher runs by itself every finish_batch commits", function()
      local tm = assert(db:manager { finish = "deferred", finish_batch = 10 })
      local results = tm:transfer_many(ring(6, 1))
      assert.are.equal("applied", results[1].state)
      assert.are.same({ applied = 6 }, states(tm))
      tm:transfer_many(ring(6, 1))
      assert.are.same({ done = 12 }, states(tm))
      local _, sum = balances()
      assert.are.equal(10000, sum)
    end)
  end)

  describe("#concurrency fencing by deadline", function()
    if deadline_reason then
      it("needs $$NOW", function() pending(deadline_reason) end)
      return
    end

    it("nobody claims a transaction before its deadline", function()
      local rescuer = assert(db:manager { application = "rescuer", stale_after = 0, lease = 0 })
      local report
      local tm = assert(db:manager { application = "slow", lease = 30, stale_after = 0,
        on_event = function(name)
          if name == "apply" and not report then report = assert(rescuer:recover()) end
        end })
      local T = assert(tm:transfer("accounts", "A1", "A2", 100))
      assert.are.equal(1, report.examined)
      assert.are.equal(1, report.skipped)
      assert.are.equal("done", T.state)
      local b = balances()
      assert.are.same({ 900, 1100 }, { b.A1, b.A2 })
    end)

    it("a creator whose deadline passed cannot apply after a takeover", function()
      local rescuer = assert(db:manager { application = "rescuer", stale_after = 0, lease = 0 })
      local report
      local tm = assert(db:manager { application = "slow", lease = 1, stale_after = 1,
        on_event = function(name)
          -- the transaction exists, pending; its applies are prepared
          if name == "create" and not report then
            mongotx.core.sleep(1.2)
            report = assert(rescuer:recover())
          end
        end })
      local T = assert(tm:transfer("accounts", "A1", "A2", 100))
      assert.are.equal(1, report.done, "the rescuer took it over and finished it")
      assert.are.equal("done", T.state)
      local b, sum = balances()
      assert.are.same({ 900, 1100 }, { b.A1, b.A2 }, "applied exactly once")
      assert.are.equal(10000, sum)
    end)
  end)
end)

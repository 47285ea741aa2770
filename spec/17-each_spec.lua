-- Resumable batch jobs: tm:each over a list and over a cursor, a re-run
-- of a finished job (nothing written), re-runs of a job killed at its
-- crash points and by kill -9 at a random moment (every account paid
-- exactly once, checked account by account), the killed run's
-- transactions still held when the re-run comes, and bad input (nothing
-- of the bad batch written, the batches before it committed).
-- examples/06-batch-job.lua is the job the child processes run
-- (spec/support/interest_job.lua).
local helpers = require "spec.helpers"
local job = require "spec.support.interest_job"
local mongotx = require "mongotx"

describe("#server tm:each", function()
  local db, name, accounts, tm

  before_each(function()
    name = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = name }))
    accounts = db:collection("accounts")
    tm = assert(db:manager { application = "job", lease = 1, stale_after = 1 })
  end)

  local function dump() return helpers.db_dump(db.client, name) end

  -- The job's transactions: state by id.
  local function states()
    local out = {}
    for _, T in ipairs(assert(tm:find({}))) do out[T._id] = T.state end
    return out
  end

  -- A credit of `amount` on account `id`.
  local function credit(id, amount)
    return { { collection = "accounts", id = id, update = { ["$inc"] = { balance = amount } } } }
  end

  local function balance(id) return assert(accounts:find_one({ _id = id })).balance end

  describe("over a list", function()
    it("commits one transaction per item under <job>/<key>, leaves out what fn declines", function()
      for i = 1, 5 do assert(accounts:insert_one { _id = i, balance = 100 }) end
      local items = {}
      for i = 1, 5 do items[i] = { account = i, amount = (i == 3) and 0 or i * 10 } end
      local seen = {}
      local report = assert(tm:each(items, function(item)
        if item.amount == 0 then return nil end
        return credit(item.account, item.amount), { account = item.account }
      end, { id = "pay", key = function(item) return item.account end, batch = 2,
             progress = function(r) seen[#seen + 1] = r.items end }))
      assert.are.same({ 2, 4, 5 }, seen)
      assert.are.same({ 5, 3, 4, 0, 1, 0, 0, 0 }, { report.items, report.batches, report.committed,
        report.skipped, report.excluded, report.recovered, report.cancelled, report.failed })
      assert.are.same({ 110, 120, 100, 140, 150 }, { balance(1), balance(2), balance(3),
        balance(4), balance(5) })
      assert.are.same({ ["pay/i1"] = "done", ["pay/i2"] = "done", ["pay/i4"] = "done",
                        ["pay/i5"] = "done" }, states())
      assert.are.same({ account = 4 }, assert(tm:get("pay/i4")).meta)
      assert.are.same({}, assert(accounts:find_one({ _id = 4 })).pendingTransactions)
    end)

    it("keeps 1 and \"1\" apart in ids, and a cancelled item says why, also on a re-run", function()
      assert(accounts:insert_many { { _id = 1, balance = 10 }, { _id = "1", balance = 10 } })
      local function debit(item)
        return { { collection = "accounts", id = item.id, update = { ["$inc"] = { balance = -item.n } },
                   where = { balance = { ["$gte"] = item.n } } } }
      end
      local opts = { id = "fee", key = function(item) return item.id end }
      local items = { { id = 1, n = 5 }, { id = "1", n = 50 } }
      local report = assert(tm:each(items, debit, opts))
      assert.are.same({ 1, 1 }, { report.committed, report.cancelled })
      assert.are.equal("1", report.cancellations[1].key)
      assert.are.equal("fee/s1:1", report.cancellations[1].id)
      assert.are.equal("guard", report.cancellations[1].cause)
      assert.matches("where condition is false", report.cancellations[1].reason)
      assert.is_false(report.cancellations[1].earlier)
      assert.are.same({ ["fee/i1"] = "done", ["fee/s1:1"] = "cancelled" }, states())
      assert.are.same({ 5, 10 }, { balance(1), balance("1") })

      local before = dump()
      report = assert(tm:each(items, debit, opts))
      assert.are.same({ 0, 1, 1 }, { report.committed, report.skipped, report.cancelled })
      assert.is_true(report.cancellations[1].earlier)
      helpers.assert_dump_unchanged(before, db.client, name)
    end)
  end)

  describe("over a cursor", function()
    local N = 60

    local function interest(account)
      local due = job.interest(account._id)
      if due == 0 then return nil end
      return { { collection = "accounts", id = account._id,
                 update = { ["$inc"] = { balance = due }, ["$set"] = { lastInterest = "m1" } },
                 undo = { ["$inc"] = { balance = -due }, ["$unset"] = { lastInterest = "" } },
                 where = { lastInterest = { ["$ne"] = "m1" } } } }
    end

    local function run(count)
      local cursor = accounts:find({}, { sort = { _id = 1 } })
      local report, err = tm:each(cursor, function(a)
        count.calls = count.calls + 1
        return interest(a)
      end, { id = "m1", key = function(a) return a._id end, batch = 25 })
      cursor:close()
      return report, err
    end

    it("pays every account once; a re-run writes nothing, calls fn only for what it left out", function()
      job.create(accounts, N)
      local due = job.due(N)
      assert.is_true(due < N, "some accounts are due nothing")
      local count = { calls = 0 }
      local report = assert(run(count))
      assert.are.same({ N, 3, due, 0, N - due }, { report.items, report.batches, report.committed,
        report.skipped, report.excluded })
      assert.are.equal(N, count.calls)
      local bad, paid = job.check(accounts, N, "m1", true)
      assert.are.same({}, bad)
      assert.are.equal(due, paid)

      local before = dump()
      count.calls = 0
      report = assert(run(count))
      assert.are.same({ N, 0, due, N - due, 0, 0 }, { report.items, report.committed, report.skipped,
        report.excluded, report.cancelled, report.failed })
      assert.are.equal(N - due, count.calls, "fn is not called for what an earlier run did")
      helpers.assert_dump_unchanged(before, db.client, name)
    end)
  end)

  describe("bad input", function()
    local items
    before_each(function()
      items = {}
      for i = 1, 4 do
        assert(accounts:insert_one { _id = i, balance = 100 })
        items[i] = { account = i }
      end
    end)

    local function pay(item) return credit(item.account, 1) end
    local function by_account(item) return item.account end

    it("raises for misuse, before anything is written", function()
      local before = dump()
      local opts = { id = "j", key = by_account }
      assert.has_error(function() tm:each(items, "pay", opts) end,
        "each: fn must be a function, not a string")
      local _, where = pcall(function() tm:each(items, pay, { id = "j", key = by_account, size = 1 }) end)
      assert.matches("17%-each_spec%.lua:%d+: unknown option size for each", where,
        "the caller's line is named")
      _, where = pcall(function() tm:each(items, function() return "x" end, opts) end)
      assert.matches("17%-each_spec%.lua:%d+: each: fn returned", where)
      assert.has_error(function() tm:each(items, pay, { id = "j" }) end,
        "each: option key (a function) is required")
      assert.has_error(function() tm:each(items, pay, { id = 7, key = by_account }) end,
        "each: option id (the job's id) must be a string, not number")
      assert.has_error(function() tm:each(items, pay, { id = "j", key = by_account, batch = "9" }) end,
        "option batch of each must be a number, not string")
      assert.has_error(function() tm:each(items, pay, { id = "j", key = by_account, size = 1 }) end,
        "unknown option size for each")
      assert.has_error(function() tm:each(42, pay, opts) end,
        "each takes a list or a cursor, not a number")
      assert.has_error(function() tm:each(items, function() return "x" end, opts) end,
        "each: fn returned a string for item 1, not a list of ops or nil")
      helpers.assert_dump_unchanged(before, db.client, name)
    end)

    it("returns invalid for a bad batch size or job id, writing nothing", function()
      local before = dump()
      for _, batch in ipairs { 0, 1.5, -1, 0 / 0, 100001 } do
        local report, err = tm:each(items, pay, { id = "j", key = by_account, batch = batch })
        assert.is_nil(report)
        assert.are.equal("invalid", err.code)
        assert.matches("option batch of each must be a whole number from 1 to 100000", err.message)
      end
      local report, err = tm:each(items, pay, { id = "", key = by_account })
      assert.is_nil(report)
      assert.are.equal("invalid", err.code)
      helpers.assert_dump_unchanged(before, db.client, name)
    end)

    -- Items 1 and 2 form the first batch; item 3 or 4 is bad.  The first
    -- batch stays committed, nothing of the second is written.
    local function second_batch_refused(key, fn, message)
      local report, err = tm:each(items, fn or pay, { id = "j", key = key or by_account, batch = 2 })
      assert.is_nil(report)
      assert.are.equal("invalid", err.code)
      assert.matches(message, err.message)
      assert.are.same({ 2, 1 }, { err.report.committed, err.report.batches })
      assert.are.same({ 101, 101, 100, 100 }, { balance(1), balance(2), balance(3), balance(4) })
      assert.are.same({ ["j/i1"] = "done", ["j/i2"] = "done" }, states())
    end

    it("a key that is a table, nil, NaN or a repeat", function()
      second_batch_refused(function(item) return item.account == 3 and { 3 } or item.account end,
        nil, "each: item 3: the key must be a string or a finite number, not a table")
      tm.tx:drop(); accounts:drop()
      for i = 1, 4 do assert(accounts:insert_one { _id = i, balance = 100 }) end
      second_batch_refused(function(item) if item.account ~= 4 then return item.account end end,
        nil, "each: item 4: the key must be a string or a finite number, not nil")
      tm.tx:drop(); accounts:drop()
      for i = 1, 4 do assert(accounts:insert_one { _id = i, balance = 100 }) end
      second_batch_refused(function(item) return item.account == 4 and 0 / 0 or item.account end,
        nil, "each: item 4: the key must be a string or a finite number, not %-?nan")
      tm.tx:drop(); accounts:drop()
      for i = 1, 4 do assert(accounts:insert_one { _id = i, balance = 100 }) end
      second_batch_refused(function(item) return item.account == 4 and 1.0 or item.account end,
        nil, "each: item 4 %(key 1%.?0?%): the key repeats item 1's")
    end)

    it("ops invalid for one item", function()
      second_batch_refused(nil, function(item)
        if item.account == 4 then
          return { { collection = "accounts", id = 4, update = { balance = 1 } } }
        end
        return pay(item)
      end, "each: item 4 %(key 4%): .*operator")
    end)
  end)

  describe("a job killed and run again (examples/06-batch-job.lua)", function()
    local N = 60
    local uri

    before_each(function()
      uri = helpers.uri()
      job.create(accounts, N)
    end)

    -- The job killed by MONGOTX_FAULT at `point`, its leftovers checked,
    -- then run again to the end; returns the second run's report.
    local function crash_and_rerun(point, args)
      local rc, out = job.run(uri, name, "m1", { "--batch", "20", "--lease", "1" },
        { MONGOTX_FAULT = point })
      assert.are_not.equal(0, rc, "the job should have crashed at " .. point .. ":\n" .. out)
      assert.are.same({}, (job.check(accounts, N, "m1", false)))
      local report
      rc, out, report = job.run(uri, name, "m1", args or { "--batch", "20", "--lease", "1" })
      assert.are.equal(0, rc, out)
      assert.are.same({}, (job.check(accounts, N, "m1", true)))
      local due = job.due(N)
      assert.are.equal(due, report.committed + report.skipped)
      assert.are.same({ 0, 0, N - due }, { report.cancelled, report.failed, report.excluded })
      local s = states()
      local n = 0
      for id, state in pairs(s) do
        n = n + 1
        assert.are.equal("done", state, id)
      end
      assert.are.equal(due, n)
      return report
    end

    it("finishes what the crashed run left pending, applied or half finished", function()
      -- the second batch left: pending with nothing applied, pending with
      -- every op applied, applied, applied with its markers pulled
      for _, point in ipairs { "create:after:2", "apply:after:2", "commit:after:2", "finish:after:2" } do
        tm.tx:drop(); accounts:drop()
        job.create(accounts, N)
        local report = crash_and_rerun(point)
        assert.is_true(report.recovered > 0 and report.recovered <= 20, point)
        assert.is_true(report.skipped >= 15, point) -- the first batch at least
      end
    end)

    it("says what the killed run still holds when told not to wait, and waits for it else", function()
      local rc, out = job.run(uri, name, "m1", { "--batch", "20", "--lease", "4" },
        { MONGOTX_FAULT = "apply:after:2" })
      assert.are_not.equal(0, rc, out)
      local report
      rc, out, report = job.run(uri, name, "m1", { "--batch", "20", "--lease", "4", "--wait", "0" })
      assert.are.equal(1, rc, out)
      assert.matches("still held by interest%-job", out)
      assert.is_true(report.failed > 0 and report.failed <= 20, out)
      assert.are.same({}, (job.check(accounts, N, "m1", false)))
      local held = 0
      for _, state in pairs(states()) do if state == "pending" then held = held + 1 end end
      assert.are.equal(report.failed, held)

      rc, out, report = job.run(uri, name, "m1", { "--batch", "20", "--lease", "4" })
      assert.are.equal(0, rc, out)
      assert.are.same({ held, 0 }, { report.recovered, report.failed })
      assert.are.equal(job.due(N), report.committed + report.skipped)
      assert.are.same({}, (job.check(accounts, N, "m1", true)))
    end)

    it("kill -9 at a random moment, then a re-run: every account paid exactly once", function()
      local pid, out = job.start(uri, name, "m1", { "--batch", "2", "--lease", "1" })
      -- a moment after its first transaction, up to when it may have ended
      for _ = 1, 500 do
        if assert(tm.tx:count({})) > 0 then break end
        helpers.core.sleep(0.02)
      end
      local delay = math.random() * 0.5
      helpers.core.sleep(delay)
      helpers.signal(pid, "KILL")
      assert.is_true(helpers.wait_exit(pid, 10))
      os.remove(out)
      local bad, paid = job.check(accounts, N, "m1", false)
      assert.are.same({}, bad)
      local rc, text, report = job.run(uri, name, "m1", { "--batch", "2", "--lease", "1" })
      assert.are.equal(0, rc, text)
      assert.are.same({}, (job.check(accounts, N, "m1", true)))
      assert.are.equal(job.due(N), report.committed + report.skipped)
      assert.is_true(report.skipped >= paid - 2, ("killed %.2f s in with %d paid: %s"):format(
        delay, paid, text))
    end)
  end)

  describe("job ids and keys", function()
    -- Two different (job, key) pairs must never share a transaction id: a
    -- "/" in the job id would let <job>/<key> of one read as another's.
    it("jobs whose ids hold / never take each other's transactions", function()
      assert(accounts:insert_one { _id = 1, balance = 0 })
      local pairs_of = { { "a", "/s1:z" }, { "a/s5:", "z" }, { "a", "/i7" }, { "a/s3:", 7 },
                         { "a/b", "c" }, { "a", "b/c" }, { "a%2F", "x" }, { "a/", "x" } }
      local ids = {}
      for _, p in ipairs(pairs_of) do
        local report = assert(tm:each({ p[2] }, function() return credit(1, 1) end,
          { id = p[1], key = function(item) return item end }))
        assert.are.same({ 1, 0 }, { report.committed, report.skipped },
          ("job %q key %q"):format(p[1], tostring(p[2])))
      end
      assert.are.equal(#pairs_of, balance(1))
      for id, st in pairs(states()) do
        assert.are.equal("done", st)
        ids[#ids + 1] = id
      end
      assert.are.equal(#pairs_of, #ids)
      -- a job id without / or % keeps its plain form
      assert(tm:each({ 5 }, function() return credit(1, 1) end,
        { id = "interest-2026-11", key = function(item) return item end }))
      assert.are.equal("done", assert(tm:get("interest-2026-11/i5")).state)
    end)
  end)
end)

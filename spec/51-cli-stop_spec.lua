-- SIGINT and SIGTERM to the `mongotx` command (issue 26): recover and
-- prune stop after the pass in hand, within about a second; nothing is
-- recorded on any transaction (no attempt, no reason: an interrupt is not
-- a failure), no claim is left, one line says what was done, the exit
-- code is 130 or 143, and there is no traceback.  The command runs as a
-- child process over a backlog that takes it several seconds, signalled
-- midway; the database is checked after.  And in the library: a raise
-- that is not a policy's (an interrupt, a bug) is not counted against the
-- transaction recovery was driving.

local helpers = require "spec.helpers"
local cli = require "spec.support.cli"
local mongotx = require "mongotx"

local core = mongotx.core
local CODES = { INT = 130, TERM = 143 }

-- The fields recovery writes on a transaction it fails or claims.
local WATCHED = { "state", "attempts", "epoch", "reason", "triedAt", "parked", "instance" }

describe("#server the mongotx command stopped by a signal", function()
  local db, tm

  before_each(function()
    if cli.no_build then return end
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    tm = assert(db:manager{ application = "app-1" })
  end)

  after_each(function()
    if db then db:close() end
  end)

  -- n committed transactions left unfinished (finish = "deferred", never
  -- finished: recovery finishes them), each its own insert, and `initial`
  -- ones never started among them (recovery claims and runs those).

  local function backlog(n)
    local deferred = assert(db:manager{ application = "app-1", finish = "deferred",
                                        finish_batch = 100000 })
    for b = 0, math.ceil(n / 500) - 1 do
      local list = {}
      for i = 1, math.min(500, n - b * 500) do
        local k = b * 500 + i
        list[i] = { ops = { { collection = "events", id = k, doc = { n = k } } }, id = k }
      end
      local res, errs = deferred:commit_many(list)
      for i = 1, #list do assert(res[i], tostring(errs[i])) end
      for j = 1, 5 do
        assert(tm:begin({ { collection = "events", id = "i" .. b .. "." .. j, doc = { j = j } } },
          { id = "init" .. b .. "." .. j }))
      end
    end
  end

  -- Every transaction's watched fields, by id key.
  local function snapshot()
    local out = {}
    for _, T in ipairs(assert(tm:find({}, { limit = 100000 }))) do
      local t = {}
      for _, f in ipairs(WATCHED) do t[f] = T[f] end
      out[core.id_key(T._id)] = t
    end
    return out
  end

  -- Waits until recovery has finished some but far from all.
  local function midway(total)
    for _ = 1, 400 do
      local done = assert(tm:stats()).done
      if done > 0 then
        assert.is_true(done < total / 2, "the sweep was too quick to stop midway")
        return
      end
      core.sleep(0.025)
    end
    error("recover finished nothing in 10 s")
  end

  local function assert_one_line(err, pattern)
    assert.is_nil(err:find("traceback", 1, true), err)
    assert.is_nil(err:find("interrupted!", 1, true), err)
    local lines = 0
    for line in err:gmatch("[^\n]+") do
      -- not libmongoc's own log lines (FerretDB refuses "endSessions" as
      -- the client closes)
      if not line:find("^%d+/%d+/%d+ [%d:.]+: %[ *%d+%]: +%u+: ") then lines = lines + 1 end
    end
    assert.are.equal(1, lines, err)
    assert.truthy(err:find(pattern), err)
  end

  for _, sig in ipairs { "INT", "TERM" } do
    it("recover: SIG" .. sig .. " stops it after the pass in hand, nothing recorded, " ..
       "exit " .. CODES[sig], function()
      if cli.no_build then pending(cli.no_build) return end
      local N = helpers.server_kind() == "ferretdb" and 300 or 3000
      backlog(N)
      local total = N + 5 * math.ceil(N / 500)
      local before = snapshot()
      -- FerretDB v1 scans the collection for each statement: a pass of
      -- the default 200 there takes over 10 s, not the second the stop
      -- may wait, so its passes are of 10
      local pass = helpers.server_kind() == "ferretdb" and "10" or "200"
      local run = cli.start({ "--database", db.name, "recover", "--application", "app-1",
                              "--stale-after", "0", "--batch", pass })
      midway(total)
      local t0 = core.monotonic_ms()
      helpers.signal(run.pid, sig)
      local code, out, err = run.wait(30)
      local waited = (core.monotonic_ms() - t0) / 1000
      assert.are.equal(CODES[sig], code, err)
      assert.is_true(waited < 1.5, "it took " .. waited .. " s to stop")
      assert.are.equal("", out)
      assert_one_line(err, "^mongotx: recover stopped by SIG" .. sig .. " after %d+ passes")
      local done = tonumber(err:match("(%d+) done"))
      local after = snapshot()
      -- each transaction is finished, or exactly as it was: unclaimed,
      -- no attempt counted, no reason
      local finished = 0
      for k, was in pairs(before) do
        local now = after[k]
        if now.state == "done" then
          finished = finished + 1
          assert.is_nil(now.reason)
        else
          assert.are.same(was, now)
        end
      end
      assert.are.equal(done, finished)
      assert.is_true(finished > 0 and finished < total)
      -- a run right after takes up the rest at once: nothing holds a claim
      code, out, err = cli.run({ "--database", db.name, "--json", "recover", "--application",
                                 "app-1", "--stale-after", "0" })
      assert.are.equal(0, code, err)
      assert.are.equal(total, assert(tm:stats()).done)
      assert.are.equal(total - finished, cli.json_last(out).done)
    end)
  end

  it("recover --loop: a signal between sweeps ends it at once, exit 130", function()
    if cli.no_build then pending(cli.no_build) return end
    local run = cli.start({ "--database", db.name, "recover", "--loop", "60" })
    core.sleep(1.5) -- past its first (empty) sweep, into the wait
    local t0 = core.monotonic_ms()
    helpers.signal(run.pid, "INT")
    local code, _, err = run.wait(10)
    assert.are.equal(130, code, err)
    assert.is_true((core.monotonic_ms() - t0) / 1000 < 1, "it waited out its sleep")
    assert_one_line(err, "^mongotx: recover %-%-loop stopped by SIGINT between sweeps")
  end)

  it("prune: SIGTERM stops it between two steps and says how many it deleted", function()
    if cli.no_build then pending(cli.no_build) return end
    local N = helpers.server_kind() == "ferretdb" and 500 or 4000
    local fast = assert(db:manager{ application = "app-1" })
    for b = 0, N / 500 - 1 do
      local list = {}
      for i = 1, 500 do
        list[i] = { ops = { { collection = "events", id = b * 500 + i, doc = { n = i } } },
                    id = b * 500 + i }
      end
      local res = assert(fast:commit_many(list))
      for i = 1, 500 do assert(res[i]) end
    end
    assert.are.equal(N, assert(tm:stats()).done)
    local run = cli.start({ "--database", db.name, "prune", "--older-than", "0", "--batch", "20" })
    for _ = 1, 400 do
      if assert(tm:stats()).done < N then break end
      core.sleep(0.025)
    end
    helpers.signal(run.pid, "TERM")
    local code, _, err = run.wait(30)
    assert.are.equal(143, code, err)
    assert_one_line(err, "^mongotx: prune stopped by SIGTERM: deleted %d+ of " .. N)
    local deleted = tonumber(err:match("deleted (%d+) of"))
    local left = assert(tm:stats()).done
    assert.is_true(deleted > 0 and left > 0, err)
    assert.are.equal(N, deleted + left)
  end)
end)

describe("#server recovery and raises that are not a policy's", function()
  local db, dbname, tm

  before_each(function()
    dbname = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    tm = assert(db:manager{ application = "app-1", stale_after = 0 })
    assert(db:collection("accounts"):insert_many {
      { _id = "A", balance = 1000 }, { _id = "B", balance = 1000 } })
    for i = 1, 3 do
      assert(tm:begin({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -i } } },
        { collection = "accounts", id = "B", update = { ["$inc"] = { balance = i } } },
      }, { id = "t" .. i }))
    end
  end)

  after_each(function() db:close() end)

  for _, case in ipairs {
    { "an interrupt of Lua's interpreter, raised in a policy", function() error("interrupted!") end },
    { "out of memory, raised in a policy", function() error("not enough memory", 0) end },
  } do
    it("goes up from recover, with nothing written: " .. case[1], function()
      local rec = assert(db:manager{ application = "app-1", stale_after = 0,
                                     may_recover = case[2] })
      for _, size in ipairs { 1, 100 } do
        -- (the $$NOW probe's collection is written once a manager, first)
        local skip = { skip = { "transactions.probe" } }
        local before = helpers.db_dump(db.client, dbname, skip)
        local ok, raised = pcall(rec.recover, rec, { batch = size })
        assert.is_false(ok)
        assert.truthy(tostring(raised):find(case[1]:match("^an interrupt") and "interrupted!"
          or "not enough memory", 1, true), tostring(raised))
        helpers.assert_dump_unchanged(before, db.client, dbname, skip)
      end
    end)
  end

  it("goes up from recover for a bug of mongotx, recording no failure", function()
    local rec = assert(db:manager{ application = "app-1", stale_after = 0 })
    -- a raise of mongotx's own code before anything is written: where
    -- recovery reads the versions alone, and where a batch claims (a
    -- batch reads no versions of begun transactions where the server
    -- fences by deadline: mongotx.engine.forward)
    local function bug() error("a bug") end
    rec.engine.versions, rec.engine.claim_many = bug, bug
    local skip = { skip = { "transactions.probe" } } -- (as above)
    for _, size in ipairs { 1, 100 } do
      local before = helpers.db_dump(db.client, dbname, skip)
      local ok, raised = pcall(rec.recover, rec, { batch = size })
      assert.is_false(ok)
      assert.truthy(tostring(raised):find("a bug", 1, true))
      helpers.assert_dump_unchanged(before, db.client, dbname, skip)
    end
  end)

  it("counts a policy's own raise as that transaction's failure, naming the policy", function()
    local rec = assert(db:manager{ application = "app-1", stale_after = 0,
      may_recover = function(T) if T._id == "t2" then error("no t2") end return true end })
    local report = assert(rec:recover())
    assert.are.equal(1, report.failed)
    assert.are.equal("policy", report.errors[1].error.code)
    assert.are.equal("t2", report.errors[1].id)
    local T2 = assert(tm:get("t2"))
    assert.are.equal(1, T2.attempts)
    assert.truthy(T2.reason:find("policy may_recover raised: .*no t2"), T2.reason)
    assert.are.equal("done", assert(tm:get("t1")).state)
    assert.are.equal("done", assert(tm:get("t3")).state)
  end)
end)

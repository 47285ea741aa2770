-- The `mongotx` command (bin/mongotx) as an operator runs it: a
-- subprocess against the test server, its output (tables and --json),
-- its exit codes, and what the database holds afterwards.  Bad input
-- (unknown commands and flags, malformed ids, bad policy files, a server
-- that does not answer) gets its exit code and message and writes
-- nothing.  One case drives the command under tmux and reads the screen
-- for the progress bar.
--
-- The command runs under the interpreter that runs the specs (lua5.4 or
-- luajit) and its build (spec/support/cli.lua).
local helpers = require "spec.helpers"
local server = require "spec.support.server"
local mongotx = require "mongotx"
local manager = require "mongotx.manager"

local q = server.quote
local support = require "spec.support.cli"
local no_build, mongotx_cmd, run = support.no_build, support.command, support.run

-- Decodes the JSON lines the command printed (with lua-cjson, a
-- separate implementation from the command's encoder).
local cjson = require "cjson"
local function json_lines(s)
  local out = {}
  for line in s:gmatch("[^\n]+") do out[#out + 1] = cjson.decode(line) end
  return out
end

local function sleep(s) mongotx.core.sleep(s) end

describe("#server the mongotx command", function()
  local db, dbname, accounts, txs, tm

  before_each(function()
    if no_build then return end
    dbname = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    tm = assert(db:manager{ application = "app-1", lease = 1, stale_after = 1 })
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
    assert(accounts:insert_many{
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
      { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
    })
  end)

  local function check_build()
    if no_build then pending(no_build) return false end
    return true
  end

  local function cli(...)
    return run({ "--database", dbname, ... })
  end

  local function transfer(n, id)
    return assert(tm:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -n } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = n } } },
    }, { id = id }))
  end

  -- A transaction claimed and half applied by stepwise calls, then
  -- abandoned past its owner's 1 s lease.
  local function abandoned(n, id)
    local t = transfer(n, id)
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    return t
  end

  local function state(id) return assert(tm:get(id)).state end

  local function age(id, secs) helpers.age(txs, id, secs) end

  -- The JSON lines of a --json command that must succeed.
  local function json_ok(...)
    local code, out, err = cli("--json", ...)
    assert.are.equal(0, code, err)
    return json_lines(out)
  end

  it("status counts by state, stale ones and the oldest open one (table and --json)", function()
    if not check_build() then return end
    assert(tm:transfer("accounts", "A", "B", 1, { id = "done-1" }))
    abandoned(10, "half")
    age("half", 60)
    transfer(5, 7)
    local code, out, err = cli("status")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("pending:%s+1\n"), out)
    assert.truthy(out:find("initial:%s+1\n"), out)
    assert.truthy(out:find("done:%s+1\n"), out)
    -- the command's own stale_after is 30 s: "half" (60 s old) is stale, 7 is not
    assert.truthy(out:find("stale:%s+1 "), out)
    assert.truthy(out:find("oldest open: [%d.]+ s %(half%)"), out)
    code, out, err = cli("--json", "status", "--stale-after", "120")
    assert.are.equal(0, code, err)
    local s = json_lines(out)
    assert.are.equal(1, #s)
    s = s[1]
    assert.are.equal(1, s.pending)
    assert.are.equal(1, s.initial)
    assert.are.equal(2, s.active)
    assert.are.equal(0, s.stale) -- none is 120 s old
    assert.are.equal("half", s.oldest_id)
    assert.is_true(s.oldest >= 60, tostring(s.oldest))
  end)

  it("list filters by state, age and parked; show decodes ops, markers and versions", function()
    if not check_build() then return end
    abandoned(10, "half")
    age("half", 60)
    transfer(5) -- an ObjectId id
    local l = json_ok("list", "--older-than", "30")
    assert.are.equal(1, #l)
    assert.are.equal("half", l[1]._id)
    assert(txs:update_one({ _id = "half" }, { ["$set"] = { parked = true } }))
    local code, out, err = cli("list")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("^ID%s+STATE"), out)
    assert.truthy(out:find("\nhalf%s+pending%s+app%-1"), out)
    l = json_ok("list", "--state", "initial")
    assert.are.equal(1, #l)
    assert.are.equal("initial", l[1].state)
    assert.are.equal("string", type(l[1]._id["$oid"]))
    assert.are.equal(1, #json_ok("list", "--parked"))
    -- a finished transaction still flagged (an older version's) is not parked
    assert(txs:insert_one{ _id = "fin", state = "done", parked = true, ops = mongotx.array(),
                           lastModified = mongotx.core.Date(0) })
    assert.are.equal("half", json_ok("list", "--parked")[1]._id)
    assert.are.equal(1, #json_ok("list", "--parked"))
    assert(txs:delete_one({ _id = "fin" }))
    assert.are.equal(2, #json_ok("list"))
    assert.are.equal(1, #json_ok("list", "--limit", "1"))

    code, out, err = cli("show", "half")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("state:%s+pending"), out)
    assert.truthy(out:find("parked:%s+true"), out)
    -- op 1 applied (marker on A, version 1), op 2 not (B untouched)
    assert.truthy(out:find('\n1%s+update%s+accounts%s+A%s+{"%$inc":{"balance":%-10}}.-yes%s+%["half"%]%s+1'),
      out)
    assert.truthy(out:find('\n2%s+update%s+accounts%s+B%s+.-yes%s+%[%]%s+%-'), out)
    local s = json_ok("show", "half")[1]
    assert.are.equal("half", s.transaction._id)
    assert.are.same({ ["$inc"] = { balance = -10 } }, s.transaction.ops[1].update)
    assert.are.same({ "half" }, s.documents[1].marker)
    assert.are.equal(1, s.documents[1].version)
    -- a credit in escrow: the document's txPending and txEscrow
    assert(accounts:insert_many{ { _id = "C", balance = 5 }, { _id = "D", balance = 0 } })
    local e = assert(tm:begin({
      { collection = "accounts", id = "C", update = { ["$inc"] = { balance = -3 } } },
      { collection = "accounts", id = "D", update = { ["$inc"] = { balance = 3 } } },
    }, { id = "esc" }))
    assert(tm:step("claim", e))
    assert(tm:step("apply", e, 1))
    assert(tm:step("apply", e, 2))
    code, out, err = cli("show", "esc")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("%sESCROW\n"), out)
    assert.truthy(out:find('\n2%s+update%s+accounts%s+D%s+.-{"balance":3}%s+%["esc"%]\n'), out)
    s = json_ok("show", "esc")[1]
    assert.are.same({ "esc" }, s.documents[2].escrow)
    assert.are.same({ balance = 3 }, s.documents[2].pending)
    assert.is_nil(s.documents[1].escrow)
    -- typed ids: the number 7 and the string "7" are two transactions
    transfer(1, 7)
    transfer(2, "7")
    assert.are.equal(-1, json_ok("show", "7")[1].transaction.ops[1].update["$inc"].balance)
    assert.are.equal(-2, json_ok("show", "str:7")[1].transaction.ops[1].update["$inc"].balance)
    code, out, err = cli("show", "nothing")
    assert.are.equal(1, code)
    assert.are.equal("", out)
    assert.truthy(err:find("no such transaction nothing", 1, true), err)
  end)

  -- (issue 35) list refused a limit above 100 000 (a list held in
  -- memory); it streams from a cursor now, a reply at a time
  describe("list streams", function()
    local N = 2500

    before_each(function()
      if no_build then return end
      local docs = {}
      for i = 1, N do
        -- lastModified decreasing with i: the order list prints is not the insert's
        docs[i] = { _id = "t" .. i, state = "done", application = "app-1", ops = mongotx.array(),
                    lastModified = mongotx.core.Date(1000000000 - i * 1000) }
      end
      assert(txs:insert_many(docs))
    end)

    it("any number of transactions, in order, as the database holds them", function()
      if not check_build() then return end
      local want = {}
      local cursor = txs:find({}, { sort = { lastModified = 1 } })
      for T in cursor.next, cursor do want[#want + 1] = T._id end
      cursor:close()
      assert.are.equal(N, #want)
      local code, out, err = cli("--json", "list", "--limit", "200000")
      assert.are.equal(0, code, err)
      local got = {}
      for i, T in ipairs(json_lines(out)) do got[i] = T._id end
      assert.are.same(want, got)
      code, out, err = cli("list", "--limit", "200000")
      assert.are.equal(0, code, err)
      local lines = {}
      for line in out:gmatch("[^\n]+") do lines[#lines + 1] = line end
      assert.are.equal(N + 1, #lines) -- one header
      assert.truthy(lines[1]:find("^ID%s+STATE"), lines[1])
      for i = 1, N do assert.truthy(lines[i + 1]:find("^" .. want[i] .. "%s+done"), lines[i + 1]) end
      -- a limit still limits
      code, out = cli("--json", "list", "--limit", "7")
      assert.are.equal(0, code)
      assert.are.equal(7, #json_lines(out))
    end)

    it("through tm:scan, which refuses what tm:find refuses and writes nothing", function()
      if not check_build() then return end
      local before = helpers.db_dump(db.client, dbname)
      for _, case in ipairs {
        { { ["$where"] = "true" } }, { { state = { ["$expr"] = 1 } } }, { {}, { limit = 0 } },
        { {}, { batch_size = -1 } },
      } do
        local c, err = tm:scan(case[1], case[2])
        assert.is_nil(c)
        assert.are.equal("invalid", err.code)
      end
      assert.has_error(function() tm:scan({}, { limt = 1 }) end, "unknown option limt for scan")
      helpers.assert_dump_unchanged(before, db.client, dbname)
    end)

    it("reads and prints a page at a time", function()
      if not check_build() then return end
      -- list in this process, its output in a file, LIST_PAGE transactions a reply
      local function list(page, json)
        return support.list_here(tm, db, { limit = 200000, json = json }, page)
      end
      local big_cmds, big_read, big_text = list(1000, true)
      local cmds, read, text = list(100, true)
      assert.are.equal(big_text, text)
      assert.are.equal(N, read)
      assert.are.equal(big_read, read)
      -- 25 replies of 100 against 3 of 1000 (FerretDB: one more, an empty
      -- getMore that finds the end)
      assert.truthy(cmds >= big_cmds + 22 and cmds <= big_cmds + 23,
                    ("%d commands against %d"):format(cmds, big_cmds))
      -- the table is the same table, a page at a time
      -- (the ages, read from the server's clock, move between the runs)
      local function aged(t) return (t:gsub("%d+%.%d s", "<age>")) end
      local _, _, paged = list(100, false)
      local _, _, whole = list(N, false)
      assert.are.equal(aged(whole), aged(paged))
    end)
  end)

  it("recover finishes what a killed worker and stepwise calls left, prints a report", function()
    if not check_build() then return end
    local wdb, w = helpers.stalled_owner()
    helpers.signal(w.pid, "KILL")
    assert.is_true(helpers.wait_exit(w.pid, 10))
    os.remove(w.out)
    os.remove(w.ready)
    local wtx = assert(wdb:manager{})
    local killed = assert(wtx:find({ state = "pending" }))
    assert.are.equal(1, #killed)
    local code, out, err = run({ "--database", wdb.name, "recover" })
    assert.are.equal(0, code, err)
    assert.truthy(out:find("done:%s+1\n"), out)
    assert.are.equal("done", assert(wtx:get(killed[1]._id)).state)
    local balances = helpers.balances(wdb:collection("accounts"))
    assert.are.same({ A = 900, B = 1100 }, balances)

    abandoned(10, "s1")
    abandoned(20, "s2")
    age("s1", 60)
    age("s2", 60)
    code, out, err = cli("--json", "recover", "--batch", "1")
    assert.are.equal(0, code, err)
    local lines = json_lines(out)
    local last = lines[#lines]
    assert.are.equal("summary", last.event)
    assert.are.equal(2, last.done)
    assert.are.equal(0, last.failed)
    assert.is_true(last.passes >= 2)
    assert.are.equal("done", state("s1"))
    assert.are.equal("done", state("s2"))
    assert.are.same({ A = 970, B = 1030 }, (helpers.balances(accounts)))
  end)

  -- Issue 34 item 1: the command is another application; a transaction
  -- a live owner began waits for that owner's lease, not the command's
  -- stale_after, and its owner can still roll it back.
  it("recover leaves a begun transaction to its creator until the creator's lease passed", function()
    if not check_build() then return end
    local owner = assert(db:manager{ application = "live", lease = 3600 })
    local t = assert(owner:begin({
      { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -100 } } },
      { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 100 } } } },
      { id = "kept" }))
    age("kept", 60)
    local code, out, err = cli("recover")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("skipped:%s+1\n"), out)
    assert.truthy(out:find("done:%s+0\n"), out)
    assert.are.equal("initial", state("kept"))
    assert.are.same({ A = 1000, B = 1000 }, (helpers.balances(accounts)))
    assert.is_true(owner:rollback(t))
    assert.are.equal("cancelled", state("kept"))
    assert.are.same({ A = 1000, B = 1000 }, (helpers.balances(accounts)))
  end)

  it("recover --loop is a worker: it sweeps again and again until stopped", function()
    if not check_build() then return end
    local out = os.tmpname()
    local p = assert(io.popen(mongotx_cmd({ "--database", dbname, "--json", "recover", "--loop",
      "0.2" }) .. " >" .. out .. " 2>&1 & echo $!"))
    local pid = tonumber(p:read("*l"))
    p:close()
    local function finished(id)
      for _ = 1, 300 do
        if state(id) == "done" then return true end
        sleep(0.1)
      end
      return false
    end
    abandoned(10, "w1")
    local first = finished("w1")
    abandoned(20, "w2") -- after the first one was recovered: a later sweep takes it
    local second = finished("w2")
    local alive = helpers.alive(pid)
    helpers.signal(pid, "TERM")
    assert.is_true(helpers.wait_exit(pid, 10))
    local said = helpers.read_file(out)
    os.remove(out)
    assert.is_true(first, said)
    assert.is_true(second, said)
    assert.is_true(alive, "the worker stopped by itself:\n" .. said)
    local summaries = 0
    for line in said:gmatch("[^\n]+") do
      -- stdout and stderr together: only the JSON lines count
      if line:find("^{") and cjson.decode(line).event == "summary" then
        summaries = summaries + 1
      end
    end
    assert.is_true(summaries >= 2, said)
    assert.are.same({ A = 970, B = 1030 }, (helpers.balances(accounts)))
  end)

  -- A worker under systemd sweeps every few seconds: a sweep that found
  -- nothing to do prints nothing, text or --json; one that moved a
  -- transaction prints its report.
  for _, json_mode in ipairs { false, true } do
    it("recover --loop says nothing of an empty sweep" .. (json_mode and " (--json)" or ""),
      function()
        if not check_build() then return end
        local out, errf = os.tmpname(), os.tmpname()
        local args = { "--database", dbname, "recover", "--loop", "0.05", "--metrics-file", out .. ".prom" }
        if json_mode then table.insert(args, 1, "--json") end
        local p = assert(io.popen(mongotx_cmd(args) .. " >" .. out .. " 2>" .. errf .. " & echo $!"))
        local pid = tonumber(p:read("*l"))
        p:close()
        -- empty sweeps: each rewrites the metrics file; wait for three
        local sweeps, last = 0, nil
        for _ = 1, 600 do
          local f = io.open(out .. ".prom")
          local text = f and f:read("*a")
          if f then f:close() end
          if text and text ~= "" then
            local stamp = io.popen("stat -c %Y.%y " .. out .. ".prom"):read("*l")
            if stamp ~= last then sweeps, last = sweeps + 1, stamp end
          end
          if sweeps >= 3 then break end
          sleep(0.05)
        end
        local quiet = helpers.read_file(out)
        -- then one to recover: that sweep reports
        abandoned(10, "q1")
        age("q1", 60)
        for _ = 1, 300 do
          if state("q1") == "done" then break end
          sleep(0.1)
        end
        sleep(0.3) -- a few more empty sweeps after it
        helpers.signal(pid, "TERM")
        assert.is_true(helpers.wait_exit(pid, 10))
        local said, err = helpers.read_file(out), helpers.read_file(errf)
        os.remove(out)
        os.remove(errf)
        os.remove(out .. ".prom")
        assert.is_true(sweeps >= 3, "sweeps seen: " .. sweeps)
        assert.are.equal("", quiet)
        assert.are.equal("done", state("q1"))
        if json_mode then
          local lines = json_lines(said)
          assert.are.equal("pass", lines[1].event, said)
          assert.are.equal(1, lines[1].done, said)
          -- one summary, of the sweep that recovered q1 (and maybe the
          -- summary of the sweep SIGTERM stopped, which names the signal)
          local summaries = {}
          for _, l in ipairs(lines) do
            if l.event == "summary" and not l.stopped then summaries[#summaries + 1] = l end
          end
          assert.are.equal(1, #summaries, said)
          assert.are.equal(1, summaries[1].done)
        else
          assert.truthy(said:find("^examined:%s+1\n"), said)
          assert.truthy(said:find("\ndone:%s+1\n"), said)
          local _, reports = said:gsub("examined:", "")
          assert.are.equal(1, reports, said)
        end
        -- (a line of libmongoc's own may come first: "Falling back to
        -- malloc for counters" when a busy machine's shared memory is short)
        assert.matches("\nmongotx: recover .*stopped by SIGTERM", "\n" .. err)
      end)
  end

  it("recover with a policy file: parked by max_attempts, unpark, then recovered", function()
    if not check_build() then return end
    abandoned(10, "p")
    age("p", 60)
    local policy = os.tmpname()
    local f = assert(io.open(policy, "w"))
    f:write("return { max_attempts = 1, stale_pending = function() return 'back' end }\n")
    f:close()
    local code, out, err = cli("--policy", policy, "recover")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("parked:%s+1\n"), out)
    assert.is_true(assert(tm:get("p")).parked)
    code, out, err = cli("unpark", "p")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("p: unparked"), out)
    local T = assert(tm:get("p"))
    assert.is_nil(T.parked)
    assert.are.equal(0, T.attempts)
    -- the policy file's stale_pending rolls it back
    code, out, err = cli("--policy", policy, "recover")
    os.remove(policy)
    assert.are.equal(0, code, err)
    assert.truthy(out:find("cancelled:%s+1\n"), out)
    assert.are.equal("cancelled", state("p"))
    assert.are.same({ A = 1000, B = 1000 }, (helpers.balances(accounts)))
  end)

  it("rollback cancels, compensate undoes a done one, a committed one cannot roll back", function()
    if not check_build() then return end
    abandoned(10, "r")
    age("r", 60)
    local code, out, err = cli("rollback", "r", "--reason", "operator said so")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("r: cancelled"), out)
    local T = assert(tm:get("r"))
    assert.are.equal("cancelled", T.state)
    assert.are.equal("operator said so", T.reason)
    assert.are.same({ A = 1000, B = 1000 }, (helpers.balances(accounts)))

    assert(tm:transfer("accounts", "A", "B", 100, { id = "d" }))
    local before = helpers.db_dump(db.client, dbname)
    code, out, err = cli("rollback", "d")
    assert.are.equal(1, code)
    assert.are.equal("", out)
    assert.truthy(err:find("compensate it instead", 1, true), err)
    helpers.assert_dump_unchanged(before, db.client, dbname)
    code, out, err = cli("--json", "compensate", "d")
    assert.are.equal(0, code, err)
    local c = json_lines(out)[1]
    assert.are.equal("done", c.state)
    assert.are.equal("done", state(c.compensation))
    assert.are.equal("d", assert(tm:get(c.compensation)).compensates)
    assert.are.same({ A = 1000, B = 1000 }, (helpers.balances(accounts)))
  end)

  it("compensate keeps the floors like tm:compensate, tries again, and --no-floors drops them", function()
    if not check_build() then return end
    assert(tm:transfer("accounts", "A", "B", 100, { id = "f", min = 0 }))
    assert(tm:transfer("accounts", "B", "A", 1050))
    assert.are.same({ A = 1950, B = 50 }, (helpers.balances(accounts)))
    local code, out, err = cli("compensate", "f")
    assert.are.equal(1, code)
    assert.are.equal("", out)
    assert.truthy(err:find("(guard)", 1, true), err)
    assert.are.equal("guard", assert(tm:get(manager.compensation_id("f"))).cause)
    assert.are.same({ A = 1950, B = 50 }, (helpers.balances(accounts)))
    assert(tm:transfer("accounts", "A", "B", 50))
    code, out, err = cli("--json", "compensate", "f")
    assert.are.equal(0, code, err)
    local c = json_lines(out)[1]
    assert.are.same({ "done", manager.compensation_id("f", 2) }, { c.state, c.compensation })
    assert.are.same({ A = 2000, B = 0 }, (helpers.balances(accounts)))

    assert(tm:transfer("accounts", "A", "B", 100, { id = "g", min = 0 }))
    assert(tm:transfer("accounts", "B", "A", 100))
    code, out, err = cli("compensate", "--no-floors", "g")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("g: compensated by", 1, true), out)
    assert.are.same({ A = 2100, B = -100 }, (helpers.balances(accounts)))
  end)

  it("prune deletes finished transactions older than --older-than and nothing else", function()
    if not check_build() then return end
    for i = 1, 5 do assert(tm:transfer("accounts", "A", "B", 1, { id = "old" .. i })) end
    transfer(1, "open")
    for _, id in ipairs { "old1", "old2", "old3", "old4", "old5", "open" } do age(id, 60) end
    assert(tm:transfer("accounts", "A", "B", 1, { id = "young" }))
    local code, out, err = cli("prune", "--older-than", "30", "--dry-run")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("would delete 5 "), out)
    assert.are.equal(7, assert(txs:count({})))
    code, out, err = cli("--json", "prune", "--older-than", "30", "--batch", "2")
    assert.are.equal(0, code, err)
    local lines = json_lines(out)
    assert.are.equal(5, lines[#lines].deleted)
    assert.are.equal(4, #lines) -- passes of 2, 2, 1, then the summary
    local left = {}
    for _, T in ipairs(helpers.dump(txs)) do left[#left + 1] = T._id end
    assert.are.same({ "open", "young" }, left)
  end)

  describe("bad input: exit code, message, nothing written", function()
    local function policy_file(text)
      local path = os.tmpname() .. ".lua"
      local f = assert(io.open(path, "w"))
      f:write(text)
      f:close()
      return path
    end

    -- { args, exit code, pattern the message must hold }; POLICY in an
    -- argument is replaced by a policy file with the text in case[4].
    local cases = {
      { { "frobnicate" }, 2, "unknown command 'frobnicate'" },
      { { "list", "--bogus" }, 2, "unknown option '%-%-bogus'" },
      { { "--bogus", "status" }, 2, "unknown option '%-%-bogus'" },
      { {}, 2, "a command is required" },
      { { "list", "--limit", "0" }, 2, "whole number from 1" },
      { { "list", "--state", "weird" }, 2, "'%-%-state' must be one of 'initial'" },
      { { "recover", "--stale-after=-1" }, 2, "number of seconds" },
      { { "prune", "--older-than", "nan" }, 2, "number of seconds" },
      { { "show" }, 2, "missing argument 'id'" },
      { { "show", '{"$gt":1}' }, 2, 'malformed id "{\\"%$gt\\":1}": it looks like JSON' },
      { { "rollback", '{"$ne":null}' }, 2, "malformed id" },
      { { "rollback", "[1]" }, 2, "malformed id" },
      { { "unpark", "oid:xyz" }, 2, "oid: takes 24 hex digits" },
      { { "compensate", "long:12a" }, 2, "long: takes digits" },
      { { "rollback", "1e999" }, 2, "id may not be inf" },
      { { "--collection", "$x", "status" }, 2, "%-%-collection must be a collection name" },
      { { "--policy", "/nonexistent/p.lua", "recover" }, 2, "policy file /nonexistent/p%.lua" },
      { { "--policy", "POLICY", "recover" }, 2, "policy file .-: .-expected", "return { x" },
      { { "--policy", "POLICY", "recover" }, 2, "policy file .- raised an error: .-boom",
        "error('boom')" },
      { { "--policy", "POLICY", "recover" }, 2, "must return a table of policies, not number",
        "return 42" },
      { { "--policy", "POLICY", "recover" }, 2, "unknown option colour for policy file",
        "return { colour = 'red' }" },
      { { "--policy", "POLICY", "recover" }, 2, "option stale_after of policy file .- must be " ..
        "a number, not string", "return { stale_after = 'soon' }" },
      { { "--policy", "POLICY", "recover" }, 2, "option max_attempts of policy file .- must be " ..
        "a whole number from 1 to 1000000, not 0", "return { max_attempts = 0 }" },
      -- past 2^63 a number is no integer: it would become a nearby double
      -- (another transaction's id), so it is refused
      { { "rollback", "9223372036854775809" }, 2, "malformed id .-whole number" },
      { { "show", "--", "-99999999999999999999" }, 2, "malformed id .-whole number" },
      -- a policy file that exits: an error, never a silent exit 0
      { { "--policy", "POLICY", "rollback", "pend" }, 2, "policy file .- called os%.exit",
        "os.exit(0)" },
      { { "rollback", "nothing" }, 1, "no such transaction" },
      { { "show", "str:" }, 1, "no such transaction str:$" }, -- the empty string, shown
      { { "unpark", "pend" }, 1, "not parked" },
    }

    it("every case of the table", function()
      if not check_build() then return end
      local t = transfer(10, "pend")
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
      age("pend", 60) -- past its lease: a rollback that got through would cancel it
      local before = helpers.db_dump(db.client, dbname)
      for _, case in ipairs(cases) do
        local args, path = {}, nil
        for i, a in ipairs(case[1]) do
          if a == "POLICY" then
            path = policy_file(case[4])
            a = path
          end
          args[i] = a
        end
        local code, out, err = cli((table.unpack or unpack)(args))
        if path then os.remove(path) end
        local what = table.concat(case[1], " ")
        assert.are.equal(case[2], code, what .. ": " .. err)
        -- its line (libmongoc may add warnings of its own)
        local said
        for line in err:gmatch("[^\n]+") do
          if line:find("^mongotx: ") then said = line end
        end
        assert.truthy(said and said:find(case[3]), what .. ": " .. err)
        assert.are.equal("", out, what)
        helpers.assert_dump_unchanged(before, db.client, dbname)
      end
      assert.are.equal("pending", state("pend"))
    end)

    it("no URI, an unknown database, a closed port and a server that does not answer", function()
      if not check_build() then return end
      local before = helpers.db_dump(db.client, dbname)
      local code, _, err = run({ "status" }, { uri = false })
      assert.are.equal(2, code)
      assert.truthy(err:find("give --uri or set MONGOTX_URI", 1, true), err)
      code, _, err = run({ "--database", "a/b", "status" })
      assert.are.equal(2, code)
      assert.truthy(err:find("option database of connect must be a database name", 1, true), err)
      -- a malformed URI is bad usage (2), named, its password hidden
      for _, uri in ipairs { "http://x", "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=abc",
                             "mongodb://u:pw@/", "mongodb://u:pw:pw@127.0.0.1" } do
        code, _, err = run({ "--database", dbname, "recover" }, { uri = uri })
        assert.are.equal(2, code, uri .. ": " .. err)
        assert.truthy(err:find("mongotx: bad URI ", 1, true), err)
        assert.falsy(err:find("pw", 1, true), err)
      end
      code, _, err = run({ "--database", dbname .. "x", "recover" })
      assert.are.equal(1, code)
      assert.truthy(err:find("has no collection transactions", 1, true), err)
      local port = server.free_port()
      code, _, err = run({ "--database", dbname, "recover" },
        { uri = "mongodb://user:secret@127.0.0.1:" .. port })
      assert.are.equal(1, code)
      assert.truthy(err:find("cannot reach mongodb://user:***@127.0.0.1:" .. port, 1, true), err)
      assert.falsy(err:find("secret", 1, true), err)
      -- a listener that accepts and never answers: the command gives up
      -- after its own 5 s timeout (libmongoc's default would be 30 s)
      local ready = os.tmpname()
      os.remove(ready)
      local listener = io.popen(string.format([[python3 -c '
import socket, time, sys
s = socket.socket(); s.bind(("127.0.0.1", %d)); s.listen(8)
open(sys.argv[1], "w").write("ok")
conns = []
while True:
    c, _ = s.accept(); conns.append(c)
' %s >/dev/null 2>&1 & echo $!]], port, q(ready)))
      local lpid = tonumber(listener:read("*l"))
      listener:close()
      assert.is_true(helpers.wait_file(ready, 20), "the listener did not start")
      local started = mongotx.core.monotonic_ms()
      code, _, err = run({ "--database", dbname, "status" },
        { uri = "mongodb://127.0.0.1:" .. port })
      local took = (mongotx.core.monotonic_ms() - started) / 1000
      helpers.signal(lpid, "KILL")
      os.remove(ready)
      assert.are.equal(1, code)
      assert.truthy(err:find("cannot reach mongodb://127.0.0.1:" .. port, 1, true), err)
      assert.is_true(took < 25, "gave up only after " .. took .. " s")
      helpers.assert_dump_unchanged(before, db.client, dbname)
    end)
  end)

  describe("what reaches a terminal, a script and a closed output", function()
    it("control characters in ids and reasons are escaped in tables and messages", function()
      if not check_build() then return end
      local id = "x\27[31mRED\nrow"
      assert(tm:transfer("accounts", "A", "B", 1, { id = id }))
      assert(tm:rollback(transfer(1, "r"), "why\27[2J\r"))
      local code, out, err = cli("list")
      assert.are.equal(0, code, err)
      assert.falsy((out:gsub("\n", "")):find("%c"), out)
      assert.are.equal(3, select(2, out:gsub("\n", "")), out) -- headers and two rows
      assert.truthy(out:find("x\\x1b[31mRED\\nrow", 1, true), out)
      assert.truthy(out:find("why\\x1b[2J\\r", 1, true), out)
      code, out, err = cli("show", "nothing\27]0;title\7")
      assert.are.equal(1, code)
      assert.are.equal("", out)
      assert.falsy((err:gsub("\n", "")):find("%c"), err)
      assert.truthy(err:find("no such transaction nothing\\x1b]0;title\\x07", 1, true), err)
      -- --json keeps the exact string, escaped as JSON
      local lines = json_ok("list")
      assert.are.equal(id, lines[1]._id)
    end)

    it("--json writes valid UTF-8 whatever the bytes of a string", function()
      local output = require "mongotx.cli.output"
      for _, s in ipairs { "ok \xc3\xa9", "bad\xff\xfe", "cut\xc3", "\xed\xa0\x80surrogate",
                           "\xc0\xafoverlong", "\xf4\x90\x80\x80big", "nul\0" } do
        local text = output.json({ s = s })
        local ok, decoded = pcall(cjson.decode, text)
        assert.is_true(ok, text)
        if s:find("^ok") or s:find("^nul") then
          assert.are.equal(s, decoded.s)
        else
          assert.truthy(decoded.s:find("\xef\xbf\xbd", 1, true), text) -- U+FFFD
        end
        -- what it wrote is valid UTF-8 (Python's strict decoder is a second reader)
        local f = assert(io.popen("python3 -c 'import sys; sys.stdin.buffer.read().decode(\"utf-8\")'", "w"))
        f:write(text)
        assert.is_true(f:close(), text)
      end
    end)

    it("output that cannot be written is a failure (exit 1), not a silent 0", function()
      if not check_build() then return end
      assert(tm:transfer("accounts", "A", "B", 1, { id = "t" }))
      local err = os.tmpname()
      local code = server.execute(mongotx_cmd({ "--database", dbname, "show", "t" }) ..
        " >&- 2>" .. err)
      local said = helpers.read_file(err)
      os.remove(err)
      assert.are.equal(1, code, said)
      assert.truthy(said:find("mongotx: cannot write the output: standard output is closed", 1,
        true), said)
      -- a full disk
      if not server.exists("/dev/full") then return end
      code = server.execute(mongotx_cmd({ "--database", dbname, "--json", "list" }) ..
        " >/dev/full 2>" .. err)
      said = helpers.read_file(err)
      os.remove(err)
      assert.are.equal(1, code, said)
      assert.truthy(said:find("mongotx: cannot write the output: No space left", 1, true), said)
    end)
  end)

  describe("recover's counts over several passes", function()
    it("a malformed transaction counts once, however many passes read it", function()
      if not check_build() then return end
      -- two hand-edited transactions recovery cannot read, oldest, then
      -- five stale ones: --batch 2 sweeps in several passes
      assert(txs:insert_many { { _id = "bad-1", state = "pending", ops = "garbage" },
                               { _id = "bad-2", state = "pending", ops = 42 } })
      for i = 1, 5 do transfer(1, "t" .. i) end
      local code, out, err = cli("--json", "recover", "--application", "app-1",
                                 "--stale-after", "0", "--batch", "2")
      assert.are.equal(1, code, err)
      local lines = json_lines(out)
      local summary, failed_lines = lines[#lines], 0
      for _, l in ipairs(lines) do
        if l.event == "failed" then failed_lines = failed_lines + 1 end
      end
      assert.are.equal("summary", summary.event)
      assert.is_true(summary.passes > 1, out)
      assert.are.same({ 2, 0, 5 }, { summary.malformed, summary.failed, summary.cancelled + summary.done })
      assert.are.equal(2, failed_lines, out) -- one line per malformed transaction
      assert.truthy(err:find("recover: 0 failed, 2 malformed", 1, true), err)
      code, out = cli("recover", "--application", "app-1", "--stale-after", "0", "--batch", "2")
      assert.are.equal(1, code)
      assert.truthy(out:find("malformed:%s+2\n"), out)
      assert.are.equal(2, select(2, out:gsub("\nbad%-%d%s+malformed", "")), out)
      assert.are.equal("pending", assert(txs:find_one({ _id = "bad-1" })).state)
    end)

    it("a transaction that fails in every pass counts once", function()
      if not check_build() then return end
      for i = 1, 5 do transfer(1, "t" .. i) end
      local path = os.tmpname() .. ".lua"
      local f = assert(io.open(path, "w"))
      f:write("return { max_attempts = 100, may_recover = function(tx) " ..
              "if tx._id == 't1' then error('not t1') end return true end }")
      f:close()
      local code, out, err = cli("--policy", path, "--json", "recover", "--application",
                                 "app-1", "--stale-after", "0", "--batch", "2")
      os.remove(path)
      assert.are.equal(1, code, err)
      local lines = json_lines(out)
      local summary = lines[#lines]
      assert.is_true(summary.passes > 1, out)
      assert.are.same({ 1, 0, 4 }, { summary.failed, summary.malformed, summary.done + summary.cancelled })
      assert.truthy(err:find("recover: 1 failed, 0 malformed", 1, true), err)
      assert.are.equal("initial", state("t1"))
    end)
  end)

  describe("progress", function()
    -- n committed transactions left unfinished (finish = "deferred",
    -- never finished), which recovery finishes.
    -- (fewer on FerretDB, where recovery is a hundred times slower: the
    -- bar is still seen midway at --batch 10)
    local ferretdb = helpers.server_kind() == "ferretdb"
    local N, PIPED = ferretdb and 150 or 2000, ferretdb and 50 or 500
    local function backlog(first, n)
      local deferred = assert(db:manager{ application = "app-1", finish = "deferred",
                                          finish_batch = 100000 })
      for b = 0, math.ceil(n / 500) - 1 do
        local list = {}
        for i = 1, math.min(500, n - b * 500) do
          local k = first + b * 500 + i
          -- an insert each: no document that many transactions share (a
          -- batch on FerretDB would take those one at a time)
          list[i] = { ops = { { collection = "events", id = k, doc = { n = k } } }, id = k }
        end
        local res, errs = deferred:commit_many(list)
        for i = 1, #list do assert(res[i], tostring(errs[i])) end
      end
      assert.are.equal(n, assert(tm:stats()).applied)
    end

    local function tmux_missing()
      return server.execute("command -v tmux >/dev/null") ~= 0 and
        "tmux is not installed (spec/support/setup.sh deps installs it)" or nil
    end

    it("a terminal shows a bar with rate and ETA during recover; a pipe gets none", function()
      if not check_build() then return end
      local why = tmux_missing()
      if why then pending(why) return end
      backlog(0, N)
      local sock = os.tmpname()
      os.remove(sock)
      local tmux = "tmux -S " .. q(sock)
      local cmd = mongotx_cmd({ "--database", dbname, "recover", "--application", "app-1",
                                "--stale-after", "0", "--batch", "10" })
      assert.are.equal(0, server.execute(string.format(
        "%s new-session -d -x 120 -y 30 -c %s %s", tmux, q(os.getenv("PWD")), q(cmd .. "; echo EXIT=$?; sleep 120"))))
      local midway, final
      for _ = 1, 1200 do
        local screen = server.capture(tmux .. " capture-pane -p")
        local done, total, rate, eta = screen:match(
          "recover %[[#.]+%]%s+(%d+)/(%d+)%s+%d+%%%s+(%d+)/s%s+ETA (%d+:%d%d)")
        if done and tonumber(done) < tonumber(total) and tonumber(rate) > 0 and eta then
          midway = screen
        end
        if screen:find("EXIT=") then final = screen break end
        sleep(0.1)
      end
      server.execute(tmux .. " kill-server")
      assert.truthy(final, "the command did not finish under tmux")
      assert.truthy(final:find("EXIT=0", 1, true), final)
      assert.truthy(midway, "no bar with a rate and an ETA was seen while it ran:\n" .. final)
      assert.truthy(final:find("recover %[#+%]%s+" .. N .. "/" .. N .. "%s+100%%%s+%d+/s%s+ETA 0:00"),
        final)
      assert.truthy(final:find("done:%s+" .. N), final)
      assert.are.equal(N, assert(tm:stats()).done)

      -- piped: the same sweep prints the report and no bar
      backlog(N, PIPED)
      local code, out, err = cli("recover", "--application", "app-1", "--stale-after", "0",
        "--batch", "10")
      assert.are.equal(0, code, err)
      assert.truthy(out:find("done:%s+" .. PIPED .. "\n"), out)
      assert.falsy(out:find("\r", 1, true), out)
      assert.falsy(out:find("ETA", 1, true), out)
      assert.falsy(out:find("\27", 1, true), out)
      assert.are.equal(N + PIPED, assert(tm:stats()).done)
    end)
  end)
end)

-- mongotx.sync: sync flags (README, "Sync flags").  A rename of a user
-- propagated into their comments (spec/support/patterns.lua): the flag is
-- set in the change's own write and cleared only by the propagation of
-- the latest change; failures and crashes leave it for repair; bad input
-- writes nothing.

local helpers = require "spec.helpers"
local patterns = require "spec.support.patterns"
local mongotx = require "mongotx"

local function fresh()
  local dbname = helpers.db_name()
  local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
  patterns.sync_setup(db)
  return db, dbname
end

local function user(db, id)
  return assert(db:collection("users"):find_one({ _id = id }))
end

local function comments_of(db, id)
  return assert(db:collection("comments"):find_all({ user = id }, { sort = { _id = 1 } }))
end

describe("#server mongotx.sync", function()
  it("changes the master and its dependents, and clears the flag", function()
    local db = fresh()
    local s = patterns.syncer(db)
    local doc = assert(s:change("u1", { ["$set"] = { name = "Ann" } }))
    assert.are.equal("Ann", doc.name)
    assert.are.equal(1, doc.syncSeq)
    local u = user(db, "u1")
    assert.are.equal("Ann", u.name)
    assert.is_nil(u.syncing)
    assert.is_nil(u.syncAttempts)
    assert.are.equal(1, u.syncSeq)
    for _, c in ipairs(comments_of(db, "u1")) do
      assert.are.equal("Ann", c.name)
      assert.are.equal(1, c.userSeq)
    end
    for _, c in ipairs(comments_of(db, "u2")) do assert.are.equal("n0", c.name) end
    assert.are.same({}, patterns.sync_final(db))
  end)

  it("creates a sparse index on the flag", function()
    local reason = helpers.ferretdb_lacks("sparse indexes (it creates the index, not sparse)")
    if reason then pending(reason) return end
    local db = fresh()
    patterns.syncer(db)
    local idx = assert(db.client:command(db.name, { listIndexes = "users" }))
    local found
    for _, i in ipairs(idx.cursor.firstBatch) do
      if i.key.syncing then found = i end
    end
    assert.is_truthy(found, "no index on syncing")
    assert.is_true(found.sparse)
  end)

  it("sets the flag by the server's clock in the change's own write", function()
    local db = fresh()
    local seen
    local s = assert(db:sync { collection = "users", propagate = function(u)
      seen = user(db, u._id) -- what the database holds while propagating
      return true
    end })
    local before = assert(db.client:command("admin", { isMaster = 1 })).localTime:value()
    assert(s:change("u1", { ["$set"] = { name = "Ann" } }))
    assert.are.equal("Ann", seen.name)
    assert.are.equal("date", mongotx.type(seen.syncing))
    assert.is_true(seen.syncing:value() >= before)
    assert.are.equal(1, seen.syncSeq)
    assert.is_nil(user(db, "u1").syncing)
  end)

  it("does not clear the flag of a later change made while propagating", function()
    local db = fresh()
    local later = patterns.syncer(db, "return")
    local runs = 0
    local s = assert(db:sync { collection = "users", propagate = function(u)
      runs = runs + 1
      if runs == 1 then
        -- another writer changes u1 meanwhile, and its propagation fails
        local _, err = later:change("u1", { ["$set"] = { name = "Cy" } })
        assert.are.equal("propagation", err.code)
        return patterns.propagate(db)(u)
      end
      -- the rerun for u1 as it is now fails too
      return nil, "dependents unavailable"
    end })
    local res, err = s:change("u1", { ["$set"] = { name = "Bo" } })
    assert.is_nil(res)
    assert.are.equal("propagation", err.code)
    assert.are.equal(2, runs)
    local u = user(db, "u1")
    assert.are.equal("Cy", u.name)
    assert.are.equal(2, u.syncSeq)
    assert.are.equal("date", mongotx.type(u.syncing), "the later change's flag was cleared")
    assert.are.equal(2, u.syncAttempts)
    -- repair propagates the later change
    local report = assert(patterns.syncer(db):repair { older_than = 0 })
    assert.are.equal(1, report.repaired)
    assert.are.same({}, patterns.sync_final(db))
    assert.are.equal("Cy", comments_of(db, "u1")[1].name)
  end)

  -- A propagation that is idempotent but not monotone (it sets the name,
  -- whatever seq it has): a slow run for an older state lands after a
  -- later change was propagated and cleared.  The later change must
  -- still win: the older run's clear fails, and the module propagates
  -- the master as it is now instead of leaving the stale names unflagged.
  local function naive(db)
    local comments = db:collection("comments")
    return function(u)
      local ok, err = comments:update_many({ user = u._id }, { ["$set"] = { name = u.name } })
      if not ok then return nil, tostring(err) end
      return true
    end
  end

  it("lets a later change win over a slow, non-monotone propagation of an earlier one", function()
    local db = fresh()
    local later = assert(db:sync { collection = "users", propagate = naive(db) })
    local nested = false
    local s = assert(db:sync { collection = "users", propagate = function(u)
      if not nested then
        nested = true
        -- another writer changes u1 meanwhile: propagated and cleared
        assert(later:change("u1", { ["$set"] = { name = "Cy" } }))
        assert.is_nil(user(db, "u1").syncing)
      end
      return naive(db)(u) -- then this run writes the older name
    end })
    assert(s:change("u1", { ["$set"] = { name = "Bo" } }))
    local u = user(db, "u1")
    assert.are.equal("Cy", u.name)
    assert.are.equal(2, u.syncSeq)
    assert.is_nil(u.syncing)
    for _, c in ipairs(comments_of(db, "u1")) do
      assert.are.equal("Cy", c.name, "a comment kept the older change's name")
    end
  end)

  it("lets a live change win over a repair running a non-monotone propagation", function()
    local db = fresh()
    local live = assert(db:sync { collection = "users", propagate = naive(db) })
    -- a flag left by a crash: u2 renamed to Old, comments not rewritten
    assert(db:collection("users"):update_one({ _id = "u2" },
      { ["$set"] = { name = "Old", syncSeq = 1 }, ["$currentDate"] = { syncing = true } }))
    local nested = false
    local sweeper = assert(db:sync { collection = "users", propagate = function(u)
      if not nested then
        nested = true
        assert(live:change("u2", { ["$set"] = { name = "New" } }))
      end
      return naive(db)(u)
    end })
    assert(sweeper:repair { older_than = 0 })
    local u = user(db, "u2")
    assert.are.equal("New", u.name)
    assert.is_nil(u.syncing)
    for _, c in ipairs(comments_of(db, "u2")) do
      assert.are.equal("New", c.name, "a comment kept the repaired (older) name")
    end
  end)

  for _, how in ipairs { "raise", "return" } do
    it("keeps the flag when the propagation fails (" .. how .. "s), and repair retries", function()
      local db = fresh()
      local bad = patterns.syncer(db, how)
      local res, err = bad:change("u2", { ["$set"] = { name = "Di" } })
      assert.is_nil(res)
      assert.are.equal("propagation", err.code)
      assert.are.equal("u2", err.id)
      assert.are.equal(1, err.seq)
      local u = user(db, "u2")
      assert.are.equal("Di", u.name) -- the change is made
      assert.are.equal("date", mongotx.type(u.syncing))
      assert.are.equal(1, u.syncAttempts)
      assert.matches(how == "raise" and "propagation broke" or "dependents unavailable",
        u.syncError)
      assert.are.equal("n0", comments_of(db, "u2")[1].name)
      -- a fresh flag is not repaired before older_than...
      local report = assert(patterns.syncer(db):repair { older_than = 60 })
      assert.are.equal(0, report.repaired)
      assert.are.equal("date", mongotx.type(user(db, "u2").syncing))
      -- ...an old one is
      report = assert(patterns.syncer(db):repair { older_than = 0 })
      assert.are.equal(1, report.repaired)
      assert.are.same({}, patterns.sync_final(db))
      u = user(db, "u2")
      assert.is_nil(u.syncAttempts)
      assert.is_nil(u.syncError)
    end)
  end

  it("lets an interrupt in propagate go up: the flag stays, no attempt counted, repair retries",
    function()
    local db = fresh()
    local interrupted = assert(db:sync{ collection = "users",
      propagate = function() error("interrupted!") end })
    local ok, raised = pcall(interrupted.change, interrupted, "u2", { ["$set"] = { name = "Di" } })
    assert.is_false(ok)
    assert.matches("interrupted!$", tostring(raised))
    local u = user(db, "u2")
    assert.are.equal("Di", u.name) -- the change is made, flagged
    assert.are.equal("date", mongotx.type(u.syncing))
    assert.are.equal(0, u.syncAttempts)
    assert.is_nil(u.syncError)
    assert.are.equal(1, assert(patterns.syncer(db):repair { older_than = 0 }).repaired)
    assert.are.same({}, patterns.sync_final(db))
  end)

  it("parks a master after max_attempts failed propagations, until it changes again", function()
    local db = fresh()
    local bad = patterns.syncer(db, "raise", { max_attempts = 2 })
    assert.is_nil((bad:change("u3", { ["$set"] = { name = "Ed" } })))
    local report = assert(bad:repair { older_than = 0 })
    assert.are.equal(0, report.repaired)
    assert.are.equal(1, #report.failed)
    assert.are.equal("propagation", report.failed[1].code)
    assert.are.equal(1, report.parked)
    assert.are.equal(2, user(db, "u3").syncAttempts)
    -- parked: repair leaves it alone, even with a propagation that works
    report = assert(patterns.syncer(db, nil, { max_attempts = 2 }):repair { older_than = 0 })
    assert.are.equal(0, report.repaired)
    assert.are.equal(1, report.parked)
    assert.are.equal(2, user(db, "u3").syncAttempts)
    -- a new change starts the count again and propagates
    assert(patterns.syncer(db, nil, { max_attempts = 2 }):change("u3",
      { ["$set"] = { name = "Flo" } }))
    assert.are.same({}, patterns.sync_final(db))
    assert.are.equal("Flo", comments_of(db, "u3")[1].name)
  end)

  it("repairs a flag set by a writer that knows only the seed's recipe (no syncId)", function()
    local db = fresh()
    assert(db:collection("users"):update_one({ _id = "u2" },
      { ["$set"] = { name = "Zed", syncSeq = 7 }, ["$currentDate"] = { syncing = true } }))
    local report = assert(patterns.syncer(db):repair { older_than = 0 })
    assert.are.equal(1, report.repaired)
    assert.are.same({}, patterns.sync_final(db))
    assert.are.equal("Zed", comments_of(db, "u2")[1].name)
  end)

  it("repairs a flag set with no syncSeq at all (a writer that knows no mongotx)", function()
    local db = fresh()
    assert(db:collection("users"):update_one({ _id = "u2" },
      { ["$set"] = { name = "Zed" }, ["$currentDate"] = { syncing = true } }))
    local report = assert(patterns.syncer(db):repair { older_than = 0 })
    assert.are.equal(1, report.repaired)
    assert.are.same({}, patterns.sync_final(db))
    assert.are.equal("Zed", comments_of(db, "u2")[1].name)
  end)

  -- The propagation docs/sync.md and examples/10-sync.lua show, taken
  -- from their text: every filter it sends is one MongoDB accepts
  -- (helpers.filter_refusal: mongo-java-server accepts `{ $not: {} }`,
  -- MongoDB and FerretDB v2 refuse it), with a master that has a syncSeq
  -- and with one flagged before it had any.
  for _, source in ipairs {
    { "docs/sync.md", "\n  propagate = function%(user%)[^\n]*\n(.-\n)  end,\n" },
    { "examples/10-sync.lua", "\nlocal function propagate%(user%)\n(.-\n)end\n" },
  } do
    it("the recipe of " .. source[1] .. " sends filters MongoDB accepts", function()
      local f = assert(io.open(source[1]))
      local body = assert(f:read("a"):match(source[2]), "no propagate in " .. source[1])
      f:close()
      local db = fresh()
      local coll, sent = db:collection("comments"), {}
      assert(coll:insert_many { { _id = "c1", author = "ada" }, { _id = "c2", author = "ada", authorSeq = 5 },
                                { _id = "c3", author = "bob" } })
      -- the real collection, each filter kept as sent
      local comments = { update_many = function(_, filter, update)
        sent[#sent + 1] = filter
        return coll:update_many(filter, update)
      end }
      local propagate = assert(load("return function(user)\n" .. body .. "end", source[1], "t",
        { comments = comments, tostring = tostring }))()
      assert(propagate { _id = "ada", name = "Ada" })          -- no syncSeq yet
      assert(propagate { _id = "ada", name = "Ada K", syncSeq = 3 })
      assert(propagate { _id = "ada", name = "Ada L", syncSeq = 6 })
      assert.are.equal(3, #sent)
      for i, filter in ipairs(sent) do assert.is_nil(helpers.filter_refusal(filter), "filter " .. i) end
      local by_id = {}
      for _, d in ipairs(helpers.dump(coll)) do by_id[d._id] = d end
      assert.are.same({ "Ada L", 6 }, { by_id.c1.authorName, by_id.c1.authorSeq })
      assert.are.same({ "Ada L", 6 }, { by_id.c2.authorName, by_id.c2.authorSeq })
      assert.is_nil(by_id.c3.authorName)
    end)
  end

  it("answers missing for a master that does not exist, writing nothing", function()
    local db, dbname = fresh()
    local s = patterns.syncer(db)
    local before = helpers.db_dump(db.client, dbname)
    local res, err = s:change("nobody", { ["$set"] = { name = "x" } })
    assert.is_nil(res)
    assert.are.equal("missing", err.code)
    helpers.assert_dump_unchanged(before, db.client, dbname)
  end)

  describe("bad input", function()
    local db, dbname, s, before
    before_each(function()
      db, dbname = fresh()
      s = patterns.syncer(db)
      before = helpers.db_dump(db.client, dbname)
    end)
    after_each(function()
      helpers.assert_dump_unchanged(before, db.client, dbname)
    end)

    local proxy = setmetatable({}, { __index = { ["$set"] = { name = "x" } },
                                     __pairs = function() return next, { ["$set"] = { name = "x" } } end })
    local bad = {
      { "an operator as id", { ["$gt"] = "" }, { ["$set"] = { name = "x" } } },
      { "a regex as id", mongotx.Regex("^u"), { ["$set"] = { name = "x" } } },
      { "NaN as id", 0 / 0, { ["$set"] = { name = "x" } } },
      { "no operator", "u1", { name = "x" } },
      { "an unknown operator", "u1", { ["$where"] = { name = "x" } } },
      { "an empty update", "u1", {} },
      { "an update of the flag", "u1", { ["$set"] = { syncing = 1 } } },
      { "an update of the seq", "u1", { ["$inc"] = { syncSeq = 1 } } },
      { "an update of a path under the flag", "u1", { ["$set"] = { ["syncing.x"] = 1 } } },
      { "a rename onto the attempts", "u1", { ["$rename"] = { name = "syncAttempts" } } },
      { "an update of _id", "u1", { ["$set"] = { _id = "u9" } } },
      { "NaN in the update", "u1", { ["$set"] = { n = 0 / 0 } } },
      { "an update hidden behind a metatable", "u1", proxy },
    }
    for _, case in ipairs(bad) do
      it("refuses " .. case[1], function()
        local res, err = s:change(case[2], case[3])
        assert.is_nil(res)
        assert.are.equal("invalid", err.code)
        assert.are.equal("change", err.step)
      end)
    end

    it("raises for wrong types and unknown options", function()
      assert.has_error(function() s:change(nil, { ["$set"] = { name = "x" } }) end)
      assert.has_error(function() s:change(print, { ["$set"] = { name = "x" } }) end)
      assert.has_error(function() s:change("u1", "name") end)
      assert.has_error(function() s:repair { older_than = "1" } end)
      assert.has_error(function() s:repair { olderthan = 1 } end)
      assert.has_error(function() db:sync { collection = "users" } end)
      assert.has_error(function() db:sync { collection = "users", propagate = true } end)
      assert.has_error(function()
        db:sync { collection = "users", propagate = print, flags = "x" }
      end, "unknown option flags for sync")
    end)

    it("answers invalid for bad option values", function()
      for _, opts in ipairs {
        { collection = "users", propagate = print, flag = "$x" },
        { collection = "users", propagate = print, flag = "a.b" },
        { collection = "users", propagate = print, flag = "syncSeq" },
        { collection = "users", propagate = print, max_attempts = 0 },
        { collection = "", propagate = print },
        { collection = "users", propagate = print, write_concern = { w = -1 } },
      } do
        local res, err = db:sync(opts)
        assert.is_nil(res)
        assert.are.equal("invalid", err.code)
      end
      for _, opts in ipairs { { older_than = -1 }, { older_than = 0 / 0 }, { limit = 0 } } do
        local res, err = s:repair(opts)
        assert.is_nil(res)
        assert.are.equal("invalid", err.code)
      end
    end)
  end)

  -- Each crash point of the module, reached in a child process, then a
  -- repair in this one: the rule of spec/support/patterns.lua holds.
  describe("crash points", function()
    local cases = {
      { "sync.change:before:1", "-", "n0" },  -- nothing changed
      { "sync.change:after:1", "-", "Gus" },  -- changed and flagged, not propagated
      { "sync.clear:before:1", "-", "Gus" },  -- propagated, flag left
      { "sync.clear:after:1", "-", "Gus" },   -- done
      { "sync.fail:before:1", "raise", "Gus" },
      { "sync.fail:after:1", "raise", "Gus" },
    }
    for _, case in ipairs(cases) do
      it("recovers from a crash at " .. case[1], function()
        local db, dbname = fresh()
        local said = patterns.child("sync-rename", helpers.uri(), dbname, "u1", "Gus", case[2], case[1])
        assert.matches("fault injected", said)
        local u = user(db, "u1")
        assert.are.equal(case[3], u.name)
        if case[1]:match("^sync.change:after") or case[1]:match("^sync.clear:before")
            or case[1]:match("^sync.fail") then
          assert.are.equal("date", mongotx.type(u.syncing), "the crash left no flag")
        end
        assert.are.same({}, patterns.sync_running(db))
        assert(patterns.syncer(db):repair { older_than = 0 })
        assert.are.same({}, patterns.sync_final(db))
        assert.are.equal(case[3], comments_of(db, "u1")[1].name)
      end)
    end
  end)

  -- sync.rerun: a change whose propagation another change overtook
  -- (spec/support/pattern_worker.lua sync-raced) crashes around the
  -- write that flags the master again.
  for _, when in ipairs { "before", "after" } do
    it("recovers from a crash at sync.rerun:" .. when .. ":1", function()
      local db, dbname = fresh()
      local said = patterns.child("sync-raced", helpers.uri(), dbname, "u1", "Gus",
        "sync.rerun:" .. when .. ":1")
      assert.matches("later ok 2", said)
      assert.matches("fault injected", said)
      local u = user(db, "u1")
      assert.are.equal("Gus2", u.name)
      if when == "after" then
        assert.are.equal("date", mongotx.type(u.syncing), "the crash left no flag")
      end
      assert.are.same({}, patterns.sync_running(db))
      assert(patterns.syncer(db):repair { older_than = 0 })
      assert.are.same({}, patterns.sync_final(db))
      assert.are.equal("Gus2", comments_of(db, "u1")[1].name)
    end)
  end

  describe("#concurrency several processes", function()
    local reason = helpers.no_concurrency()
    if reason then
      it("runs on servers that isolate concurrent writers", function() pending(reason) end)
      return
    end

    it("keep every comment consistent with its user, one killed on the way", function()
      local db, dbname = fresh()
      local loops = patterns.loops("sync-loop", helpers.uri(), dbname, 3)
      local violations, notes = {}, {}
      for round = 1, 20 do
        helpers.core.sleep(0.1)
        if round == 8 then helpers.signal(loops.pids[1], "KILL") end
        local bad, noted = patterns.sync_running(db)
        for _, v in ipairs(bad) do violations[#violations + 1] = v end
        for _, v in ipairs(noted) do notes[#notes + 1] = v end
      end
      if #notes > 0 then
        print(("\n  note (mongo-java-server's half-applied reads, spec/support/patterns.lua): " ..
          "%d sightings, first %s"):format(#notes, notes[1]))
      end
      assert.is_true(patterns.stop_loops(loops))
      assert.are.same({}, violations)
      assert(patterns.syncer(db):repair { older_than = 0 })
      assert.are.same({}, patterns.sync_final(db))
      local seqs = 0
      for _, u in ipairs(assert(db:collection("users"):find_all({}))) do
        seqs = seqs + (u.syncSeq or 0)
      end
      assert.is_true(seqs > 3, "the workers renamed almost nothing")
    end)
  end)
end)

-- The 16 MiB limit with the fields the modules add (issue 26): a caller's
-- value that fits alone but not with a module's own fields (a version's
-- root and itemId, a sync change's flag, a job's state and times) is
-- `nil, invalid` naming the argument, with nothing written; exactly at
-- the limit and one byte under are written.  Each boundary is computed
-- from the document the module sends, encoded here the same way.
-- (mongotx.ledger needs no check: an entry holds at most 1000 changes,
-- each account id at most 1 KiB.)

local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local core = mongotx.core
local MAX = 16 * 1024 * 1024

local function fresh()
  local dbname = helpers.db_name()
  return assert(mongotx.connect(helpers.uri(), { database = dbname })), dbname
end

-- The length of a blob that makes `shape(blob)` encode to MAX + delta.
local function blob_for(shape, delta)
  return MAX - #core.encode(shape("")) + delta
end

local function assert_invalid_named(res, err, what)
  assert.is_nil(res)
  assert.are.equal("invalid", err.code, tostring(err))
  assert.truthy(err.message:find(what, 1, true), err.message)
  assert.truthy(err.message:find("16 MiB", 1, true), err.message)
end

describe("#server the 16 MiB limit with the fields a module adds", function()
  it("versioned put: one byte over is invalid, nothing written; at and under are stored", function()
    local db, dbname = fresh()
    local v = assert(db:versioned{ roots = "roots", items = "items" })
    local w = assert(v:begin("R"))
    local function shape(blob)
      return core.doc("_id", core.ObjectId(), "root", "R", "itemId", "x1", "version", w.version,
        "doc", { blob = blob })
    end
    local before = helpers.db_dump(db.client, dbname)
    local ok, err = w:put("x1", { blob = ("a"):rep(blob_for(shape, 1)) })
    assert_invalid_named(ok, err, "the document")
    helpers.assert_dump_unchanged(before, db.client, dbname)
    -- the same value with a one byte longer item id is over too
    ok, err = w:put("x10", { blob = ("a"):rep(blob_for(shape, 0)) })
    assert_invalid_named(ok, err, "the document")
    assert.are.equal(0, assert(db:collection("items"):count({})))
    for _, case in ipairs { { "x1", 0 }, { "x2", -1 } } do
      local n = blob_for(shape, case[2])
      assert(w:put(case[1], { blob = ("a"):rep(n) }))
      local got = assert(db:collection("items"):find_one({ itemId = case[1] }))
      assert.are.equal(n, #got.doc.blob)
      assert.are.equal(MAX + case[2], #core.encode(got))
    end
    assert.are.equal(w.version, assert(w:publish()))
    assert.are.equal(2, #assert(v:read("R")).items)
  end)

  it("sync change: one byte over is invalid, nothing written; at and under are applied", function()
    local db, dbname = fresh()
    local users = db:collection("users")
    assert(users:insert_one({ _id = "u1", name = "Ann" }))
    local propagated = 0
    local s = assert(db:sync{ collection = "users",
                              propagate = function() propagated = propagated + 1 return true end })
    -- the statement change sends: its filter, and the caller's $set with
    -- the flag's fields
    local function shape(blob)
      return { q = { _id = "u1" },
               u = { ["$set"] = { blob = blob, syncId = core.ObjectId(), syncAttempts = 0 },
                     ["$currentDate"] = { syncing = true }, ["$inc"] = { syncSeq = 1 },
                     ["$unset"] = { syncError = "" } } }
    end
    local before = helpers.db_dump(db.client, dbname)
    local doc, err = s:change("u1", { ["$set"] = { blob = ("a"):rep(blob_for(shape, 1)) } })
    assert_invalid_named(doc, err, "the update")
    helpers.assert_dump_unchanged(before, db.client, dbname)
    assert.are.equal(0, propagated)
    for seq, delta in ipairs { 0, -1 } do
      local n = blob_for(shape, delta)
      doc, err = s:change("u1", { ["$set"] = { blob = ("a"):rep(n) } })
      assert.is_truthy(doc, tostring(err))
      local u = assert(users:find_one({ _id = "u1" }))
      assert.are.equal(n, #u.blob)
      assert.are.equal(seq, u.syncSeq)
      assert.is_nil(u.syncing) -- propagated and cleared
    end
    assert.are.equal(2, propagated)
  end)

  it("queue push and done: one byte over is invalid, nothing written; at and under are stored",
    function()
    local db, dbname = fresh()
    local q = assert(db:queue{})
    local function shape(blob)
      return { _id = "j1", type = "t", details = { blob = blob }, priority = 0, state = "ready",
               ts = core.Date(0), created = core.Date(0), attempts = 0, epoch = 0 }
    end
    local before = helpers.db_dump(db.client, dbname)
    local job, err = q:push("t", { blob = ("a"):rep(blob_for(shape, 1)) }, { id = "j1" })
    assert_invalid_named(job, err, "push: details")
    helpers.assert_dump_unchanged(before, db.client, dbname)
    for _, case in ipairs { { "j1", 0 }, { "j2", -1 } } do
      local n = blob_for(shape, case[2])
      assert(q:push("t", { blob = ("a"):rep(n) }, { id = case[1] }))
      local got = assert(q.jobs:find_one({ _id = case[1] }))
      assert.are.equal(n, #got.details.blob)
      assert.are.equal(MAX + case[2], #core.encode(got))
    end
    assert(q.jobs:delete_many({}))
    -- done's result: the update done sends must fit, or nothing is written
    assert(q:push("t", { n = 1 }, { id = "small" }))
    local claimed = assert(q:claim("w1"))
    local function update(blob)
      return { q = { _id = "small", epoch = claimed.epoch, state = "running" },
               u = { ["$set"] = { state = "done", finished = core.Date(0), result = { blob = blob } },
                     ["$unset"] = { lease_until = "" } } }
    end
    local held = assert(q.jobs:find_one({ _id = "small" }))
    local ok
    ok, err = q:done(claimed, { blob = ("a"):rep(blob_for(update, 1)) })
    assert_invalid_named(ok, err, "done: result")
    assert.are.same(held, assert(q.jobs:find_one({ _id = "small" })))
    assert.is_true(assert(q:done(claimed, { n = 2 })))
    assert.are.equal("done", assert(q.jobs:find_one({ _id = "small" })).state)
  end)
end)

-- mongotx.versioned: versioned structures (README, "Versioned
-- documents").  A tree of counts summing to 100 (spec/support/patterns.lua)
-- edited by writers that insert new versions and publish them by raising
-- the root's version: readers never see a half-written change, of two
-- writers from one version exactly one publishes, gc removes only what
-- can never be published, bad input writes nothing.

local helpers = require "spec.helpers"
local patterns = require "spec.support.patterns"
local mongotx = require "mongotx"

local function fresh(setup)
  local dbname = helpers.db_name()
  local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
  if setup ~= false then patterns.versioned_setup(db) end
  return db, dbname, patterns.trees(db)
end

local function root(db)
  return assert(db:collection("trees"):find_one({ _id = patterns.ROOT }))
end

-- The tree as { id = n } at its published version.
local function counts(trees)
  local tree = assert(trees:read(patterns.ROOT))
  local out = {}
  for _, it in ipairs(tree.items) do out[it.id] = it.doc.n end
  return out, tree.version
end

describe("#server mongotx.versioned", function()
  it("publishes a writer's versions at once, and only then", function()
    local db, _, trees = fresh()
    assert.are.same({ a = 20, b = 20, c = 20, d = 20, e = 20 }, (counts(trees)))
    local w = assert(trees:begin(patterns.ROOT))
    assert.are.equal(1, w.base)
    assert(w:put("a", { n = 15 }))
    assert(w:put("f", { n = 5 }))
    -- written, not published: readers still see version 1
    local now, version = counts(trees)
    assert.are.equal(1, version)
    assert.are.same({ a = 20, b = 20, c = 20, d = 20, e = 20 }, now)
    assert.are.equal(2, assert(db:collection("nodes"):count({ version = w.version })))
    assert.are.equal(w.version, assert(w:publish()))
    now, version = counts(trees)
    assert.are.equal(w.version, version)
    assert.are.same({ a = 15, b = 20, c = 20, d = 20, e = 20, f = 5 }, now)
    local r = root(db)
    assert.are.equal(w.version, r.version)
    assert.are.equal(0, #r.open)
    assert.are.equal(0, #r.dead)
    -- the old version of a is still stored (history), the new one is read
    assert.are.equal(2, assert(db:collection("nodes"):count({ itemId = "a" })))
    -- a finished writer writes no more
    local ok, err = w:put("b", { n = 1 })
    assert.is_nil(ok)
    assert.are.equal("state", err.code)
  end)

  it("deletes an item with a tombstone", function()
    local db, _, trees = fresh()
    local w = assert(trees:begin(patterns.ROOT))
    assert(w:delete("e"))
    assert(w:put("d", { n = 40 }))
    assert(w:publish())
    assert.are.same({ a = 20, b = 20, c = 20, d = 40 }, (counts(trees)))
    local tomb = assert(db:collection("nodes"):find_one({ itemId = "e", version = w.version }))
    assert.is_true(tomb.deleted)
    -- an item can come back after its tombstone
    w = assert(trees:begin(patterns.ROOT))
    assert(w:put("e", { n = 0 }))
    assert(w:publish())
    assert.are.equal(0, (counts(trees)).e)
  end)

  it("lets exactly one of two writers from one version publish", function()
    local db, _, trees = fresh()
    local w1, w2 = assert(trees:begin(patterns.ROOT)), assert(trees:begin(patterns.ROOT))
    assert.are.equal(w1.base, w2.base)
    assert.are_not.equal(w1.version, w2.version)
    assert(w1:put("a", { n = 10 }))
    assert(w1:put("b", { n = 30 }))
    assert(w2:put("c", { n = 99 }))
    assert(w2:put("d", { n = 1 }))
    assert.are.equal(w2.version, assert(w2:publish()))
    local ok, err = w1:publish()
    assert.is_nil(ok)
    assert.are.equal("conflict", err.code)
    -- the loser's versions are dead and gone; the winner's are read
    local r = root(db)
    assert.are.equal(w2.version, r.version)
    assert.are.equal(1, #r.dead)
    assert.are.equal(w1.version, r.dead[1])
    assert.are.equal(0, assert(db:collection("nodes"):count({ version = w1.version })))
    assert.are.same({ a = 20, b = 20, c = 99, d = 1, e = 20 }, (counts(trees)))
    -- and it can retry from the new version
    local w3 = assert(trees:begin(patterns.ROOT))
    assert.are.equal(w2.version, w3.base)
    assert(w3:put("a", { n = 10 }))
    assert(w3:publish())
    assert.are.equal(10, (counts(trees)).a)
  end)

  it("never shows the items of a version that lost, even below a later published one", function()
    local db, _, trees = fresh()
    -- w1 takes a number, w2 a higher one; w2 publishes; w1 keeps writing
    -- (a stalled loser) and a third writer publishes above both
    local w1, w2 = assert(trees:begin(patterns.ROOT)), assert(trees:begin(patterns.ROOT))
    assert(w2:put("a", { n = 21 }))
    assert(w2:put("b", { n = 19 }))
    assert(w2:publish())
    assert(w1:put("c", { n = 1000 }))
    local w3 = assert(trees:begin(patterns.ROOT))
    assert(w3:put("d", { n = 21 }))
    assert(w3:put("e", { n = 19 }))
    assert(w3:publish())
    assert.is_true(w1.version < w3.version)
    assert.are.same({}, patterns.versioned_running(db))
    assert.are.equal(20, (counts(trees)).c)
    -- gc aborts w1 (its base is gone) and deletes its item
    local report = assert(trees:gc { older_than = 3600 })
    assert.are.equal(1, report.aborted)
    assert.are.equal(1, report.removed)
    local ok, err = w1:publish()
    assert.is_nil(ok)
    assert.are.equal("conflict", err.code)
    assert.are.same({}, patterns.versioned_final(db))
  end)

  it("gc leaves a young writer's version alone and aborts an old one", function()
    local db, _, trees = fresh()
    local w = assert(trees:begin(patterns.ROOT))
    assert(w:put("a", { n = 19 }))
    assert(w:put("b", { n = 21 }))
    local report = assert(trees:gc { older_than = 60 })
    assert.are.equal(0, report.aborted)
    assert.are.equal(0, report.removed)
    assert.are.equal(2, assert(db:collection("nodes"):count({ version = w.version })))
    -- the writer can still publish what gc kept
    assert(w:publish())
    assert.are.equal(19, (counts(trees)).a)
    -- an old writer (older_than = 0: every open one) is aborted, and
    -- its publish, coming after, is refused: it never publishes items
    -- gc deleted
    local late = assert(trees:begin(patterns.ROOT))
    assert(late:put("a", { n = 1 }))
    report = assert(trees:gc { older_than = 0 })
    assert.are.equal(1, report.aborted)
    assert.are.equal(1, report.removed)
    local ok, err = late:publish()
    assert.is_nil(ok)
    assert.are.equal("conflict", err.code)
    assert.are.equal(19, (counts(trees)).a)
    -- a stalled writer's insert after gc is invisible, and the next gc removes it
    assert.are.equal("state", select(2, late:put("c", { n = 5 })).code)
    local stale = assert(db:collection("nodes"):insert_one(mongotx.doc("root", patterns.ROOT,
      "itemId", "c", "version", late.version, "doc", { n = 5 })))
    assert.is_truthy(stale)
    assert.are.same({}, patterns.versioned_running(db))
    report = assert(trees:gc { older_than = 0 })
    assert.are.equal(1, report.removed)
    assert.are.same({}, patterns.versioned_final(db))
  end)

  it("refuses a second version of one item in one writer, and an abandoned writer", function()
    local db, dbname, trees = fresh()
    local w = assert(trees:begin(patterns.ROOT))
    assert(w:put("a", { n = 1 }))
    local before = helpers.db_dump(db.client, dbname)
    local ok, err = w:put("a", { n = 2 })
    assert.is_nil(ok)
    assert.are.equal("invalid", err.code)
    ok, err = w:delete("a")
    assert.is_nil(ok)
    assert.are.equal("invalid", err.code)
    helpers.assert_dump_unchanged(before, db.client, dbname)
    assert(w:abandon())
    local r = root(db)
    assert.are.equal(1, #r.dead)
    assert.are.equal(w.version, r.dead[1])
    assert.are.equal(0, assert(db:collection("nodes"):count({ version = w.version })))
    ok, err = w:publish()
    assert.is_nil(ok)
    assert.are.equal("state", err.code)
  end)

  it("reads a root nobody published as version 0 with no items", function()
    local _, _, trees = fresh(false)
    local tree = assert(trees:read("nothing"))
    assert.are.equal(0, tree.version)
    assert.are.same({}, tree.items)
  end)

  it("creates its indexes", function()
    local db = fresh()
    local idx = assert(db.client:command(db.name, { listIndexes = "nodes" }))
    local unique
    for _, i in ipairs(idx.cursor.firstBatch) do
      if i.key.itemId and i.key.version and i.key.root then unique = i.unique end
    end
    assert.is_true(unique)
  end)

  it("reads a document raw: a metatable cannot add content", function()
    local db, _, trees = fresh()
    local w = assert(trees:begin(patterns.ROOT))
    -- nothing raw: an empty document is stored as such, not __index's
    assert(w:put("z", setmetatable({}, { __index = { ["$where"] = "1" } })))
    local stored = assert(db:collection("nodes"):find_one({ itemId = "z" }))
    assert.are.same({}, stored.doc)
  end)

  describe("bad input", function()
    local db, dbname, trees, w, before
    before_each(function()
      db, dbname, trees = fresh()
      w = assert(trees:begin(patterns.ROOT))
      before = helpers.db_dump(db.client, dbname)
    end)
    after_each(function()
      helpers.assert_dump_unchanged(before, db.client, dbname)
    end)

    local ids = {
      { "an operator", { ["$gt"] = "" } },
      { "a regex", mongotx.Regex(".") },
      { "NaN", 0 / 0 },
      { "a table with unordered keys", { a = 1, b = 2 } },
    }
    for _, case in ipairs(ids) do
      it("refuses " .. case[1] .. " as a root or item id", function()
        for _, call in ipairs {
          function() return trees:begin(case[2]) end,
          function() return trees:read(case[2]) end,
          function() return w:put(case[2], { n = 1 }) end,
          function() return w:delete(case[2]) end,
        } do
          local res, err = call()
          assert.is_nil(res)
          assert.are.equal("invalid", err.code)
        end
      end)
    end

    local docs = {
      { "an operator key", { ["$set"] = 1 } },
      { "a nested operator key", { a = { ["$gt"] = 1 } } },
      { "a dotted key", { ["a.b"] = 1 } },
      { "NaN", { n = 0 / 0 } },
      { "a function", { f = print } },
    }
    for _, case in ipairs(docs) do
      it("refuses a document with " .. case[1], function()
        local res, err = w:put("a", case[2])
        assert.is_nil(res)
        assert.are.equal("invalid", err.code)
        assert.are.equal("put", err.step)
      end)
    end

    it("raises for wrong types and unknown options", function()
      assert.has_error(function() trees:begin(nil) end)
      assert.has_error(function() trees:read(print) end)
      assert.has_error(function() w:put("a", "n = 1") end)
      assert.has_error(function() w:put(nil, { n = 1 }) end)
      assert.has_error(function() trees:gc { older_than = "1" } end)
      assert.has_error(function() trees:gc { olderthan = 1 } end)
      assert.has_error(function() trees:gc { limit = 1 } end)
      assert.has_error(function() db:versioned { root = "x" } end)
      assert.has_error(function() db:versioned { roots = 1 } end)
    end)

    it("answers invalid for bad option values", function()
      for _, opts in ipairs { { roots = "" }, { items = "$x" }, { roots = "a", items = "a" },
                              { write_concern = { j = true, w = 0 } } } do
        local res, err = db:versioned(opts)
        assert.is_nil(res)
        assert.are.equal("invalid", err.code)
      end
      for _, opts in ipairs { { older_than = -1 }, { older_than = 0 / 0 } } do
        local res, err = trees:gc(opts)
        assert.is_nil(res)
        assert.are.equal("invalid", err.code)
      end
    end)
  end)

  -- Each crash point, reached in a child process, then gc in this one:
  -- the published tree always sums to 100, and gc leaves nothing that
  -- can never be published.
  describe("crash points", function()
    local cases = {
      { "versioned-new", "versioned.create:before:1" },
      { "versioned-new", "versioned.create:after:1" },
      { "versioned-new", "versioned.begin:after:1" },
      { "versioned-new", "versioned.publish:after:1" },
      { "versioned-move", "versioned.begin:before:1" },
      { "versioned-move", "versioned.begin:after:1" },
      { "versioned-move", "versioned.put:before:1" },
      { "versioned-move", "versioned.put:after:1" },
      { "versioned-move", "versioned.put:after:2" },
      { "versioned-move", "versioned.publish:before:1" },
      { "versioned-move", "versioned.publish:after:1" },
      { "versioned-race", "versioned.abort:before:1" },
      { "versioned-race", "versioned.abort:after:1" },
      { "versioned-race", "versioned.discard:before:1" },
      { "versioned-race", "versioned.discard:after:1" },
    }
    for _, case in ipairs(cases) do
      it("recovers from a crash at " .. case[2] .. " (" .. case[1] .. ")", function()
        local db, dbname, trees = fresh()
        local said = patterns.child(case[1], helpers.uri(), dbname, case[2])
        assert.matches("fault injected", said)
        assert.are.same({}, patterns.versioned_running(db))
        local published = root(db).version
        assert(trees:gc { older_than = 0 })
        assert.are.same({}, patterns.versioned_final(db))
        assert.are.equal(published, root(db).version, "gc changed the published version")
      end)
    end
  end)

  describe("#concurrency several processes", function()
    local reason = helpers.no_concurrency()
    if reason then
      it("runs on servers that isolate concurrent writers", function() pending(reason) end)
      return
    end

    it("never show a half-written tree; stopped and killed writers are cleaned", function()
      local db, dbname, trees = fresh()
      local loops = patterns.loops("versioned-loop", helpers.uri(), dbname, 3)
      local violations, versions = {}, {}
      for round = 1, 24 do
        helpers.core.sleep(0.1)
        if round == 6 then helpers.signal(loops.pids[2], "STOP") end
        if round == 10 then helpers.signal(loops.pids[1], "KILL") end
        if round == 16 then
          -- pids[2] has been stopped past older_than = 0.5: gc aborts it
          assert(trees:gc { older_than = 0.5 })
          helpers.signal(loops.pids[2], "CONT")
        end
        for _, v in ipairs(patterns.versioned_running(db)) do violations[#violations + 1] = v end
        versions[#versions + 1] = root(db).version
      end
      assert.is_true(patterns.stop_loops(loops))
      assert.are.same({}, violations)
      for i = 2, #versions do assert.is_true(versions[i] >= versions[i - 1]) end
      assert.is_true(versions[#versions] > 3, "the writers published almost nothing")
      assert(trees:gc { older_than = 0 })
      assert.are.same({}, patterns.versioned_final(db))
    end)
  end)
end)

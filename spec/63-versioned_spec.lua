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

  -- A root document gc did not write (no version: another program's,
  -- or damaged) sorts before the tree: gc must still clean the tree,
  -- not stop at it with a Lua error.
  it("gc cleans the other roots past a root without a version", function()
    local db, _, trees = fresh()
    assert(db:collection("trees"):insert_one({ _id = "0-odd", open = mongotx.array({ 1 }),
      dead = mongotx.array() }))
    local w = assert(trees:begin(patterns.ROOT))
    assert(w:put("a", { n = 1 }))
    local ok, report, err = pcall(trees.gc, trees, { older_than = 0 })
    assert.is_true(ok, "gc raised: " .. tostring(report))
    assert.is_truthy(report, err)
    assert.is_true(report.aborted >= 1)
    assert.are.equal(0, assert(db:collection("nodes"):count({ version = w.version })))
    assert.are.same({}, patterns.versioned_final(db))
  end)

  -- A publish whose reply is lost (a network error, a write concern
  -- timeout) after the server applied it: the outcome is unknown to the
  -- writer, which tries again or gives up.  Neither may delete the items
  -- of the version the root now shows.  (The roots collection is wrapped
  -- so that the first publish's reply is lost after the real write.)
  local function losing_reply(trees)
    local real, lose = trees.roots, false
    trees.roots = setmetatable({
      update_one = function(_, ...)
        local res, err = real:update_one(...)
        if res and lose then
          lose = false
          return nil, { code = "network", message = "the reply was lost" }
        end
        return res, err
      end,
    }, { __index = function(_, k) return function(_, ...) return real[k](real, ...) end end })
    return function() lose = true end
  end

  for _, retry in ipairs { "publish", "abandon" } do
    it("keeps a published version's items when a publish whose reply was lost is followed by "
        .. retry, function()
      local db, _, trees = fresh()
      local lose = losing_reply(trees)
      local w = assert(trees:begin(patterns.ROOT))
      assert(w:put("a", { n = 19 }))
      assert(w:put("b", { n = 21 }))
      lose()
      assert.is_nil((w:publish()))
      assert.are.equal(w.version, root(db).version) -- the server applied it
      local res, err = w[retry](w)
      if retry == "publish" then
        assert.are.equal(w.version, res)
      else -- too late to abandon: it says so
        assert.is_nil(res)
        assert.are.equal("state", err.code)
      end
      assert.are.equal(2, assert(db:collection("nodes"):count({ version = w.version })),
        "the published version's items were deleted")
      local now = counts(trees)
      assert.are.equal(19, now.a)
      assert.are.equal(21, now.b)
      assert.are.same({}, patterns.versioned_running(db))
    end)
  end

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
    -- the README's error table: an abandoned version is a conflict, as
    -- often as publish is called; abandon again does nothing more
    for _ = 1, 2 do
      ok, err = w:publish()
      assert.is_nil(ok)
      assert.are.equal("conflict", err.code)
    end
    assert.is_true(w:abandon())
    r = root(db)
    assert.are.same({ w.version }, { table.unpack(r.dead) })
    assert.are.equal(0, #r.open)
    assert.are.equal(w.base, r.version)
  end)

  -- A collection wrapper whose next call of `method` fails with a network
  -- error, without reaching the server ("before") or after it applied
  -- the call ("after").
  local function failing(coll, method)
    local fail_when
    local wrapped = setmetatable({
      [method] = function(_, ...)
        local when = fail_when
        fail_when = nil
        if when == "before" then return nil, { code = "stream", message = "not sent" } end
        local res, err = coll[method](coll, ...)
        if res and when == "after" then return nil, { code = "stream", message = "reply lost" } end
        return res, err
      end,
    }, { __index = function(_, k) return function(_, ...) return coll[k](coll, ...) end end })
    return wrapped, function(when) fail_when = when end
  end

  it("publish again after a database error: published if the write never arrived, the " ..
     "same answer after a success or a loss, the loser's clean-up finished", function()
    local db, _, trees = fresh()
    local fail
    trees.roots, fail = failing(trees.roots, "update_one")
    -- the write never reached the server: the retry publishes
    local w = assert(trees:begin(patterns.ROOT))
    assert(w:put("a", { n = 19 }))
    assert(w:put("b", { n = 21 }))
    fail("before")
    local v, err = w:publish()
    assert.is_nil(v)
    assert.are.equal("stream", err.code)
    assert.are.equal(w.base, root(db).version)
    assert.are.equal(w.version, assert(w:publish()))
    assert.are.equal(w.version, root(db).version)
    assert.are.equal(w.version, assert(w:publish())) -- and again: the same answer

    -- a loser whose clean-up (the abort of its version) failed: publish
    -- again finishes it and answers conflict, as the first would have
    local a = assert(trees:begin(patterns.ROOT))
    local b = assert(trees:begin(patterns.ROOT))
    assert(a:put("a", { n = 18 }))
    assert(a:put("b", { n = 22 }))
    assert(b:put("c", { n = 10 }))
    assert(b:put("d", { n = 30 }))
    assert.are.equal(a.version, assert(a:publish()))
    local items
    items, fail = failing(trees.items, "delete_many")
    trees.items = items
    fail("before")
    v, err = b:publish()
    assert.is_nil(v)
    assert.are.equal("stream", err.code)
    assert.are.equal(2, assert(db:collection("nodes"):count({ version = b.version })))
    for _ = 1, 2 do
      v, err = b:publish()
      assert.is_nil(v)
      assert.are.equal("conflict", err.code)
    end
    assert.are.equal(0, assert(db:collection("nodes"):count({ version = b.version })))
    local r = root(db)
    assert.are.equal(a.version, r.version)
    assert.are.equal(0, #r.open)
    assert.are.same({ b.version }, { table.unpack(r.dead) })
    assert.are.same({ a = 18, b = 22, c = 20, d = 20, e = 20 }, (counts(trees)))
    assert.are.same({}, patterns.versioned_running(db))
  end)

  it("reads a root nobody published as version 0 with no items", function()
    local _, _, trees = fresh(false)
    local tree = assert(trees:read("nothing"))
    assert.are.equal(0, tree.version)
    assert.are.same({}, tree.items)
  end)

  -- A root whose numbers reach 2^53 as doubles (written by another
  -- program, or by LuaJIT, whose numbers are all doubles): next + 1 ==
  -- next there, and handing that number out twice would let two writers
  -- share a version (and the second publish over the first).
  it("refuses to hand out a version number that cannot be raised exactly", function()
    local db, dbname, trees = fresh(false)
    local big = 2.0 ^ 53
    assert(db:collection("trees"):insert_one({ _id = "big", version = big, next = big,
      open = mongotx.array(), dead = mongotx.array() }))
    local before = helpers.db_dump(db.client, dbname)
    local w, err = trees:begin("big")
    assert.is_nil(w, "a writer got version " .. tostring(w and w.version))
    assert.are.equal("malformed", err.code)
    helpers.assert_dump_unchanged(before, db.client, dbname)
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

-- client:counters() / client:reset_counters(): round trips (libmongoc's
-- command monitoring: one succeeded or failed event a command) and write
-- statements (counted where mongotx hands them to libmongoc, when a
-- command went out).  bench/ divides them by the transfers it ran, so
-- they must be exact.
local helpers = require "spec.helpers"
local mongotx_core = require "mongotx.core"

describe("#server client counters", function()
  local client, coll, dbname

  before_each(function()
    client = helpers.client()
    dbname = helpers.db_name()
    coll = client:collection(dbname, "c")
  end)

  after_each(function()
    client:close()
  end)

  -- The counters a call adds, starting from zero.
  local function counted(fn)
    client:reset_counters()
    fn()
    return client:counters()
  end

  it("start at zero and go back to zero on reset", function()
    local fresh = helpers.client()
    assert.are.same({ commands = 0, writes = 0 }, fresh:counters())
    assert(fresh:command("admin", { ping = 1 }))
    assert.are.same({ commands = 1, writes = 0 }, fresh:counters())
    fresh:reset_counters()
    assert.are.same({ commands = 0, writes = 0 }, fresh:counters())
    fresh:close()
  end)

  it("count insert_one as one command with one write", function()
    assert.are.same({ commands = 1, writes = 1 }, counted(function()
      assert(coll:insert_one({ _id = 1, n = 0 }, {}))
    end))
    assert.are.same({ { _id = 1, n = 0 } }, helpers.dump(coll))
  end)

  it("count update_many as one write statement, whatever it matches", function()
    assert(coll:insert_many({ { _id = 1, n = 0 }, { _id = 2, n = 0 }, { _id = 3, n = 0 } }, {}))
    assert.are.same({ commands = 1, writes = 1 }, counted(function()
      local res = assert(coll:update_many({}, { ["$inc"] = { n = 1 } }, {}))
      assert.are.equal(3, res.modified)
    end))
    assert.are.same({ { _id = 1, n = 1 }, { _id = 2, n = 1 }, { _id = 3, n = 1 } },
                    helpers.dump(coll))
  end)

  it("count a bulk write of 3 updates as one command with three writes", function()
    assert(coll:insert_many({ { _id = 1, n = 0 }, { _id = 2, n = 0 }, { _id = 3, n = 0 } }, {}))
    assert.are.same({ commands = 1, writes = 3 }, counted(function()
      assert(coll:bulk_write({
        { op = "update_one", filter = { _id = 1 }, update = { ["$inc"] = { n = 1 } } },
        { op = "update_one", filter = { _id = 2 }, update = { ["$inc"] = { n = 2 } } },
        { op = "update_one", filter = { _id = 3 }, update = { ["$inc"] = { n = 3 } } },
      }, {}))
    end))
    assert.are.same({ { _id = 1, n = 1 }, { _id = 2, n = 2 }, { _id = 3, n = 3 } },
                    helpers.dump(coll))
  end)

  it("count a mixed bulk write by command: one per run of the same kind", function()
    -- libmongoc groups consecutive requests of one kind into one command
    assert.are.same({ commands = 3, writes = 4 }, counted(function()
      assert(coll:bulk_write({
        { op = "insert", doc = { _id = 1 } },
        { op = "insert", doc = { _id = 2 } },
        { op = "update_one", filter = { _id = 1 }, update = { ["$set"] = { n = 1 } } },
        { op = "delete_one", filter = { _id = 2 } },
      }, {}))
    end))
    assert.are.same({ { _id = 1, n = 1 } }, helpers.dump(coll))
  end)

  it("count find as one command and no write", function()
    assert(coll:insert_many({ { _id = 1 }, { _id = 2 } }, {}))
    local docs
    assert.are.same({ commands = 1, writes = 0 }, counted(function()
      docs = assert(coll:find_all({}, { sort = { _id = 1 } }))
    end))
    assert.are.same({ { _id = 1 }, { _id = 2 } }, docs)
  end)

  it("count find_and_modify as one write", function()
    assert(coll:insert_one({ _id = 1, n = 0 }, {}))
    assert.are.same({ commands = 1, writes = 1 }, counted(function()
      assert(coll:find_and_modify({ _id = 1 }, { update = { ["$inc"] = { n = 5 } } }))
    end))
    assert.are.same({ { _id = 1, n = 5 } }, helpers.dump(coll))
  end)

  it("count a failed write too: it was sent", function()
    assert(coll:insert_one({ _id = 1 }, {}))
    assert.are.same({ commands = 1, writes = 1 }, counted(function()
      local res, err = coll:insert_one({ _id = 1 }, {})
      assert.is_nil(res)
      assert.is_not_nil(err)
    end))
    assert.are.same({ { _id = 1 } }, helpers.dump(coll))
  end)

  it("count each getMore of a cursor, and the killCursors of one closed early", function()
    local docs = {}
    for i = 1, 5 do docs[i] = { _id = i } end
    assert(coll:insert_many(docs, {}))
    -- find answers 2, two getMores the other 3 (the last batch ends the cursor)
    assert.are.same({ commands = 3, writes = 0 }, counted(function()
      local cur = coll:find({}, { sort = { _id = 1 }, batch_size = 2 })
      local seen = {}
      for doc in cur.next, cur do seen[#seen + 1] = doc._id end
      assert.are.same({ 1, 2, 3, 4, 5 }, seen)
    end))
    -- closed after its first batch: the server's cursor is killed
    assert.are.same({ commands = 2, writes = 0 }, counted(function()
      local cur = coll:find({}, { sort = { _id = 1 }, batch_size = 2 })
      assert.are.equal(1, cur:next()._id)
      cur:close()
    end))
    assert.are.same(docs, helpers.dump(coll))
  end)

  it("count a write command sent through client:command by its statements", function()
    assert.are.same({ commands = 1, writes = 2 }, counted(function()
      assert(client:command(dbname, mongotx_core.doc("insert", "c",
        "documents", { { _id = 1 }, { _id = 2 } })))
    end))
    assert.are.same({ { _id = 1 }, { _id = 2 } }, helpers.dump(coll))
  end)

  it("count a command the server answers with an error", function()
    assert.are.same({ commands = 1, writes = 0 }, counted(function()
      local res, err = client:command(dbname, { noSuchCommand = 1 })
      assert.is_nil(res)
      assert.is_not_nil(err)
    end))
    assert.are.same({}, helpers.dump(coll))
  end)

  it("count nothing for a write libmongoc refuses before sending it", function()
    assert.are.same({ commands = 0, writes = 0 }, counted(function()
      local res, err = coll:insert_one({ _id = 1, [""] = 1 }, {})
      assert.is_nil(res)
      assert.matches("empty key", err.message)
      res, err = coll:update_one({ _id = 1 }, mongotx_core.doc("$set", { n = 1 }, "n", 2), {})
      assert.is_nil(res)
      assert.matches("operators", err.message)
    end))
    assert.are.same({}, helpers.dump(coll))
  end)

  it("raise on a closed client", function()
    local other = helpers.client()
    other:close()
    assert.has_error(function() other:counters() end, "attempt to use a closed client")
    assert.has_error(function() other:reset_counters() end, "attempt to use a closed client")
  end)
end)

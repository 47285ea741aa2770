-- client:counters() / client:reset_counters(): round trips and write
-- statements as libmongoc's command monitoring sees them.  bench/ divides
-- them by the transfers it ran, so they must be exact.
local helpers = require "spec.helpers"

describe("#server client counters", function()
  local client, coll

  before_each(function()
    client = helpers.client()
    coll = client:collection(helpers.db_name(), "c")
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

  it("raise on a closed client", function()
    local other = helpers.client()
    other:close()
    assert.has_error(function() other:counters() end, "attempt to use a closed client")
    assert.has_error(function() other:reset_counters() end, "attempt to use a closed client")
  end)
end)

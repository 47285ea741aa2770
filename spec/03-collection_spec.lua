-- Every collection operation against the live server; each spec checks
-- what the database holds afterwards.
local helpers = require "spec.helpers"
local core = helpers.core

-- mongo-java-server (the in-memory test server) gets a few reply fields
-- wrong that libmongoc passes through: insert's "n" counts failed
-- documents too, and findAndModify leaves out lastErrorObject after an
-- upsert or a remove.  Those assertions run on the other servers only.
local EXACT_REPLIES = helpers.server_kind() ~= "memory"

local function ids(docs)
  local out = {}
  for i, d in ipairs(docs) do out[i] = d._id end
  return out
end

describe("#server collection", function()
  local client, coll, db

  before_each(function()
    client = helpers.client()
    db = helpers.db_name()
    coll = client:collection(db, "c")
  end)

  -- by name; none when the collection does not exist (MongoDB and
  -- FerretDB answer NamespaceNotFound there, mongo-java-server no index)
  local function indexes()
    local reply, err = client:command(db, { listIndexes = "c" })
    if not reply and err.server_code == 26 then return {} end
    assert(reply, err)
    local out = {}
    for _, index in ipairs(reply.cursor.firstBatch) do out[index.name] = index end
    return out
  end

  after_each(function()
    client:close()
  end)

  describe("insert_one", function()
    it("stores the document and returns its _id", function()
      local res = assert(coll:insert_one({ _id = 7, name = "seven" }))
      assert.are.equal(7, res.inserted_id)
      assert.are.same({ { _id = 7, name = "seven" } }, helpers.dump(coll))
    end)

    it("generates an ObjectId when the document has none", function()
      local doc = { name = "no id" }
      local res = assert(coll:insert_one(doc))
      assert.are.equal("objectId", core.type(res.inserted_id))
      assert.is_nil(doc._id) -- the caller's table is left alone
      local stored = helpers.dump(coll)
      assert.are.equal(1, #stored)
      assert.is_true(stored[1]._id == res.inserted_id)
      assert.are.equal("no id", stored[1].name)
    end)

    it("takes a write concern", function()
      assert(coll:insert_one({ _id = 1 }, { write_concern = { w = 1 } }))
      assert.are.equal(1, coll:count({ _id = 1 }))
    end)

    it("stores every BSON type and reads it back byte for byte", function()
      local lacks = helpers.ferretdb_lacks("every BSON type (it drops the connection on the deprecated ones)")
      if lacks then return pending(lacks) end
      local doc = core.doc(
        "_id", core.ObjectId(), "i", 7, "l", core.Int64(1099511627776),
        "max", core.Int64("9223372036854775807"), "min", core.Int64("-9223372036854775808"),
        "int32max", 2147483647, "d", 0.25, "nz", -1 * 0.0, "inf", math.huge,
        "s", "h\195\169llo", "t", true, "n", core.null,
        "o", core.doc("z", 1, "a", core.doc("y", 2, "b", 3)), "arr", core.array { 1, "x", core.null },
        "ea", core.array(), "eo", {}, "dt", core.Date(1600000000123),
        "dec", core.Decimal128("1.10"), "bin", core.Binary("\0\1\255", 0),
        "re", core.Regex("^a", "i"), "ts", core.Timestamp(1600000000, 1),
        "minkey", core.MinKey, "maxkey", core.MaxKey)
      local bytes = core.encode(doc)
      assert(coll:insert_one(doc))
      local back = assert(coll:find_one({ _id = doc._id }))
      assert.are.equal(bytes, core.encode(back))
      local nan = assert(coll:insert_one({ _id = "nan", v = 0 / 0 }))
      local v = assert(coll:find_one({ _id = nan.inserted_id })).v
      assert.is_true(v ~= v)
    end)

    it("round-trips a 15.9 MiB document", function()
      local big = ("0123456789abcdef"):rep(math.floor(15.9 * 1024 * 1024 / 16))
      assert(coll:insert_one({ _id = "big", s = big }))
      local back = assert(coll:find_one({ _id = "big" }))
      assert.are.equal(#big, #back.s)
      assert.is_true(back.s == big)
    end)

    it("raises for a document over 16 MiB and stores nothing", function()
      local ok, err = pcall(coll.insert_one, coll, { _id = "huge", s = ("x"):rep(16 * 1024 * 1024) })
      assert.is_false(ok)
      assert.matches("exceeds the 16 MiB limit", err)
      assert.are.equal(0, coll:count({}))
    end)
  end)

  describe("insert_many", function()
    it("stores all documents and returns their _ids in order", function()
      local res = assert(coll:insert_many({ { _id = 1 }, { a = "gen" }, { _id = 3 } }))
      assert.are.equal(3, res.inserted)
      assert.are.equal(3, #res.inserted_ids)
      assert.are.equal(1, res.inserted_ids[1])
      assert.are.equal("objectId", core.type(res.inserted_ids[2]))
      assert.are.equal(3, res.inserted_ids[3])
      assert.are.equal(3, coll:count({}))
      assert.is_true(coll:find_one({ a = "gen" })._id == res.inserted_ids[2])
    end)

    it("ordered (default) stops at the first failure", function()
      assert(coll:insert_one({ _id = 2 }))
      local res, err = coll:insert_many({ { _id = 1 }, { _id = 2 }, { _id = 3 } })
      assert.is_nil(res)
      assert.are.equal("server", err.code)
      assert.are.equal(11000, err.server_code)
      assert.are.same({ 1, 2 }, ids(helpers.dump(coll)))
    end)

    it("unordered goes on after a failure", function()
      assert(coll:insert_one({ _id = 2 }))
      local res, err = coll:insert_many({ { _id = 1 }, { _id = 2 }, { _id = 3 } }, { ordered = false })
      assert.is_nil(res)
      assert.are.equal("server", err.code)
      assert.are.equal(11000, err.server_code)
      assert.are.same({ 1, 2, 3 }, ids(helpers.dump(coll)))
    end)

    it("raises for an empty list or a non-document, storing nothing", function()
      assert.has_error(function() coll:insert_many({}) end)
      assert.has_error(function() coll:insert_many({ { _id = 1 }, 2 }) end)
      assert.has_error(function() coll:insert_many({ { _id = 1 }, { f = print } }) end)
      assert.are.equal(0, coll:count({}))
    end)
  end)

  describe("find", function()
    before_each(function()
      for i = 1, 10 do
        assert(coll:insert_one({ _id = i, g = i % 2, name = "n" .. i, extra = { i, i } }))
      end
    end)

    it("find_all with a filter, sort, skip and limit", function()
      local docs = assert(coll:find_all({ g = 0 }, { sort = { _id = -1 }, skip = 1, limit = 3 }))
      assert.are.same({ 8, 6, 4 }, ids(docs))
    end)

    it("find_all with no filter returns everything", function()
      assert.are.equal(10, #assert(coll:find_all()))
      assert.are.equal(10, #assert(coll:find_all({})))
    end)

    it("a sort on several keys needs core.doc", function()
      local docs = assert(coll:find_all({}, { sort = core.doc("g", 1, "_id", -1) }))
      assert.are.same({ 10, 8, 6, 4, 2, 9, 7, 5, 3, 1 }, ids(docs))
    end)

    it("projection", function()
      local doc = assert(coll:find_one({ _id = 3 }, { projection = { name = 1 } }))
      assert.are.same({ _id = 3, name = "n3" }, doc)
      doc = assert(coll:find_one({ _id = 3 }, { projection = { name = 0, extra = 0 } }))
      assert.are.same({ _id = 3, g = 1 }, doc)
    end)

    it("a cursor with a small batch size walks every document", function()
      local cur = coll:find({ g = 1 }, { batch_size = 2, sort = { _id = 1 } })
      local seen = {}
      while true do
        local doc, err = cur:next()
        assert.is_nil(err)
        if not doc then break end
        seen[#seen + 1] = doc._id
      end
      assert.are.same({ 1, 3, 5, 7, 9 }, seen)
      cur:close()
    end)

    it("find_one returns the first match or nil", function()
      assert.are.equal(10, assert(coll:find_one({}, { sort = { _id = -1 } }))._id)
      assert.are.equal("n4", assert(coll:find_one({ _id = 4 })).name)
      assert.is_nil(coll:find_one({ _id = 99 }))
      assert.is_nil((select(2, coll:find_one({ _id = 99 }))))
    end)

    it("find_one ignores a limit given to it", function()
      assert.are.equal(1, assert(coll:find_one({}, { limit = 5, sort = { _id = 1 } }))._id)
    end)

    it("read_preference", function()
      assert.are.equal(10, #assert(coll:find_all({}, { read_preference = "primary" })))
      assert.are.equal(5, coll:count({ g = 0 }, { read_preference = "primaryPreferred" }))
    end)

    it("documents read back re-encode to the same bytes", function()
      for _, doc in ipairs(assert(coll:find_all({}))) do
        local bytes = core.encode(doc)
        assert.are.equal(bytes, core.encode(assert(core.decode(bytes))))
      end
    end)

    it("a query the server rejects gives nil, err", function()
      local docs, err = coll:find_all({ ["$bogus"] = 1 })
      assert.is_nil(docs)
      assert.are.equal("table", type(err))
      assert.is_string(err.message)
    end)

    it("count with filter, skip and limit", function()
      assert.are.equal(10, coll:count())
      assert.are.equal(10, coll:count({}))
      assert.are.equal(5, coll:count({ g = 1 }))
      assert.are.equal(3, coll:count({ g = 1 }, { skip = 2 }))
      assert.are.equal(2, coll:count({}, { limit = 2 }))
      assert.are.equal(0, coll:count({ g = 7 }))
    end)
  end)

  describe("update", function()
    before_each(function()
      assert(coll:insert_many({ { _id = 1, n = 0 }, { _id = 2, n = 0 }, { _id = 3, n = 5 } }))
    end)

    it("update_one changes one matching document", function()
      local res = assert(coll:update_one({ n = 0 }, { ["$inc"] = { n = 1 } }))
      assert.are.equal(1, res.matched)
      assert.are.equal(1, res.modified)
      assert.is_nil(res.upserted_id)
      assert.are.equal(1, coll:count({ n = 1 }))
      assert.are.equal(1, coll:count({ n = 0 }))
    end)

    it("update_many changes every matching document", function()
      local res = assert(coll:update_many({ n = 0 }, { ["$set"] = { n = 9 } }))
      assert.are.equal(2, res.matched)
      assert.are.equal(2, res.modified)
      assert.are.same({ 1, 2 }, ids(assert(coll:find_all({ n = 9 }, { sort = { _id = 1 } }))))
      assert.are.equal(5, coll:find_one({ _id = 3 }).n)
    end)

    it("reports matched but not modified for a no-op", function()
      local res = assert(coll:update_one({ _id = 3 }, { ["$set"] = { n = 5 } }))
      assert.are.equal(1, res.matched)
      assert.are.equal(0, res.modified)
      assert.are.same({ _id = 3, n = 5 }, coll:find_one({ _id = 3 }))
    end)

    it("no match changes nothing", function()
      local res = assert(coll:update_many({ n = 42 }, { ["$set"] = { n = 1 } }))
      assert.are.equal(0, res.matched)
      assert.are.equal(0, res.modified)
      assert.are.same({ { _id = 1, n = 0 }, { _id = 2, n = 0 }, { _id = 3, n = 5 } },
                      helpers.dump(coll))
    end)

    it("upsert inserts and returns the new _id", function()
      local res = assert(coll:update_one({ _id = 4 }, { ["$set"] = { n = 4 } }, { upsert = true }))
      assert.are.equal(0, res.matched)
      assert.are.equal(4, res.upserted_id)
      assert.are.same({ _id = 4, n = 4 }, coll:find_one({ _id = 4 }))
      res = assert(coll:update_many({ n = 77 }, { ["$set"] = { m = 1 } }, { upsert = true }))
      assert.are.equal("objectId", core.type(res.upserted_id))
      assert.are.equal(1, coll:find_one({ _id = res.upserted_id }).m)
      assert.are.equal(5, coll:count({}))
    end)

    it("an update without operators is refused and changes nothing", function()
      local res, err = coll:update_one({ _id = 1 }, { n = 100 })
      assert.is_nil(res)
      assert.is_string(err.message)
      assert.are.same({ _id = 1, n = 0 }, coll:find_one({ _id = 1 }))
    end)

    it("replace_one replaces the whole document", function()
      local res = assert(coll:replace_one({ _id = 1 }, { m = "new" }))
      assert.are.equal(1, res.matched)
      assert.are.equal(1, res.modified)
      assert.are.same({ _id = 1, m = "new" }, coll:find_one({ _id = 1 }))
      res = assert(coll:replace_one({ _id = 9 }, { m = "up" }, { upsert = true }))
      assert.are.equal(9, res.upserted_id)
      assert.are.same({ _id = 9, m = "up" }, coll:find_one({ _id = 9 }))
    end)

    it("replace_one refuses update operators and changes nothing", function()
      local res, err = coll:replace_one({ _id = 1 }, { ["$set"] = { n = 1 } })
      assert.is_nil(res)
      assert.is_string(err.message)
      assert.are.same({ _id = 1, n = 0 }, coll:find_one({ _id = 1 }))
    end)

    it("keeps int64 values int64 through an update", function()
      assert(coll:update_one({ _id = 1 }, { ["$set"] = { big = core.Int64(5) } }))
      local doc = assert(coll:find_one({ _id = 1 }))
      assert.are.equal(5, doc.big)
      assert(coll:replace_one({ _id = 1 }, doc))
      local again = assert(coll:find_one({ _id = 1 }))
      assert.are.equal(core.encode(doc), core.encode(again))
    end)
  end)

  describe("read, change, write back", function()
    it("keeps int64 values inside arrays int64", function()
      assert(coll:insert_one({ _id = 1, a = core.array { core.Int64(1), core.Int64(2) } }))
      local doc = assert(coll:find_one({ _id = 1 }))
      doc.b = true
      local ok, res = pcall(coll.replace_one, coll, { _id = 1 }, doc)
      assert.is_true(ok, res)
      assert(res)
      local again = assert(coll:find_one({ _id = 1 }))
      assert.is_true(again.b)
      assert.are.equal(core.encode { a = core.array { core.Int64(1), core.Int64(2) } },
                       core.encode { a = again.a })
    end)
  end)

  describe("delete", function()
    before_each(function()
      assert(coll:insert_many({ { _id = 1, k = "a" }, { _id = 2, k = "a" }, { _id = 3, k = "b" } }))
    end)

    it("delete_one removes one matching document", function()
      assert.are.equal(1, assert(coll:delete_one({ k = "a" })).deleted)
      assert.are.equal(1, coll:count({ k = "a" }))
      assert.are.equal(2, coll:count({}))
    end)

    it("delete_many removes every matching document", function()
      assert.are.equal(2, assert(coll:delete_many({ k = "a" })).deleted)
      assert.are.same({ { _id = 3, k = "b" } }, helpers.dump(coll))
    end)

    it("no match deletes nothing", function()
      assert.are.equal(0, assert(coll:delete_many({ k = "z" })).deleted)
      assert.are.equal(3, coll:count({}))
    end)

    it("delete_many with an empty filter empties the collection", function()
      assert.are.equal(3, assert(coll:delete_many({}, { write_concern = { w = 1 } })).deleted)
      assert.are.equal(0, coll:count({}))
    end)
  end)

  describe("find_and_modify", function()
    before_each(function()
      assert(coll:insert_many({ { _id = 1, n = 1, q = "x" }, { _id = 2, n = 2, q = "x" } }))
    end)

    it("returns the old document by default", function()
      local res = assert(coll:find_and_modify({ _id = 1 }, { update = { ["$inc"] = { n = 10 } } }))
      assert.are.same({ _id = 1, n = 1, q = "x" }, res.value)
      assert.are.equal(1, res.n)
      assert.is_true(res.updated_existing)
      assert.are.equal(11, coll:find_one({ _id = 1 }).n)
    end)

    it("returns the new document with new = true, limited by fields", function()
      local lacks = helpers.ferretdb_lacks("findAndModify's fields")
      if lacks then return pending(lacks) end
      local res = assert(coll:find_and_modify({ _id = 2 }, {
        update = { ["$set"] = { n = 20 } }, new = true, fields = { n = 1 } }))
      assert.are.same({ _id = 2, n = 20 }, res.value)
      assert.are.same({ _id = 2, n = 20, q = "x" }, coll:find_one({ _id = 2 }))
    end)

    it("takes the first document in sort order", function()
      local res = assert(coll:find_and_modify({ q = "x" }, {
        update = { ["$set"] = { picked = true } }, sort = { _id = -1 } }))
      assert.are.equal(2, res.value._id)
      assert.is_true(coll:find_one({ _id = 2 }).picked)
      assert.is_nil(coll:find_one({ _id = 1 }).picked)
    end)

    it("upserts", function()
      local res = assert(coll:find_and_modify({ _id = 3 }, {
        update = { ["$set"] = { n = 3 } }, upsert = true, new = true }))
      assert.are.same({ _id = 3, n = 3 }, res.value)
      assert.are.same({ _id = 3, n = 3 }, coll:find_one({ _id = 3 }))
      if EXACT_REPLIES then
        assert.are.equal(3, res.upserted_id)
        assert.is_false(res.updated_existing)
      end
    end)

    it("removes", function()
      local res = assert(coll:find_and_modify({ _id = 1 }, { remove = true }))
      assert.are.same({ _id = 1, n = 1, q = "x" }, res.value)
      assert.is_nil(coll:find_one({ _id = 1 }))
      assert.are.equal(1, coll:count({}))
      if EXACT_REPLIES then assert.are.equal(1, res.n) end
    end)

    it("no match returns no value and changes nothing", function()
      local res = assert(coll:find_and_modify({ _id = 99 }, { update = { ["$set"] = { n = 0 } } }))
      assert.is_nil(res.value)
      assert.are.same({ { _id = 1, n = 1, q = "x" }, { _id = 2, n = 2, q = "x" } }, helpers.dump(coll))
    end)

    it("takes a write concern", function()
      assert(coll:find_and_modify({ _id = 1 }, { remove = true, write_concern = { w = 1 } }))
      assert.are.equal(0, coll:count({ _id = 1 }))
    end)

    it("needs exactly one of update and remove", function()
      assert.has_error(function() coll:find_and_modify({ _id = 1 }, {}) end)
      assert.has_error(function()
        coll:find_and_modify({ _id = 1 }, { update = { ["$set"] = { n = 0 } }, remove = true })
      end)
      assert.has_error(function() coll:find_and_modify({ _id = 1 }) end)
      assert.are.equal(2, coll:count({}))
      assert.are.equal(1, coll:find_one({ _id = 1 }).n)
    end)
  end)

  describe("bulk_write", function()
    it("runs every kind of request", function()
      assert(coll:insert_many({ { _id = 1, n = 1 }, { _id = 2, n = 2 }, { _id = 3, n = 3 }, { _id = 4, n = 4 } }))
      local res = assert(coll:bulk_write({
        { op = "insert", doc = { _id = 10, n = 10 } },
        { op = "update_one", filter = { _id = 1 }, update = { ["$set"] = { n = 100 } } },
        { op = "update_many", filter = { n = { ["$gte"] = 3, ["$lt"] = 5 } }, update = { ["$inc"] = { n = 1 } } },
        { op = "replace_one", filter = { _id = 2 }, doc = { r = true } },
        { op = "delete_one", filter = { _id = 10 } },
        { op = "update_one", filter = { _id = 20 }, update = { ["$set"] = { n = 20 } }, upsert = true },
        { op = "delete_many", filter = { n = { ["$in"] = { 4, 5 } } } },
      }))
      assert.is_true(res.ok)
      assert.are.equal(1, res.inserted)
      assert.are.equal(4, res.matched)
      assert.are.equal(4, res.modified)
      assert.are.equal(3, res.deleted)
      assert.are.equal(1, res.upserted)
      assert.are.equal(7, #res.items)
      for i = 1, 7 do assert.is_true(res.items[i].ok) end
      assert.are.equal(20, res.items[6].upserted_id)
      assert.are.same({ { _id = 1, n = 100 }, { _id = 2, r = true }, { _id = 20, n = 20 } },
                      helpers.dump(coll))
    end)

    it("ordered: stops at the first failure, marks the rest not executed", function()
      assert(coll:insert_one({ _id = 2 }))
      local res = assert(coll:bulk_write({
        { op = "insert", doc = { _id = 1 } },
        { op = "insert", doc = { _id = 2 } },
        { op = "insert", doc = { _id = 3 } },
      }))
      assert.is_false(res.ok)
      assert.is_true(res.items[1].ok)
      assert.is_false(res.items[2].ok)
      assert.are.equal(11000, res.items[2].server_code)
      assert.is_string(res.items[2].message)
      assert.is_false(res.items[3].ok)
      assert.is_false(res.items[3].executed)
      if EXACT_REPLIES then assert.are.equal(1, res.inserted) end
      assert.are.same({ 1, 2 }, ids(helpers.dump(coll)))
    end)

    it("unordered: goes on after a failure", function()
      assert(coll:insert_one({ _id = 2 }))
      local res = assert(coll:bulk_write({
        { op = "insert", doc = { _id = 1 } },
        { op = "insert", doc = { _id = 2 } },
        { op = "update_one", filter = { _id = 5 }, update = { ["$set"] = { u = 1 } }, upsert = true },
      }, { ordered = false, write_concern = { w = 1 } }))
      assert.is_false(res.ok)
      assert.is_true(res.items[1].ok)
      assert.is_false(res.items[2].ok)
      assert.are.equal(11000, res.items[2].server_code)
      assert.is_nil(res.items[2].executed)
      assert.is_true(res.items[3].ok)
      assert.are.equal(5, res.items[3].upserted_id)
      assert.are.same({ { _id = 1 }, { _id = 2 }, { _id = 5, u = 1 } }, helpers.dump(coll))
    end)

    it("raises for malformed requests before writing anything", function()
      local bad = {
        {},
        { 1 },
        { { op = "upsert", doc = { _id = 1 } } },
        { { op = "insert" } },
        { { op = "update_one", update = { ["$set"] = { a = 1 } } } },
        { { op = "update_one", filter = {} } },
        { { op = "replace_one", filter = {} } },
        { { op = "delete_one" } },
        { { op = "insert", doc = { _id = 1 }, bogus = true } },
        { { op = "insert", doc = { _id = 1 } }, { op = "delete_one", filter = { f = print } } },
      }
      for i, requests in ipairs(bad) do
        assert.has_error(function() coll:bulk_write(requests) end, nil, "case " .. i)
      end
      assert.are.equal(0, coll:count({}))
    end)
  end)

  describe("indexes", function()
    it("a unique index refuses duplicates", function()
      assert.is_true(assert(coll:create_index({ email = 1 }, { unique = true })))
      assert.is_true(indexes().email_1.unique)
      assert(coll:insert_one({ _id = 1, email = "a@x" }))
      local res, err = coll:insert_one({ _id = 2, email = "a@x" })
      assert.is_nil(res)
      assert.are.equal("server", err.code)
      assert.are.equal(11000, err.server_code)
      assert.are.same({ { _id = 1, email = "a@x" } }, helpers.dump(coll))
    end)

    it("names the index as asked, keys in core.doc order", function()
      local lacks = helpers.ferretdb_lacks("the expireAfterSeconds index option")
      if lacks then return pending(lacks) end
      assert(coll:create_index(core.doc("b", 1, "a", -1), { name = "b_a", sparse = true }))
      assert(coll:create_index({ t = 1 }, { expire_after = 3600 }))
      local all = indexes()
      assert.is_not_nil(all._id_)
      assert.is_not_nil(all.b_a, "index b_a")
      assert.are.equal(core.encode(core.doc("b", 1, "a", -1)), core.encode(all.b_a.key))
      assert.is_true(all.b_a.sparse)
      assert.is_not_nil(all.t_1, "generated name t_1")
      assert.are.equal(3600, all.t_1.expireAfterSeconds)
    end)

    it("create_index raises for a plain table with several keys", function()
      assert.has_error(function() coll:create_index({ a = 1, b = 1 }) end)
      assert.has_error(function() coll:create_index({ a = 1 }, { bogus = true }) end)
      assert.has_error(function() coll:create_index({ a = 1 }, { unique = "yes" }) end)
      assert.is_nil(indexes().a_1)
    end)
  end)

  describe("drop and name", function()
    it("drop removes the collection, and is fine when it is missing", function()
      assert(coll:insert_one({ _id = 1 }))
      assert.is_true(assert(coll:drop()))
      assert.are.equal(0, coll:count({}))
      assert.is_true(assert(coll:drop()))
      assert.are.equal(0, coll:count({}))
    end)

    it("name", function()
      assert.are.equal("c", coll:name())
      assert.are.equal("other", client:collection("x", "other"):name())
    end)
  end)
end)

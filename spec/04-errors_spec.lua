-- Error tables (nil, err for runtime failures) and raised errors (bad
-- arguments).  Every failure leaves the database as it was.  Every error's
-- `code` is a string: the C core's are libmongoc's domain names ("server",
-- "stream", ...) with the number in `server_code`, the Lua layer's its own
-- ("invalid", "guard", ...).
local helpers = require "spec.helpers"
local core = helpers.core
local mongotx = require "mongotx"

describe("errors", function()

  describe("core.error", function()
    it("gives a table the error metatable, with a readable tostring", function()
      local t = { message = "boom", step = "prepare", id = 42, code = "server", server_code = 7 }
      local err = core.error(t)
      assert.are.equal(t, err)
      assert.are.equal("mongotx: prepare of 42: boom (server 7)", tostring(err))
      -- without a server_code: the code alone
      assert.are.equal("mongotx: step: m (guard)",
                       tostring(core.error { step = "step", message = "m", code = "guard" }))
      -- without code: only the message is promised
      assert.matches("^mongotx: boom", tostring(core.error { message = "boom" }))
    end)

    it("raises for a non-table", function()
      assert.has_error(function() core.error("boom") end)
      assert.has_error(function() core.error() end)
    end)
  end)

  describe("#server runtime failures", function()
    local client, coll, db

    before_each(function()
      client = helpers.client()
      db = helpers.db_name()
      coll = client:collection(db, "c")
      assert(coll:insert_one({ _id = 1, v = "original" }))
    end)

    after_each(function()
      client:close()
    end)

    local function unchanged()
      assert.are.same({ { _id = 1, v = "original" } }, helpers.dump(coll))
    end

    it("a duplicate key is nil, err with code server, server_code 11000 and the database unchanged",
    function()
      local res, err = coll:insert_one({ _id = 1, v = "duplicate" })
      assert.is_nil(res)
      assert.are.equal("table", type(err))
      assert.are.equal("server", err.code)
      assert.are.equal(11000, err.server_code)
      assert.is_nil(err.domain)
      -- the server's own words (its wording varies: "E11000 duplicate key
      -- error ...", "Duplicate key violation ..."); the code is the contract
      assert.is_truthy(err.message:find(err.reply.writeErrors[1].errmsg, 1, true))
      assert.is_false(err.transient)
      assert.are.equal("table", type(err.reply))
      assert.are.equal("table", type(err.reply.writeErrors))
      assert.are.equal(11000, err.reply.writeErrors[1].code)
      assert.are.equal("mongotx: " .. err.message .. " (server 11000)", tostring(err))
      assert.are.equal(getmetatable(core.error {}), getmetatable(err))
      unchanged()
    end)

    it("a duplicate key from an update is nil, err", function()
      local lacks = helpers.ferretdb_lacks("the duplicate-key error of an update with code 11000")
      if lacks then return pending(lacks) end
      assert(coll:create_index({ v = 1 }, { unique = true }))
      assert(coll:insert_one({ _id = 2, v = "other" }))
      local res, err = coll:update_one({ _id = 2 }, { ["$set"] = { v = "original" } })
      assert.is_nil(res)
      assert.are.equal("server", err.code)
      assert.are.equal(11000, err.server_code)
      assert.are.same({ { _id = 1, v = "original" }, { _id = 2, v = "other" } }, helpers.dump(coll))
    end)

    it("a command the server refuses is nil, err with the reply", function()
      local reply, err = client:command(db, { noSuchCommand = 1 })
      assert.is_nil(reply)
      assert.are.equal("server", err.code)
      assert.is_number(err.server_code)
      assert.are.not_equal(0, err.server_code)
      assert.is_false(err.transient)
      assert.are.equal("table", type(err.reply))
      assert.matches("^mongotx: .+ %(server %d+%)$", tostring(err))
      unchanged()
    end)
  end)

  describe("an unreachable server", function()
    local client, coll

    before_each(function()
      client = assert(core.connect("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300"))
      coll = client:collection("mtx_unreachable", "c")
    end)

    after_each(function()
      client:close()
    end)

    local function transient(res, err)
      assert.is_nil(res)
      assert.are.equal("table", type(err))
      assert.is_true(err.transient)
      assert.are.equal("server_selection", err.code)
      assert.is_nil(err.domain)
      assert.is_string(err.message)
      assert.matches("^mongotx: ", tostring(err))
    end

    it("connect succeeds; the first operation is nil, err with transient = true", function()
      transient(coll:insert_one({ _id = 1 }))
    end)

    it("every kind of operation reports it", function()
      transient(coll:find_one({}))
      transient(coll:find_all({}))
      transient(coll:count({}))
      transient(coll:update_one({}, { ["$set"] = { a = 1 } }))
      transient(coll:delete_many({}))
      transient(coll:insert_many({ { a = 1 } }))
      transient(coll:find_and_modify({}, { remove = true }))
      transient(coll:bulk_write({ { op = "insert", doc = { a = 1 } } }))
      transient(client:command("admin", { ping = 1 }))
      local cur = coll:find({})
      transient(cur:next())
      cur:close()
    end)
  end)

  describe("#server bad arguments raise", function()
    local client, coll

    before_each(function()
      client = helpers.client()
      coll = client:collection(helpers.db_name(), "c")
      assert(coll:insert_one({ _id = 1, a = 1, b = 1 }))
    end)

    after_each(function()
      -- nothing a raising call was given reached the database
      assert.are.same({ { _id = 1, a = 1, b = 1 } }, helpers.dump(coll))
      client:close()
    end)

    it("wrong argument types", function()
      assert.has_error(function() coll:insert_one("doc") end)
      assert.has_error(function() coll:insert_one() end)
      assert.has_error(function() coll:insert_one(core.array { { _id = 2 } }) end)
      assert.has_error(function() coll:insert_many({ _id = 2 }) end)
      assert.has_error(function() coll:insert_many("docs") end)
      assert.has_error(function() coll:find("filter") end)
      assert.has_error(function() coll:find_all(1) end)
      assert.has_error(function() coll:count("x") end)
      assert.has_error(function() coll:update_one({ _id = 1 }, "update") end)
      assert.has_error(function() coll:update_many(nil, { ["$set"] = { a = 2 } }) end)
      assert.has_error(function() coll:replace_one({ _id = 1 }) end)
      assert.has_error(function() coll:delete_one("x") end)
      assert.has_error(function() coll:delete_many() end)
      assert.has_error(function() coll:find_and_modify("x", { remove = true }) end)
      assert.has_error(function() coll:bulk_write("x") end)
      assert.has_error(function() coll:create_index("a") end)
      assert.has_error(function() client:collection(nil, "c") end)
      assert.has_error(function() client:collection("db") end)
      assert.has_error(function() client:command("admin", "ping") end)
      assert.has_error(function() client:command(nil, { ping = 1 }) end)
    end)

    it("a method called on the wrong handle", function()
      assert.has_error(function() coll.insert_one(client, { _id = 2 }) end)
      assert.has_error(function() client.collection(coll, "db", "c") end)
      assert.has_error(function() coll.find({}) end)
    end)

    it("values that cannot be encoded, naming the path", function()
      assert.has_error(function() coll:insert_one({ _id = 2, f = { print } }) end,
                       "mongotx: cannot encode function at f[1]")
      assert.has_error(function() coll:update_one({ _id = 1 }, { ["$set"] = { a = print } }) end)
      assert.has_error(function() coll:find_all({ a = { 1, x = 2 } }) end)
      assert.has_error(function() coll:delete_many({ ["a\0b"] = 1 }) end)
    end)

    it("unknown options", function()
      local function unknown(f)
        local ok, err = pcall(f)
        assert.is_false(ok)
        assert.matches("unknown option 'bogus'", err)
      end
      unknown(function() coll:insert_one({ _id = 2 }, { bogus = 1 }) end)
      unknown(function() coll:insert_many({ { _id = 2 } }, { bogus = 1 }) end)
      unknown(function() coll:find({}, { bogus = 1 }) end)
      unknown(function() coll:find_all({}, { bogus = 1 }) end)
      unknown(function() coll:find_one({}, { bogus = 1 }) end)
      unknown(function() coll:count({}, { bogus = 1 }) end)
      unknown(function() coll:update_one({}, { ["$set"] = { a = 2 } }, { bogus = 1 }) end)
      unknown(function() coll:update_many({}, { ["$set"] = { a = 2 } }, { bogus = 1 }) end)
      unknown(function() coll:replace_one({}, { a = 2 }, { bogus = 1 }) end)
      unknown(function() coll:delete_one({}, { bogus = 1 }) end)
      unknown(function() coll:delete_many({}, { bogus = 1 }) end)
      unknown(function() coll:find_and_modify({}, { remove = true, bogus = 1 }) end)
      unknown(function() coll:bulk_write({ { op = "delete_many", filter = {} } }, { bogus = 1 }) end)
      unknown(function() coll:create_index({ z = 1 }, { bogus = 1 }) end)
      unknown(function() client:command("admin", { ping = 1 }, { bogus = 1 }) end)
      local ok, err = pcall(coll.insert_one, coll, { _id = 2 }, { write_concern = { bogus = 1 } })
      assert.is_false(ok)
      assert.matches("unknown option 'write_concern.bogus'", err, 1, true)
    end)

    it("options of the wrong type", function()
      assert.has_error(function() coll:find_all({}, { limit = "1" }) end)
      assert.has_error(function() coll:find_all({}, { limit = -1 }) end)
      assert.has_error(function() coll:find_all({}, { skip = 1.5 }) end)
      assert.has_error(function() coll:find_all({}, { batch_size = true }) end)
      assert.has_error(function() coll:find_all({}, { projection = "a" }) end)
      assert.has_error(function() coll:find_all({}, { read_preference = "fastest" }) end)
      assert.has_error(function() coll:find_all({}, { read_preference = 1 }) end)
      assert.has_error(function() coll:find_all({}, "opts") end)
      assert.has_error(function() coll:count({}, { limit = "x" }) end)
      assert.has_error(function()
        coll:update_one({ _id = 1 }, { ["$set"] = { a = 2 } }, { upsert = "yes" })
      end)
      assert.has_error(function()
        coll:update_one({ _id = 1 }, { ["$set"] = { a = 2 } }, { write_concern = { w = true } })
      end)
      assert.has_error(function()
        coll:delete_many({}, { write_concern = "majority" })
      end)
      assert.has_error(function()
        coll:delete_many({}, { write_concern = { j = "yes" } })
      end)
      assert.has_error(function() coll:insert_many({ { _id = 2 } }, { ordered = "no" }) end)
      assert.has_error(function() coll:create_index({ z = 1 }, { name = {} }) end)
      assert.has_error(function() coll:create_index({ z = 1 }, { expire_after = -5 }) end)
    end)

    it("a plain multi-key sort table", function()
      local function needs_doc(f)
        local ok, err = pcall(f)
        assert.is_false(ok)
        assert.matches("mongotx.doc", err, 1, true)
      end
      needs_doc(function() coll:find({}, { sort = { a = 1, b = -1 } }) end)
      needs_doc(function() coll:find_all({}, { sort = { a = 1, b = -1 } }) end)
      needs_doc(function() coll:find_one({}, { sort = { a = 1, b = -1 } }) end)
      needs_doc(function()
        coll:find_and_modify({}, { remove = true, sort = { a = 1, b = -1 } })
      end)
      needs_doc(function() coll:create_index({ a = 1, b = 1 }) end)
      needs_doc(function() client:command("admin", { count = "c", query = {} }) end)
      -- one key has no order to lose, and core.doc keeps it
      assert.are.equal(1, #assert(coll:find_all({}, { sort = { a = 1 } })))
      assert.are.equal(1, #assert(coll:find_all({}, { sort = core.doc("a", 1, "b", -1) })))
    end)

    it("a raising call leaves the client usable", function()
      pcall(coll.insert_one, coll, { _id = 2, f = print })
      pcall(coll.find_all, coll, {}, { bogus = 1 })
      assert.are.equal(1, coll:count({ _id = 1 }))
      assert.are.equal(1, #assert(coll:find_all({ _id = 1 })))
    end)
  end)

  describe("#server errors of the engine", function()
    local db, tm, accounts

    before_each(function()
      db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
      tm = assert(db:manager { application = "app-1" })
      accounts = db:collection("accounts")
      assert(accounts:insert_many { { _id = "A", balance = 100 }, { _id = "B", balance = 100 } })
    end)
    after_each(function() db:close() end)

    local ops = { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } },
                  { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 1 } } } }

    -- documents, not arrays: FerretDB v1 stores no nested arrays
    local function nested(depth)
      local t = {}
      for _ = 1, depth do t = { n = t } end
      return t
    end

    local function itself()
      local t = { a = 1 }
      t.self = t
      return t
    end

    -- fn() returns nil and an invalid error finding msg, and writes nothing.
    local function invalid(fn, msg, step)
      local before = helpers.db_dump(db.client, db.name)
      local res, err = fn()
      assert.is_nil(res)
      assert.is_table(err, "expected an error table, got " .. tostring(err))
      assert.are.equal("invalid", err.code, tostring(err))
      assert.truthy(err.message:find(msg, 1, true), err.message)
      assert.are.equal(step, err.step)
      assert.matches(" %(invalid%)$", tostring(err))
      helpers.assert_dump_unchanged(before, db.client, db.name)
    end

    it("a meta that cannot be stored is nil, invalid for begin, run and transfer", function()
      local big = { s = ("x"):rep(16 * 1024 * 1024) }
      for _, call in ipairs {
        { "begin", function(meta) return tm:begin(ops, { meta = meta }) end },
        { "run", function(meta) return tm:run(ops, { meta = meta }) end },
        { "transfer", function(meta) return tm:transfer("accounts", "A", "B", 1, { meta = meta }) end },
      } do
        local step, fn = call[1], call[2]
        invalid(function() return fn(itself()) end, "meta cannot be stored: ", step)
        invalid(function() return fn(itself()) end, "contains itself at meta.self", step)
        invalid(function() return fn(nested(101)) end, "meta cannot be stored: ", step)
        invalid(function() return fn({ f = print }) end, "meta cannot be stored: ", step)
        invalid(function() return fn(big) end, "meta cannot be stored: ", step)
      end
      assert.are.equal(0, db:collection("transactions"):count({}))
    end)

    -- libmongoc refuses an empty key in an update or an inserted document
    -- when the write is sent: after the transaction is stored, the op
    -- would fail on every apply (or undo) and the transaction would stay
    -- pending.  So it is bad content, refused before anything is written.
    it("an empty key anywhere in what is stored is nil, invalid, nothing written", function()
      local function run(op) return tm:run({ op }) end
      invalid(function()
        return run { collection = "accounts", id = "B", update = { ["$set"] = { name = { [""] = 1 } } },
                     undo = { ["$unset"] = { name = "" } } }
      end, "op 1: update holds an empty key", "begin")
      invalid(function()
        return run { collection = "accounts", id = "B", update = { ["$push"] = { list = { [""] = 1 } } },
                     undo = { ["$pop"] = { list = 1 } } }
      end, "op 1: update holds an empty key", "begin")
      invalid(function()
        return run { collection = "accounts", id = "B", update = { ["$unset"] = { name = "" } },
                     undo = { ["$set"] = { name = { deep = { [""] = 1 } } } } }
      end, "op 1: undo holds an empty key", "begin")
      invalid(function()
        return run { collection = "accounts", id = "C", doc = { a = { [""] = 1 } } }
      end, "op 1: doc may not hold an empty key", "begin")
      invalid(function()
        return run { collection = "accounts", id = "C", doc = { [""] = 1 } }
      end, "op 1: doc may not hold an empty key", "begin")
      invalid(function()
        return run { collection = "accounts", id = { [""] = 1 }, doc = { a = 1 } }
      end, "op 1: id holds an empty key", "begin")
      invalid(function() return tm:run(ops, { meta = { x = { [""] = 1 } } }) end,
        "meta cannot be stored: it holds an empty key", "run")
      invalid(function() return tm:begin(ops, { meta = { ["$x"] = 1 } }) end,
        "meta cannot be stored: it holds the key \"$x\"", "begin")
      invalid(function() return tm:transfer("accounts", "A", "B", 1, { meta = { ["a.b"] = 1 } }) end,
        "meta cannot be stored: it holds the key \"a.b\"", "transfer")
      assert.are.equal(0, db:collection("transactions"):count({}))
    end)

    it("meta and ops over 16 MiB together are nil, invalid", function()
      local meta = { s = ("x"):rep(16 * 1024 * 1024 - 32 * 1024) }
      invalid(function() return tm:begin(ops, { meta = meta }) end,
        "a transaction is one document of at most 16 MiB", "begin")
    end)

    it("a meta that fits is stored", function()
      local T = assert(tm:run(ops, { meta = { user = "alice", nested = nested(50) } }))
      assert.are.equal("alice", assert(tm:get(T._id)).meta.user)
    end)

    it("commit_many and transfer_many: a bad meta is that item's error, the others run", function()
      local results, errs = tm:commit_many {
        { ops = ops, meta = itself() },
        { ops = ops, id = "k2" },
      }
      assert.is_false(results[1])
      assert.are.equal("invalid", errs[1].code)
      assert.are.equal("commit_many", errs[1].step)
      assert.truthy(errs[1].message:find("meta cannot be stored", 1, true))
      assert.are.equal("done", results[2].state)
      results, errs = tm:transfer_many {
        { collection = "accounts", from = "A", to = "B", amount = 1, id = "k3" },
        { collection = "accounts", from = "A", to = "B", amount = 1, meta = nested(101) },
      }
      assert.are.equal("done", results[1].state)
      assert.is_false(results[2])
      assert.are.equal("invalid", errs[2].code)
      local ids = {}
      for _, T in ipairs(assert(tm:find({}))) do ids[#ids + 1] = T._id end
      table.sort(ids)
      assert.are.same({ "k2", "k3" }, ids)
      assert.are.same({ A = 98, B = 102 }, (helpers.balances(accounts)))
    end)

    it("a rollback reason over 16 MiB is nil, invalid; the transaction is left as it was", function()
      local t = assert(tm:begin(ops, { id = "r1" }))
      invalid(function() return tm:rollback(t, ("x"):rep(16 * 1024 * 1024 + 1)) end,
        "reason takes 16777217 bytes", "rollback")
      local T = assert(tm:get("r1"))
      assert.are.equal("initial", T.state)
      assert.is_nil(T.reason)
      assert.is_true(assert(tm:rollback(t, ("y"):rep(1024))))
      assert.are.equal(("y"):rep(1024), assert(tm:get("r1")).reason)
    end)

    it("every error's code is a string, numbers only in server_code", function()
      local errs = {}
      local _, e = tm:begin({})
      errs[#errs + 1] = e
      _, e = tm:transfer("accounts", "A", "B", 1000, { min = 0 })
      errs[#errs + 1] = e
      _, e = db:collection("accounts"):insert_one({ _id = "A" })
      errs[#errs + 1] = e
      _, e = core.decode("abc")
      errs[#errs + 1] = e
      _, e = tm:recover { limit = 0 }
      errs[#errs + 1] = e
      _, e = db:manager { lease = 0 / 0 }
      errs[#errs + 1] = e
      assert.are.equal(6, #errs)
      for _, err in ipairs(errs) do
        assert.is_string(err.code, tostring(err))
        assert.is_nil(err.domain)
        assert.is_true(err.server_code == nil or math.type == nil or
          math.type(err.server_code) == "integer")
      end
      assert.are.same({ "invalid", "guard", "server", "bson", "invalid", "invalid" },
        { errs[1].code, errs[2].code, errs[3].code, errs[4].code, errs[5].code, errs[6].code })
      assert.are.equal(11000, errs[3].server_code)
    end)
  end)

  describe("#server option errors name the option", function()
    it("connect(uri, { tls = 'yes' }) raises naming tls, not an argument number", function()
      for _, connect in ipairs { mongotx.connect, core.connect } do
        local ok, raised = pcall(connect, helpers.uri(), { tls = "yes" })
        assert.is_false(ok)
        assert.truthy(raised:find("tls", 1, true), raised)
        assert.is_nil(raised:find("#", 1, true), raised)
      end
    end)

    it("db:manager and recover return nil, invalid for a bad value and write nothing", function()
      local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
      local tm, err = db:manager { marker = "txRemoving" }
      assert.is_nil(tm)
      assert.are.equal("invalid", err.code)
      assert.are.equal("manager", err.step)
      assert.truthy(err.message:find("option marker of manager", 1, true))
      assert.are.equal("", helpers.db_dump(db.client, db.name))
      tm = assert(db:manager {})
      local res
      res, err = tm:recover { limit = 0 }
      assert.is_nil(res)
      assert.are.equal("invalid", err.code)
      assert.are.equal(0, db:collection("transactions"):count({}))
      db:close()
    end)
  end)

  -- Crash points (csrc/fault.c): the torture suite's way to end a process
  -- at a named write.  core.crash_point lets modules written in Lua carry
  -- points too; a child process shows that it traces and crashes there.
  describe("crash points", function()
    local function run(body)
      local pid, out, script = helpers.spawn_script(string.format([[
        package.cpath = %q .. ";" .. package.cpath
        local core = require "mongotx.core"
        %s
        io.stdout:write("reached the end\n")
      ]], os.getenv("MONGOTX_CPATH") or "./build/lua54/?.so", body))
      return helpers.script_output(pid, out, script, 10)
    end

    it("core.crash_point ends the process at the armed point, and only there", function()
      local output = run([[
        core.crash_point("q.claim", "before")   -- not armed: passes
        core.fault("q.claim:after:2")
        core.crash_point("q.claim", "after")    -- first time: passes
        io.stdout:write("after the first\n"); io.stdout:flush()
        core.crash_point("q.claim", "after")    -- second: ends here
      ]])
      assert.matches("after the first", output)
      assert.matches("fault injected", output)
      assert.not_matches("reached the end", output)
    end)

    it("core.crash_point refuses a bad moment or name", function()
      assert.has_error(function() core.crash_point("x", "during") end)
      assert.has_error(function() core.crash_point(string.rep("x", 64), "before") end)
      assert.has_error(function() core.crash_point(nil, "before") end)
    end)
  end)
end)

-- Client, collection and cursor handles: connect options, close, what a
-- closed handle does, and which handle keeps which alive.
local helpers = require "spec.helpers"
local core = helpers.core

local LUAJIT = type(jit) == "table"

local function full_gc()
  collectgarbage()
  collectgarbage()
end

describe("#server handles", function()

  describe("connect", function()
    it("returns a client that reaches the server", function()
      local client = helpers.client()
      assert.matches("^mongotx%.Client %(", tostring(client))
      local reply = assert(client:command("admin", { ping = 1 }))
      assert.are.equal(1, reply.ok)
      client:close()
    end)

    it("takes appname, write_concern and read_preference", function()
      local client = assert(core.connect(helpers.uri(), {
        appname = "mongotx-spec",
        write_concern = { w = 1, j = false, wtimeout = 1000 },
        read_preference = "primaryPreferred",
      }))
      local coll = client:collection(helpers.db_name(), "c")
      assert(coll:insert_one({ _id = 1 }))
      assert.are.equal(1, coll:count({ _id = 1 }))
      client:close()
    end)

    it("returns nil, err for a malformed URI", function()
      local client, err = core.connect("not-a-uri://x")
      assert.is_nil(client)
      assert.are.equal("table", type(err))
      assert.are.equal("string", type(err.message))
      assert.matches("^mongotx: ", tostring(err))
    end)

    -- libmongoc logs why it refuses these on stderr (its process-wide log
    -- handler) and answers a vaguer error: the caller gets the why, and
    -- nothing is printed, pooled or not.
    it("says why it refuses a URI, with nothing on stderr", function()
      local cases = {
        { "mongodb://127.0.0.1/?serverSelectionTimeoutMS=abc",
          'Unsupported value for "serverSelectionTimeoutMS": "abc"' },
        { "mongodb://127.0.0.1/?maxPoolSize=9999999999", 'Unsupported value for "maxPoolSize"' },
        { "mongodb://", "Empty hostname in URI host list" },
        { "mongodb://u:pw@/db", "Empty hostname in URI host list" },
        { "mongodb://a,,b/", "Empty hostname in URI host list" },
        { "mongodb://h:99999/", 'Port could not be parsed in host "h:99999"' },
        { "mongodb://h:27x/", 'Port could not be parsed in host "h:27x"' },
        { "mongodb://h?w=1", "A '/' is required between the host list and any options" },
      }
      local lines = {}
      for _, c in ipairs(cases) do
        for _, pool in ipairs { "false", "true" } do
          lines[#lines + 1] = string.format(
            "do local c, e = core.connect(%q, { pool = %s }) print(c == nil and e.code .. ': ' .. e.message) end",
            c[1], pool)
        end
      end
      -- URIs the checks must leave to libmongoc, which takes them
      for _, uri in ipairs { "mongodb://[::1]:27017/?wtimeoutMS=99999999999",
                             "mongodb://u:p%3Fx@h:1,h2/?serverSelectionTimeoutMS=-1",
                             "mongodb://%2Ftmp%2Fm.sock/?connectTimeoutMS=10" } do
        lines[#lines + 1] = string.format(
          "do local c, e = core.connect(%q) print(c and 'taken' or tostring(e)) end", uri)
      end
      local pid, out, script = helpers.spawn_script(
        'package.cpath = os.getenv("MONGOTX_CPATH") .. ";" .. package.cpath\n' ..
        'local core = require "mongotx.core"\n' .. table.concat(lines, "\n") .. "\n")
      local said = helpers.script_output(pid, out, script)
      local got = {}
      for line in said:gmatch("[^\n]+") do
        -- (libmongoc's word on the machine, not on a URI: no shared memory to spare)
        if not line:find("mongoc: Falling back to malloc for counters", 1, true) then got[#got + 1] = line end
      end
      assert.are.equal(#lines, #got, said) -- one line each: nothing else on stderr
      for i, c in ipairs(cases) do
        for j = 0, 1 do
          local line = got[2 * i - 1 + j]
          assert.truthy(line:find(": " .. c[2], 1, true), c[1] .. " -> " .. line)
        end
      end
      for i = 2 * #cases + 1, #got do assert.are.equal("taken", got[i]) end
    end)

    it("raises for unknown options and options of the wrong type", function()
      local uri = helpers.uri()
      assert.has_error(function() core.connect(uri, { bogus = 1 }) end,
                       "mongotx: unknown option 'bogus'")
      assert.has_error(function() core.connect(uri, { write_concern = { x = 1 } }) end)
      assert.has_error(function() core.connect(uri, { write_concern = 1 }) end)
      assert.has_error(function() core.connect(uri, { read_preference = "fastest" }) end)
      assert.has_error(function() core.connect(uri, { appname = {} }) end)
      assert.has_error(function() core.connect(uri, { tls = true }) end)
      assert.has_error(function() core.connect(uri, { tls = { bogus = true } }) end)
      assert.has_error(function() core.connect(uri, "appname") end)
      assert.has_error(function() core.connect() end)
      assert.has_error(function() core.connect(uri, { [1] = "x" }) end)
    end)
  end)

  describe("client", function()
    it("close is idempotent", function()
      local client = helpers.client()
      client:close()
      client:close()
      assert.are.equal("mongotx.Client (closed)", tostring(client))
    end)

    it("raises 'attempt to use a closed client' after close", function()
      local client = helpers.client()
      client:close()
      local msg = "attempt to use a closed client"
      assert.has_error(function() client:collection("db", "c") end, msg)
      assert.has_error(function() client:command("admin", { ping = 1 }) end, msg)
      assert.has_error(function() client:set_write_concern({ w = 1 }) end, msg)
      assert.has_error(function() client:set_read_preference("primary") end, msg)
    end)

    it("a collection of a closed client raises, and writes nothing", function()
      local client = helpers.client()
      local db = helpers.db_name()
      local coll = client:collection(db, "c")
      client:close()
      assert.has_error(function() coll:insert_one({ _id = 1 }) end,
                       "attempt to use a closed client")
      assert.has_error(function() coll:find_all({}) end, "attempt to use a closed client")
      assert.has_error(function() coll:count({}) end, "attempt to use a closed client")
      local other = helpers.client()
      assert.are.equal(0, other:collection(db, "c"):count({}))
      other:close()
    end)

    it("set_write_concern and set_read_preference apply and check their argument", function()
      local client = helpers.client()
      client:set_write_concern({ w = 1, j = false })
      client:set_read_preference("primary")
      local coll = client:collection(helpers.db_name(), "c")
      assert(coll:insert_one({ _id = "wc" }))
      assert.are.same({ { _id = "wc" } }, helpers.dump(coll))
      assert.has_error(function() client:set_write_concern("majority") end)
      assert.has_error(function() client:set_write_concern({ w = true }) end)
      assert.has_error(function() client:set_write_concern({ bogus = 1 }) end)
      assert.has_error(function() client:set_read_preference("fastest") end)
      assert.has_error(function() client:set_read_preference(1) end)
      client:close()
    end)

    it("is closed by the garbage collector without close", function()
      local db = helpers.db_name()
      do
        local client = helpers.client()
        assert(client:collection(db, "c"):insert_one({ _id = 1 }))
      end
      full_gc()
      local client = helpers.client()
      assert.are.equal(1, client:collection(db, "c"):count({}))
      client:close()
    end)
  end)

  describe("collection", function()
    it("keeps its client alive", function()
      local db = helpers.db_name()
      local coll = helpers.client():collection(db, "c")
      full_gc()
      assert(coll:insert_one({ _id = 1, v = "kept" }))
      full_gc()
      assert.are.same({ { _id = 1, v = "kept" } }, helpers.dump(coll))
    end)

    it("close is idempotent; a closed collection raises", function()
      local client = helpers.client()
      local db = helpers.db_name()
      local coll = client:collection(db, "c")
      assert.are.equal("c", coll:name())
      assert.matches("^mongotx%.Collection %(c%)", tostring(coll))
      coll:close()
      coll:close()
      assert.are.equal("mongotx.Collection (closed)", tostring(coll))
      assert.has_error(function() coll:insert_one({ _id = 1 }) end,
                       "attempt to use a closed collection")
      assert.has_error(function() coll:name() end, "attempt to use a closed collection")
      assert.are.equal(0, client:collection(db, "c"):count({}))
      client:close()
    end)

    it("may be closed after its client", function()
      local client = helpers.client()
      local coll = client:collection(helpers.db_name(), "c")
      client:close()
      coll:close()
      assert.are.equal("mongotx.Collection (closed)", tostring(coll))
    end)
  end)

  describe("cursor", function()
    local client, coll

    before_each(function()
      client = helpers.client()
      coll = client:collection(helpers.db_name(), "c")
      assert(coll:insert_many({ { _id = 1 }, { _id = 2 }, { _id = 3 } }))
    end)

    after_each(function()
      client:close()
    end)

    it("walks the documents, then returns nil and stays at the end", function()
      local cur = coll:find({}, { sort = { _id = 1 }, batch_size = 1 })
      assert.matches("^mongotx%.Cursor %(", tostring(cur))
      local seen = {}
      for doc in function() return cur:next() end do seen[#seen + 1] = doc._id end
      assert.are.same({ 1, 2, 3 }, seen)
      assert.is_nil(cur:next())
      cur:close()
    end)

    it("close is idempotent; a closed cursor raises", function()
      local cur = coll:find({})
      assert.is_not_nil(cur:next())
      cur:close()
      cur:close()
      assert.are.equal("mongotx.Cursor (closed)", tostring(cur))
      assert.has_error(function() cur:next() end, "attempt to use a closed cursor")
    end)

    it("is closed with its client", function()
      local cur = coll:find({}, { batch_size = 1 })
      assert.is_not_nil(cur:next())
      client:close()
      assert.has_error(function() cur:next() end, "attempt to use a closed cursor")
    end)

    it("keeps its collection and client alive", function()
      local cur = coll:find({}, { sort = { _id = 1 }, batch_size = 1 })
      local db_coll = coll
      coll, client = nil, nil
      full_gc()
      local seen = {}
      for doc in function() return cur:next() end do seen[#seen + 1] = doc._id end
      assert.are.same({ 1, 2, 3 }, seen)
      -- give after_each something to close
      coll, client = db_coll, helpers.client()
    end)
  end)

  describe("__close", function()
    -- <close> is Lua 5.4 syntax: compiled with load() so that LuaJIT can
    -- still parse this file.
    local function run54(src, ...)
      return assert(load(src, "=close", "t"))(...)
    end

    it("closes a client, collection and cursor at the end of the scope", function()
      if LUAJIT then
        pending("LuaJIT has no to-be-closed variables (<close> is Lua 5.4)")
        return
      end
      local db = helpers.db_name()
      local client, coll, cur = run54([[
        local helpers, db = ...
        local outer_client, outer_coll, outer_cur
        do
          local client <close> = helpers.client()
          local coll <close> = client:collection(db, "c")
          assert(coll:insert_many({ { _id = 1 }, { _id = 2 } }))
          local cur <close> = coll:find({}, { batch_size = 1 })
          assert(cur:next())
          outer_client, outer_coll, outer_cur = client, coll, cur
        end
        return outer_client, outer_coll, outer_cur
      ]], helpers, db)
      assert.are.equal("mongotx.Client (closed)", tostring(client))
      assert.are.equal("mongotx.Collection (closed)", tostring(coll))
      assert.are.equal("mongotx.Cursor (closed)", tostring(cur))
      local other = helpers.client()
      assert.are.equal(2, other:collection(db, "c"):count({}))
      other:close()
    end)

    it("closes the client when the scope is left by an error", function()
      if LUAJIT then
        pending("LuaJIT has no to-be-closed variables (<close> is Lua 5.4)")
        return
      end
      local box = {}
      local ok, err = pcall(run54, [[
        local helpers, box = ...
        local client <close> = helpers.client()
        box.client = client
        error("boom")
      ]], helpers, box)
      assert.is_false(ok)
      assert.matches("boom", err)
      assert.are.equal("mongotx.Client (closed)", tostring(box.client))
    end)
  end)
end)

-- A server known not to isolate concurrent updates of one document
-- (FerretDB v1, its issue #3040) loses money under two writers (issue 34
-- item 5, docs/servers.md), so a manager refuses it, writing nothing,
-- unless its caller opts in to a single writer: `single_writer = true`,
-- or MONGOTX_SINGLE_WRITER=1 in the environment.  Runs on FerretDB: the
-- one of `make test-ferretdb`, else one this spec starts.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local server = require "spec.support.server"

-- FerretDB is built by `make test`'s set-up where a Go toolchain is found;
-- without one these cases are pending, and say why.
local function ferretdb_built()
  local f = io.open(server.cache .. "/bin/ferretdb")
  if f then f:close() end
  return f ~= nil
end

describe("#server a server that does not isolate updates of one document", function()
  local started, uri
  local absent = "FerretDB v1 is not built in " .. server.cache
    .. " (spec/support/setup.sh ferretdb needs a Go toolchain)"

  setup(function()
    if helpers.server_kind() == "ferretdb" then
      uri = helpers.uri()
    elseif ferretdb_built() then
      started = assert(server.start { kind = "ferretdb" })
      uri = started.uri
    end
  end)
  teardown(function() if started then started:stop() end end)

  -- A case that needs this FerretDB: pending, with the reason, without one.
  local function on_ferretdb(name, fn)
    it(name, function()
      if not uri then
        pending(absent)
        return
      end
      fn()
    end)
  end

  local function connect()
    return assert(mongotx.connect(uri, { database = helpers.db_name() }))
  end

  local function refused(err)
    assert.is_table(err)
    assert.are.equal("unsupported", err.code, tostring(err))
    assert.are.equal("manager", err.step)
    for _, part in ipairs { "FerretDB v1.24", "#3040", "two writers lose money",
                            "single_writer = true", "MONGOTX_SINGLE_WRITER=1" } do
      assert.truthy(err.message:find(part, 1, true), err.message)
    end
  end

  on_ferretdb("refuses a manager there, writing nothing, unless told of one writer", function()
    local db = connect()
    local before = helpers.db_dump(db.client, db.name)
    local tm, err = db:manager { application = "shop", single_writer = false }
    assert.is_nil(tm)
    refused(err)
    -- not even the transactions collection or its index
    helpers.assert_dump_unchanged(before, db.client, db.name)
    db:close()
  end)

  on_ferretdb("runs with single_writer = true", function()
    local db = connect()
    local accounts = db:collection("accounts")
    assert(accounts:insert_many({ { _id = "A", balance = 10 }, { _id = "B", balance = 0 } }, {}))
    local tm = assert(db:manager { single_writer = true })
    assert.are.equal("done", assert(tm:transfer("accounts", "A", "B", 4, { min = 0 })).state)
    assert.are.same({ A = 6, B = 4 }, (helpers.balances(accounts)))
    db:close()
  end)

  -- The default follows the environment, for a whole process tree (the
  -- command, the test targets): each child is a process of its own, with
  -- the variable set to one value, or unset.
  on_ferretdb("takes MONGOTX_SINGLE_WRITER=1 as the same promise, and nothing else", function()
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write([[
      package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path
      package.cpath = os.getenv("MONGOTX_CPATH") .. ";" .. package.cpath
      local mongotx = require "mongotx"
      local db = assert(mongotx.connect(arg[1], { database = arg[2] }))
      local tm, err = db:manager {}
      io.write(tm and "started" or err.code .. ": " .. err.message)
    ]])
    f:close()
    for _, row in ipairs {
      { env = "MONGOTX_SINGLE_WRITER=1", expected = "^started$" },
      { env = "MONGOTX_SINGLE_WRITER=yes", expected = "^unsupported: FerretDB v1" },
      { env = "-u MONGOTX_SINGLE_WRITER", expected = "^unsupported: FerretDB v1" },
    } do
      -- (stderr left out: libmongoc's warnings)
      local p = assert(io.popen(("env %s %s %s '%s' %s 2>/dev/null"):format(row.env, helpers.lua(),
        script, uri, helpers.db_name())))
      local out = p:read("*a")
      p:close()
      assert.truthy(out:match(row.expected), row.env .. ": " .. out)
    end
    os.remove(script)
  end)

  it("lets a manager start on a server that isolates them (no option needed)", function()
    if helpers.server_kind() == "ferretdb" then
      pending("this run's server is FerretDB")
      return
    end
    local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    assert(db:manager { single_writer = false })
    db:close()
  end)
end)

-- A fresh nginx deploy (docs/openresty.md, "Recovery"): examples/openresty
-- with its recovery timer, on a database that has accounts but no
-- transaction yet.  A healthy deploy logs nothing above info: the missing
-- transactions collection is said once at info, creates nothing, and
-- once the first transfer creates it recovery sweeps it without a word.
--
-- `make test-openresty` runs it (MONGOTX_OPENRESTY=1, LuaJIT); the other
-- targets report it pending.
local helpers = require "spec.helpers"

if os.getenv("MONGOTX_OPENRESTY") ~= "1" then
  describe("#openresty a fresh deploy's log", function()
    pending("needs nginx and its Lua module: make test-openresty runs it")
  end)
  return
end

local server = require "spec.support.server"
local nginx = require "spec.support.nginx"
local mongotx = require "mongotx"
local sleep = mongotx.core.sleep

-- The lines of the log above info, but nginx's own notices of its start
-- and stop (signals, worker processes): what a healthy deploy must not
-- show.
local function loud(log)
  local out = {}
  for line in log:gmatch("[^\n]+") do
    local level = line:match("^%S+ %S+ %[(%a+)%]")
    if level and level ~= "info" and level ~= "debug"
        and not (level == "notice" and not line:find("mongotx", 1, true)) then
      out[#out + 1] = line
    end
  end
  return out
end

local function collections(db, name)
  local names = {}
  local reply = assert(db.client:command(name, { listCollections = 1 }))
  for _, c in ipairs(reply.cursor.firstBatch) do names[#names + 1] = c.name end
  table.sort(names)
  return names
end

describe("#openresty a fresh deploy's log", function()
  local srv

  setup(function() srv = assert(server.start { kind = "memory" }) end)
  teardown(function() if srv then srv:stop() end end)

  it("says at info, once, that there is nothing to recover yet, then sweeps quietly", function()
    local name = helpers.db_name()
    local db = assert(mongotx.connect(srv.uri, { database = name }))
    assert(db:collection("accounts"):insert_many {
      { _id = "A", balance = 100 }, { _id = "B", balance = 0 },
    })
    local n = assert(nginx.start { uri = srv.uri, database = name, workers = 2, log_level = "info",
      configure = "{ recovery = { every = 0.1 } }" })
    finally(function() n:stop() end)

    -- passes every 0.1 s in the elected worker: a second is about ten
    local said
    for _ = 1, 100 do
      said = nginx.readfile(n.log) or ""
      if said:find("has no collection transactions", 1, true) then break end
      sleep(0.1)
    end
    sleep(1)
    said = nginx.readfile(n.log)
    local _, told = said:gsub("%[info%][^\n]*mongotx recovery: [^\n]*has no collection transactions", "")
    assert.are.equal(1, told, said)
    assert.are.same({}, loud(said))
    assert.are.same({ "accounts" }, collections(db, name)) -- nothing created

    -- the first transfer creates the collection; recovery then finds it
    local status, body = n:request("POST", "/transfer", '{"from":"A","to":"B","amount":30}')
    assert.are.equal(200, status, body)
    sleep(1)
    said = nginx.readfile(n.log)
    assert.are.same({}, loud(said))
    local names = table.concat(collections(db, name), " ")
    assert.truthy((" " .. names .. " "):find(" transactions ", 1, true), names)
    assert.are.equal(70, db:collection("accounts"):find_one({ _id = "A" }).balance)
    assert.are.equal(1, assert(db:collection("transactions"):count({ state = "done" })))
    assert(db.client:command(name, { dropDatabase = 1 }))
    db:close()
  end)
end)

-- A mistyped name never creates what it names (issue 26): every
-- subcommand of `mongotx` refuses a transactions collection (or a
-- database) that does not exist, with a message naming both, exit 1, and
-- the database's collections are the same after.  Names are compared by
-- the command, not left to listCollections' filter, which
-- mongo-java-server ignores (it answers with every collection, in one
-- batch, whatever batchSize says: the getMore of mongotx.catalog, for a
-- server that both ignores the filter and batches, is not reached here).

local helpers = require "spec.helpers"
local cli = require "spec.support.cli"
local mongotx = require "mongotx"

-- The collection names of database `name`, sorted.
local function collections(db, name)
  local names = {}
  local reply = assert(db.client:command(name, mongotx.doc("listCollections", 1,
    "nameOnly", true, "cursor", { batchSize = 1000 })))
  assert(reply.cursor.id == 0)
  for _, c in ipairs(reply.cursor.firstBatch) do names[#names + 1] = c.name end
  table.sort(names)
  return names
end

local COMMANDS = {
  { "status" }, { "list" }, { "list", "--parked" }, { "show", "t1" }, { "recover" },
  { "recover", "--limit", "5" }, { "rollback", "t1" }, { "compensate", "t1" },
  { "unpark", "t1" }, { "prune" }, { "prune", "--dry-run" },
}

describe("#server the mongotx command and names that do not exist", function()
  local db

  before_each(function()
    if cli.no_build then return end
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    local tm = assert(db:manager{ application = "app-1" })
    assert(db:collection("accounts"):insert_one({ _id = "A", balance = 1 }))
    assert(tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 1 } } } },
      { id = "t1" }))
  end)

  after_each(function() if db then db:close() end end)

  it("refuses a mistyped --collection or --database in every subcommand, creating nothing",
    function()
    if cli.no_build then pending(cli.no_build) return end
    local before = collections(db, db.name)
    local other = helpers.db_name()
    for _, args in ipairs(COMMANDS) do
      for _, where in ipairs {
        { { "--database", db.name, "--collection", "transaction" }, db.name, "transaction" },
        { { "--database", other }, other, "transactions" },
      } do
        local words = {}
        for _, w in ipairs(where[1]) do words[#words + 1] = w end
        for _, w in ipairs(args) do words[#words + 1] = w end
        local code, out, err = cli.run(words)
        local said = table.concat(words, " ") .. ":\n" .. err
        assert.are.equal(1, code, said)
        assert.are.equal("", out, said)
        assert.truthy(err:find("database " .. where[2] .. " has no collection " .. where[3],
          1, true), said)
        assert.truthy(err:find("nothing was created", 1, true), said)
      end
    end
    assert.are.same(before, collections(db, db.name))
    assert.are.same({}, collections(db, other))
    assert.are.equal(0, assert(db:manager{}):stats().done)
  end)

  it("finds the collection among 150 others (every one of them in the answer where the " ..
     "filter is ignored)", function()
    if cli.no_build then pending(cli.no_build) return end
    for i = 1, 150 do assert(db:collection(string.format("c%03d", i)):insert_one({ _id = 1 })) end
    assert(db:manager{ collection = "zz-transactions" })
    local before = collections(db, db.name)
    local code, out, err = cli.run({ "--database", db.name, "--collection", "zz-transactions",
                                     "status" })
    assert.are.equal(0, code, err)
    assert.truthy(out:find("initial:%s+0"), out)
    code, out, err = cli.run({ "--database", db.name, "--collection", "zz-transaction", "status" })
    assert.are.equal(1, code, err)
    assert.are.equal("", out)
    assert.truthy(err:find("has no collection zz-transaction ", 1, true), err)
    assert.are.same(before, collections(db, db.name))
  end)
end)

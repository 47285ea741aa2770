-- A batch's bulk applies and finishes go in the order of their documents'
-- _id (mongotx.batch): FerretDB v2 runs a bulk write in one PostgreSQL
-- transaction, and two that lock two hot rows in opposite orders
-- deadlock (PostgreSQL finds it after a second).  Proved on what the
-- server received: this spec starts its own mongo-java-server with its
-- debug log, which holds every command as sent, and reads the order of
-- the documents in each update command of its database.
local helpers = require "spec.helpers"
local server = require "spec.support.server"
local mongotx = require "mongotx"

describe("#server bulk writes of a batch", function()
  local s, db, name

  setup(function()
    s = assert(server.start { kind = "memory", log_level = "debug" })
    name = helpers.db_name()
    db = assert(mongotx.connect(s.uri, { database = name }))
  end)

  teardown(function()
    if db then db:close() end
    if s then s:stop() end
  end)

  -- The ids of each update command's statements on `coll` in this
  -- spec's database, in the order sent: a list of lists.
  local function updates(coll)
    local out = {}
    local head = '^{"update" : "' .. coll .. '"'
    local marker = '"$db" : "' .. name .. '"'
    for line in io.lines(s.log) do
      local doc = line:match("document: (%b{})")
      if doc and doc:find(head) and doc:find(marker, 1, true) then
        local ids = {}
        for id in doc:gmatch('"q" : { "_id" : "(%a+)"') do ids[#ids + 1] = id end
        out[#out + 1] = ids
      end
    end
    return out
  end

  for _, fencing in ipairs { "auto", "version" } do
    it("go in the order of their documents' _id (fencing " .. fencing .. ")", function()
      local coll = "accounts_" .. fencing
      local accounts = db:collection(coll)
      local docs = {}
      for i, id in ipairs { "a", "b", "c", "d", "e", "f" } do docs[i] = { _id = id, balance = 100 } end
      assert(accounts:insert_many(docs))
      local tm = assert(db:manager { application = "order", fencing = fencing })
      -- debits from the later ids, credits to the earlier ones
      assert(tm:transfer(coll, "f", "a", 1))
      assert(tm:transfer(coll, "e", "b", 1, { min = 0 }))
      local res = tm:transfer_many {
        { collection = coll, from = "f", to = "a", amount = 1 },
        { collection = coll, from = "d", to = "c", amount = 1 },
        { collection = coll, from = "e", to = "b", amount = 1 } }
      for i = 1, 3 do assert.truthy(res[i], "transfer " .. i) end
      local many = 0
      for _, ids in ipairs(updates(coll)) do
        if #ids > 1 then many = many + 1 end
        local sorted = {}
        for i, id in ipairs(ids) do sorted[i] = id end
        table.sort(sorted)
        assert.are.same(sorted, ids)
      end
      -- the applies and finishes of the plain transfer and of the batch
      assert.is_true(many >= 4, "only " .. many .. " bulk writes of several documents")
      local b = {}
      for _, d in ipairs(assert(accounts:find_all({}, { sort = { _id = 1 } }))) do b[#b + 1] = d.balance end
      assert.are.same({ 102, 102, 101, 99, 98, 98 }, b)
    end)
  end
end)

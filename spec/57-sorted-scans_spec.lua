-- Scans that do not trust an unsorted cursor: FerretDB v2 returns a
-- document more than once across the replies of an unsorted find after
-- updates (its cursor goes on from a row's place, which an update moves),
-- and may skip one.  mongotx's own reads of many documents (recovery,
-- tm:find and tm:scan, prune, each, the batches' reads by ids, the bench
-- checks) send a sort, so no server's cursor makes them count a document
-- twice or miss one.  Proved on what the server received: this spec
-- starts its own mongo-java-server with its debug log, which holds every
-- command as sent, drives each of those reads, and checks that every
-- `find` of its database for more than one document carries a sort
-- (`_id`, or `lastModified` for the indexed reads of the oldest, which
-- are limited).
local helpers = require "spec.helpers"
local server = require "spec.support.server"
local mongotx = require "mongotx"
local bank = require "bench.bank"

describe("#server mongotx's reads of many documents", function()
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

  -- The find commands of this spec's database in the server's log, as
  -- sent: { text = <the command document>, sort = <its sort's text> }.
  local function finds()
    local out = {}
    local marker = '"$db" : "' .. name .. '"'
    for line in io.lines(s.log) do
      local doc = line:match("document: (%b{})")
      if doc and doc:find('^{"find" : ') and doc:find(marker, 1, true) then
        out[#out + 1] = { text = doc, sort = doc:match('"sort" : (%b{})') }
      end
    end
    return out
  end

  it("every find sends a sort, whichever read sends it", function()
    local accounts = db:collection(bank.COLLECTION)
    local docs = {}
    for i = 1, 300 do docs[i] = { _id = i, balance = bank.START } end
    assert(accounts:insert_many(docs))
    -- versions read for 150 transfers: 300 ids, more than one reply
    local tm = assert(db:manager { application = "scan", fencing = "version" })
    local list = {}
    for i = 1, 150 do list[i] = { collection = bank.COLLECTION, from = 2 * i - 1, to = 2 * i, amount = 1 } end
    local res = tm:transfer_many(list)
    for i = 1, 150 do assert.truthy(res[i], "transfer " .. i) end
    bank.check_accounts(db, 300) -- the bench's check of the accounts

    -- a backlog left by a manager that went away: never started, and
    -- pending with its debit applied; recovery drives both
    local gone = assert(db:manager { application = "gone", lease = 0 })
    local function ops(from, to)
      return { { collection = bank.COLLECTION, id = from, update = { ["$inc"] = { balance = -1 } } },
               { collection = bank.COLLECTION, id = to, update = { ["$inc"] = { balance = 1 } } } }
    end
    local waiting = assert(gone:begin(ops(1, 2)))
    local half = assert(gone:begin(ops(3, 4)))
    assert(gone:step("claim", half))
    assert(gone:step("apply", half, 1))
    local txs = db:collection("transactions")
    helpers.age(txs, waiting._id, 3600)
    helpers.age(txs, half._id, 3600)
    local report = assert(tm:recover())
    assert.are.same({ 2, 2 }, { report.examined, report.done })

    -- a cancelled transaction with an insert (prune reads them for
    -- placeholders first), then everything pruned
    local T, err = tm:run({
      { collection = "orders", id = "o1", kind = "insert", doc = { item = "pen" } },
      { collection = bank.COLLECTION, id = 5, kind = "assert", where = { balance = { ["$lt"] = 0 } } } })
    assert.is_nil(T)
    assert.are.equal("guard", err.code)

    -- a resumable job, run twice (the second run reads what the first left)
    local items = {}
    for i = 1, 20 do items[i] = i end
    local function job(i) return ops(100 + i, 200 + i) end
    local opts = { id = "job", key = function(i) return i end }
    assert.are.equal(20, assert(tm:each(items, job, opts)).committed)
    assert.are.equal(20, assert(tm:each(items, job, opts)).skipped)

    -- the lists, with no sort given
    local found = assert(tm:find({ state = "done" }))
    local cursor = assert(tm:scan({ state = "done" }, { batch_size = 50 }))
    local scanned = 0
    while cursor:next() do scanned = scanned + 1 end
    cursor:close()
    assert.are.equal(#found, scanned)
    assert.are.equal(172, scanned) -- 150 + the 2 recovered + the job's 20

    assert.are.equal(10, assert(tm:prune { older_than = 0, limit = 10 }))
    assert.are.equal(163, assert(tm:prune { older_than = 0 }))
    assert.are.equal(0, txs:count({}))

    local sent, unsorted, reads = finds(), {}, {}
    for _, f in ipairs(sent) do
      if not f.sort then
        -- (a find of limit 1 reads one document: nothing to repeat)
        if not f.text:find('"limit" : 1[,}]') then unsorted[#unsorted + 1] = f.text end
      elseif not (f.sort:find('^{"_id" : 1') or f.sort:find('^{"lastModified" : 1')) then
        unsorted[#unsorted + 1] = "sorted by another key: " .. f.text
      end
      for what, pattern in pairs {
        ids = '"_id" : {"$in" : ', placeholders = '"ops.kind" : "insert"',
        stale = '"parked" : {"$ne" : true}', accounts = '^{"find" : "accounts", "filter" : {}',
        done = '"filter" : {"state" : "done"}' } do
        if f.text:find(pattern) then reads[what] = (reads[what] or 0) + 1 end
      end
    end
    assert.are.same({}, unsorted)
    -- each kind of read was seen (the spec would pass on nothing else)
    for _, what in ipairs { "ids", "placeholders", "stale", "accounts", "done" } do
      assert.truthy(reads[what], "no " .. what .. " read in the server's log")
    end
  end)
end)

-- Every read is bounded (issue 29): tm:find has a default limit and a
-- maximum; prune's clean-up of placeholders, L:reconcile, L:balance,
-- L:commit, sync:repair and v:read read from the server a reply or a
-- chunk at a time, whatever lies in the collection.  What a read brought
-- is counted from the server's replies (client:returned(), as spec/19
-- does) and its round trips from
-- client:counters(): a read cut into replies of n documents takes one
-- more command per n documents, which a read held whole does not.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local options = require "mongotx.options"
local operate = require "mongotx.manager.operate"
local committer = require "mongotx.ledger.committer"
local accounts = require "mongotx.ledger.accounts"
local versioned = require "mongotx.versioned"
local sync = require "mongotx.sync"
local patterns = require "spec.support.patterns"

local core = mongotx.core

local no_ledger = helpers.ferretdb_lacks("a unique index on a path inside an array of " ..
  "documents nor $elemMatch with field conditions (spec/60)")

describe("#server bounded reads", function()
  local db

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
  end)
  after_each(function() db:close() end)

  -- The commands and documents `fn` cost, as the client counted them.
  local function cost(fn)
    db.client:reset_counters()
    local out = fn()
    return db.client:counters().commands, db.client:returned(), out
  end

  -- With module field `m[k]` set to `v` for the length of `fn`.
  local function with(m, k, v, fn)
    local was = m[k]
    m[k] = v
    local ok, a, b, c = pcall(fn)
    m[k] = was
    if not ok then error(a, 0) end
    return a, b, c
  end

  describe("tm:find", function()
    local tm

    before_each(function()
      tm = assert(db:manager { application = "app-1" })
      -- more finished transactions than the default limit
      local docs = {}
      for i = 1, options.FIND_LIMIT + 200 do
        docs[i] = { _id = i, state = "done", application = "app-1", ops = {},
                    lastModified = core.Date(1000 * i) }
      end
      assert(db:collection("transactions"):insert_many(docs, {}))
    end)

    it("returns at most 1000 without a limit, the oldest first when sorted", function()
      local _, read, list = cost(function()
        return assert(tm:find({}, { sort = { lastModified = 1 } }))
      end)
      assert.are.equal(options.FIND_LIMIT, #list)
      assert.are.equal(options.FIND_LIMIT, read)
      assert.are.equal(1, list[1]._id)
      assert.are.equal(options.FIND_LIMIT, list[#list]._id)
    end)

    it("takes a limit above the default, up to the maximum", function()
      local _, read, list = cost(function()
        return assert(tm:find({ state = "done" }, { limit = options.FIND_LIMIT + 150 }))
      end)
      assert.are.equal(options.FIND_LIMIT + 150, #list)
      assert.are.equal(options.FIND_LIMIT + 150, read)
      assert.are.equal(options.FIND_LIMIT + 200,
                       #assert(tm:find({}, { limit = options.FIND_MAX })))
    end)

    it("refuses a limit above the maximum as invalid, reading nothing", function()
      local commands, read, out = cost(function()
        return { tm:find({}, { limit = options.FIND_MAX + 1 }) }
      end)
      assert.is_nil(out[1])
      assert.are.equal("invalid", out[2].code)
      assert.matches("limit of find must be a whole number from 1 to 100000", out[2].message)
      assert.are.equal(0, commands)
      assert.are.equal(0, read)
    end)
  end)

  it("prune reads the placeholders' transactions a reply at a time", function()
    local tm = assert(db:manager { application = "app-1", lease = 0 })
    local orders = db:collection("orders")
    -- 25 transactions, each debiting A and inserting an order, applied
    -- to the debit and rolled back by recovery: each leaves a placeholder
    assert(db:collection("accounts"):insert_one({ _id = "A", balance = 1000 }))
    local n = 25
    for i = 1, n do
      local t = assert(tm:begin({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } },
        { collection = "orders", id = "o-" .. i, doc = { item = "x" } },
      }, { id = "t-" .. i }))
      assert(tm:step("claim", t))
      assert(tm:step("apply", t, 1))
    end
    core.sleep(0.01)
    local back = assert(db:manager { application = "recoverer", stale_after = 0, lease = 0,
                                     stale_pending = function() return "back" end })
    assert.are.equal(n, assert(back:recover()).cancelled)
    core.sleep(0.01)
    assert.are.equal(n, orders:count({ txPlaceholder = { ["$exists"] = true } }))
    -- the same prune twice, on two copies of the backlog: read in one
    -- reply, then in replies of 10 (a find and its getMores)
    local function prune(read)
      return with(operate, "PRUNE_READ", read, function()
        return cost(function() return assert(tm:prune { older_than = 0, dry_run = false }) end)
      end)
    end
    local whole_cmds, whole_read, whole_n
    do
      -- a copy of the database's state for the second run
      local txs = db:collection("transactions")
      local saved_tx, saved_orders = helpers.dump(txs), helpers.dump(orders)
      whole_cmds, whole_read, whole_n = prune(1000)
      assert.are.equal(n, whole_n)
      assert.are.equal(0, orders:count({}))
      assert(txs:insert_many(saved_tx, {}))
      assert(orders:insert_many(saved_orders, {}))
    end
    local cmds, read, pruned = prune(10)
    assert.are.equal(n, pruned)
    assert.are.equal(0, orders:count({}))
    assert.are.equal(0, db:collection("transactions"):count({}))
    -- every transaction read once either way; 25 in replies of 10 is a
    -- find and two getMores, two commands more than one reply of 25
    assert.are.equal(whole_read, read)
    assert.are.equal(whole_cmds + 2, cmds)
  end)

  it("prune with a limit deletes the oldest a step of ids at a time", function()
    local tm = assert(db:manager { application = "app-1" })
    local txs = db:collection("transactions")
    local docs = {}
    for i = 1, 30 do
      docs[i] = { _id = i, state = "done", application = "app-1", ops = {},
                  lastModified = core.Date(1000 * i) }
    end
    local function prune(read)
      assert(txs:delete_many({}))
      assert(txs:insert_many(docs, {}))
      return with(operate, "PRUNE_READ", read, function()
        return cost(function() return assert(tm:prune { older_than = 0, limit = 25 }) end)
      end)
    end
    local whole_cmds, whole_read, whole_n = prune(1000)
    local cmds, read, n = prune(10)
    assert.are.equal(25, whole_n)
    assert.are.equal(25, n)
    local left = {}
    for _, T in ipairs(helpers.dump(txs)) do left[#left + 1] = T._id end
    assert.are.same({ 26, 27, 28, 29, 30 }, left)
    -- the same 25 ids read either way; in steps of 10, 10 and 5, each a
    -- find of ids, one of placeholders and a delete: six commands more
    assert.are.equal(25, read)
    assert.are.equal(whole_read, read)
    assert.are.equal(whole_cmds + 6, cmds)
  end)

  it("L:reconcile replays an account in chunks of seqIds", function()
    if no_ledger then pending(no_ledger) return end
    local L = assert(db:ledger {})
    local n = 35
    for i = 1, n do assert(L:post({ { account = "A", value = i } })) end
    assert(L:commit())
    local function reconcile(chunk)
      return with(committer, "RECONCILE_CHUNK", chunk, function()
        return cost(function() return assert(L:reconcile("A")) end)
      end)
    end
    local whole_cmds, whole_read, whole = reconcile(1000)
    local cmds, read, report = reconcile(10)
    assert.are.same({ balance = n * (n + 1) / 2, seq = n, ok = true, problems = {} }, report)
    assert.are.same(whole, report)
    -- every entry read once either way; 35 in chunks of 10 is four reads
    -- and an empty one, against one and an empty one
    assert.are.equal(whole_read, read)
    assert.are.equal(whole_cmds + 3, cmds)
    -- a chunk is a range of seqIds: a problem in a later chunk still shows
    assert(db:collection("ledger"):update_one({ ["changes.seqId"] = 23 },
      { ["$set"] = { ["changes.0.cacheBal"] = 1 } }))
    local _, _, broken = reconcile(10)
    assert.is_false(broken.ok)
    assert.are.same({ "cacheBal 1 at seqId 23, the replay gives 276" }, broken.problems)
  end)

  it("L:balance reads an account's uncommitted tail in chunks of seqIds", function()
    if no_ledger then pending(no_ledger) return end
    local L = assert(db:ledger {})
    local n = 45 -- no commit: every entry is after the (missing) head
    for i = 1, n do assert(L:post({ { account = "A", value = i } })) end
    local function balance(chunk)
      return with(accounts, "TAIL_CHUNK", chunk, function()
        return cost(function() return { assert(L:balance("A")) } end)
      end)
    end
    local whole_cmds, whole_read, whole = balance(1000)
    local cmds, read, got = balance(10)
    assert.are.same({ n * (n + 1) / 2, n }, got)
    assert.are.same(whole, got)
    -- no head yet; 8 entries one by one, then the other 37 in chunks of
    -- 10 (four reads) against one read of them all
    assert.are.equal(whole_read, read)
    assert.are.equal(n, read)
    assert.are.equal(whole_cmds + 3, cmds)
  end)

  it("L:history reads a page of entries, no more", function()
    if no_ledger then pending(no_ledger) return end
    local L = assert(db:ledger {})
    local n = 45
    for i = 1, n do assert(L:post({ { account = "A", value = i } })) end
    local reads, after = {}, nil
    repeat
      local cmds, read, page = cost(function()
        local p, a = assert(L:history("A", { after = after, limit = 10 }))
        after = a
        return p
      end)
      reads[#reads + 1] = { #page, read, cmds }
    until after == nil
    -- each page: 8 entries one by one, then one range of the 2 it lacks
    -- (the last: 5 found, the sixth lookup finds none)
    assert.are.same({ { 10, 10, 9 }, { 10, 10, 9 }, { 10, 10, 9 }, { 10, 10, 9 }, { 5, 5, 6 } }, reads)
  end)

  it("L:commit caches an account's tail a chunk a call", function()
    if no_ledger then pending(no_ledger) return end
    local L = assert(db:ledger {})
    local n = 25
    for i = 1, n do assert(L:post({ { account = "A", value = i } })) end
    local heads, entries = db:collection("ledger_accounts"), db:collection("ledger")
    local seqs = {}
    with(accounts, "TAIL_CHUNK", 10, function()
      for _ = 1, 4 do
        local r = assert(L:commit { account = "A" })
        seqs[#seqs + 1] = { r.cached, assert(heads:find_one({ _id = "A" })).seq }
      end
    end)
    -- 8 walked one by one and 2 of the first chunk, then 10, then the last 5
    assert.are.same({ { 10, 10 }, { 10, 20 }, { 5, 25 }, { 0, 25 } }, seqs)
    assert.are.equal(n * (n + 1) / 2, assert(heads:find_one({ _id = "A" })).balance)
    assert.are.equal(0, entries:count({ proc = "UNCOMMITTED" }))
    assert.is_true(assert(L:reconcile("A")).ok)
    local none, err = L:commit { limit = 100001 }
    assert.is_nil(none)
    assert.are.equal("invalid", err.code)
  end)

  it("sync:repair reads the flagged masters a reply at a time", function()
    -- 25 masters flagged long ago (seed 002's recipe: no syncId), one
    -- propagated per call of propagate
    local masters = db:collection("masters")
    local docs = {}
    for i = 1, 25 do docs[i] = { _id = i, syncing = core.Date(1000 + i) } end
    local propagated = {}
    local s = assert(db:sync { collection = "masters", propagate = function(m)
      propagated[#propagated + 1] = m._id
      return true
    end })
    local function repair(read, limit)
      assert(masters:delete_many({}))
      assert(masters:insert_many(docs, {}))
      propagated = {}
      return with(sync, "READ", read, function()
        return cost(function() return assert(s:repair { older_than = 0, limit = limit }) end)
      end)
    end
    local whole_cmds, whole_read, whole = repair(1000, 1000)
    local cmds, read, report = repair(10, 1000)
    assert.are.same(whole, report)
    assert.are.same({ repaired = 25, failed = {}, parked = 0 }, report)
    assert.are.same({ 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                      21, 22, 23, 24, 25 }, propagated) -- oldest flag first
    assert.are.equal(0, masters:count({ syncing = { ["$exists"] = true } }))
    -- 25 in replies of 10: a find and two getMores, against one reply
    assert.are.equal(whole_read, read)
    assert.are.equal(whole_cmds + 2, cmds)
    -- a limit reads no further than asked
    local _, few, some = repair(10, 12)
    assert.are.equal(12, some.repaired)
    assert.are.equal(13, masters:count({ syncing = { ["$exists"] = true } }))
    assert.are.equal(12, few)
  end)

  it("v:read streams the item versions, keeping only the structure", function()
    patterns.versioned_setup(db) -- items a..e at version 1
    local trees = patterns.trees(db)
    -- 6 more versions of each of the 5 items: 35 stored versions
    for _ = 1, 6 do
      local w = assert(trees:begin(patterns.ROOT))
      for _, id in ipairs { "a", "b", "c", "d", "e" } do assert(w:put(id, { n = w.version })) end
      assert(w:publish())
    end
    local function read(size)
      return with(versioned, "READ", size, function()
        return cost(function() return assert(trees:read(patterns.ROOT)) end)
      end)
    end
    local whole_cmds, whole_read, whole = read(1000)
    local cmds, got, tree = read(10)
    assert.are.same(whole, tree)
    assert.are.equal(7, tree.version)
    assert.are.equal(5, #tree.items)
    for _, item in ipairs(tree.items) do assert.are.same({ n = 7 }, item.doc) end
    -- 35 versions (and the root) either way; in replies of 10 a find and
    -- three getMores, three commands more than one reply
    assert.are.equal(36, got)
    assert.are.equal(whole_read, got)
    assert.are.equal(whole_cmds + 3, cmds)
  end)
end)

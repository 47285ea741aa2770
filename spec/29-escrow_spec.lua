-- Escrow (docs/guards.md, "Escrow"): a credit waits in its document's
-- txPending until its transaction finishes, so that a floor guard never
-- reads it before the commit and never waits for it.  Walked step by step,
-- through the guards that meet it committed and uncommitted, through
-- recovery from each state a crash leaves, compensation, and several
-- processes on three hot accounts while this one checks the invariants
-- at every poll.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local util = require "luassert.util"

local concurrency = helpers.no_concurrency()

local function inc(id, n, where)
  return { collection = "accounts", id = id, update = { ["$inc"] = { balance = n } }, where = where }
end
local function transfer_ops(from, to, n)
  return { inc(from, -n, { balance = { ["$gte"] = n } }), inc(to, n) }
end

describe("#server escrow", function()
  local db, accounts, tm

  local function setup(balances)
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    accounts = db:collection("accounts")
    local docs = {}
    for id, b in pairs(balances) do
      docs[#docs + 1] = { _id = id, balance = b, pendingTransactions = mongotx.array() }
    end
    assert(accounts:insert_many(docs))
    tm = assert(db:manager { application = "app-1" })
  end

  after_each(function() if db then db:close() end db = nil end)

  local function doc(id) return assert(accounts:find_one({ _id = id })) end
  -- { balance, txPending.balance (nil when absent), markers }
  local function seen(id)
    local d = doc(id)
    return { d.balance, d.txPending and d.txPending.balance, #d.pendingTransactions }
  end

  it("walks the tutorial's steps with the credit in escrow until B's finish", function()
    setup { A = 1000, B = 1000 }
    local t = assert(tm:begin(transfer_ops("A", "B", 100), { id = 1 }))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 1))
    assert(tm:step("apply", t, 2))
    assert(tm:step("apply", t, 2)) -- a repeat changes nothing
    assert.are.same({ 900, nil, 1 }, seen("A"))
    assert.are.same({ 1000, 100, 1 }, seen("B"))
    assert(tm:step("commit", t))
    assert.are.same({ 1000, 100, 1 }, seen("B")) -- committed, not finished
    assert(tm:step("finish", t, 2))
    assert.are.same({ finished = false }, assert(tm:step("finish", t, 2))) -- moved once
    assert.are.same({ 1100, 0, 0 }, seen("B"))
    assert(tm:step("finish", t, 1))
    assert(tm:step("done", t))
    assert.are.same({ 900, nil, 0 }, seen("A"))
    assert.are.same({ 1100, 0, 0 }, seen("B"))
  end)

  it("takes an uncommitted credit back out of escrow when cancelled", function()
    setup { A = 1000, B = 1000 }
    local t = assert(tm:begin(transfer_ops("A", "B", 100)))
    assert(tm:step("claim", t))
    assert(tm:step("apply", t, 2))
    assert(tm:step("apply", t, 2))
    assert.are.same({ 1000, 100, 1 }, seen("B"))
    assert.is_true(tm:rollback(t, "changed my mind"))
    assert.are.same({ 1000, 0, 0 }, seen("B"))
    assert.are.same({ 1000, nil, 0 }, seen("A"))
    assert.are.equal("cancelled", assert(tm:get(t._id)).state)
  end)

  -- The isolation promise on the escrow path: the guard reads B's
  -- balance without the credit while it may be undone, and with it once
  -- committed (the committed holder is finished first).
  it("a floor guard never spends an uncommitted credit, and spends a committed one", function()
    setup { A = 100, B = 0, C = 0 }
    local t1 = assert(tm:begin(transfer_ops("A", "B", 40), { id = "t1" }))
    assert(tm:step("claim", t1))
    assert(tm:step("apply", t1, 1))
    assert(tm:step("apply", t1, 2))
    local other = assert(db:manager { application = "app-2", retries = 0 })
    local res, err = other:transfer("accounts", "B", "C", 40, { min = 0, id = "t2" })
    assert.is_nil(res, "a guard spent a credit that was not committed")
    assert.are.equal("guard", err.code) -- refused at once, nobody waited
    assert.are.same({ 0, 40, 1 }, seen("B"))
    -- committed but not finished: the guard finishes t1 on B, then passes
    assert(tm:step("commit", t1))
    assert(other:transfer("accounts", "B", "C", 40, { min = 0, id = "t3" }))
    assert.are.same({ 0, 0, 0 }, seen("B"))
    assert.are.same({ 60, nil, 1 }, seen("A")) -- t1 still to finish on A
    assert.are.equal("done", assert(tm:commit(t1)).state)
    assert.are.same({ A = 60, B = 0, C = 40 }, (helpers.balances(accounts)))
  end)

  -- A crash leaves the transaction pending with its credit in escrow,
  -- applied (committed, not finished), or canceling; recovery, batched or
  -- one at a time, forward or back, moves each credit in once or takes
  -- it back, and a second pass changes nothing.
  for _, batch in ipairs { 100, 1 } do
    for _, way in ipairs { "forward", "back" } do
      it(("recovers credits left in escrow (batch %d, pending rolled %s)"):format(batch, way), function()
        setup { A1 = 100, B1 = 0, A2 = 100, B2 = 0, A3 = 100, B3 = 0 }
        local gone = assert(db:manager { application = "gone", lease = 0 })
        local function left(i, upto)
          local t = assert(gone:begin(transfer_ops("A" .. i, "B" .. i, 30), { id = "x" .. i }))
          assert(gone:step("claim", t))
          assert(gone:step("apply", t, 1))
          assert(gone:step("apply", t, 2))
          if upto == "applied" then assert(gone:step("commit", t)) end
          if upto == "canceling" then assert(gone:step("cancel", t)) end
          return t
        end
        left(1, "pending")
        left(2, "applied")
        left(3, "canceling")
        assert.are.same({ 0, 30, 1 }, seen("B1"))
        assert.are.same({ 0, 30, 1 }, seen("B2"))
        mongotx.core.sleep(0.01)
        local rec = assert(db:manager { application = "rec", stale_after = 0,
          stale_pending = function() return way end })
        local r = assert(rec:recover { batch = batch })
        assert.are.equal(3, r.done + r.cancelled)
        local first = way == "forward" and 30 or 0
        assert.are.same({ first, 0, 0 }, seen("B1"))
        assert.are.same({ 100 - first, nil, 0 }, seen("A1"))
        assert.are.same({ 30, 0, 0 }, seen("B2"))
        assert.are.same({ 70, nil, 0 }, seen("A2"))
        assert.are.same({ 0, 0, 0 }, seen("B3"))
        assert.are.same({ 100, nil, 0 }, seen("A3"))
        assert(rec:recover { batch = batch })
        local _, sum = helpers.balances(accounts)
        assert.are.equal(300, sum)
        assert.are.same({ 30, 0, 0 }, seen("B2"))
      end)
    end
  end

  it("compensates an escrowed transfer with an escrowed credit back", function()
    setup { A = 100, B = 0 }
    local t = assert(tm:transfer("accounts", "A", "B", 30, { min = 0, id = "pay" }))
    assert.are.same({ 30, 0, 0 }, seen("B"))
    local c = assert(tm:compensate(t))
    assert.are.equal("done", c.state)
    assert.are.same({ A = 100, B = 0 }, (helpers.balances(accounts)))
    local C = assert(db:collection("transactions"):find_one({ _id = c._id }))
    for _, op in ipairs(C.ops) do
      if op.id == "A" then assert.are.equal("escrow", op.effect) end
    end
    assert.are.same({ 100, 0, 0 }, seen("A"))
  end)

  it("refuses an op that writes txPending, and a manager option escrow that is no boolean", function()
    setup { A = 100 }
    local _, err = tm:begin({ { collection = "accounts", id = "A",
                                update = { ["$inc"] = { ["txPending.balance"] = 5 } } } })
    assert.are.equal("invalid", err.code)
    assert.matches("txPending", err.message)
    assert.has_error(function() db:manager { escrow = "yes" } end)
    assert.are.equal(0, db:collection("transactions"):count({}))
  end)
end)

-- Processes doing guarded transfers among three accounts by several
-- paths: none waits for another's credit (no busy), and at every poll no
-- balance is below its floor and balances with what escrow holds never
-- exceed the total (a credit counted twice would).
local WORKER = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local mode, uri, dbname, n, seed = arg[1], arg[2], arg[3], tonumber(arg[4]), tonumber(arg[5])
local db = assert(mongotx.connect(uri, { database = dbname }))
-- the batches' worker defers its finishes (to one tm:finish at its end):
-- its credits wait in escrow the whole run, where every poll can see them,
-- and until the poller has seen one
local tm = assert(db:manager { application = "hot-" .. seed, fencing = arg[6],
  finish = mode == "many" and "deferred" or nil })
local names = { "H1", "H2", "H3" }
math.randomseed(seed)
local function pick()
  local from, to = names[math.random(3)]
  repeat to = names[math.random(3)] until to ~= from
  return from, to, math.random(1, 9)
end
local function report(t, err)
  print(t and "done" or ("failed %s: %s"):format(tostring(err and err.code), tostring(err and err.message)))
end
for _ = 1, n do
  local from, to, amount = pick()
  if mode == "transfer" then
    report(tm:transfer("accounts", from, to, amount, { min = 0 }))
  elseif mode == "commit" then
    local t, err = tm:begin({
      { collection = "accounts", id = to, update = { ["$inc"] = { balance = amount } } },
      { collection = "accounts", id = from, update = { ["$inc"] = { balance = -amount } },
        where = { balance = { ["$gte"] = amount } } } })
    if t then report(tm:commit(t)) else report(nil, err) end
  else
    local items = {}
    for i = 1, 4 do
      local f, t2, a = pick()
      items[i] = { collection = "accounts", from = f, to = t2, amount = a, min = 0 }
    end
    local res, errs = tm:transfer_many(items)
    for i = 1, 4 do report(res[i], errs[i]) end
  end
end
if mode == "many" then
  -- its credits stay in escrow until the poller has seen one (its flag),
  -- however slow the poller runs (under valgrind), at most two minutes
  local flags, give_up = db:collection("flags"), mongotx.core.monotonic_ms() + 120000
  while assert(flags:count({ _id = "seen" })) == 0 and mongotx.core.monotonic_ms() < give_up do
    mongotx.core.sleep(0.01)
  end
  local _, err = tm:finish()
  assert(not err, tostring(err))
end
print("exit")
]]

-- The three accounts, and whether they are a snapshot.  A find reads one
-- document at a time and can meet a transaction between its two applies
-- (its credit written, its debit not yet), as any such reader can, so one
-- find is no snapshot: this reads until two finds in a row agree (each
-- document then held its value over both reads, so all three held them
-- at once, between the reads), at most a few times.  Under valgrind the
-- reads are slow and the documents keep moving: the first find still
-- shows what is in escrow, and the sums are checked on snapshots only.
local function snapshot(accounts)
  local first = accounts:find_all({}, { sort = { _id = 1 } })
  local last = first
  for _ = 1, 20 do
    local docs = last and accounts:find_all({}, { sort = { _id = 1 } })
    if not docs then return first, false end
    if util.deepcompare(docs, last, true) then return first, true, docs end
    last = docs
  end
  return first, false
end

describe("#server #concurrency escrow on hot accounts", function()
  if concurrency then
    it("runs on servers that isolate concurrent writers", function() pending(concurrency) end)
    return
  end

  -- fencing = "version" is FerretDB v2's default (its server refuses $$NOW
  -- in writes): each debit is fenced by the version read before it
  for _, fencing in ipairs { "auto", "version" } do
    it(("processes never answer busy, and no poll sees a floor broken or money made (fencing %s)")
        :format(fencing), function()
      local START = 100000
      local dbname = helpers.db_name()
      local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
      local accounts = db:collection("accounts")
      assert(accounts:insert_many {
        { _id = "H1", balance = START }, { _id = "H2", balance = START }, { _id = "H3", balance = START } })
      local procs = {}
      for i, mode in ipairs { "transfer", "transfer", "commit", "many" } do
        local pid, out, script = helpers.spawn_script(WORKER, mode, helpers.uri(), dbname,
          mode == "many" and 15 or 60, i, fencing)
        procs[i] = { pid = pid, out = out, script = script }
      end
      local polls, problems, in_escrow, snapshots, snapshots_in_escrow = 0, {}, 0, 0, 0
      local deadline = mongotx.core.monotonic_ms() + 180000
      repeat
        local running = false
        for _, p in ipairs(procs) do running = running or helpers.alive(p.pid) end
        local first, agreed, docs = snapshot(accounts)
        if first then
          polls = polls + 1
          for _, d in ipairs(first) do
            local pending = d.txPending and d.txPending.balance or 0
            if pending > 0 then
              in_escrow = in_escrow + 1
              if in_escrow == 1 then assert(db:collection("flags"):insert_many { { _id = "seen" } }) end
            end
            if d.balance < 0 then problems[#problems + 1] = ("%s at %d"):format(d._id, d.balance) end
          end
        end
        if agreed then
          snapshots = snapshots + 1
          local total = 0
          for _, d in ipairs(docs) do
            local pending = d.txPending and d.txPending.balance or 0
            if pending > 0 then snapshots_in_escrow = snapshots_in_escrow + 1 end
            total = total + d.balance + pending
          end
          if total > 3 * START then problems[#problems + 1] = "total " .. total end
        end
      until not running or mongotx.core.monotonic_ms() > deadline
      local outcomes = {}
      for _, p in ipairs(procs) do
        local said = helpers.script_output(p.pid, p.out, p.script, 10)
        assert.truthy(said:find("exit"), said)
        -- (libmongoc may warn on stderr when processes start at once)
        for line in said:gmatch("[^\n]+") do
          if line:match("^done$") or line:match("^exit$") or line:match("^failed ") then
            outcomes[line] = (outcomes[line] or 0) + 1
          end
        end
      end
      assert.are.same({}, problems)
      assert.are.same({ done = 240, exit = 4 }, outcomes) -- no busy, no refusal
      assert.truthy(in_escrow > 0, "no poll saw a credit in escrow: the spec tested nothing")
      local _, sum = helpers.balances(accounts)
      assert.are.equal(3 * START, sum)
      for _, d in ipairs(helpers.dump(accounts)) do
        assert.are.equal(0, d.txPending.balance, d._id)
        assert.are.same({}, d.pendingTransactions, d._id)
      end
      assert.truthy(snapshots > 0, "no two reads agreed: no sum was checked")
      print(("\n  escrow (fencing %s): 4 processes, 240 transfers on 3 accounts, %d polls, %d saw a credit in escrow;"
        .. " %d snapshots summed, %d with a credit in escrow"):format(fencing, polls, in_escrow, snapshots,
        snapshots_in_escrow))
      db:close()
    end)
  end
end)

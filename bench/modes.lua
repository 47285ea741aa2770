-- bench/modes.lua: the single-process modes.  Each mode's run(ctx) sets
-- up a fresh database, times ctx.n transfers, checks what the database
-- holds, drops it, and returns a sample (see bench/stats.lua), or nil and
-- "missing: ..." when the engine does not offer what the mode measures.
--
--   ctx = { uri, n = transfers, accounts, batch (batch modes) }
--
-- Round trips and writes are the client's counters (client:counters(),
-- libmongoc's command monitoring) over the timed part only; CPU is
-- os.clock() of this process.

local mongotx = require "mongotx"
local bank = require "bench.bank"
local servercpu = require "bench.servercpu"

local now = mongotx.core.monotonic_ms
local clock = os.clock
local WOPTS = bank.WOPTS

local _M = {}

-- Times body(lat, moved) on db's client; body fills lat[i] (ms per
-- transfer) and moved[account] (balance deltas of completed transfers) and
-- returns how many transfers completed.
local function timed(db, n, body)
  local lat, moved = {}, {}
  db.client:reset_counters()
  local server0, cpu0, t0 = servercpu.read(), clock(), now()
  local ok = body(lat, moved)
  local wall = now() - t0
  local cpu, server = clock() - cpu0, servercpu.since(server0)
  local c = db.client:counters()
  return { n = n, ok = ok, failed = n - ok, wall_ms = wall, cpu_s = cpu, server_s = server,
           commands = c.commands, writes = c.writes, lat = lat }, moved
end

local function move(moved, from, to)
  moved[from] = (moved[from] or 0) - 1
  moved[to] = (moved[to] or 0) + 1
end

-- A manager with opts, or nil and the reason when this engine does not
-- know one of them yet.
local function manager(db, opts)
  local ok, tm, err = pcall(db.manager, db, opts)
  if not ok then return nil, "missing: " .. tostring(tm):gsub("^[^:]*:%d+: ", "") end
  return assert(tm, err)
end

-- Runs a mode on a fresh database: setup(db) returns the per-transfer
-- driver or nil, why; the driver is timed, then the accounts are
-- checked (and the transactions when `states` gives their expected
-- counts from the sample).
local function with_bank(ctx, tag, setup, states)
  local db = bank.open(ctx.uri, tag, ctx.accounts)
  local from, to = bank.plan(ctx.accounts, ctx.n, ctx.batch)
  local drive, why = setup(db)
  if not drive then
    bank.drop(db)
    return nil, why
  end
  local sample, moved = timed(db, ctx.n, function(lat, moved)
    return drive(from, to, lat, moved)
  end)
  bank.check_accounts(db, ctx.accounts, moved)
  if states then bank.check_transactions(db, states(sample)) end
  bank.drop(db)
  return sample
end

local function done_only(sample)
  return { done = sample.ok, cancelled = sample.failed }
end

-- raw: the two $inc updates of a transfer, unprotected (the floor).
_M.raw = {
  label = "raw $inc x2",
  run = function(ctx)
    return with_bank(ctx, "raw", function(db)
      local acc = db:collection(bank.COLLECTION)
      local debit, credit = { ["$inc"] = { balance = -1 } }, { ["$inc"] = { balance = 1 } }
      return function(from, to, lat, moved)
        for i = 1, #from do
          local t = now()
          assert(acc:update_one({ _id = from[i] }, debit, WOPTS))
          assert(acc:update_one({ _id = to[i] }, credit, WOPTS))
          lat[i] = now() - t
          move(moved, from[i], to[i])
        end
        return #from
      end
    end)
  end,
}

-- The tutorial's eight steps, one command each, through mongotx.core.
local function textbook_transfer(tx, acc, from, to)
  local id = mongotx.ObjectId()
  local function one(res, what)
    assert(res, what)
    assert(res.modified == 1, what .. " matched nothing")
  end
  assert(tx:insert_one({ _id = id, source = from, destination = to, value = 1,
                         state = "initial", lastModified = mongotx.Date() }, WOPTS))
  local function to_state(old, new)
    one(tx:update_one({ _id = id, state = old }, { ["$set"] = { state = new },
      ["$currentDate"] = { lastModified = true } }, WOPTS), old .. " -> " .. new)
  end
  to_state("initial", "pending")
  one(acc:update_one({ _id = from, pendingTransactions = { ["$ne"] = id } },
    { ["$inc"] = { balance = -1 }, ["$push"] = { pendingTransactions = id } }, WOPTS), "apply A")
  one(acc:update_one({ _id = to, pendingTransactions = { ["$ne"] = id } },
    { ["$inc"] = { balance = 1 }, ["$push"] = { pendingTransactions = id } }, WOPTS), "apply B")
  to_state("pending", "applied")
  one(acc:update_one({ _id = from, pendingTransactions = id },
    { ["$pull"] = { pendingTransactions = id } }, WOPTS), "pull A")
  one(acc:update_one({ _id = to, pendingTransactions = id },
    { ["$pull"] = { pendingTransactions = id } }, WOPTS), "pull B")
  to_state("applied", "done")
end

_M.textbook = {
  label = "textbook 8 steps",
  run = function(ctx)
    return with_bank(ctx, "textbook", function(db)
      local tx, acc = db:collection("transactions"), db:collection(bank.COLLECTION)
      return function(from, to, lat, moved)
        for i = 1, #from do
          local t = now()
          textbook_transfer(tx, acc, from[i], to[i])
          lat[i] = now() - t
          move(moved, from[i], to[i])
        end
        return #from
      end
    end, done_only)
  end,
}

-- One transaction per call: call(tm, arg) returns the transaction or
-- nil, err, where arg is prepare(tm, from, to) (timed as part of the
-- transfer, but its round trips are not the call's).  `finish` is the
-- manager's finish option (nil: the default); with "deferred" the batched
-- finishing (tm:finish()) is timed too.  sample.call_commands counts the
-- round trips inside call() only: what the caller waits for.
local function single(tag, finish, call, prepare)
  return function(ctx)
    local call_commands, per_call = 0, {}
    local sample, why = with_bank(ctx, tag, function(db)
      local tm, err = manager(db, { application = "bench", finish = finish })
      if not tm then return nil, err end
      if finish == "deferred" and type(tm.finish) ~= "function" then
        return nil, "missing: tm:finish()"
      end
      local client = db.client
      return function(from, to, lat, moved)
        local ok = 0
        for i = 1, #from do
          local t = now()
          local arg = prepare and prepare(tm, from[i], to[i]) or { from[i], to[i] }
          local c0 = client:counters().commands
          local res = call(tm, arg)
          local n = client:counters().commands - c0
          call_commands, per_call[n] = call_commands + n, (per_call[n] or 0) + 1
          lat[i] = now() - t
          if res then
            ok = ok + 1
            move(moved, from[i], to[i])
          end
        end
        if finish == "deferred" then assert(tm:finish()) end
        return ok
      end
    end, done_only)
    if sample then
      -- the most common count: the first call also reads the server's
      -- clock, and every finish_batch-th deferred call runs the finisher
      local typical, most = nil, 0
      for n, calls in pairs(per_call) do
        if calls > most then typical, most = n, calls end
      end
      sample.call_commands, sample.typical_call_commands = call_commands, typical
    end
    return sample, why
  end
end

local function transfer(tm, pair)
  return tm:transfer(bank.COLLECTION, pair[1], pair[2], 1)
end

-- The same with transfer's floor guard (min = 0): what keeping the guard
-- promise costs (README, "Guards").  Balances start high enough that no
-- guard fails.
local function guarded(tm, pair)
  return tm:transfer(bank.COLLECTION, pair[1], pair[2], 1, { min = 0 })
end

_M.transfer = { label = "tm:transfer", run = single("transfer", nil, transfer) }
_M.transfer_guarded = { label = "tm:transfer min=0", run = single("guarded", nil, guarded) }
_M.transfer_deferred = { label = "tm:transfer deferred", run = single("deferred", "deferred", transfer) }
_M.begin_commit = {
  label = "tm:begin+commit",
  run = single("begin_commit", nil,
    function(tm, t) return t and tm:commit(t) end,
    function(tm, from, to) return assert(tm:begin(bank.ops(from, to, 1))) end),
}

-- Batches of ctx.batch transactions in one call: method is "commit_many"
-- (lists of ops) or "transfer_many" (transfer tables, with the floor
-- guard min = 0 when `min`).  A transfer's latency is its batch's time
-- divided by the batch's size.
local function many(method, min)
  return function(ctx)
    return with_bank(ctx, method .. ctx.batch, function(db)
      local tm = assert(db:manager { application = "bench" })
      if type(tm[method]) ~= "function" then return nil, "missing: tm:" .. method end
      local item = method == "commit_many"
        and function(f, t) return bank.ops(f, t, 1) end
        or function(f, t)
          return { collection = bank.COLLECTION, from = f, to = t, amount = 1, min = min }
        end
      return function(from, to, lat, moved)
        local ok = 0
        for first = 1, #from, ctx.batch do
          local last = math.min(first + ctx.batch - 1, #from)
          local list = {}
          for i = first, last do list[#list + 1] = item(from[i], to[i]) end
          local t = now()
          local results = assert(tm[method](tm, list))
          local per = (now() - t) / #list
          for k = 1, #list do
            local i = first + k - 1
            lat[i] = per
            if results[k] then
              ok = ok + 1
              move(moved, from[i], to[i])
            end
          end
        end
        return ok
      end
    end, done_only)
  end
end

_M.commit_many = { label = "tm:commit_many", run = many("commit_many") }
_M.transfer_many = { label = "tm:transfer_many", run = many("transfer_many") }
_M.transfer_many_guarded = { label = "tm:transfer_many min=0", run = many("transfer_many", 0) }

-- ledger: mongotx.ledger transfers (one inserted entry each), one per
-- call or ctx.batch per transfer_many, unguarded like tm:transfer.  Then
-- (not timed) every moved account's entries must sum to what the completed
-- transfers moved, and twenty accounts are committed and reconciled.
local function ledger(ctx)
  local db = bank.open(ctx.uri, "ledger" .. (ctx.batch or 1), 0)
  local L = assert(db:ledger {})
  local from, to = bank.plan(ctx.accounts, ctx.n, ctx.batch)
  local batch = ctx.batch or 1
  local sample, moved = timed(db, ctx.n, function(lat, moved)
    local ok = 0
    for first = 1, #from, batch do
      local last = math.min(first + batch - 1, #from)
      local t = now()
      local done = {}
      if batch == 1 then
        done[first] = L:transfer(from[first], to[first], 1) ~= nil
      else
        local list = {}
        for i = first, last do list[#list + 1] = { from = from[i], to = to[i], amount = 1 } end
        local res = assert(L:transfer_many(list))
        for k in ipairs(list) do done[first + k - 1] = res[k] ~= false end
      end
      local per = (now() - t) / (last - first + 1)
      for i = first, last do
        lat[i] = per
        if done[i] then ok = ok + 1; move(moved, from[i], to[i]) end
      end
    end
    return ok
  end)
  -- every entry once: each account's values sum to what it moved, at
  -- seqIds 1..n; then the committer and a replay for twenty accounts
  local sums, seqs = {}, {}
  for _, e in ipairs(assert(db:collection("ledger"):find_all({}, { sort = { _id = 1 } }))) do
    for _, c in ipairs(e.changes) do
      sums[c.account] = (sums[c.account] or 0) + c.value
      seqs[c.account] = (seqs[c.account] or 0) + 1
    end
  end
  local checked = 0
  for account, delta in pairs(moved) do
    assert(sums[account] == delta, "ledger entries of " .. account)
    if checked < 20 then
      assert(L:commit { account = account })
      local r = assert(L:reconcile(account))
      assert(r.ok and r.balance == delta and r.seq == seqs[account], "ledger reconcile of " .. account)
      checked = checked + 1
    end
  end
  bank.drop(db)
  return sample
end

_M.ledger = { label = "ledger:transfer", run = ledger }
_M.ledger_many = { label = "ledger:transfer_many", run = ledger }

-- Recovery: ctx.n transactions of one kind left behind by an application
-- that is gone (lease 0), then the time one manager (stale_after = 0,
-- lease = 0) takes to recover all of them through tm:recover{ limit =
-- 1000, batch = ctx.batch } (batch 1: one at a time, as before batched
-- recovery).  Latency is a recover() pass's time divided by the
-- transactions it drove.  The kinds, as left:
--   initial    tm:begin without commit
--   pending    claimed, its debit applied (tm:step)
--   applied    committed, not finished (commit_many, finish deferred)
--   canceling  claimed, its debit applied, then cancelled (tm:step)
local function leave(db, kind, from, to)
  local gone = assert(db:manager { application = "gone", lease = 0, finish = "deferred",
                                   finish_batch = 100000 })
  if kind == "applied" then
    for first = 1, #from, 100 do
      local list = {}
      for i = first, math.min(first + 99, #from) do list[#list + 1] = bank.ops(from[i], to[i], 1) end
      local res, errs = gone:commit_many(list)
      for k = 1, #list do assert(res[k], tostring(errs[k])) end
    end
    return
  end
  for i = 1, #from do
    local t = assert(gone:begin(bank.ops(from[i], to[i], 1)))
    if kind ~= "initial" then
      assert(gone:step("claim", t))
      assert(gone:step("apply", t, 1))
      if kind == "canceling" then assert(gone:step("cancel", t)) end
    end
  end
end

local function recovery(kind)
  return function(ctx)
    local db = bank.open(ctx.uri, "recovery", ctx.accounts)
    local from, to = bank.plan(ctx.accounts, ctx.n, ctx.n)
    leave(db, kind, from, to)
    local tm = assert(db:manager { application = "recoverer", stale_after = 0, lease = 0 })
    local sample, moved = timed(db, ctx.n, function(lat)
      local ok = 0
      repeat
        local t = now()
        local report = assert(tm:recover { limit = 1000, batch = ctx.batch })
        local driven = report.done + report.cancelled
        assert(report.failed == 0 and report.parked == 0, "recovery failed or parked")
        for _ = 1, driven do lat[#lat + 1] = (now() - t) / driven end
        ok = ok + driven
      until driven == 0
      return ok
    end)
    assert(sample.ok == ctx.n, ("recovered %d of %d"):format(sample.ok, ctx.n))
    if kind == "canceling" then
      bank.check_accounts(db, ctx.accounts, {})
      bank.check_transactions(db, { cancelled = ctx.n })
    else
      for i = 1, ctx.n do move(moved, from[i], to[i]) end
      bank.check_accounts(db, ctx.accounts, moved)
      bank.check_transactions(db, { done = ctx.n })
    end
    bank.drop(db)
    return sample
  end
end

for _, kind in ipairs { "initial", "pending", "applied", "canceling" } do
  _M["recover_" .. kind] = { label = "tm:recover " .. kind, run = recovery(kind) }
end

-- (for bench/holds.lua's modes)
_M.single, _M.timed, _M.manager, _M.with_bank, _M.move, _M.done_only =
  single, timed, manager, with_bank, move, done_only

return _M

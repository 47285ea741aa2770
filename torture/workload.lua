-- The random workload of the kill, stall and server-fault sections.
--
-- Accounts: acct1..acctN carry `floor = 0` and start poor (BALANCE), so a
-- fair share of the debits cannot pay and their transactions must cancel
-- (the case of issue 8: a cancelled transaction's credit must never pay
-- for another transaction's guarded debit).  Every debit of them is
-- guarded with `balance >= floor + amount`, so the floor observer
-- (torture/observer.lua) may never see one below 0.  The first HOT of
-- them take 40% of the picks (contention).  spare1..spareS have no floor
-- field: compensations only compensate transfers from a floored account
-- to a spare one and debit the spare account (keeping the transfer's
-- `min` there), which the observer does not watch.
--
-- Paths, each with guarded debits: tm:transfer, begin+commit and tm:run
-- of multi-collection transactions (a ledger insert, a token removal, an
-- assert, a counter; the credit before or after the debit, and a third of
-- them a credit that also lowers another field),
-- tm:transfer_many and tm:commit_many batches, a transaction walked with
-- tm:step that applies its credit, waits, and is rolled back
-- (tm:rollback) or committed (its debit may then fail), and
-- compensations.  role(name) gives some workers recovery with
-- stale_pending = "back" and some finish = "deferred" (committed
-- transactions keep their markers until finished).
--
-- One step in eight is a transaction of the serial-order check
-- (serial_step).
--
-- Every transaction has a caller-supplied id "<worker>-<n>" (batch items
-- "<worker>-<n>.<k>"), logged by the worker before it begins and with its
-- outcome after, so the audit (torture/check.lua) can tell what each
-- caller was promised.

local manager = require "mongotx.manager"
local core = require "mongotx.core"
local serial = require "torture.serial"

local M = {}

M.BALANCE = 30       -- each floored account at the start
M.FLOOR = 0
M.SPARE_BALANCE = 300
M.SPARE = 3
M.HOT = 3
M.MAX_AMOUNT = 60

function M.fixture(accounts, tokens)
  local f = { accounts = {}, tokens = {}, flags = { { _id = "open", open = true } },
              counters = {}, ledger = {} }
  for i = 1, accounts do
    f.accounts[i] = { _id = "acct" .. i, balance = M.BALANCE, floor = M.FLOOR, seq = 0 }
  end
  for i = 1, M.SPARE do
    f.accounts[accounts + i] = { _id = "spare" .. i, balance = M.SPARE_BALANCE, seq = 0 }
  end
  for i = 1, tokens do f.tokens[i] = { _id = "tok" .. i } end
  for i = 1, 3 do f.counters[i] = { _id = "c" .. i, n = 0 } end
  f[serial.COLLECTION] = serial.fixture()
  return f
end

-- Manager options of worker `name` ("w<n>"): every third one recovers
-- stale pending transactions by rolling them back, every fourth defers
-- finishing its batches.
function M.role(name)
  local n = tonumber(name:match("%d+")) or 0
  return { back = n % 3 == 0, deferred = n % 4 == 1 }
end

function M.manager_options(name, extra)
  local role = M.role(name)
  local o = { application = name, lease = 1, stale_after = 1 }
  -- a mixed fleet's configurations (torture/fleet.lua, spawn)
  local other = require("torture.check").OTHER
  if name:find("t$") then o.collection = other.collection end
  if name:find("m$") then o.marker, o.version_field = other.marker, other.version end
  if role.back then o.stale_pending = function() return "back" end end
  if role.deferred then o.finish, o.finish_batch = "deferred", 5 end
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

local function account(n)
  if math.random(100) <= 40 then return "acct" .. math.random(math.min(M.HOT, n)) end
  return "acct" .. math.random(n)
end

local function pick_two(n)
  local a = account(n)
  local b
  repeat b = account(n) until b ~= a
  return a, b
end

local function debit(from, amount)
  return { collection = "accounts", id = from, update = { ["$inc"] = { balance = -amount } },
           where = { balance = { ["$gte"] = M.FLOOR + amount } } }
end

local function credit(to, amount)
  return { collection = "accounts", id = to, update = { ["$inc"] = { balance = amount } } }
end

-- A credit that also lowers `seq`: a mixed $inc, neither a pure credit
-- nor a debit, which an engine may treat apart from both (96febb8 did:
-- it held the account, txHeld, while plain credits waited for the finish).
local function held_credit(to, amount)
  return { collection = "accounts", id = to,
           update = { ["$inc"] = { balance = amount, seq = -1 } } }
end

-- A transfer with a ledger entry and one more op: a token removal, an
-- assert or a counter; the credit first half the time, a held one
-- (held_credit) a third of the time.
local function multi(id, sizes, from, to, amount)
  local ops = { debit(from, amount),
    math.random(3) == 1 and held_credit(to, amount) or credit(to, amount),
    { collection = "ledger", id = id, kind = "insert",
      doc = { from = from, to = to, amount = amount } } }
  if math.random(2) == 1 then ops[1], ops[2] = ops[2], ops[1] end
  local r = math.random(100)
  if r <= 40 then
    ops[4] = { collection = "tokens", id = "tok" .. math.random(sizes.tokens), kind = "remove" }
  elseif r <= 70 then
    ops[4] = { collection = "flags", id = "open", kind = "assert", where = { open = true } }
  else
    ops[4] = { collection = "counters", id = "c" .. math.random(3),
               update = { ["$inc"] = { n = 1 } } }
  end
  return ops
end

local function amount()
  return math.random(1, M.MAX_AMOUNT)
end

local function outcome(log, id, res, err)
  if res then
    log("done " .. id)
  else
    log(("failed %s %s %s"):format(id, tostring(err and err.code),
      tostring(err):gsub("%s+", " ")))
  end
end

-- Runs one random transaction (or batch) `id` with manager tm; log(line)
-- records what happens.  `done` lists this worker's committed transfers
-- from a floored account to a spare one (compensation candidates).
function M.step(tm, id, sizes, log, done)
  local r = math.random(100)
  local n = sizes.accounts
  local from, to = pick_two(n)
  if math.random(100) <= 12 then return M.serial_step(tm, id, log) end
  if r <= 6 and #done > 0 then
    local orig = table.remove(done, math.random(#done))
    local cid = manager.compensation_id(orig)
    log("begin " .. cid)
    outcome(log, cid, tm:compensate({ _id = orig }))
  elseif r <= 14 then
    -- money in and out of the spare accounts, guarded like any debit
    local spare = "spare" .. math.random(M.SPARE)
    local out = math.random(3) > 1
    log("begin " .. id)
    local res, err = tm:transfer("accounts", out and from or spare, out and spare or from,
      amount(), { id = id, min = M.FLOOR })
    if res and out then done[#done + 1] = id end
    outcome(log, id, res, err)
  elseif r <= 36 then
    log("begin " .. id)
    outcome(log, id, tm:transfer("accounts", from, to, amount(), { id = id, min = M.FLOOR }))
  elseif r <= 50 then
    log("begin " .. id)
    local T, err = tm:begin(multi(id, sizes, from, to, amount()), { id = id })
    if T then
      outcome(log, id, tm:commit(T))
    else
      outcome(log, id, nil, err)
    end
  elseif r <= 60 then
    log("begin " .. id)
    outcome(log, id, tm:run(multi(id, sizes, from, to, amount()), { id = id }))
  elseif r <= 70 then
    local list = {}
    for k = 1, math.random(2, 4) do
      local a, b = pick_two(n)
      list[k] = { collection = "accounts", from = a, to = b, amount = amount(),
                  min = M.FLOOR, id = id .. "." .. k }
      log("begin " .. list[k].id)
    end
    local res, errs = tm:transfer_many(list)
    for k, item in ipairs(list) do outcome(log, item.id, res[k], errs[k]) end
  elseif r <= 78 then
    local list = {}
    for k = 1, math.random(2, 3) do
      local a, b = pick_two(n)
      local kid = id .. "." .. k
      list[k] = { ops = multi(kid, sizes, a, b, amount()), id = kid }
      log("begin " .. kid)
    end
    local res, errs = tm:commit_many(list)
    for k, item in ipairs(list) do outcome(log, item.id, res[k], errs[k]) end
  else
    -- one at a time: the credit applied first and left visible a moment,
    -- then rolled back, or committed (the debit may not pay: cancelled)
    local a = amount()
    local ops = { credit(to, a), debit(from, a) }
    log("begin " .. id)
    local T, err = tm:begin(ops, { id = id })
    if not T then return outcome(log, id, nil, err) end
    local claimed = tm:step("claim", T)
    if claimed then tm:step("apply", T, 1) end
    core.sleep(math.random() * 0.03)
    if r <= 89 then
      local ok
      ok, err = tm:rollback(T, "rolled back by the worker")
      if ok then
        log(("failed %s cancelled rolled back by the worker"):format(id))
      else
        outcome(log, id, nil, err)
      end
    else
      outcome(log, id, tm:commit(T))
    end
  end
end

-- A transaction (or a batch of them) of the serial-order check
-- (torture/serial.lua): each pushes its name (its id, and the collection
-- of its manager when not the default: ids repeat across collections in
-- a mixed fleet) onto two shared documents, by run, begin+commit or
-- commit_many.
function M.serial_step(tm, id, log)
  local coll = tm.tx:name()
  local function name(x) return coll == "transactions" and x or coll .. ":" .. x end
  local r = math.random(4)
  if r <= 2 then
    log("begin " .. id)
    outcome(log, id, tm:run(serial.ops(name(id)), { id = id }))
  elseif r == 3 then
    log("begin " .. id)
    local T, err = tm:begin(serial.ops(name(id)), { id = id })
    if T then outcome(log, id, tm:commit(T)) else outcome(log, id, nil, err) end
  else
    local list = {}
    for k = 1, 2 do
      local kid = id .. "." .. k
      list[k] = { ops = serial.ops(name(kid)), id = kid }
      log("begin " .. kid)
    end
    local res, errs = tm:commit_many(list)
    for k, item in ipairs(list) do outcome(log, item.id, res[k], errs[k]) end
  end
end

-- A worker's last words: finish what a deferred manager still holds.
function M.close(tm, name)
  if M.role(name).deferred then tm:finish() end
end

return M

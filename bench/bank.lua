-- bench/bank.lua: the benchmark's data.  Accounts 1..N in a fresh
-- database per run, a plan of transfers between them, and the check of
-- what the database holds after a run (the benchmark fails rather than
-- report figures of a run that lost or duplicated money).

local mongotx = require "mongotx"

local _M = {}

-- Every balance starts so high that no transfer can overdraw it: the
-- benchmark measures the protocol's happy path, not its guards.
_M.START = 1000000000
_M.COLLECTION = "accounts"
-- The engine's default write concern, given to the plain modes too, so
-- that every mode waits for the same acknowledgement.
_M.WRITE_CONCERN = { w = "majority", j = true }
_M.WOPTS = { write_concern = _M.WRITE_CONCERN }

local serial = 0

-- A database no other run uses, with `accounts` documents { _id = i,
-- balance = START } (none when accounts is 0).
function _M.open(uri, tag, accounts)
  serial = serial + 1
  local name = string.format("bench_%s_%d_%d", tag:gsub("[^%w]", "_"), os.time() % 100000, serial)
  local db = assert(mongotx.connect(uri, { database = name, write_concern = _M.WRITE_CONCERN }))
  local coll = db:collection(_M.COLLECTION)
  local chunk = {}
  for i = 1, accounts or 0 do
    chunk[#chunk + 1] = { _id = i, balance = _M.START }
    if #chunk == 10000 or i == accounts then
      assert(coll:insert_many(chunk, {}))
      chunk = {}
    end
  end
  return db
end

function _M.drop(db)
  assert(db.client:command(db.name, { dropDatabase = 1 }))
  db:close()
end

-- count transfers among `accounts` accounts: from[i] ~= to[i], and no
-- account appears twice within one block of `distinct` consecutive
-- transfers (a batch), so a batch never conflicts with itself.
function _M.plan(accounts, count, distinct)
  distinct = math.min(distinct or 1, math.floor(accounts / 2))
  local from, to = {}, {}
  local perm, next_pair = {}, math.huge
  for i = 1, accounts do perm[i] = i end
  local pairs_per_perm = math.floor(accounts / 2)
  for i = 1, count do
    -- a new shuffle when the rest of this one cannot hold a whole block
    if (i - 1) % distinct == 0 and next_pair + distinct - 1 > pairs_per_perm then
      for k = accounts, 2, -1 do
        local j = math.random(k)
        perm[k], perm[j] = perm[j], perm[k]
      end
      next_pair = 1
    end
    from[i], to[i] = perm[2 * next_pair - 1], perm[2 * next_pair]
    next_pair = next_pair + 1
  end
  return from, to
end

-- The two $inc ops of transfer i, as begin/commit_many take them.
function _M.ops(from, to, amount)
  return {
    { collection = _M.COLLECTION, id = from, update = { ["$inc"] = { balance = -amount } } },
    { collection = _M.COLLECTION, id = to, update = { ["$inc"] = { balance = amount } } },
  }
end

-- Transfers first..last of the plan (from, to) through manager tm, one
-- of each account to the other: tm:transfer at batch 1, tm:commit_many of
-- `batch` otherwise (bench/profile.lua and bench/steps.lua); raises on
-- any that fails.
function _M.drive(tm, from, to, first, last, batch)
  if batch == 1 then
    for i = first, last do assert(tm:transfer(_M.COLLECTION, from[i], to[i], 1)) end
    return
  end
  for b = first, last, batch do
    local list = {}
    for i = b, math.min(b + batch - 1, last) do list[#list + 1] = _M.ops(from[i], to[i], 1) end
    local results = tm:commit_many(list)
    for k = 1, #list do assert(results[k]) end
  end
end

-- Raises unless the accounts hold exactly START plus the deltas of the
-- transfers that completed (moved[a] for account a; when moved is nil,
-- only that the total is unchanged) and no document still carries a
-- marker of an open transaction.
function _M.check_accounts(db, accounts, moved)
  local coll = db:collection(_M.COLLECTION)
  local docs = assert(coll:find_all({}, { projection = { balance = 1, pendingTransactions = 1 },
                                          sort = { _id = 1 } }))
  assert(#docs == accounts, ("%d accounts, expected %d"):format(#docs, accounts))
  local total = 0
  for _, d in ipairs(docs) do
    total = total + d.balance
    if moved then
      local want = _M.START + (moved[d._id] or 0)
      assert(d.balance == want, ("account %s holds %s, expected %s"):format(d._id, d.balance, want))
    end
    assert(not d.pendingTransactions or #d.pendingTransactions == 0,
      ("account %s still carries a marker"):format(d._id))
  end
  assert(total == accounts * _M.START, ("money not conserved: total %s"):format(total))
end

-- Raises unless the transactions collection counts `want` per state
-- (states not named must have none).
function _M.check_transactions(db, want)
  local coll = db:collection("transactions")
  local seen = assert(db.client:command(db.name, mongotx.doc(
    "aggregate", "transactions",
    "pipeline", { { ["$group"] = { _id = "$state", n = { ["$sum"] = 1 } } } },
    "cursor", {})))
  local got = {}
  for _, g in ipairs(seen.cursor.firstBatch) do got[g._id] = g.n end
  for state, n in pairs(want) do
    assert((got[state] or 0) == n, ("%d transactions %s, expected %d"):format(got[state] or 0, state, n))
  end
  for state, n in pairs(got) do
    assert(want[state] ~= nil, ("%d transactions unexpectedly %s"):format(n, state))
  end
  return coll
end

return _M

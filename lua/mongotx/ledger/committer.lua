-- mongotx.ledger.committer: the ledger's committer (commit: each change's
-- cacheBal, the entries' proc, the accounts' heads) and its audit
-- (reconcile: an account replayed from its first entry).  The functions
-- take the ledger; mongotx.ledger makes them its methods.

--- The ledger's committer and audit (its methods `L:commit` and `L:reconcile`).
-- @submodule mongotx.ledger

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local acct = require "mongotx.ledger.accounts"

local id_key = validate.id_key
local crash_point, null = core.crash_point, core.null
local invalid, check_account, change_of = acct.invalid, acct.check_account, acct.change_of
local present = acct.present
local ipairs, sort, tostring, type = ipairs, table.sort, tostring, type
local format = string.format

local _M = {}

local CALLER = 2

-- The most UNCOMMITTED entries one commit reads (option limit).
local MAX_LIMIT = 100000

-- Caches the balances of one account's entries after its head (`view`,
-- as accounts.read left it), in seqId
-- order: each change's cacheBal (a value every committer computes alike,
-- so writing it twice is harmless), the
-- entry's proc = COMMITTED once no change of it is left uncached, then
-- the head.  Returns how many changes it cached; nil, err.
local function commit_account(self, view)
  local err
  local seq, balance = view.head or 0, view.head_balance or 0
  local cached, wc = 0, self.wopts
  for _, t in ipairs(view.tail) do
    local c, e = t.change, t.entry
    if c.seqId ~= seq + 1 then break end -- a gap cannot happen (seqIds are taken max + 1)
    seq, balance = c.seqId, balance + (e.state == "VALID" and c.value or 0)
    if c.cacheBal == nil or c.cacheBal == null then
      -- by its place in the list: an entry's changes never move (a
      -- positional $ is not matched by every server for $elemMatch)
      local path = "changes." .. t.at
      local filter = { _id = e._id, [path .. ".seqId"] = seq }
      crash_point("ledger.cache", "before")
      local res
      res, err = self.entries:update_one(filter, { ["$set"] = { [path .. ".cacheBal"] = balance } }, wc)
      crash_point("ledger.cache", "after")
      if not res then return nil, err end
      cached = cached + 1
    elseif c.cacheBal ~= balance then
      return nil, errors.new("mismatch", format("entry %s caches %s for account %s at seqId %d, " ..
        "its entries sum to %s", tostring(e._id), tostring(c.cacheBal), tostring(view.account),
        seq, tostring(balance)), { step = "commit", id = e._id, account = view.account })
    end
    if e.proc ~= "COMMITTED" then
      crash_point("ledger.commit", "before")
      local res
      res, err = self.entries:update_one({ _id = e._id, proc = "UNCOMMITTED",
                                           ["changes.cacheBal"] = { ["$ne"] = null } },
                                         { ["$set"] = { proc = "COMMITTED" } }, wc)
      crash_point("ledger.commit", "after")
      if not res then return nil, err end
    end
  end
  if seq > (view.head or 0) then
    crash_point("ledger.head", "before")
    local res
    res, err = self.accounts:update_one({ _id = view.account, seq = { ["$lt"] = seq } },
      { ["$set"] = { seq = seq, balance = balance } }, { upsert = true, write_concern = wc.write_concern })
    crash_point("ledger.head", "after")
    -- a duplicate key: another committer moved the head as far or further
    if not res and err.server_code ~= 11000 then return nil, err end
  end
  return cached
end

-- commit([{ account = a } | { limit = n }]): the committer.  With an
-- account, caches that account's entries; else finds up to limit (default
-- 1000, at most MAX_LIMIT) UNCOMMITTED entries, oldest first, and caches
-- the accounts they touch.  Each account's tail is read and cached
-- acct.TAIL_CHUNK changes a call at most: a committer far behind catches
-- up over several calls, in the memory of one chunk.  Safe to run in
-- several processes at once and to kill at any point.  Returns
-- { accounts = n, cached = changes cached, uncommitted = entries still
-- UNCOMMITTED among those seen }; nil, err.

--- The committer: caches balances and marks entries COMMITTED, up to 1000 changes an account a call.
-- @syntax report, err = L:commit([{ limit = 1000 } | { account = a }])
-- @tparam[opt] table opts `limit` (1 to 100000), or `account`
-- @treturn table `{ accounts, cached, uncommitted }`
-- @errors `invalid` (a limit above 100000, an account and a limit), database errors
-- @usage assert(L:commit())
-- @function Ledger:commit
function _M.commit(self, opts)
  local err
  opts, err = options.check(opts, { account = true, limit = true }, "commit", CALLER)
  if not opts then return nil, err end
  if opts.account ~= nil and opts.limit ~= nil then
    return invalid("commit takes an account or a limit, not both", "commit")
  end
  if opts.limit ~= nil and opts.limit > MAX_LIMIT then
    return invalid(format("option limit of commit must be a whole number from 1 to %d " ..
      "(the entries seen are held in memory), not %d", MAX_LIMIT, opts.limit), "commit")
  end
  local accounts, seen = {}, nil
  if opts.account ~= nil then
    local sent, key = check_account(opts.account, "commit")
    if sent == nil then return nil, key end
    accounts[1] = { account = sent, key = key }
  else
    seen, err = self.entries:find_all({ proc = "UNCOMMITTED" },
      { sort = core.doc("proc", 1, "ts", 1), limit = opts.limit or 1000 })
    if not seen then return nil, errors.wrap(err, "commit") end
    local keys = {}
    for _, e in ipairs(seen) do
      for _, c in ipairs(e.changes) do
        local k = id_key(c.account)
        if k and not keys[k] then
          keys[k] = true
          accounts[#accounts + 1] = { account = c.account, key = k }
        end
      end
    end
  end
  local report = { accounts = #accounts, cached = 0, uncommitted = 0 }
  if #accounts == 0 then return report end
  local ok
  -- each account's tail in turn, at most TAIL_CHUNK changes of it a call
  ok, err = acct.read(self, accounts, acct.TAIL_CHUNK, function(view)
    local n, why = commit_account(self, view)
    if not n then return nil, why end
    report.cached = report.cached + n
    return true
  end)
  if not ok then return nil, errors.wrap(err, "commit") end
  if seen and #seen > 0 then
    local ids = {}
    for i, e in ipairs(seen) do ids[i] = e._id end
    report.uncommitted = self.entries:count({ _id = { ["$in"] = ids }, proc = "UNCOMMITTED" }) or 0
  end
  return report
end

-- reconcile(account): replays the account from its first entry.  Returns
-- { balance, seq, ok, problems = { ... } }: ok when the seqIds run 1..seq
-- without a gap, every cached balance (cacheBal, the head) equals the sum
-- of the entries up to it, and balance() agrees with the replay at the
-- seqId it gives (safe on a live ledger: see below); nil, err.
--
-- The entries are read RECONCILE_CHUNK seqIds at a time (a range of the
-- unique index, one entry a seqId), each chunk replayed and let go: what
-- it holds is a chunk, whatever the account's length.  It reads on past
-- the seqId balance() gave until a chunk comes back empty.
_M.RECONCILE_CHUNK = 1000

--- Replays an account from its first entry, in chunks of seqIds, and reports what disagrees.
-- @syntax report, err = L:reconcile(account)
-- @param account the account
-- @treturn table `{ balance, seq, ok, problems }`
-- @errors database errors
-- @usage assert(L:reconcile("A").ok)
-- @function Ledger:reconcile
function _M.reconcile(self, account)
  present(account, "an account", "reconcile")
  local sent, key = check_account(account, "reconcile")
  if sent == nil then return nil, key end
  -- The head, then balance(), then the entries: each read sees at least
  -- what the one before saw (entries never change, and a head only moves
  -- over entries that exist), so what writers and committers add meanwhile
  -- lies after the seqIds compared and is no problem of the books.
  local head, err = self.accounts:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, "reconcile") end
  local now, now_seq = self:balance(sent)
  if not now then return nil, now_seq end
  local chunk = _M.RECONCILE_CHUNK
  -- the replay's balance at the two seqIds it checks (the head's and
  -- balance()'s), 0 before the first entry
  local want = { [0] = 0 }
  local function check_at(seq)
    if type(seq) == "number" and seq == seq and want[seq] == nil then want[seq] = false end
  end
  check_at(now_seq)
  if head then check_at(head.seq) end
  local problems, balance, n, from = {}, 0, 0, 1
  while true do
    -- the first chunk from below: a seqId under 1 (no writer takes one)
    -- is a problem to report
    local range = { ["$lt"] = from + chunk }
    if from > 1 then range["$gte"] = from end
    -- (a broken ledger may hold two entries at a seqId: up to twice the
    -- chunk is read, the rest would show as seqIds out of place)
    local found
    found, err = self.entries:find_all({ changes = { ["$elemMatch"] = { account = sent,
      seqId = range } } }, { limit = 2 * chunk })
    if not found then return nil, errors.wrap(err, "reconcile") end
    if #found == 0 and from > now_seq then break end
    local list = {}
    for _, e in ipairs(found) do list[#list + 1] = { entry = e, change = change_of(e, key) } end
    sort(list, function(a, b) return a.change.seqId < b.change.seqId end)
    for _, t in ipairs(list) do
      local c = t.change
      n = n + 1
      if c.seqId ~= n then
        problems[#problems + 1] = format("seqId %d where %d was due", c.seqId, n)
      end
      if t.entry.state == "VALID" then balance = balance + c.value end
      if want[c.seqId] ~= nil then want[c.seqId] = balance end
      if c.cacheBal ~= nil and c.cacheBal ~= null and c.cacheBal ~= balance then
        problems[#problems + 1] = format("cacheBal %s at seqId %d, the replay gives %s",
          tostring(c.cacheBal), c.seqId, tostring(balance))
      end
    end
    from = from + chunk
  end
  local function at(seq) return want[seq] or nil end -- false: no entry at that seqId
  if head and at(head.seq) ~= head.balance then
    problems[#problems + 1] = format("the head caches %s at seqId %s, the replay gives %s",
      tostring(head.balance), tostring(head.seq), tostring(at(head.seq)))
  end
  if at(now_seq) ~= now then
    problems[#problems + 1] = format("balance() gives %s, the replay %s", tostring(now),
      tostring(at(now_seq)))
  end
  return { balance = balance, seq = n, ok = #problems == 0, problems = problems }
end

return _M

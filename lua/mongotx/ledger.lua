-- mongotx.ledger: transfers as log entries (the seed's "log
-- reconciliation"), an alternative to two-phase commit for moving amounts
-- between accounts.
--
-- A transfer is ONE inserted document of the ledger collection:
--
--   { _id, ts = <server time>, proc = "UNCOMMITTED" | "COMMITTED", state = "VALID",
--     changes = { { account, value, seqId, cacheBal = null | <balance after it> }, ... },
--     seqs = { { account, seqId }, ... },  -- the changes' keys, for the unique index
--     reverses = <id of the entry it reverses, for a counter-transfer> }
--
-- Each change takes the next seqId of its account; the unique index on
-- `seqs` lets only one writer take a number, so a duplicate key means
-- another writer got there first: read again and retry with the next one.
-- It is one field, not { "changes.account", "changes.seqId" }: a
-- compound index over two paths of one array is built per element by
-- MongoDB but from every combination of the elements by DocumentDB
-- (FerretDB v2), where (A 1, B 2) then refuses (A 2, B 1).  Because a writer only takes max + 1
-- of what it read, every account's seqIds are 1, 2, 3 ... with no gap, and
-- a guard (`min`, no overdraft) checked against the balance read at the
-- number taken cannot be passed twice on one balance.
--
-- The same gap-free numbering lets a writer skip the read: when seqId
-- s + 1 is free, no entry above s exists, so the balance at s (from the
-- account's head, or remembered from this ledger's last write or read of
-- the account; entries never change) is the balance at the number taken.
-- A transfer first inserts at the remembered numbers (one round trip, or
-- two with a read of the heads) and reads the accounts' entries only when
-- the insert finds a number taken or the remembered balance fails a guard.
--
-- An account's balance is the cache of its head (an `accounts` document
-- { _id = account, seq, balance }, the seed's account cache) plus the
-- values of the entries after it.  The committer (commit) walks each
-- account's entries after its head in seqId order, writes each change's
-- cacheBal, marks an entry COMMITTED once all its changes are cached and
-- moves the head on.  Every value it writes is a function of the entries
-- before it, which never change, so committers may run in several
-- processes at once and be killed at any point: the next run redoes the
-- same writes.  An entry is never deleted nor cancelled: later entries'
-- guards were checked against balances that included it, so a mistake is
-- undone by a counter-transfer (reverse).  `state` stays "VALID" (the
-- seed's field, which balances still read).
--
-- This module owns the ledger object, the checks of what callers pass and
-- the writer's public calls (post, transfer, reverse, transfer_many);
-- mongotx.ledger.writer makes their entries and inserts them,
-- mongotx.ledger.accounts reads accounts, mongotx.ledger.committer holds
-- commit and reconcile.

--- A ledger: transfers as log entries with per-account sequence ids; `db:ledger(opts)` (docs/ledger.md).
-- @module mongotx.ledger

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local clock = require "mongotx.clock"
local acct = require "mongotx.ledger.accounts"
local committer = require "mongotx.ledger.committer"
local writer = require "mongotx.ledger.writer"

local check_id, id_key = validate.check_id, validate.id_key
local rawlen = validate.rawlen
local invalid, check_account, present = acct.invalid, acct.check_account, acct.present
local ipairs, type, next, rawget, setmetatable, tostring =
  ipairs, type, next, rawget, setmetatable, tostring
local floor, format = math.floor, string.format

local _M = {}

local Ledger = {}
Ledger.__index = Ledger

local CALLER, HELPER_CALLER = 2, 3

-- Policy, with its default: how many times a post may find its seqIds
-- taken (each time another writer's entry landed, so someone progressed)
-- before it gives up with `contention`.
local DEFAULT_RETRIES = 100


-- At most this many changes in one entry, and transfers in one batch.
local MAX_CHANGES, MAX_BATCH = 1000, 10000

-- Values stay exact (and sums associative) as whole numbers within 2^53:
-- amounts are in the currency's smallest unit.
local MAX_VALUE = 2 ^ 53

local CHANGES_INDEX = core.doc("changes.account", 1, "changes.seqId", 1)

local ledger_options = { collection = true, accounts = true, write_concern = true,
                         retries = true }


-- db:ledger{ collection = "ledger", accounts = <collection> .. "_accounts",
-- write_concern = { w = "majority", j = true }, retries = 100 }: creates
-- the unique index on seqs, one on (changes.account, changes.seqId) for
-- the reads of an account's entries, and one on (proc, ts) for the
-- committer.
function _M.new(db, opts)
  local why
  opts, why = options.check(opts, ledger_options, "ledger", HELPER_CALLER)
  if not opts then return nil, why end
  local name = opts.collection or "ledger"
  local heads = opts.accounts or name .. "_accounts"
  if heads == name then
    return invalid(format("the heads (option accounts) need a collection of their own, " ..
      "not the entries' %q", name), "ledger")
  end
  local self = setmetatable({
    db = db,
    entries = db.client:collection(db.name, name),
    accounts = db.client:collection(db.name, heads),
    wopts = { write_concern = opts.write_concern or { w = "majority", j = true } },
    retries = opts.retries or DEFAULT_RETRIES,
    timer = clock.new(db),
    known = {}, n_known = 0, -- id_key(account) -> { seq, balance } (remember)
    before_seqs = false, -- begun before seqs: its unique index is (changes.account, changes.seqId)
  }, Ledger)
  -- sparse: entries written before seqs have none, and a ledger may hold many
  local ok, err = self.entries:create_index(core.doc("seqs", 1), { unique = true, sparse = true })
  if ok then ok, err = self.entries:create_index(CHANGES_INDEX) end
  -- a ledger begun before seqs has this index unique (85 or 86: the same
  -- keys with other options), which serves the reads as well and keeps
  -- guarding its older entries, those without seqs (docs/ledger.md)
  if not ok and (err.server_code == 85 or err.server_code == 86) then
    ok, err, self.before_seqs = true, nil, true
  end
  if ok then ok, err = self.entries:create_index(core.doc("proc", 1, "ts", 1)) end
  if not ok then return nil, errors.wrap(err, "ledger") end
  return self
end

-- Checks ------------------------------------------------------------------

local function check_value(v, what, step, positive)
  if type(v) ~= "number" then error(what .. " must be a number", HELPER_CALLER) end
  if v ~= v or v >= MAX_VALUE or v <= -MAX_VALUE or floor(v) ~= v then
    return invalid(format("%s must be a whole number within 2^53 (amounts are in the " ..
      "smallest unit), not %s", what, tostring(v)), step)
  end
  if positive and v <= 0 then return invalid(what .. " must be positive", step) end
  if v == 0 then return invalid(what .. " may not be 0", step) end
  return true
end


-- The length of `list`, a table whose keys are 1..n with 1 <= n <= max
-- (raw reads), or nil, err.
local function list_length(list, what, max, step)
  local n = rawlen(list)
  if n == 0 or n > max then
    return invalid(format("%s must hold 1 to %d items, not %d", what, max, n), step)
  end
  for k in next, list do
    if type(k) ~= "number" or k < 1 or k > n or floor(k) ~= k then
      return invalid(what .. " must be a list", step)
    end
  end
  return n
end

local post_options, guard_options = { id = true, min = true }, { min = true }

-- The changes of a post as { account, key, value } (raw reads: a
-- metatable cannot show the checks one table and the insert another), or
-- nil, err.
local function check_changes(changes, step)
  if type(changes) ~= "table" then error("changes must be a table", HELPER_CALLER) end
  local n, err = list_length(changes, "changes", MAX_CHANGES, step)
  if not n then return nil, err end
  local out, seen = {}, {}
  for i = 1, n do
    local c = rawget(changes, i)
    if type(c) ~= "table" then error(format("change %d must be a table", i), HELPER_CALLER) end
    for k in next, c do
      if k ~= "account" and k ~= "value" then
        error(format("change %d has an unknown field %s", i, tostring(k)), HELPER_CALLER)
      end
    end
    local sent, key = check_account(rawget(c, "account"), step, i)
    if sent == nil then return nil, key end
    if seen[key] then return invalid(format("account of change %d appears twice", i), step) end
    seen[key] = true
    local ok
    ok, err = check_value(rawget(c, "value"), format("value of change %d", i), step)
    if not ok then return nil, err end
    out[i] = { account = sent, key = key, value = rawget(c, "value") }
  end
  return out
end

-- The options of post and transfer (post_options), reverse and
-- transfer_many (guard_options: an id is per entry).
local function check_post_options(opts, names, step, level)
  local err
  opts, err = options.check(opts, names, step, level + 1)
  if not opts then return nil, err end
  if opts.min ~= nil then
    local ok
    ok, err = validate.bound(opts.min, "min")
    if not ok then err.step = step; return nil, err end
  end
  if opts.id ~= nil then
    local sent, why = validate.check_tid(opts.id)
    if sent == nil then why.step = step; return nil, why end
    opts.id = sent
  end
  return opts
end

-- Reading accounts (mongotx.ledger.accounts) -------------------------------

-- balance(account): the reconciled balance and the last seqId taken
-- (0, 0 for an account without entries); nil, err.

--- @type Ledger

--- An account's balance and its last seqId.
-- @syntax balance, seq = L:balance(account)
-- @param account the account
-- @treturn integer the balance (0 without entries)
-- @treturn integer the last seqId taken
-- @errors nil, err: `invalid`, database errors
-- @usage local balance, seq = assert(L:balance("A"))
function Ledger:balance(account)
  present(account, "an account", "balance")
  local sent, key = check_account(account, "balance")
  if sent == nil then return nil, key end
  local view = { account = sent, key = key }
  local ok, err = acct.read(self, { view })
  if not ok then return nil, errors.wrap(err, "balance") end
  return view.balance, view.seq
end

-- history(account [, { after, limit }]): a page of the account's changes
-- after seqId `after` (0: from the first), in seqId order, read by the
-- walk balance uses (mongotx.ledger.accounts), so a page costs at most
-- `limit` entries of memory and the reads of one tail walk.

-- The most changes one page of history holds (option limit), and the
-- default.
local HISTORY_MAX, HISTORY_LIMIT = 1000, 100

--- A page of an account's changes, in seqId order.
-- @syntax page, after = L:history(account [, { after = 0, limit = 100 }])
-- @param account the account
-- @tparam[opt] table opts `after` (the seqId the page starts after; 0 by default), `limit` (1 to 1000, 100 by default)
-- @treturn table `{ { seqId, value, entry }, ... }`: each change of the account and its whole entry
-- @treturn ?integer the `after` of the next page, or nil when this page reached the last entry
-- @errors `invalid` (a limit above 1000), database errors
-- @usage local page, after = assert(L:history("A", { limit = 50 }))
function Ledger:history(account, opts)
  present(account, "an account", "history")
  local sent, key = check_account(account, "history")
  if sent == nil then return nil, key end
  local err
  opts, err = options.check(opts, { after = true, limit = true }, "history", CALLER)
  if not opts then return nil, err end
  local limit = opts.limit or HISTORY_LIMIT
  if limit > HISTORY_MAX then
    return invalid(format("option limit of history must be a whole number from 1 to %d " ..
      "(a page is held in memory), not %d", HISTORY_MAX, limit), "history")
  end
  local tail
  tail, err = acct.entries_after(self, sent, key, opts.after or 0, limit)
  if not tail then return nil, errors.wrap(err, "history") end
  local page = {}
  for i, t in ipairs(tail) do
    page[i] = { seqId = t.change.seqId, value = t.change.value, entry = t.entry }
  end
  return page, #page == limit and page[#page].seqId or nil
end

-- Writing entries (made and inserted by mongotx.ledger.writer) -------------

-- The entry with this id, or nil; nil, err.
-- (check_id, not check_tid: a counter-entry's id is a document.)

--- The entry with this id.
-- @syntax entry, err = L:get(id)
-- @param id the entry's id
-- @treturn ?table the entry, or nil
-- @errors `invalid`, database errors
-- @usage local e = L:get(id)
function Ledger:get(id)
  present(id, "an entry id", "get")
  local sent, why = check_id(id)
  if sent == nil then why.step = "get"; return nil, why end
  local doc, err = self.entries:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, "get") end
  return doc
end

-- post(changes [, { id, min }]): one entry moving change.value on each
-- change.account (at most once each); with `min`, every account a change
-- takes from must keep at least min.  An id makes the call safe to repeat
-- (the same changes return the existing entry).  The entry, or nil, err
-- (`invalid`, `guard`, `idempotency`, `contention`, or the server's).

--- One entry moving each change's value on its account.
-- @syntax entry, err = L:post(changes [, { id, min }])
-- @tparam table changes `{ { account, value }, ... }`, each account once
-- @tparam[opt] table opts `id` (a repeat returns the same entry), `min` (the floor of accounts taken from)
-- @treturn table the entry
-- @errors `invalid`, `guard`, `idempotency`, `contention`, `unsupported` (FerretDB v1), database errors
-- @usage assert(L:post({ { account = "A", value = 1000 } }))
function Ledger:post(changes, opts)
  local norm, err = check_changes(changes, "post")
  if not norm then return nil, err end
  opts, err = check_post_options(opts, post_options, "post", CALLER)
  if not opts then return nil, err end
  return writer.post(self, norm, opts, "post")
end

-- transfer(from, to, amount [, { id, min }]): post of -amount on from and
-- +amount on to.

--- A post of -amount on `from` and +amount on `to`.
-- @syntax entry, err = L:transfer(from, to, amount [, { id, min }])
-- @param from the account debited
-- @param to the account credited
-- @int amount whole and positive
-- @tparam[opt] table opts `id`, `min`
-- @treturn table the entry
-- @errors as post
-- @usage local e, err = L:transfer("A", "B", 100, { min = 0, id = "order-1" })
function Ledger:transfer(from, to, amount, opts)
  local ok, err = check_value(amount, "amount", "transfer", true)
  if not ok then return nil, err end
  local norm
  norm, err = check_changes({ { account = from, value = -amount }, { account = to, value = amount } },
                            "transfer")
  if not norm then return nil, err end
  opts, err = check_post_options(opts, post_options, "transfer", CALLER)
  if not opts then return nil, err end
  return writer.post(self, norm, opts, "transfer")
end

-- reverse(id [, { min }]): the counter-transfer of entry `id` (every value
-- negated), linked by `reverses`; its _id is derived from id, so an entry
-- is reversed at most once and repeating the call returns the same
-- counter-entry.  Without min the reversal is not guarded: it corrects a
-- mistake and must land.

--- The counter-transfer of an entry, at most once.
-- @syntax entry, err = L:reverse(id [, { min }])
-- @param id the entry to reverse
-- @tparam[opt] table opts `min` (unguarded by default)
-- @treturn table the counter-entry (`reverses` = id)
-- @errors `state` (no such entry), as post
-- @usage assert(L:reverse(e._id))
function Ledger:reverse(id, opts)
  present(id, "an entry id", "reverse")
  local err
  opts, err = check_post_options(opts, guard_options, "reverse", CALLER)
  if not opts then return nil, err end
  local entry
  entry, err = self:get(id)
  if err then err.step = "reverse"; return nil, err end
  if not entry then
    return nil, errors.new("state", "no such entry", { step = "reverse", id = id })
  end
  local changes = {}
  for i, c in ipairs(entry.changes) do
    changes[i] = { account = c.account, key = id_key(c.account), value = -c.value }
  end
  return writer.post(self, changes, { id = core.doc("reverses", entry._id), min = opts.min,
                               reverses = entry._id }, "reverse")
end

-- transfer_many(list [, { min }]): transfers { from, to, amount } in one
-- ordered bulk insert (one round trip for the writes), each at the next
-- seqIds of its accounts after those before it in the list.  Returns the
-- i-th entry, or false and its error; a transfer whose seqIds were taken
-- meanwhile is retried with those after it.

--- Transfers in one ordered bulk insert.
-- @syntax entries = L:transfer_many(list [, { min }])
-- @tparam table list `{ { from, to, amount }, ... }`
-- @tparam[opt] table opts `min`
-- @treturn table `entries[i]`: the entry, or false
-- @treturn table `errs[i]`: its error, or false
-- @errors per item; `invalid` for the whole list
-- @usage L:transfer_many({ { from = "A", to = "B", amount = 5 } }, { min = 0 })
function Ledger:transfer_many(list, opts)
  if type(list) ~= "table" then error("transfer_many needs a list", CALLER) end
  local n, err = list_length(list, "a batch", MAX_BATCH, "transfer_many")
  if not n then return nil, err end
  opts, err = check_post_options(opts, guard_options, "transfer_many", CALLER)
  if not opts then return nil, err end
  local items = {}
  for i = 1, n do
    local t = rawget(list, i)
    if type(t) ~= "table" then error(format("transfer %d must be a table", i), CALLER) end
    for k in next, t do
      if k ~= "from" and k ~= "to" and k ~= "amount" then
        error(format("transfer %d has an unknown field %s", i, tostring(k)), CALLER)
      end
    end
    local amount = rawget(t, "amount")
    local ok
    ok, err = check_value(amount, format("amount of transfer %d", i), "transfer_many", true)
    if not ok then return nil, err end
    local norm
    norm, err = check_changes({ { account = rawget(t, "from"), value = -amount },
                                { account = rawget(t, "to"), value = amount } }, "transfer_many")
    if not norm then return nil, err end
    items[i] = norm
  end
  return writer.post_many(self, items, opts)
end

-- The committer (commit, reconcile): mongotx.ledger.committer.
Ledger.commit, Ledger.reconcile = committer.commit, committer.reconcile

return _M

-- mongotx.ledger: transfers as log entries (the seed's "log
-- reconciliation"), an alternative to two-phase commit for moving amounts
-- between accounts.
--
-- A transfer is ONE inserted document of the ledger collection:
--
--   { _id, ts = <server time>, proc = "UNCOMMITTED" | "COMMITTED", state = "VALID",
--     changes = { { account, value, seqId, cacheBal = null | <balance after it> }, ... },
--     reverses = <id of the entry it reverses, for a counter-transfer> }
--
-- Each change takes the next seqId of its account; the unique index on
-- { "changes.account", "changes.seqId" } lets only one writer take a
-- number, so a duplicate key means another writer got there first: read
-- again and retry with the next one.  Because a writer only takes max + 1
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

--- A ledger: transfers as log entries with per-account sequence ids; `db:ledger(opts)` (docs/ledger.md).
-- @module mongotx.ledger

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local clock = require "mongotx.clock"

local check_id, id_key = validate.check_id, validate.id_key
local crash_point, null = core.crash_point, core.null
local rawlen = validate.rawlen
local ipairs, type, next, rawget, setmetatable, sort, tostring =
  ipairs, type, next, rawget, setmetatable, table.sort, tostring
local floor, format = math.floor, string.format

local _M = {}

local Ledger = {}
Ledger.__index = Ledger

local CALLER, HELPER_CALLER = 2, 3

-- Policy, with its default: how many times a post may find its seqIds
-- taken (each time another writer's entry landed, so someone progressed)
-- before it gives up with `contention`.
local DEFAULT_RETRIES = 100

-- How many accounts a ledger remembers the last (seqId, balance) of; the
-- memory starts afresh when it is full.
local MAX_KNOWN = 100000

-- At most this many changes in one entry, and transfers in one batch.
local MAX_CHANGES, MAX_BATCH = 1000, 10000

-- Values stay exact (and sums associative) as whole numbers within 2^53:
-- amounts are in the currency's smallest unit.
local MAX_VALUE = 2 ^ 53

local ledger_options = { collection = true, accounts = true, write_concern = true,
                         retries = true }

local function invalid(message, step)
  return nil, errors.new("invalid", message, { step = step })
end

-- db:ledger{ collection = "ledger", accounts = <collection> .. "_accounts",
-- write_concern = { w = "majority", j = true }, retries = 100 }: creates
-- the unique index on (changes.account, changes.seqId) and one on
-- (proc, ts) for the committer.
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
  }, Ledger)
  local ok, err = self.entries:create_index(core.doc("changes.account", 1, "changes.seqId", 1),
                                            { unique = true })
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

local function check_account(a, step, i)
  local sent, key = check_id(a)
  -- an empty document (or array: Lua cannot tell) is no condition to
  -- some servers inside $elemMatch, where every read of an account goes
  if sent ~= nil and type(sent) == "table" and next(sent) == nil then
    sent, key = invalid("an account may not be an empty table", step)
  end
  if sent == nil then
    key.step, key.message = step, format("account%s: %s", i and " " .. i or "", key.message)
    return nil, key
  end
  return sent, key
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

-- Reading accounts ---------------------------------------------------------

-- The change of `entry` on the account with this key and its place in
-- the list (0-based, as paths count), or nil.
local function change_of(entry, key)
  for i, c in ipairs(entry.changes or {}) do
    if id_key(c.account) == key then return c, i - 1 end
  end
end

-- Each account's entries after seq, read one seqId at a time by the
-- whole key of the unique index (a lookup every server answers from the
-- index; mongo-java-server scans the collection for anything else) while
-- the tail is short, then the rest at once by $elemMatch (an index range
-- on MongoDB).
local WALK = 8

-- The change of account `view` at seqId seq and its entry, or nil (the
-- two path conditions may match two elements: the change is picked here).
function Ledger:_at(view, seq)
  local found, err = self.entries:find_all(core.doc("changes.account", view.account,
                                                     "changes.seqId", seq))
  if not found then return nil, err end
  for _, e in ipairs(found) do
    local c, at = change_of(e, view.key)
    if c and c.seqId == seq then return { entry = e, change = c, at = at } end
  end
  return false
end

-- Appends the entries of `view` after view.seq to view.tail, in seqId
-- order; true or nil, err.
function Ledger:_tail(view)
  for _ = 1, WALK do
    local t, err = self:_at(view, view.seq + 1)
    if t == nil then return nil, err end
    if not t then return true end
    view.tail[#view.tail + 1] = t
    view.seq = view.seq + 1
  end
  local rest, err = self.entries:find_all({ changes = { ["$elemMatch"] = {
    account = view.account, seqId = { ["$gt"] = view.seq } } } })
  if not rest then return nil, err end
  local more = {}
  for _, e in ipairs(rest) do
    local c, at = change_of(e, view.key)
    if c and c.seqId > view.seq then more[#more + 1] = { entry = e, change = c, at = at } end
  end
  sort(more, function(a, b) return a.change.seqId < b.change.seqId end)
  for _, t in ipairs(more) do
    view.tail[#view.tail + 1] = t
    view.seq = t.change.seqId
  end
  return true
end

-- Sets view.head and view.head_balance of these views from their
-- accounts' heads (nil where there is none), in one read; true or nil, err.
function Ledger:_heads(views)
  local ids, by_key = {}, {}
  for i, v in ipairs(views) do
    ids[i], by_key[v.key] = v.account, v
    v.head, v.head_balance = nil, nil
  end
  local heads, err = self.accounts:find_all({ _id = { ["$in"] = ids } })
  if not heads then return nil, err end
  for _, h in ipairs(heads) do
    local v = by_key[id_key(h._id)]
    if v then v.head, v.head_balance = h.seq, h.balance end
  end
  return true
end

-- What the database says of these accounts ({ account, key } tables):
-- their heads in one read, then the entries after each.  Fills view.head
-- and view.head_balance (the head, if any), view.seq (the last seqId
-- taken), view.balance (head + every valid change after it) and
-- view.tail (those changes with their entries, in seqId order).
function Ledger:_read(views)
  local _, err = self:_heads(views)
  if err then return nil, err end
  for _, v in ipairs(views) do v.seq, v.tail = v.head or 0, {} end
  for _, v in ipairs(views) do
    local ok
    ok, err = self:_tail(v)
    if not ok then return nil, err end
    v.balance = v.head_balance or 0
    for _, t in ipairs(v.tail) do
      if t.entry.state == "VALID" then v.balance = v.balance + t.change.value end
    end
  end
  self:_remember(views)
  return true
end

-- Notes the (seq, balance) of these views as the last known of their
-- accounts.
function Ledger:_remember(views)
  local known = self.known
  for _, v in ipairs(views) do
    if not known[v.key] then
      if self.n_known >= MAX_KNOWN then known, self.n_known = {}, 0; self.known = known end
      self.n_known = self.n_known + 1
    end
    known[v.key] = { v.seq, v.balance }
  end
end

-- Fills the views from what this ledger remembers and, for the accounts
-- it knows nothing of, from their heads (one read; none when it knows
-- them all): a guess the unique index checks (see the top of the file).
function Ledger:_guess(views)
  local unknown = {}
  for _, v in ipairs(views) do
    local k = self.known[v.key]
    if k then v.seq, v.balance = k[1], k[2] else unknown[#unknown + 1] = v end
  end
  if #unknown == 0 then return true end
  local ok, err = self:_heads(unknown)
  if not ok then return nil, err end
  for _, v in ipairs(unknown) do v.seq, v.balance = v.head or 0, v.head_balance or 0 end
  return true
end

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
  local sent, key = check_account(account, "balance")
  if sent == nil then return nil, key end
  local view = { account = sent, key = key }
  local ok, err = self:_read({ view })
  if not ok then return nil, errors.wrap(err, "balance") end
  return view.balance, view.seq
end

-- Writing entries ----------------------------------------------------------

-- The entry with this id, or nil; nil, err.
-- (check_id, not check_tid: a counter-entry's id is a document.)

--- The entry with this id.
-- @syntax entry, err = L:get(id)
-- @param id the entry's id
-- @treturn ?table the entry, or nil
-- @errors `invalid`, database errors
-- @usage local e = L:get(id)
function Ledger:get(id)
  local sent, why = check_id(id)
  if sent == nil then why.step = "get"; return nil, why end
  local doc, err = self.entries:find_one({ _id = sent })
  if err then return nil, errors.wrap(err, "get") end
  return doc
end

-- A new entry for `changes` (checked), at the seqIds `views` say are
-- next, or nil, err when a guard fails.
local function build_entry(changes, views, opts, now, step)
  for i, c in ipairs(changes) do -- every guard before any view moves
    local v = views[i]
    if opts.min ~= nil and c.value < 0 and v.balance + c.value < opts.min then
      return nil, errors.new("guard", format("account %s would go below %s (balance %s at " ..
        "seqId %d)", tostring(c.account), tostring(opts.min), tostring(v.balance), v.seq),
        { step = step, account = c.account, balance = v.balance, seqId = v.seq })
    end
  end
  local out = {}
  for i, c in ipairs(changes) do
    local v = views[i]
    out[i] = { account = c.account, value = c.value, seqId = v.seq + 1, cacheBal = null }
    v.seq, v.balance = v.seq + 1, v.balance + c.value
  end
  return { _id = opts.id == nil and core.ObjectId() or opts.id, ts = core.Date(floor(now)),
           proc = "UNCOMMITTED", state = "VALID", changes = out, reverses = opts.reverses }
end

-- Do the checked changes `a` move what the stored changes `b` move?  By
-- account as the server compares ids and by value as numbers compare, in
-- any order (accounts are unique in an entry): a list built from pairs()
-- comes in another order in another process, and 100 and 100.0 are one
-- amount.
local function same_changes(a, b)
  if type(b) ~= "table" or #a ~= #b then return false end
  local want = {}
  for _, c in ipairs(a) do want[c.key] = c.value end
  for _, c in ipairs(b) do
    local key = id_key(c.account)
    if key == nil or want[key] ~= c.value then return false end
  end
  return true
end

-- After a duplicate key on an entry with a caller's id: the existing
-- entry when it is this one (a repeated call), an `idempotency` error when
-- the id holds other changes, or nil when the id is free (the seqIds were
-- taken: retry).
function Ledger:_existing(id, changes, step)
  local doc, err = self.entries:find_one({ _id = id })
  if err then return nil, errors.wrap(err, step) end
  if not doc then return nil end
  if same_changes(changes, doc.changes) then return doc end
  return nil, errors.new("idempotency", "this id was used for other changes",
    { step = step, id = id })
end

-- The unique index on (changes.account, changes.seqId) is the ledger's
-- only defence against two entries taking one seqId, and it is a
-- multikey index over an array of documents: a server may accept such an
-- index and not enforce it (FerretDB v1.24 does: a second entry with a
-- taken (account, seqId) goes in), and a ledger there would let two
-- writers share a seqId in silence.  So before its first write a ledger
-- tries the index on a collection of its own (`<entries>.probe`, same
-- index): two documents under one new (ObjectId, 1) pair, the second of
-- which must fail as a duplicate; both are deleted again.  Once per
-- connection and collection; nil, `unsupported` where the index is not
-- enforced.
local PROBE_INDEX = core.doc("changes.account", 1, "changes.seqId", 1)
local probed = setmetatable({}, { __mode = "k" }) -- client -> { "<db>.<entries>" = true }

function Ledger:_index_enforced(step)
  local client = self.db.client
  local seen = probed[client]
  if not seen then
    seen = {}
    probed[client] = seen
  end
  local key = self.db.name .. "." .. self.entries:name()
  if seen[key] then return true end
  local probe = client:collection(self.db.name, self.entries:name() .. ".probe")
  local ok, err = probe:create_index(PROBE_INDEX, { unique = true })
  if not ok then return nil, errors.wrap(err, step) end
  local changes = { { account = core.ObjectId(), seqId = 1 } }
  local first, second = core.ObjectId(), core.ObjectId()
  ok, err = probe:insert_one({ _id = first, changes = changes }, self.wopts)
  if not ok then return nil, errors.wrap(err, step) end
  local dup, why = probe:insert_one({ _id = second, changes = changes }, self.wopts)
  probe:delete_many({ _id = { ["$in"] = { first, second } } }, self.wopts)
  if dup then
    return nil, errors.new("unsupported", "this server does not enforce a unique index " ..
      "on a path inside an array of documents, which keeps two entries off one seqId",
      { step = step })
  end
  if why.server_code ~= 11000 then return nil, errors.wrap(why, step) end
  seen[key] = true
  return true
end

function Ledger:_post(changes, opts, step)
  local enforced, unsafe = self:_index_enforced(step)
  if not enforced then return nil, unsafe end
  local views = {}
  for i, c in ipairs(changes) do views[i] = { account = c.account, key = c.key } end
  local taken, read = 0, false
  while true do
    local ok, err
    if read then ok, err = self:_read(views) else ok, err = self:_guess(views) end
    if not ok then return nil, errors.wrap(err, step) end
    local now
    now, err = self.timer:now()
    if not now then return nil, err end
    local entry
    entry, err = build_entry(changes, views, opts, now, step)
    if entry then
      crash_point("ledger.insert", "before")
      local res
      res, err = self.entries:insert_one(entry, self.wopts)
      crash_point("ledger.insert", "after")
      if res then
        self:_remember(views)
        return entry
      end
      if err.server_code ~= 11000 then return nil, errors.wrap(err, step, entry._id) end
      if opts.id ~= nil then
        local existing, why = self:_existing(opts.id, changes, step)
        if existing or why then return existing, why end
      end
      taken = taken + 1
      if taken > self.retries then
        return nil, errors.new("contention", format("the seqIds were taken by other " ..
          "writers %d times in a row", taken), { step = step })
      end
    elseif read then
      -- a guard, on what the database holds; but a call repeated with its
      -- id (its first reply lost) finds its own entry, whatever the
      -- balance says now
      if opts.id ~= nil then
        local existing, why = self:_existing(opts.id, changes, step)
        if existing or why then return existing, why end
      end
      return nil, err
    end
    read = true -- a number taken, or a guard on a guess: read the accounts
  end
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
  return self:_post(norm, opts, "post")
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
  return self:_post(norm, opts, "transfer")
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
  return self:_post(changes, { id = core.doc("reverses", entry._id), min = opts.min,
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
  return self:_post_many(items, opts)
end

-- The views of every account of items (one per account).
local function views_of(items, from)
  local views, by_key = {}, {}
  for i = from, #items do
    for _, c in ipairs(items[i]) do
      if not by_key[c.key] then
        by_key[c.key] = { account = c.account, key = c.key }
        views[#views + 1] = by_key[c.key]
      end
    end
  end
  return views, by_key
end

function Ledger:_post_many(items, opts)
  local enforced, unsafe = self:_index_enforced("transfer_many")
  if not enforced then return nil, unsafe end
  local results, errs = {}, {}
  local from, taken, read = 1, 0, false
  while from <= #items do
    local views, by_key = views_of(items, from)
    local ok, err
    if read then ok, err = self:_read(views) else ok, err = self:_guess(views) end
    if not ok then return nil, errors.wrap(err, "transfer_many") end
    local now
    now, err = self.timer:now()
    if not now then return nil, err end
    local batch, where, refused = {}, {}, false
    for i = from, #items do
      local mine = {}
      for k, c in ipairs(items[i]) do mine[k] = by_key[c.key] end
      local entry, why = build_entry(items[i], mine, opts, now, "transfer_many")
      if entry then
        batch[#batch + 1], where[#batch + 1] = { op = "insert", doc = entry }, i
        results[i], errs[i] = entry, nil -- (a refusal on a guess is judged again)
      else
        results[i], errs[i], refused = false, why, true
      end
    end
    if refused and not read then
      read = true -- a guard refused on a guess: read the accounts, then decide
    elseif #batch == 0 then
      break
    else
      crash_point("ledger.insert_many", "before")
      local res
      res, err = self.entries:bulk_write(batch, { ordered = true,
                                                  write_concern = self.wopts.write_concern })
      crash_point("ledger.insert_many", "after")
      if not res then return nil, errors.wrap(err, "transfer_many") end
      from = #items + 1
      for k, item in ipairs(res.items) do
        if not item.ok then
          if item.server_code ~= 11000 and item.executed ~= false then
            return nil, errors.new("server", item.message or "insert failed",
              { step = "transfer_many", server_code = item.server_code })
          end
          from = where[k] -- this one and the rest: again after a read
          break
        end
      end
      if from > #items then self:_remember(views) end
      if from <= #items then
        read, taken = true, taken + 1
        if taken > self.retries then
          for i = from, #items do
            results[i], errs[i] = false, errors.new("contention", "the seqIds were taken by " ..
              "other writers too many times", { step = "transfer_many" })
          end
          break
        end
      end
    end
  end
  return results, errs
end

-- The committer ------------------------------------------------------------

-- Caches the balances of one account's entries after its head (`view`,
-- as _read left it), in seqId
-- order: each change's cacheBal (a value every committer computes alike,
-- so writing it twice is harmless), the
-- entry's proc = COMMITTED once no change of it is left uncached, then
-- the head.  Returns how many changes it cached; nil, err.
function Ledger:_commit_account(view)
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
-- 1000) UNCOMMITTED entries, oldest first, and caches the accounts they
-- touch.  Safe to run in several processes at once and to kill at any
-- point.  Returns { accounts = n, cached = changes cached, uncommitted =
-- entries still UNCOMMITTED among those seen }; nil, err.

--- The committer: caches balances and marks entries COMMITTED.
-- @syntax report, err = L:commit([{ limit = 1000 } | { account = a }])
-- @tparam[opt] table opts `limit`, or `account`
-- @treturn table `{ accounts, cached, uncommitted }`
-- @errors database errors
-- @usage assert(L:commit())
function Ledger:commit(opts)
  local err
  opts, err = options.check(opts, { account = true, limit = true }, "commit", CALLER)
  if not opts then return nil, err end
  if opts.account ~= nil and opts.limit ~= nil then
    return invalid("commit takes an account or a limit, not both", "commit")
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
  ok, err = self:_read(accounts)
  if not ok then return nil, errors.wrap(err, "commit") end
  for _, view in ipairs(accounts) do
    local n
    n, err = self:_commit_account(view)
    if not n then return nil, errors.wrap(err, "commit") end
    report.cached = report.cached + n
  end
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

--- Replays an account from its first entry and reports what disagrees.
-- @syntax report, err = L:reconcile(account)
-- @param account the account
-- @treturn table `{ balance, seq, ok, problems }`
-- @errors database errors
-- @usage assert(L:reconcile("A").ok)
function Ledger:reconcile(account)
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
  local all
  all, err = self.entries:find_all({ changes = { ["$elemMatch"] = { account = sent } } })
  if not all then return nil, errors.wrap(err, "reconcile") end
  local list = {}
  for _, e in ipairs(all) do list[#list + 1] = { entry = e, change = change_of(e, key) } end
  sort(list, function(a, b) return a.change.seqId < b.change.seqId end)
  local problems, balance, at = {}, 0, { [0] = 0 }
  for i, t in ipairs(list) do
    local c = t.change
    if c.seqId ~= i then
      problems[#problems + 1] = format("seqId %d where %d was due", c.seqId, i)
    end
    if t.entry.state == "VALID" then balance = balance + c.value end
    at[c.seqId] = balance
    if c.cacheBal ~= nil and c.cacheBal ~= null and c.cacheBal ~= balance then
      problems[#problems + 1] = format("cacheBal %s at seqId %d, the replay gives %s",
        tostring(c.cacheBal), c.seqId, tostring(balance))
    end
  end
  if head and at[head.seq] ~= head.balance then
    problems[#problems + 1] = format("the head caches %s at seqId %s, the replay gives %s",
      tostring(head.balance), tostring(head.seq), tostring(at[head.seq]))
  end
  if at[now_seq] ~= now then
    problems[#problems + 1] = format("balance() gives %s, the replay %s", tostring(now),
      tostring(at[now_seq]))
  end
  return { balance = balance, seq = #list, ok = #problems == 0, problems = problems }
end

return _M

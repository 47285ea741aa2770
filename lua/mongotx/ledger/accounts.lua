-- mongotx.ledger.accounts: what an account of mongotx.ledger is (an id
-- that may be sent in a filter: check_account) and what the database says
-- of it: its head and the entries after it (read), or what this ledger
-- remembers of it (remember, guess).  The functions take the ledger (its
-- entries and accounts collections, and its memory `known`).

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"

local check_id, id_key = validate.check_id, validate.id_key
local ipairs, type, next, sort = ipairs, type, next, table.sort
local format, min = string.format, math.min

local _M = {}

-- How many accounts a ledger remembers the last (seqId, balance) of; the
-- memory starts afresh when it is full.
local MAX_KNOWN = 100000

-- nil and an `invalid` error of this step.
function _M.invalid(message, step)
  return nil, errors.new("invalid", message, { step = step })
end
local invalid = _M.invalid

-- An id or account argument that no id can be (none, a function, a
-- thread) is misuse, as for tm:get: it raises at the caller of the
-- public method that called this.
function _M.present(x, what, step)
  local kind = type(x)
  if x == nil or kind == "function" or kind == "thread" then
    error(format("%s needs %s, not a %s", step, what, kind), 3)
  end
end

-- The account as sent in a filter and its key (validate.id_key), or nil,
-- err; `i` numbers the change in the message.
function _M.check_account(a, step, i)
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

-- The change of `entry` on the account with this key and its place in
-- the list (0-based, as paths count), or nil.
function _M.change_of(entry, key)
  for i, c in ipairs(entry.changes or {}) do
    if id_key(c.account) == key then return c, i - 1 end
  end
end

-- One element of an entry's seqs: the key the unique index holds, in a
-- fixed field order (documents compare field by field).
function _M.seq_key(account, seqId)
  return core.doc("account", account, "seqId", seqId)
end

-- Each account's entries after seq, read one seqId at a time by the
-- whole key of the unique index (a lookup every server answers from the
-- index; mongo-java-server scans the collection for anything else): seqs,
-- or (changes.account, changes.seqId) in a ledger begun before seqs,
-- whose older entries have none.  That while the tail is short, then
-- TAIL_CHUNK seqIds at a time by $elemMatch (an index range on MongoDB):
-- a committer far behind makes the reads many, not large.
local WALK = 8
_M.TAIL_CHUNK = 1000

-- The change of account `view` at seqId seq and its entry, or nil (the
-- two path conditions may match two elements: the change is picked here).
local function entry_at(self, view, seq)
  local found, err = self.entries:find_all(self.before_seqs and
    core.doc("changes.account", view.account, "changes.seqId", seq) or
    { seqs = _M.seq_key(view.account, seq) })
  if not found then return nil, err end
  for _, e in ipairs(found) do
    local c, at = _M.change_of(e, view.key)
    if c and c.seqId == seq then return { entry = e, change = c, at = at } end
  end
  return false
end

-- Has `view` kept as many changes as it asked for (view.keep)?
local function full(view)
  return view.keep ~= nil and #view.tail >= view.keep
end

-- Moves `view` on over the change t (its account's next): its seqId and
-- balance, and t into view.tail while it keeps changes.
local function take(view, t)
  view.seq = t.change.seqId
  if t.entry.state == "VALID" then view.balance = view.balance + t.change.value end
  if view.keep then view.tail[#view.tail + 1] = t end
end

-- Moves `view` over its account's entries after view.seq, in seqId order,
-- until their end or until view.tail is full; true or nil, err.  A view
-- that keeps changes reads no range past the last one it keeps, so what
-- one call reads is bounded by what it keeps (L:history's page).
local function read_tail(self, view)
  for _ = 1, WALK do
    if full(view) then return true end
    local t, err = entry_at(self, view, view.seq + 1)
    if t == nil then return nil, err end
    if not t then return true end
    take(view, t)
  end
  while not full(view) do
    local chunk = view.keep and min(_M.TAIL_CHUNK, view.keep - #view.tail) or _M.TAIL_CHUNK
    -- (a broken ledger may hold two entries at a seqId: up to twice the
    -- chunk is read)
    local rest, err = self.entries:find_all({ changes = { ["$elemMatch"] = {
      account = view.account, seqId = { ["$gt"] = view.seq, ["$lte"] = view.seq + chunk } } } },
      { limit = 2 * chunk })
    if not rest then return nil, err end
    local more = {}
    for _, e in ipairs(rest) do
      local c, at = _M.change_of(e, view.key)
      if c and c.seqId > view.seq then more[#more + 1] = { entry = e, change = c, at = at } end
    end
    sort(more, function(a, b) return a.change.seqId < b.change.seqId end)
    for _, t in ipairs(more) do
      if full(view) then return true end
      take(view, t)
    end
    if #more < chunk then return true end -- seqIds have no gap: this was the end
  end
  return true
end

-- Sets view.head and view.head_balance of these views from their
-- accounts' heads (nil where there is none), in one read; true or nil, err.
local function read_heads(self, views)
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
-- taken) and view.balance (head + every valid change up to view.seq).
-- With `keep` (the committer), view.tail holds the changes after the
-- head with their entries, in seqId order, and the read stops at `keep`
-- of them (view.seq and view.balance where it stopped); without, it reads
-- to the end holding none, so a balance costs the memory of one chunk.
-- each(view), when given, is called as soon as a view is read (true or
-- nil, err), and its tail let go after it: one account's at a time.
function _M.read(self, views, keep, each)
  local _, err = read_heads(self, views)
  if err then return nil, err end
  for _, v in ipairs(views) do
    v.seq, v.balance, v.tail, v.keep = v.head or 0, v.head_balance or 0, {}, keep
  end
  for _, v in ipairs(views) do
    local ok
    ok, err = read_tail(self, v)
    if ok and each then
      ok, err = each(v)
      v.tail = {}
    end
    if not ok then return nil, err end
  end
  _M.remember(self, views)
  return true
end

-- The entries of one account after seqId `after`, at most `keep` of
-- them, in seqId order: { { entry, change, at }, ... } read by the same
-- walk as read's (L:history); nil, err.
function _M.entries_after(self, account, key, after, keep)
  local view = { account = account, key = key, seq = after, balance = 0, tail = {}, keep = keep }
  local ok, err = read_tail(self, view)
  if not ok then return nil, err end
  return view.tail
end

-- Notes the (seq, balance) of these views as the last known of their
-- accounts.
function _M.remember(self, views)
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
-- them all): a guess the unique index checks (see the top of mongotx.ledger).
function _M.guess(self, views)
  local unknown = {}
  for _, v in ipairs(views) do
    local k = self.known[v.key]
    if k then v.seq, v.balance = k[1], k[2] else unknown[#unknown + 1] = v end
  end
  if #unknown == 0 then return true end
  local ok, err = read_heads(self, unknown)
  if not ok then return nil, err end
  for _, v in ipairs(unknown) do v.seq, v.balance = v.head or 0, v.head_balance or 0 end
  return true
end

return _M

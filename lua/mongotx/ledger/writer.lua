-- mongotx.ledger.writer: how mongotx.ledger writes an entry (post) or a
-- batch of them (post_many): the entry at the next seqIds of its
-- accounts, the insert the unique index accepts or refuses, the read and
-- retry after a number taken, a repeated id answered with its entry, and
-- the check (once per connection) that the server enforces that index.
-- mongotx.ledger checks what callers pass and calls these with the
-- ledger; the top of mongotx.ledger says why the numbering is safe.

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local acct = require "mongotx.ledger.accounts"

local id_key = validate.id_key
local seq_key = acct.seq_key
local crash_point, null = core.crash_point, core.null
local ipairs, type, setmetatable = ipairs, type, setmetatable
local floor, format = math.floor, string.format

local _M = {}

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
  local out, keys = {}, {}
  for i, c in ipairs(changes) do
    local v = views[i]
    out[i] = { account = c.account, value = c.value, seqId = v.seq + 1, cacheBal = null }
    keys[i] = seq_key(c.account, v.seq + 1)
    v.seq, v.balance = v.seq + 1, v.balance + c.value
  end
  return { _id = opts.id == nil and core.ObjectId() or opts.id, ts = core.Date(floor(now)),
           proc = "UNCOMMITTED", state = "VALID", changes = out, seqs = keys,
           reverses = opts.reverses }
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
local function existing_entry(self, id, changes, step)
  local doc, err = self.entries:find_one({ _id = id })
  if err then return nil, errors.wrap(err, step) end
  if not doc then return nil end
  if same_changes(changes, doc.changes) then return doc end
  return nil, errors.new("idempotency", "this id was used for other changes",
    { step = step, id = id })
end

-- The unique index on seqs is the ledger's only defence against two
-- entries taking one seqId, and it is a multikey index over an array of
-- documents: a server may accept such an index and not enforce it
-- (FerretDB v1.24 does: a second entry with a taken (account, seqId) goes
-- in), and a ledger there would let two writers share a seqId in silence.
-- So before its first write a ledger tries the index on a collection of
-- its own (`<entries>.seqs_probe`, same index; not the `.probe` of the
-- version before seqs, which holds the old index): two documents that
-- share one new (ObjectId, 1) pair, the first with a second pair (FerretDB
-- v1 refuses only an equal whole array), the second of which must fail as
-- a duplicate; both are deleted again.  Once per connection and
-- collection; nil, `unsupported` where the index is not enforced.
local PROBE_INDEX = core.doc("seqs", 1)
local probed = setmetatable({}, { __mode = "k" }) -- client -> { "<db>.<entries>" = true }

local function index_enforced(self, step)
  local client = self.db.client
  local seen = probed[client]
  if not seen then
    seen = {}
    probed[client] = seen
  end
  local key = self.db.name .. "." .. self.entries:name()
  if seen[key] then return true end
  local probe = client:collection(self.db.name, self.entries:name() .. ".seqs_probe")
  local ok, err = probe:create_index(PROBE_INDEX, { unique = true, sparse = true })
  if not ok then return nil, errors.wrap(err, step) end
  local shared = seq_key(core.ObjectId(), 1)
  local first, second = core.ObjectId(), core.ObjectId()
  ok, err = probe:insert_one({ _id = first, seqs = { shared, seq_key(core.ObjectId(), 1) } },
                             self.wopts)
  if not ok then return nil, errors.wrap(err, step) end
  local dup, why = probe:insert_one({ _id = second, seqs = { shared } }, self.wopts)
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

-- One entry of the checked `changes` at the next seqIds of their
-- accounts (see the top of mongotx.ledger): the entry, or nil, err.
function _M.post(self, changes, opts, step)
  local enforced, unsafe = index_enforced(self, step)
  if not enforced then return nil, unsafe end
  local views = {}
  for i, c in ipairs(changes) do views[i] = { account = c.account, key = c.key } end
  local taken, read = 0, false
  while true do
    local ok, err
    if read then ok, err = acct.read(self, views) else ok, err = acct.guess(self, views) end
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
        acct.remember(self, views)
        return entry
      end
      if err.server_code ~= 11000 then return nil, errors.wrap(err, step, entry._id) end
      if opts.id ~= nil then
        local existing, why = existing_entry(self, opts.id, changes, step)
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
        local existing, why = existing_entry(self, opts.id, changes, step)
        if existing or why then return existing, why end
      end
      return nil, err
    end
    read = true -- a number taken, or a guard on a guess: read the accounts
  end
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

-- The checked transfers `items` in one ordered bulk insert (see
-- transfer_many): results and errs by item, or nil, err.
function _M.post_many(self, items, opts)
  local enforced, unsafe = index_enforced(self, "transfer_many")
  if not enforced then return nil, unsafe end
  local results, errs = {}, {}
  local from, taken, read = 1, 0, false
  while from <= #items do
    local views, by_key = views_of(items, from)
    local ok, err
    if read then ok, err = acct.read(self, views) else ok, err = acct.guess(self, views) end
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
      if from > #items then acct.remember(self, views) end
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

return _M

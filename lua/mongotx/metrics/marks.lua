-- mongotx.metrics.marks: the transactions a registry counted begun and has
-- not yet counted ended (docs/metrics.md, "Counting under kills").
--
-- Each transaction is counted begun, and then done or cancelled, once,
-- by the registry that counted it begun, whoever ends it.  Its create
-- marks it in the store (in nginx the shared dict, so every worker of
-- the instance finds the marks of the others); its end counts it only
-- when it removes the mark (an atomic step in the shared dict: of two
-- that end one, one counts).  An end without a mark (another registry's
-- transaction, or one whose creator died with its registry) counts
-- nothing.  Marks whose end went uncounted (the process that wrote it
-- was killed before its event, or another process ended it) are found by
-- reconcile: so begun - done - cancelled is the number of marks, never
-- below 0, and back to 0 once all finished and reconciled.  A store
-- without marks (a caller's own) keeps them in this Lua state.
--
-- Marks are kept by application and by namespace ("<database>.<collection>"
-- of the transactions, on_event's third argument): two managers of one
-- application on two transactions collections (or databases) count into
-- one registry, and each reconciles only its own marks.

--- The marks of the transactions a metrics registry counted begun (internal).
-- @module mongotx.metrics.marks
-- @local

local core = require "mongotx.core"
local engine = require "mongotx.engine"

local pairs, ipairs, setmetatable, type = pairs, ipairs, setmetatable, type
local sort, max, min = table.sort, math.max, math.min
local key_of, now_ms = engine.key, core.monotonic_ms

local _M = {}

-- The marks of a table store: k = "<application>\t<namespace>\t<id's key>" ->
-- { t = ms, id = id }.
local Table = {}
function Table:mark(k, id, t)
  if self.marks[k] then return "exists" end
  self.marks[k] = { t = t, id = id }
  return "new"
end
function Table:unmark(k)
  local was = self.marks[k]
  self.marks[k] = nil
  return was ~= nil
end
function Table:marked(prefix)
  local list, n = {}, #prefix
  for k, e in pairs(self.marks) do
    if k:sub(1, n) == prefix then list[#list + 1] = { k = k, id = e.id, t = e.t } end
  end
  return list
end
function Table:touch(k, dt)
  local e = self.marks[k]
  if e then e.t = e.t + dt end
end

--- Gives a store class (whose objects have a `marks` table) the mark methods.
-- @tparam table class the store's metatable
function _M.mix(class)
  for name, f in pairs(Table) do class[name] = f end
end

local Own = { __index = Table }

local function of(m)
  local store = m.store
  if store.mark and store.unmark and store.marked and store.touch then return store end
  m.own_marks = m.own_marks or setmetatable({ marks = {} }, Own)
  return m.own_marks
end

-- The namespace in 6 characters (a hash of 36 bits: two namespaces of
-- one application share marks once in 2^36 pairs), so that the key of
-- an ObjectId's mark stays within 52 bytes (an application of up to 11):
-- 128 bytes of the shared dict's memory, not 256.
local DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local function short(ns)
  local h = 0
  for i = 1, #ns do h = (h * 257 + ns:byte(i)) % 68719476731 end
  local out = {}
  for i = 1, 6 do
    local d = h % 64
    out[i], h = DIGITS:sub(d + 1, d + 1), (h - d) / 64
  end
  return table.concat(out)
end

-- A mark's key: "<application>\t<namespace's hash>\t<id's key>", the
-- application's tabs (and %) escaped, so that the second tab ends the
-- tag (mongotx.metrics.shared); tag_of gives the part up to that tab.
local ESCAPE = { ["%"] = "%%", ["\t"] = "%t" }
local function tag_of(m, app, ns)
  ns = ns or ""
  local of_app = m.tags[app]
  if not of_app then of_app = {}; m.tags[app] = of_app end
  local tag = of_app[ns]
  if not tag then
    tag = app:gsub("[%%\t]", ESCAPE) .. "\t" .. short(ns) .. "\t"
    of_app[ns] = tag
  end
  return tag
end

local function key(m, app, ns, id) return tag_of(m, app, ns) .. key_of(id) end

--- Marks `id` begun at `t` ms: true when this call made the mark (no room
-- for it: false, and the store says so).
function _M.add(m, app, ns, id, t)
  return of(m):mark(key(m, app, ns, id), id, t) == "new"
end

--- Ends `id`'s count: true when this call removed its mark (and counts).
function _M.take(m, app, ns, id)
  return of(m):unmark(key(m, app, ns, id))
end

--- Moves `id`'s mark `ms` later: it is read back that much later (a hold,
-- open until its expiry).
function _M.later(m, app, ns, id, ms)
  of(m):touch(key(m, app, ns, id), ms)
end

local ENDED = { done = "done", cancelled = "cancelled" }

--- Reconciles the marks of app's transactions in namespace `ns` older
-- than `age` seconds with what the database holds: `find(ids)` answers
-- the stored states (at most `limit` ids, one bounded read); a mark whose
-- transaction is done or cancelled, or gone (pruned, or removed by hand:
-- counted cancelled, reason unknown), is counted ended now, once, by
-- `count_end(m, app, outcome, reason, cause)`; one still open is looked
-- at again `age` after its stored deadline (a hold's is its expiry), or
-- after now if that is later: `clock()` gives the server's time the
-- deadline is compared with (asked only when one is open).  The store
-- keeps the time of the oldest mark left unread, so a call with none due
-- reads one value.  Returns how many it counted, or nil, err.
function _M.reconcile(m, app, ns, find, clock, age, limit, count_end)
  local marks, store = of(m), m.store
  local now, age_ms = now_ms(), max(0, age or 0) * 1000
  -- no live mark left unread is older than this
  local tag = tag_of(m, app, ns)
  local oldest_key = "mongotx_oldest\t" .. tag
  local oldest = store:get(oldest_key)
  if type(oldest) == "number" and oldest + age_ms > now then return 0 end
  local list = marks:marked(tag)
  sort(list, function(a, b) return a.t < b.t end)
  local batch = {}
  oldest = now
  for _, e in ipairs(list) do
    if e.t + age_ms > now or #batch == limit then
      oldest = min(oldest, e.t)
      break
    end
    batch[#batch + 1] = e
  end
  store:set(oldest_key, oldest)
  if #batch == 0 then return 0 end
  local ids = {}
  for i, e in ipairs(batch) do ids[i] = e.id end
  local docs, err = find(ids)
  if not docs then
    for _, e in ipairs(batch) do marks:touch(e.k, now - e.t) end
    return nil, err
  end
  local by_key = {}
  for _, doc in ipairs(docs) do by_key[key_of(doc._id)] = doc end
  local counted, server = 0, nil
  for _, e in ipairs(batch) do
    local doc = by_key[key_of(e.id)]
    local outcome = not doc and "cancelled" or ENDED[doc.state]
    if not outcome then
      -- open: its mark's time becomes its deadline (now if past or none)
      local later = 0
      if core.type(doc.deadline) == "date" then
        server = server or clock() or false
        if server then later = max(0, doc.deadline:value() - server) end
      end
      marks:touch(e.k, now + later - e.t)
    elseif marks:unmark(e.k) then
      count_end(m, app, outcome, doc and doc.reason, doc and doc.cause)
      m:stop(e.id)
      counted = counted + 1
    end
  end
  return counted
end

return _M

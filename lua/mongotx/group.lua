-- mongotx.group: group commit.  Calls of tm:transfer, tm:run and
-- tm:commit that concurrent callers make one at a time are collected and
-- run as one batch (the way tm:transfer_many runs; begun transactions the
-- way batched recovery drives them), and each caller gets exactly what
-- its own call would have returned alone.
--
-- Two halves:
--
--   group.new{...}   the queue, scheduler-neutral: the first call to find
--                    no batch in flight starts a driver (spawn); the
--                    driver waits until `max` calls are queued or the
--                    oldest has waited `delay` seconds, runs them as one
--                    batch (run), wakes every caller with its own result,
--                    and goes on with the calls that arrived meanwhile.
--                    How to wait, wake and start a driver is injected:
--                    ngx.semaphore and ngx.timer in mongotx.resty, or a
--                    coroutine scheduler's (spec/43-group_spec.lua).
--   run_calls(tm, calls, wait)
--                    the batch, on the manager's side (tm:run_calls): each
--                    call checked as its call alone checks it, then the
--                    ones that passed as one batch of the protocol.
--
-- For a program with its own scheduler (mongotx.pool users):
--
--   local g = group.wrap(tm, { max = 100, delay = 0,
--     signal = function() return <object with :wait(seconds), :post()> end,
--     spawn = function(fn) <run fn in a new task>; return true end,
--     now = function() return <seconds> end })
--   local t, err = g:transfer("accounts", "A", "B", 100, { min = 0 })
--
-- signal():wait(seconds) returns when post() was called (true) or when the
-- time is up (false); it and every call of g yield to the scheduler.

--- Group commit: concurrent `tm:transfer`, `tm:run`, `tm:commit` calls as one batch (docs/openresty.md#group-commit).
-- @module mongotx.group

local errors = require "mongotx.errors"
local stored = require "mongotx.stored"
local engine = require "mongotx.engine"
local checks = require "mongotx.manager.checks"
local batches = require "mongotx.manager.batches"
local forward = require "mongotx.engine.forward"

local type, ipairs, pairs, pcall, error, select, setmetatable, tostring =
  type, ipairs, pairs, pcall, error, select, setmetatable, tostring
local format = string.format
local unpack = table.unpack or unpack -- luacheck: ignore 143
local id_key, tid_key, is_floor = stored.id_key, engine.key, stored.is_floor

local _M = {}

-- What a batch runner answers for a call that must wait for the next
-- batch (run_calls: it conflicts with a call before it in this one).
_M.AGAIN = setmetatable({}, { __tostring = function() return "group.AGAIN" end })
local AGAIN = _M.AGAIN

-- The queue ----------------------------------------------------------------

local Group = {}
Group.__index = Group

-- new{ run, signal, spawn, now [, max = 100] [, delay = 0] [, inflight = 1] }:
--   run(items, { wait = <seconds the driver waited> }) -> results, one
--     per item (group.AGAIN: put it in the next batch; never for the
--     first item), and optionally the order the calls took effect in (a
--     list of item indices; by default theirs); a raise fails every call
--     of the batch with it
--   signal() -> an object with :wait(seconds) -> woken? and :post()
--   spawn(fn) -> ok, err: runs fn in a task of its own; when it cannot,
--     the call runs as a batch of one in the caller's task; when fn has
--     not begun START seconds after a call, that call's caller drives
--   now() -> seconds
--   inflight: how many batches may run at once, each driven by a task of
--     its own.  A batch's round trips leave the server and the caller's
--     CPU idle in turns; a second batch fills them.  Batches running at
--     once touch disjoint documents and ids (Group:call's keys), so none
--     meets another's holds, and each call still answers as it would alone.

--- A group: the scheduler-neutral queue whose drivers run the calls queued as batches.
-- @syntax g = group.new{ run, signal, spawn, now [, max = 100] [, delay = 0] [, inflight = 1] }
-- @tparam table o `run(items, { wait })` (one result per item, `group.AGAIN` to put one off; optionally the order
--   they took effect in), `signal()` (an object with `:wait(seconds)` and `:post()`), `spawn(fn)` (runs fn in a
--   task of its own; false: the call runs alone), `now()` (seconds); `max` calls a batch, `delay` seconds a
--   driver waits for them, `inflight` batches at once (calls with disjoint keys)
-- @treturn table the group
-- @errors a bad option raises
-- @usage local g = group.new{ run = run, signal = signal, spawn = spawn, now = now }
function _M.new(o)
  if type(o) ~= "table" then error("group.new takes a table of options", 2) end
  for _, k in ipairs { "run", "signal", "spawn", "now" } do
    if type(o[k]) ~= "function" then error("option " .. k .. " of group.new must be a function", 2) end
  end
  local max, delay, inflight = o.max or 100, o.delay or 0, o.inflight or 1
  for name, v in pairs { max = max, inflight = inflight } do
    if type(v) ~= "number" or v < 1 or v ~= math.floor(v) or v == math.huge then
      error("option " .. name .. " of group must be a whole number >= 1", 2)
    end
  end
  if type(delay) ~= "number" or delay ~= delay or delay < 0 or delay == math.huge then
    error("option delay of group must be a number of seconds >= 0", 2)
  end
  -- held: key -> how many running batches hold it; alone: a running batch
  -- holds a call without keys (it may touch anything); flying: batches
  -- running; running: drivers begun; pending: drivers spawned, not begun
  return setmetatable({ run = o.run, signal = o.signal, spawn = o.spawn, now = o.now,
                        max = max, delay = delay, inflight = inflight, queue = {},
                        held = {}, alone = false, flying = 0, running = 0, pending = {},
                        npending = 0, gathering = false, kick = o.signal(), batches = 0 }, Group)
end

-- Runs one batch of tickets and wakes their callers; returns the tickets
-- the runner put off, in their order.
local function run_batch(self, batch, waited)
  local items = {}
  for i, t in ipairs(batch) do items[i] = t.item end
  self.batches = self.batches + 1
  local number = self.batches
  local ok, results, order = pcall(self.run, items, { wait = waited })
  if ok and type(results) ~= "table" then
    ok, results = false, "mongotx.group: the batch runner returned a " .. type(results)
  end
  local position = {}
  for k, i in ipairs(ok and order or {}) do position[i] = k end
  local again = {}
  for i, t in ipairs(batch) do
    local r = ok and results[i]
    if ok and r == AGAIN and i > 1 then
      again[#again + 1] = t
    else
      if ok and r == AGAIN then
        ok, results = false, "mongotx.group: the batch runner put off the first call"
      end
      t.done, t.ok, t.result = true, ok, ok and r or results
      t.batch, t.position = number, position[i] or i
      t.signal:post()
    end
  end
  return again
end

-- Which calls may run now ----------------------------------------------------

-- A key no call has: a call queued without keys reserves it, so that no
-- call behind it overtakes it.
local ALL = {}

-- Must ticket t wait: does it meet a running batch, or a call queued
-- before it that waits (reserved)?
local function blocked(self, t, reserved)
  if self.alone or reserved[ALL] then return true end
  local keys = t.keys
  if keys == nil then return self.flying > 0 end
  for _, k in ipairs(keys) do
    if self.held[k] or reserved[k] then return true end
  end
  return false
end

-- The next batch: up to max calls of the queue, in its order, that meet no
-- running batch; a call that must wait holds back the later calls with
-- its keys, so each key's calls keep their order and none waits for ever.
-- Nil when none may run now.
local function pick(self)
  local batch, rest, reserved = {}, {}, {}
  for _, t in ipairs(self.queue) do
    if #batch < self.max and not blocked(self, t, reserved) then
      batch[#batch + 1] = t
    else
      rest[#rest + 1] = t
      for _, k in ipairs(t.keys or { ALL }) do reserved[k] = true end
    end
  end
  if #batch == 0 then return nil end
  self.queue, self.flying = rest, self.flying + 1
  for _, t in ipairs(batch) do
    if t.keys == nil then self.alone = true end
    for _, k in ipairs(t.keys or {}) do self.held[k] = (self.held[k] or 0) + 1 end
  end
  return batch
end

local function release(self, batch)
  self.flying = self.flying - 1
  for _, t in ipairs(batch) do
    if t.keys == nil then self.alone = false end
    for _, k in ipairs(t.keys or {}) do
      local n = self.held[k] - 1
      self.held[k] = n > 0 and n or nil
    end
  end
end

local drive_all -- (below: a driver's task)

-- Starts a driver; false when spawn cannot.
local function start(self)
  local token = {}
  self.pending[token], self.npending = true, self.npending + 1
  local ok = self.spawn(function()
    if self.pending[token] then self.pending[token], self.npending = nil, self.npending - 1 end
    drive_all(self)
  end)
  if not ok then self.pending[token], self.npending = nil, self.npending - 1 end
  return ok
end

-- A driver: batches until no queued call may run (the rest wait for a
-- running batch, whose driver goes on with them).
local function drive(self)
  while #self.queue > 0 and not self.gathering do
    local started = self.now()
    local left = self.queue[1].at + self.delay - started
    if #self.queue < self.max and left > 0 then
      self.gathering = true
      self.kick:wait(left)
      self.gathering = false
    end
    local batch = pick(self)
    if not batch then break end
    if #self.queue > 0 and self.running + self.npending < self.inflight then
      start(self) -- what is left may run beside this batch
    end
    local ok, again = pcall(run_batch, self, batch, self.now() - started)
    release(self, batch)
    if not ok then
      for _, t in ipairs(batch) do
        if not t.done then
          t.done, t.ok, t.result = true, false, again
          t.signal:post()
        end
      end
      error(again, 0)
    end
    if #again > 0 then
      for _, t in ipairs(self.queue) do again[#again + 1] = t end
      self.queue = again
    end
  end
end

-- How long a call waits for the driver spawn() started to begin before
-- its caller drives the queue itself: a host may drop a task it accepted
-- (nginx skips a timer's callback when lua_max_running_timers are
-- running, or it cannot make the timer's fake connection, and only logs
-- it), and the calls queued must not wait for ever.
_M.START = 1

-- A driver, in whichever task gets here: a spawned one, or a caller whose
-- driver never began (Group:call).  At most `inflight` drive at once.
function drive_all(self)
  if self.running >= self.inflight then return end
  self.running = self.running + 1
  local ok, err = pcall(drive, self)
  self.running = self.running - 1
  if not ok then
    -- never leave a caller waiting: the calls still queued fail with err
    local queue = self.queue
    self.queue = {}
    for _, t in ipairs(queue) do
      t.done, t.ok, t.result = true, false, "mongotx.group: " .. tostring(err)
      t.signal:post()
    end
  end
end

-- g:call(item [, keys]) -> the runner's result for item, and the ticket ({ batch,
-- position }: which batch of this group ran it, and where in the order
-- its calls took effect).  Raises what the runner raised.

--- @type Group

--- Queues an item, waits for the batch that runs it, and returns its result.
-- @syntax result, ticket = g:call(item [, keys])
-- @param item what the runner gets for this call
-- @tparam[opt] table keys strings naming what the call touches (`group.keys`): it runs only in a batch whose
--   neighbours running at once hold none of them; without keys, only when no other batch runs
-- @return the runner's result for the item
-- @treturn table the ticket: `{ batch, position }`, which batch of this group ran it and where in the order its
--   calls took effect
-- @errors raises what the runner raised
-- @usage local result = g:call({ method = "transfer", n = 4, "accounts", "A", "B", 10 })
function Group:call(item, keys)
  local t = { item = item, keys = keys, at = self.now(), signal = self.signal(), done = false }
  local queue = self.queue
  queue[#queue + 1] = t
  if self.running + self.npending == 0 then
    if not start(self) then
      -- no task for a driver: this call alone, here (the queue held only it)
      self.queue = {}
      local again = run_batch(self, { t }, 0)
      assert(#again == 0)
    end
  elseif #queue >= self.max and self.gathering then
    self.gathering = false -- one post per wait
    self.kick:post()
  elseif self.running + self.npending < self.inflight and not self.gathering
      and self.npending == 0 and not blocked(self, t, {}) then
    start(self) -- a batch runs; this call may run beside it
  end
  while not t.done do
    local _, err = t.signal:wait(self.running > 0 and 60 or _M.START)
    if err and err ~= "timeout" then error("mongotx.group: cannot wait: " .. tostring(err), 2) end
    if not t.done and self.running == 0 and self.now() - t.at >= _M.START then
      self.pending, self.npending = {}, 0 -- the drivers spawned never began
      drive_all(self) -- this caller drives
    end
  end
  if not t.ok then error(t.result, 0) end
  return t.result, t
end

-- What a call touches, as Group:call's keys: "d", collection and _id per
-- document, "t" and the id when the caller names its transaction.  Nil
-- (it may touch anything) for a commit, whose documents are stored, and
-- for arguments whose ids have no key (they fail their checks anyway).
local function call_keys(method, a1, a2, a3, _, a5)
  local docs, id
  if method == "transfer" then
    docs, id = { { collection = a1, id = a2 }, { collection = a1, id = a3 } }, a5 and a5.id
  elseif method == "run" then
    docs, id = a1, a2 and a2.id
  else
    return nil
  end
  local keys = {}
  for i, op in ipairs(docs) do
    local k = id_key(op.id)
    if type(op.collection) ~= "string" or k == nil then return nil end
    keys[i] = "d\0" .. op.collection .. "\0" .. k
  end
  if #keys == 0 then return nil end
  if id ~= nil then keys[#keys + 1] = "t\0" .. tid_key(id) end
  return keys
end

--- The keys of a grouped call (`Group:call`'s second argument): the documents and transaction id it touches.
-- @syntax keys = group.keys(method, ...)
-- @tparam string method "transfer", "run" or "commit"
-- @param ... the call's arguments
-- @treturn ?table the keys, or nil when the call may touch any document (a commit, or arguments that fail their
--   checks)
-- @usage g:call(item, group.keys("transfer", "accounts", "A", "B", 10))
function _M.keys(method, ...)
  local ok, keys = pcall(call_keys, method, ...)
  return ok and keys or nil
end

-- The batch, on the manager's side ------------------------------------------

-- What each method checks before it runs (mongotx.manager.checks:
-- transfer_call, run_call, tx_ref), with the level that leaves a raise without a position, as
-- the ungrouped call's is when it runs under pcall.
local CHECK = {
  transfer = function(tm, c) return pcall(checks.transfer_call, tm, c[1], c[2], c[3], c[4], c[5], 1) end,
  run = function(tm, c) return pcall(checks.run_call, tm, c[1], c[2], c[3], 1) end,
  commit = function(_, c) return pcall(checks.tx_ref, c[1], "commit", 1) end,
}

_M.METHODS = { "transfer", "run", "commit" }

-- May spec join the batch whose admitted ops are `ops` (by document key:
-- "any" when some op there is no floor guard, "floor" when all are) and
-- ids `ids`?  A guard must read what it would read alone after the calls
-- before it: the debits of floor guards before it (they apply in order,
-- first in a batch), but never an effect that a batch applies after its
-- guards (mongotx.batch, "apply").  So a guard on a document that an
-- earlier call changes otherwise, and an id already in the batch, wait
-- for the next batch.
local function admit(spec, ops, ids)
  local id = spec.id ~= nil and tid_key(spec.id)
  if id and ids[id] then return false end
  local keys = {}
  for i, op in ipairs(spec.ops) do
    local k = op.collection .. "\0" .. (id_key(op.id) or tostring(op.id))
    keys[i] = k
    if op.where ~= nil and (ops[k] == "any" or (ops[k] and not is_floor(op.where))) then
      return false
    end
  end
  if id then ids[id] = true end
  for i, op in ipairs(spec.ops) do
    local k = keys[i]
    if op.where ~= nil and is_floor(op.where) then
      ops[k] = ops[k] or "floor"
    else
      ops[k] = "any"
    end
  end
  return true
end

-- The answer of a call the batch ran: { n = 1, T } or { n = 2, nil, err }
-- as the call alone returns, or { raise = err } for a policy's raise
-- (errors.is_policy: the batch failed that call's entry with it, the
-- others went on; alone, the call raises it).
-- fn(...) -> a, b, c, a part of the batch (the transfers and runs, or the
-- commits): a policy's raise in a step the whole part shares (a retry's
-- backoff, ...) is nil, <the raise>, as each of its calls alone would
-- raise it, and the other part runs on; any other raise goes up.
local function shared(fn, ...)
  local ok, a, b, c = pcall(fn, ...)
  if ok then return a, b, c end
  if not errors.is_policy(a) then error(a, 0) end
  return nil, a
end

local function answer(T, err)
  if T then return { n = 1, T } end
  if errors.is_policy(err) then return { raise = err } end
  return { n = 2, nil, err or errors.new("internal", "no result", { step = "group" }) }
end

-- run_calls(tm, calls, wait): calls[i] = { method = "transfer" | "run" |
-- "commit", n = <how many arguments>, <the arguments> }.  Returns one
-- result per call: { n = 1, T } or { n = 2, nil, err } as the call alone
-- returns, { raise = <message or error> } for what it raises, or
-- group.AGAIN (the call conflicts with one before it here); and the
-- order the calls answered took effect in.
--
-- The transfers and runs go first, as one batch (mongotx.batch); then the
-- commits: their transactions loaded in one find, the begun ones
-- (`initial`) claimed, applied, committed and finished as one batch
-- (mongotx.engine.forward), any other driven alone as tm:commit drives it.
-- The order is theirs within each part, but those settled one at a time
-- after the others of their part had committed (a guard that failed at
-- first is tried again then: mongotx.batch) come after them.  So each
-- answer is what its call alone gives when the calls run one at a time in
-- that order.  Emits on_event("group", { size = <calls answered>, wait =
-- wait, application }) once.
function _M.run_calls(tm, calls, wait)
  local out, checked, sent = {}, {}, {}
  for i, c in ipairs(calls) do
    local check = CHECK[c.method]
    if not check then error(format("mongotx.group: no grouped method %s", tostring(c.method)), 2) end
    local ok, v, err = check(tm, c)
    if not ok then
      out[i] = { raise = type(v) == "string" and v or tostring(v) }
    elseif v == nil then
      out[i] = { n = 2, nil, err }
    else
      checked[i] = v
      if c.method == "commit" then sent[#sent + 1] = v end
    end
  end
  -- the transactions to commit, in one read
  local found, load_err
  if #sent > 0 then found, load_err = forward.load(tm.engine, sent) end
  -- which join: a part's ops by document (admit), ids across both parts
  local specs, errs, where, items, cwhere = {}, {}, {}, {}, {}
  local ops, cops, ids = {}, {}, {}
  for i, c in ipairs(calls) do
    local v = checked[i] -- (nil: answered above)
    if v ~= nil and c.method ~= "commit" then
      if admit(v, ops, ids) then
        local k = #specs + 1
        specs[k], errs[k], where[k] = v, false, i
      else
        out[i] = AGAIN -- (never the first: it meets an empty batch)
      end
    elseif v ~= nil then
      local id = c[1]._id
      local k = tid_key(id)
      local item = found and found[k]
      if ids[k] or (item and item.ready and not admit({ id = id, ops = item.T.ops }, cops, ids)) then
        out[i] = AGAIN
      else
        ids[k] = true
        if not found then
          out[i] = { n = 2, nil, load_err }
        elseif not item then
          out[i] = { n = 2, nil, errors.new("state", "no such transaction", { step = "commit", id = id }) }
        else
          local n = #items + 1
          items[n], cwhere[n] = item, i
        end
      end
    end
  end
  -- part (1 the batch, 2 settled after it, 3 the commits, 4 those
  -- settled or driven after them) of each call the batch ran
  local part = {}
  if #specs > 0 then
    local results, late
    results, errs, late = shared(batches.run_batch, tm, specs, errs)
    for k, i in ipairs(where) do
      out[i], part[i] = results and answer(results[k], errs[k]) or { raise = errs }, late and late[k] and 2 or 1
    end
  end
  if #items > 0 then
    local results, cerrs, late = shared(forward.commit, tm.engine, items)
    for k, i in ipairs(cwhere) do
      out[i], part[i] = results and answer(results[k], cerrs[k]) or { raise = cerrs }, late and late[k] and 4 or 3
    end
  end
  local order = {}
  for p = 1, 4 do
    for i = 1, #calls do
      if out[i] ~= AGAIN and (part[i] or 1) == p then order[#order + 1] = i end
    end
  end
  tm.engine:event("group", { size = #order, wait = wait, application = tm.application })
  return out, order
end

-- A manager (mongotx, or mongotx.pool's) behind a group: group.wrap(tm,
-- opts) with opts as group.new's but run (tm:run_calls).  Its transfer,
-- run and commit answer as tm's.

--- For a program with its own scheduler.
-- @section scheduler
local Wrapped = {}
Wrapped.__index = Wrapped

--- A manager behind a group, for a program with its own scheduler: its `transfer`, `run` and `commit` answer as `tm`'s.
-- @syntax g = group.wrap(tm, { signal, spawn, now [, max = 100] [, delay = 0] })
-- @tparam table tm a manager (mongotx's or mongotx.pool's)
-- @tparam table opts as `group.new`'s, without `run`
-- @treturn table an object with `g:transfer(...)`, `g:run(...)` and `g:commit(t)`, each answering exactly as the
--   manager's call alone (its transaction, `nil, err`, or its raise), run in batches with the concurrent ones
-- @errors a bad option raises; each call's errors are its own
-- @usage local g = group.wrap(tm, { signal = signal, spawn = spawn, now = now })
-- local t, err = g:transfer("accounts", "A", "B", 100, { min = 0 })
function _M.wrap(tm, opts)
  if type(opts) ~= "table" then error("group.wrap takes a manager and a table of options", 2) end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.run = function(items, info)
    local out, order = tm:run_calls(items, info.wait)
    if out then return out, order end
    local err = order
    out = {} -- (mongotx.pool: no client came free) each caller gets err
    for i = 1, #items do out[i] = { n = 2, nil, err } end
    return out
  end
  return setmetatable({ tm = tm, group = _M.new(o) }, Wrapped)
end

for _, method in ipairs(_M.METHODS) do
  Wrapped[method] = function(self, ...)
    local r = self.group:call({ method = method, n = select("#", ...), ... }, _M.keys(method, ...))
    if r.raise then
      -- as the call alone raises: at the caller, unless it says where
      -- (or is an error value: a policy's raise)
      if type(r.raise) ~= "string" or r.raise:find("^[^\n]-:%d+: ") then error(r.raise, 0) end
      error(r.raise, 2)
    end
    return unpack(r, 1, r.n)
  end
end

return _M

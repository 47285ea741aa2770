-- mongotx.group.queue: group commit's queue, scheduler-neutral (the
-- first half of mongotx.group, which re-exports new, AGAIN and START):
-- calls queue, drivers take them as batches, each caller waits for its
-- own answer.

--- @submodule mongotx.group

local type, ipairs, pairs, pcall, error, setmetatable, tostring, tonumber =
  type, ipairs, pairs, pcall, error, setmetatable, tostring, tonumber

local _M = {}

-- What a batch runner answers for a call that must wait for the next
-- batch (run_calls: it conflicts with a call before it in this one).
_M.AGAIN = setmetatable({}, { __tostring = function() return "group.AGAIN" end })
local AGAIN = _M.AGAIN

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
  -- running; running: drivers begun; pending: drivers spawned, not begun;
  -- lingering: tickets whose callers go on with them (mongotx.group.busy)
  return setmetatable({ run = o.run, signal = o.signal, spawn = o.spawn, now = o.now,
                        max = max, delay = delay, inflight = inflight, queue = {},
                        held = {}, alone = false, flying = 0, running = 0, pending = {},
                        npending = 0, gathering = false, kick = o.signal(), batches = 0,
                        lingering = {} }, Group)
end

-- Gives back the keys of ticket t.
local function unkey(self, t)
  if t.keys == nil then self.alone = false end
  for _, k in ipairs(t.keys or {}) do
    local n = self.held[k] - 1
    self.held[k] = n > 0 and n or nil
  end
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
      local b = ok and type(r) == "table" and r.busy
      if b then
        -- its caller goes on with it (mongotx.group.busy): it holds the
        -- keys the runner names until then (Group:settled), after the
        -- calls it names
        unkey(self, t)
        t.keys, t.lingering, t.after, self.lingering[t] = b.keys or {}, true, {}, true
        for _, k in ipairs(t.keys) do self.held[k] = (self.held[k] or 0) + 1 end
        self:linger(t, tonumber(b.wait) or 0)
        for _, j in ipairs(b.after or {}) do t.after[#t.after + 1] = batch[j] end
      end
    end
  end
  for _, t in ipairs(batch) do
    if t.done then t.signal:post() end
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
  local now = self.now()
  for t in pairs(self.lingering) do
    if now >= t.expires then self:settled(t) end -- (its caller went away)
  end
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

-- A batch ran: its tickets give back their keys, but those whose
-- callers go on with them (lingering).
local function release(self, batch)
  self.flying = self.flying - 1
  for _, t in ipairs(batch) do
    if not t.lingering then unkey(self, t) end
  end
end

local drive_all -- (below: a driver's task)

-- Forgets the drivers spawned START seconds ago or more that never
-- began (a host dropped them), so that they hold no place of inflight.
local function forget_dropped(self)
  if self.npending == 0 then return end
  local now = self.now()
  for token, at in pairs(self.pending) do
    if now - at >= _M.START then self.pending[token], self.npending = nil, self.npending - 1 end
  end
end

-- Starts a driver; false when spawn cannot (or raises).
local function start(self)
  local token = {}
  self.pending[token], self.npending = self.now(), self.npending + 1
  local called, ok = pcall(self.spawn, function()
    if self.pending[token] then self.pending[token], self.npending = nil, self.npending - 1 end
    drive_all(self)
  end)
  if not (called and ok) then self.pending[token], self.npending = nil, self.npending - 1 end
  return called and ok
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
    local waited = self.now() - started
    local batch = pick(self)
    if not batch then break end
    if #self.queue > 0 and self.running + self.npending < self.inflight then
      start(self) -- what is left may run beside this batch
    end
    local ok, again = pcall(run_batch, self, batch, waited)
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
  forget_dropped(self)
  if self.running + self.npending == 0 then
    -- no task for a driver: this caller drives (the queue held only its call)
    if not start(self) then drive_all(self) end
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

-- A call the batch handed to its caller (its result's `busy`:
-- mongotx.group.busy) keeps its keys while its caller goes on with it,
-- so that the later calls on its documents stay behind it, as one batch
-- after another keeps them; at most until START seconds after the wait
-- its caller said (linger), in case the caller went away (an nginx
-- handler whose request ended).

--- Internal: the caller of a lingering call waits `seconds` more (mongotx.group.busy).
-- @local
-- @syntax g:linger(ticket, seconds)
function Group:linger(t, seconds)
  t.expires = self.now() + seconds + _M.START
end

--- Internal: waits until the calls a lingering call goes after are settled (mongotx.group.busy).
-- @local
-- @syntax g:after(ticket)
function Group:after(t)
  for _, l in ipairs(t.after or {}) do
    while l.lingering do
      local left = l.expires - self.now()
      if left <= 0 then break end
      t.expires = math.max(t.expires, l.expires + _M.START)
      l.followers = l.followers or {}
      l.followers[#l.followers + 1] = t.signal
      t.signal:wait(left)
    end
  end
  t.after = nil
end

--- Internal: the caller of a lingering call is done with it: its keys go back (mongotx.group.busy).
-- @local
-- @syntax g:settled(ticket)
function Group:settled(t)
  if not t.lingering then return end
  t.lingering, self.lingering[t] = false, nil
  unkey(self, t)
  for _, signal in ipairs(t.followers or {}) do signal:post() end
  t.followers = nil
  -- the calls its keys held back: a driver for them
  if #self.queue > 0 and self.running + self.npending == 0 and not start(self) then
    drive_all(self)
  end
end

return _M

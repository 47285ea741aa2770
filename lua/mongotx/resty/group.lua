-- mongotx.resty.group: group commit (mongotx.group) in nginx, both sides:
-- run_group runs a batch of grouped calls in a worker thread, and on the
-- worker side new_group makes a manager's group (its driver in a timer),
-- grouped sends a call to it and group_option reads db:manager's `group`.

local group = require "mongotx.group"
local busy = require "mongotx.group.busy"
local held = require "mongotx.resty.held"
local wire = require "mongotx.resty.wire"

local type, pairs, ipairs, select, tostring, error, pcall =
  type, pairs, ipairs, select, tostring, error, pcall
local pack, unpack, unpack_list, unpack_all = wire.pack, wire.unpack, wire.unpack_list, wire.unpack_all
local reraise, call, now = wire.reraise, wire.call, wire.now

local _M = {}

-- A call's answer as it crosses back (run_calls' r, or group.AGAIN).
local function crossing(r)
  if r == group.AGAIN then return { again = true } end
  -- a raise as a message, as thread() sends what a call alone raised
  if r.raise then return { raise = type(r.raise) == "string" and r.raise or tostring(r.raise) } end
  if r.busy then return { busy = r.busy } end
  return { ok = pack(r.n, unpack(r, 1, r.n)), held = r.held }
end

-- A batch of grouped calls (group_runner below): args[1] lists { m =
-- <method>, a = <its arguments, pack()ed> }, args[2] is how long the
-- driver waited.  Returns, pack()ed, one { ok = <the results, pack()ed>
-- [, held = <what its caller waits for>] }, { raise = <message> } or {
-- again = true } per call, and the order they took effect in
-- (mongotx.group.run_calls).  With args[1] = { busy = <info> }: a call its
-- caller goes on with (mongotx.group.busy), its one answer so.
local function run_group(tm, list, wait)
  if list.busy then -- a call its caller goes on with (mongotx.group.busy)
    local _, r = tm:later("busy", list.busy)
    return pack(1, crossing(r))
  end
  local calls = {}
  for i, c in ipairs(list) do
    local a, n = unpack_list(c.a)
    a.method, a.n = c.m, n
    calls[i] = a
  end
  local res, order = tm:run_calls(calls, wait)
  if not res then return pack(2, nil, order) end -- no client of the pool came free
  local out = {}
  for i, r in ipairs(res) do out[i] = crossing(r) end
  return pack(2, out, order)
end
-- Group commit (mongotx.group): the worker side.  The driver runs in a
-- timer of its own (ngx.timer.at 0), not in the coroutine of the handler
-- that started it: a handler's coroutine ends with its request (a client
-- abort under lua_check_client_abort, an ngx.exit in another of its
-- threads), and a batch run there would leave its callers waiting.  A
-- caller waits on a semaphore of its own.

-- The batch runner: the calls of `items` as one tm:run_calls in one worker
-- thread.  Returns one { ok = <results, pack()ed> } | { raise = msg } |
-- group.AGAIN per item.
local function group_runner(tm)
  return function(items, info)
    local list = {}
    for i, item in ipairs(items) do list[i] = { m = item.method, a = item.args } end
    -- the results and the order they took effect in, or nil and why not
    local res, order = call(tm.db, 1, "group", tm.spec, nil, list, info.wait)
    local out = {}
    for i = 1, #items do
      if not res then
        out[i] = { ok = pack(2, nil, order) } -- overloaded, or no manager: each caller learns it
      elseif res[i].again then
        out[i] = group.AGAIN
      else
        out[i] = res[i]
      end
    end
    return out, res and order
  end
end

local function new_group(tm, o)
  local ngx = ngx -- luacheck: ignore 113
  local semaphore = require "ngx.semaphore"
  return group.new {
    max = o.max, delay = o.delay, inflight = o.inflight, run = group_runner(tm),
    signal = semaphore.new,
    spawn = function(fn) return ngx.timer.at(0, function() fn() end) end,
    now = now,
  }
end

-- tm:transfer, tm:run, tm:commit and tm:hold under group: the call joins its worker's next
-- batch.  ngx.ctx.mongotx_group says which batch of this manager in this
-- worker ran it ({ batch, position }: for logs).  A call whose arguments
-- cannot cross to a worker thread (a function, ...) goes alone(self, ...),
-- which answers it as it does ungrouped.
local function grouped(self, method, alone, ...)
  local ok, args = pcall(pack, select("#", ...), ...)
  if not ok then return alone(self, ...) end
  local g = self.group
  local r, ticket = g:call({ method = method, args = args }, group.keys(method, ...))
  local ngx = ngx -- luacheck: ignore 113
  ngx.ctx.mongotx_group = { batch = ticket.batch, position = ticket.position }
  local handed = r.busy ~= nil
  if handed then
    -- its apply waits for a retry: this handler sleeps, no worker thread
    -- held, then a thread goes on with it alone
    local err
    r, err = busy.go_on(g, ticket, r, ngx.sleep, function(info)
      return call(self.db, 3, "group", self.spec, nil, { busy = info }, 0) -- (nil, err: no thread came free)
    end, now)
    r = r or { ok = pack(2, nil, err) } -- (none came free in holder_wait: in_progress, its id)
  end
  if r.raise then reraise(r.raise, 2) end
  -- its own transaction, taken over meanwhile: settled by its id
  if r.held and handed then return held.own(self, 2, r) end
  -- another call holds its transaction: this handler waits (ngx.sleep
  -- between reads, no worker thread held), then runs it alone
  if r.held and group.await_held(r.held, function(id) return self:get(id) end, ngx.sleep, now) then
    return alone(self, ...)
  end
  return unpack_all(r.ok)
end

-- The group option of db:manager: false (off), or { max =, delay =,
-- inflight = } (each defaulting to GROUP_DEFAULT's, each a number:
-- group.new checks the rest); nil and true are GROUP_DEFAULT.
-- On by default: it cuts the CPU a request costs to a third once calls
-- are concurrent and costs up to 0.5 ms alone (bench/README.md,
-- "OpenResty: group commit").
local GROUP_DEFAULT = { max = 100, delay = 0, inflight = 1 }

local function group_option(g)
  if g == false then return false end
  if g == nil or g == true then g = {} end
  if type(g) ~= "table" then error("option group of manager must be a table, true or false", 3) end
  for k, v in pairs(g) do
    if GROUP_DEFAULT[k] == nil then error("unknown option group." .. tostring(k), 3) end
    if type(v) ~= "number" then error("option group." .. k .. " must be a number, not a " .. type(v), 3) end
  end
  local o = {}
  for k, v in pairs(GROUP_DEFAULT) do
    if g[k] == nil then o[k] = v else o[k] = g[k] end
  end
  return o
end

_M.run_group, _M.new_group, _M.grouped, _M.group_option = run_group, new_group, grouped, group_option

return _M

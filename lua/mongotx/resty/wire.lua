-- mongotx.resty.wire: how a call of mongotx.resty crosses to a worker
-- thread and back: its values as one BSON string with the error tables
-- marked (pack, unpack_all), and call, which runs mongotx.resty's
-- thread() in a thread of the pool (through mongotx.resty.thread; or
-- here, with offload = false), waiting while every worker-thread VM is
-- busy.

local core = require "mongotx.core"

local type, pairs, select, tostring, error, pcall, setmetatable, getmetatable =
  type, pairs, select, tostring, error, pcall, setmetatable, getmetatable
local format, find, min = string.format, string.find, math.min
local encode, decode = core.encode, core.decode

local _M = {}

local ERROR_MT = getmetatable(core.error({ code = "probe", message = "" }))
local ERROR_MARK = "__mongotx_error"

-- Values across the thread boundary ----------------------------------------

-- Marks every error table in v, so that the other side can give it the
-- error metatable back, and lists them in marked (to clear the marks).
local function mark_errors(v, seen, marked)
  if type(v) ~= "table" or seen[v] then return end
  seen[v] = true
  if getmetatable(v) == ERROR_MT then
    v[ERROR_MARK] = true
    marked[#marked + 1] = v
  end
  for _, x in pairs(v) do mark_errors(x, seen, marked) end
end

-- n values as one BSON string: { n = n, ["1"] = v1, ... } (nils left out).
-- Raises when a value cannot be encoded.
local function pack(n, ...)
  local t = { n = n }
  for i = 1, n do
    local v = select(i, ...)
    if v ~= nil then t[tostring(i)] = v end
  end
  local marked = {}
  mark_errors(t, {}, marked)
  local ok, bytes = pcall(encode, t)
  for i = 1, #marked do marked[i][ERROR_MARK] = nil end
  if not ok then error(bytes, 0) end
  return bytes
end

-- Gives the error tables in v (decoded) their metatable back.
local function restore_errors(v, depth)
  if type(v) ~= "table" or depth > 100 then return v end
  for k, x in pairs(v) do
    if type(x) == "table" then v[k] = restore_errors(x, depth + 1) end
  end
  if v[ERROR_MARK] then
    v[ERROR_MARK] = nil
    return core.error(setmetatable(v, nil))
  end
  return v
end

local unpack = table.unpack or unpack -- luacheck: ignore 143

-- The values of a pack()ed string as a list, and how many.  (Bytes
-- without the mark hold no error table: nothing to walk.)
local function unpack_list(bytes)
  local t = decode(bytes)
  local out = {}
  local marked = find(bytes, ERROR_MARK, 1, true)
  for i = 1, t.n do
    local v = t[tostring(i)]
    if marked then v = restore_errors(v, 0) end
    out[i] = v
  end
  return out, t.n
end

-- The values of a pack()ed string.
local function unpack_all(bytes)
  local out, n = unpack_list(bytes)
  return unpack(out, 1, n)
end

-- The crossing ------------------------------------------------------------

-- nginx's clock, in seconds (its cached time brought up to date first).
local function now()
  local ngx = ngx -- luacheck: ignore 113
  ngx.update_time()
  return ngx.now()
end

-- Messages of ngx.run_worker_thread that mean "wait and try again": every
-- worker-thread VM is in a call (lua_worker_thread_vm_pool_size), or the
-- thread pool's queue is full (thread_pool's max_queue).
local BUSY = { ["no available Lua vm"] = true, ["ngx_thread_task_post failed"] = true }

local function overloaded(self, why)
  return nil, core.error({
    code = "overloaded", transient = true, step = "resty",
    message = format("no worker thread came free within %g s (%s: thread_pool %s, " ..
      "lua_worker_thread_vm_pool_size); nothing was done", self.wait, why, self.thread_pool),
  })
end

-- Re-raises what a call raised in the thread at `level` (of the caller
-- of reraise), without the position in mongotx.resty or mongotx.pool the
-- message got on the way.
local function reraise(msg, level)
  msg = msg:gsub("^[^\n]-mongotx/resty%.lua:%d+: ", ""):gsub("^[^\n]-mongotx/pool%.lua:%d+: ", "")
  if msg:find("^[^\n]-:%d+: ") then error(msg, 0) end
  error(msg, level + 1)
end

-- The calls of this worker waiting for a VM, per thread pool, in line
-- on an ngx.semaphore (its waiters wake in their order; its count() is
-- minus how many wait, and a request that ends while waiting leaves it).
-- A call that finds every VM busy waits on it, every call that ends
-- wakes the first waiter, whose VM just came free, and a call that finds
-- others in line joins the line rather than take that VM.  Polling
-- instead (each caller sleeping 1 ms, doubling to 50 ms) let a call that
-- just came, or just woke, take the VM a longer waiter was due: at 64
-- connections over 32 VMs some waited 3 s and more (bench/README.md,
-- "OpenResty: where the tail was").
local lines = {}

-- How long a waiter sleeps at most before it tries again without being
-- woken (a VM freed by a call of another module, or a full thread pool
-- queue, wakes no one); it then waits again at the end of the line.
local RETRY = 1

local function line_of(thread_pool)
  local sem = lines[thread_pool]
  if not sem then
    sem = require("ngx.semaphore").new()
    lines[thread_pool] = sem
  end
  return sem
end

-- Runs thread(kind, spec, method, args...) in a worker thread (or here,
-- with offload = false) and returns its results.  While every VM is busy
-- it waits in line (lines above) for at most self.wait seconds, then
-- returns an `overloaded` error.  A raise is reported `up` frames
-- above call's caller (1 when the public method tail-calls call, so that
-- it lands on the handler's line).
local function call(self, up, kind, spec, method, ...)
  local ok, args = pcall(pack, select("#", ...), ...)
  if not ok then
    -- an argument that is itself a function or a coroutine has the wrong
    -- Lua type for every call (require "mongotx" raises); one inside a
    -- table is a value BSON has no type for (`invalid` there too)
    for i = 1, select("#", ...) do
      local kind_i = type((select(i, ...)))
      if kind_i == "function" or kind_i == "thread" then
        error(format("argument %d of %s is a %s, which no call takes", i, method or kind, kind_i),
          up + 1)
      end
    end
    return nil, core.error({ code = "invalid", step = method or kind,
      message = "an argument cannot be sent to a worker thread: " .. tostring(args) })
  end
  local status, res
  if not self.offload then
    status, res = require("mongotx.resty").thread(kind, spec, method, args)
  else
    local ngx = ngx -- luacheck: ignore 113
    local line = line_of(self.thread_pool)
    local started = now()
    -- others wait for a VM: behind them
    if line:count() < 0 then line:wait(min(self.wait, RETRY)) end
    while true do
      local done
      done, status, res = ngx.run_worker_thread(self.thread_pool, "mongotx.resty.thread", "thread",
                                                kind, spec, method, args)
      if done then break end
      if not BUSY[status] then
        if status == "thread_pool not found" then
          status = format("thread_pool %s not found (nginx.conf: thread_pool %s threads=N; " ..
                          "in the main context)", self.thread_pool, self.thread_pool)
        end
        error("mongotx.resty: " .. tostring(status), up + 1)
      end
      local left = self.wait - (now() - started)
      if left <= 0 then return overloaded(self, status) end
      line:wait(min(left, RETRY))
    end
    -- this call's VM is free again: the first in line takes it
    if line:count() < 0 then line:post(1) end
  end
  if status == "raise" then reraise(res, up + 1) end
  return unpack_all(res)
end

_M.pack, _M.unpack, _M.unpack_list, _M.unpack_all = pack, unpack, unpack_list, unpack_all
_M.reraise, _M.call, _M.now = reraise, call, now

return _M

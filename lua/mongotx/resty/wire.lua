-- mongotx.resty.wire: how a call of mongotx.resty crosses to a worker
-- thread and back: its values as one BSON string with the error tables
-- marked (pack, unpack_all), and call, which runs mongotx.resty's
-- thread() in a thread of the pool (or here, with offload = false),
-- waiting while every worker-thread VM is busy.

local core = require "mongotx.core"

local type, pairs, select, tostring, error, pcall, setmetatable, getmetatable =
  type, pairs, select, tostring, error, pcall, setmetatable, getmetatable
local format, min = string.format, math.min
local encode, decode = core.encode, core.decode

local _M = {}

local ERROR_MT = getmetatable(core.error({ code = "probe", message = "" }))
local ERROR_MARK = "__mongotx_error"

-- Values across the thread boundary ----------------------------------------

-- Marks (or, with unmark, clears the mark of) every error table in v, so
-- that the other side can give it the error metatable back.
local function walk_errors(v, unmark, seen)
  if type(v) ~= "table" or seen[v] then return end
  seen[v] = true
  if getmetatable(v) == ERROR_MT then v[ERROR_MARK] = (not unmark) or nil end
  for _, x in pairs(v) do walk_errors(x, unmark, seen) end
end

-- n values as one BSON string: { n = n, ["1"] = v1, ... } (nils left out).
-- Raises when a value cannot be encoded.
local function pack(n, ...)
  local t = { n = n }
  for i = 1, n do
    local v = select(i, ...)
    if v ~= nil then t[tostring(i)] = v end
  end
  walk_errors(t, false, {})
  local ok, bytes = pcall(encode, t)
  walk_errors(t, true, {})
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

-- The values of a pack()ed string as a list, and how many.
local function unpack_list(bytes)
  local t = decode(bytes)
  local out = {}
  for i = 1, t.n do out[i] = restore_errors(t[tostring(i)], 0) end
  return out, t.n
end

-- The values of a pack()ed string.
local function unpack_all(bytes)
  local out, n = unpack_list(bytes)
  return unpack(out, 1, n)
end

-- The crossing ------------------------------------------------------------

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

-- Runs thread(kind, spec, method, args...) in a worker thread (or here,
-- with offload = false) and returns its results.  While every VM is busy
-- it polls (1 ms, doubling up to 50 ms) for at most self.wait seconds,
-- then returns an `overloaded` error.  A raise is reported `up` frames
-- above call's caller (1 when the public method tail-calls call, so that
-- it lands on the handler's line).
local function call(self, up, kind, spec, method, ...)
  local ok, args = pcall(pack, select("#", ...), ...)
  if not ok then
    return nil, core.error({ code = "invalid", step = method or kind,
      message = "an argument cannot be sent to a worker thread: " .. tostring(args) })
  end
  local status, res
  if not self.offload then
    status, res = require("mongotx.resty").thread(kind, spec, method, args)
  else
    local ngx = ngx -- luacheck: ignore 113
    local started, delay = nil, 0.001
    while true do
      local done
      done, status, res = ngx.run_worker_thread(self.thread_pool, "mongotx.resty", "thread",
                                                kind, spec, method, args)
      if done then break end
      if not BUSY[status] then
        if status == "thread_pool not found" then
          status = format("thread_pool %s not found (nginx.conf: thread_pool %s threads=N; " ..
                          "in the main context)", self.thread_pool, self.thread_pool)
        end
        error("mongotx.resty: " .. tostring(status), up + 1)
      end
      ngx.update_time()
      started = started or ngx.now()
      if ngx.now() - started >= self.wait then return overloaded(self, status) end
      ngx.sleep(delay)
      delay = min(delay * 2, 0.05)
    end
  end
  if status == "raise" then reraise(res, up + 1) end
  return unpack_all(res)
end

_M.pack, _M.unpack, _M.unpack_list, _M.unpack_all = pack, unpack, unpack_list, unpack_all
_M.reraise, _M.call = reraise, call

return _M

-- mongotx.metrics in nginx: the figures of every worker process of an
-- instance (and of their worker-thread VMs, where mongotx.resty runs the
-- calls and so the events fire) summed in one lua_shared_dict, and a
-- handler that serves them (docs/metrics.md).
--
--   # nginx.conf (http):  lua_shared_dict mongotx_metrics 1m;
--   #   location = /metrics { content_by_lua_block {
--   #     require("mongotx.metrics.shared").serve("mongotx_metrics") } }
--   local tm = db:manager{ application = "bank", metrics = "mongotx_metrics" }
--
-- Every update is one atomic incr of an existing key (no lock); a key's
-- first update adds it with safe_add, which never evicts another key (an
-- incr with init may: the dict is LRU and would drop someone's counter).
-- A full dict is a degradation, never a failed transaction: the update
-- is lost and mongotx_metrics_dropped_total counts it (its key is added
-- first, so counting needs no room).  The keys are bounded (families x
-- applications x reasons x buckets): 1m holds them for dozens of
-- applications.

--- mongotx.metrics in nginx: every worker's figures summed in one `lua_shared_dict` (docs/metrics.md#in-nginx).
-- @module mongotx.metrics.shared

local metrics = require "mongotx.metrics"
local exposition = require "mongotx.metrics.exposition"

local setmetatable, error, type, tostring = setmetatable, error, type, tostring

local _M = {}

local DROPPED = "mongotx_metrics_dropped_total\t\t"

local Store = {}
Store.__index = Store

function Store:dropped()
  self.dict:incr(DROPPED, 1)
end

function Store:incr(key, n)
  local dict = self.dict
  if dict:incr(key, n) then return end
  local ok, err = dict:safe_add(key, 0)
  if (ok or err == "exists") and dict:incr(key, n) then return end
  self:dropped()
end

-- The transactions counted begun and not yet ended (mongotx.metrics):
-- one key each, shared by the workers, so that a worker that ends one
-- another (killed) worker began counts it once.  Kept MARK_TTL seconds
-- at most (a transaction open longer is counted begun again at its end).
local MARK, MARK_TTL = "mongotx_begun\t", 7 * 24 * 3600
function Store:mark(k)
  local ok, err = self.dict:safe_add(MARK .. k, 1, MARK_TTL)
  if ok then return "new" end
  if err == "exists" then return "exists" end
  return false
end
function Store:unmark(k)
  local left = self.dict:incr(MARK .. k, -1)
  if left == nil then return false end
  self.dict:delete(MARK .. k)
  return left == 0
end

function Store:set(key, v)
  if not self.dict:safe_set(key, v) then self:dropped() end
end

function Store:get(key) return self.dict:get(key) end

-- Every key of the dict (get_keys locks it while it copies them: a
-- scrape's cost, not a transaction's).
function Store:keys() return self.dict:get_keys(0) end

local function dict_of(name)
  local ngx = ngx -- luacheck: ignore 113
  local dict = type(name) == "string" and ngx and ngx.shared and ngx.shared[name]
  if not dict then
    error("no lua_shared_dict " .. tostring(name) .. " (nginx.conf, http: " ..
          "lua_shared_dict " .. tostring(name) .. " 1m;)", 3)
  end
  return dict
end

-- One registry per dict name in each Lua state (its key cache and the
-- transactions it times are this state's; the counts are the dict's).
local registries = {}

-- The mongotx.metrics registry of this Lua state over the dict `name`.

--- The mongotx.metrics registry of this Lua state over a shared dict.
-- @syntax m = shared.new(name)
-- @string name the `lua_shared_dict`'s name
-- @treturn table the registry (`m:wrap`, `m:render`, as mongotx.metrics's)
-- @errors no such dict raises
-- @usage local m = require("mongotx.metrics.shared").new("mongotx_metrics")
function _M.new(name)
  local m = registries[name]
  if m then return m end
  local dict = dict_of(name)
  dict:safe_add(DROPPED, 0)
  m = metrics.new { store = setmetatable({ dict = dict }, Store) }
  registries[name] = m
  return m
end

-- db:manager's options with `metrics` (a dict's name) replaced by an
-- on_event that counts into that dict, then calls opts.on_event.
-- mongotx.resty calls it where the manager is made.

--- `db:manager`'s options with `metrics` (a dict's name) replaced by an `on_event` that counts there.
-- @syntax opts2 = shared.wrap(opts)
-- @tparam table opts the manager's options, `metrics` naming the dict
-- @treturn table the options (`on_event` counts, then calls `opts.on_event`)
-- @errors no such dict raises
-- @usage local tm = assert(db:manager(shared.wrap{ application = "bank", metrics = "mongotx_metrics" }))
function _M.wrap(opts)
  local name = opts.metrics
  opts.metrics = nil
  return _M.new(name):wrap(opts)
end

-- The dict's figures in the exposition format: a content handler.

--- A content handler: the dict's figures in the exposition format.
-- @syntax shared.serve(name)
-- @string name the `lua_shared_dict`'s name
-- @errors no such dict raises
-- @usage -- location = /metrics { content_by_lua_block { require("mongotx.metrics.shared").serve("mongotx_metrics") } }
function _M.serve(name)
  local ngx = ngx -- luacheck: ignore 113
  local text = _M.new(name):render()
  ngx.header["Content-Type"] = exposition.CONTENT_TYPE
  ngx.print(text)
end

return _M

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

local setmetatable, error, type, tostring, ipairs = setmetatable, error, type, tostring, ipairs

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

-- The transactions counted begun and not yet counted ended
-- (mongotx.metrics): one key each, MARK .. k, shared by the workers, so
-- that a worker that ends one another (killed) worker began counts it,
-- and the recovery pass of any worker reconciles them.  Its value is the
-- time of the mark (core.monotonic_ms, one clock for the host's
-- processes), >= 0 while it is live; ending it is one atomic incr by
-- -CLAIM, so of two workers that end one, only the one that took it from
-- >= 0 counts it (a later touch adds less than CLAIM: a taken mark stays
-- below 0).  A mark ends at its transaction's end or at a reconcile; one
-- left (no reconcile of its namespace runs) expires after TTL seconds,
-- so that it cannot fill the dict for good.  The id is read back from k
-- (the key of a string, an integer or an ObjectId: every id mongotx
-- makes), else from a second key, ID .. k, holding its BSON.  Marks of
-- an older build (OLD, keyed without the namespace, never taken now)
-- are deleted by the next reconcile that lists the marks.
local MARK, ID, CLAIM = "mongotx\t", "mongotx_id\t", 2 ^ 50
local OLD, OLD_ID = "mongotx_begun\t", "mongotx_begid\t"
_M.TTL = 7 * 86400
local core = require "mongotx.core"

-- The id whose key (engine.key) is `key` (a string's, an integer's or an
-- ObjectId's; nil for another's).
local function id_of(key)
  local kind, rest = key:sub(1, 1), key:sub(2)
  if kind == "o" then return core.ObjectId(rest) end
  if kind == "i" then return core.Int64(rest) end
  if kind == "s" then return rest:match("^%d+:(.*)$") end
end

-- Does mark k's key ("<application>\t<namespace's hash>\t<key>") tell its id?
-- (Its first byte: no string is made, as the events of every transaction
-- ask.)
local TOLD = { [("o"):byte()] = true, [("i"):byte()] = true, [("s"):byte()] = true }
local function told(k)
  local at = k:find("\t", 1, true)
  at = at and k:find("\t", at + 1, true)
  return at ~= nil and TOLD[k:byte(at + 1)] == true
end

function Store:mark(k, id, t)
  local dict = self.dict
  local ok, err = dict:safe_add(MARK .. k, t, _M.TTL)
  if not ok then
    if err == "exists" then return "exists" end
    self:dropped()
    return false
  end
  if not told(k) and not dict:safe_set(ID .. k, core.encode { id = id }, _M.TTL) then
    dict:delete(MARK .. k)
    self:dropped()
    return false
  end
  return "new"
end

function Store:unmark(k)
  local dict = self.dict
  local left = dict:incr(MARK .. k, -CLAIM)
  if left == nil then return false end
  dict:delete(MARK .. k)
  if not told(k) then dict:delete(ID .. k) end
  return left >= -CLAIM
end

function Store:touch(k, dt)
  self.dict:incr(MARK .. k, dt)
end

-- The live marks whose k starts with prefix: a copy of the dict's keys
-- (get_keys locks it while it copies them, as a scrape does).
function Store:marked(prefix)
  local dict, list, from = self.dict, {}, #MARK + 1
  local head = MARK .. prefix
  for _, name in ipairs(dict:get_keys(0)) do
    if name:sub(1, #OLD) == OLD or name:sub(1, #OLD_ID) == OLD_ID then
      dict:delete(name)
    elseif name:sub(1, #head) == head then
      local t, k = dict:get(name), name:sub(from)
      local id
      if told(k) then
        id = id_of(k:sub(#prefix + 1))
      else
        local bson = dict:get(ID .. k)
        id = bson and core.decode(bson).id
      end
      if type(t) == "number" and t >= 0 and id ~= nil then
        list[#list + 1] = { k = k, id = id, t = t }
      end
    end
  end
  return list
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

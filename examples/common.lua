-- What the examples share: module paths, the demo database, and a
-- printer that shows documents the way the mongo shell would.

local cpath = os.getenv("MONGOTX_CPATH") or "./build/lua54/?.so"
package.cpath = cpath .. ";" .. package.cpath
package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path

local mongotx = require "mongotx"

local _M = { mongotx = mongotx }

-- A value as the mongo shell would print it (dates as ISO time).
function _M.show(v)
  if v == mongotx.null then return "null" end
  local t = type(v)
  if t == "string" then return string.format("%q", v) end
  if t ~= "table" and t ~= "userdata" then return tostring(v) end
  local kind = mongotx.type(v)
  if kind == "date" then
    local ms = v:value()
    return os.date("!%Y-%m-%dT%H:%M:%S", math.floor(ms / 1000)) .. string.format(".%03dZ", ms % 1000)
  end
  if t == "userdata" then return tostring(v) end
  local parts = {}
  if kind == "array" then
    for i = 1, #v do parts[i] = _M.show(v[i]) end
    return "[" .. table.concat(parts, ", ") .. "]"
  end
  local mt = getmetatable(v)
  local keys, seen = {}, {}
  if v._id ~= nil then keys[1], seen._id = "_id", true end
  for _, k in ipairs(mt or {}) do
    if not seen[k] and v[k] ~= nil then keys[#keys + 1], seen[k] = k, true end
  end
  local rest = {}
  for k in pairs(v) do
    if not seen[k] then rest[#rest + 1] = tostring(k) end
  end
  table.sort(rest)
  for _, k in ipairs(rest) do keys[#keys + 1] = k end
  for i, k in ipairs(keys) do parts[i] = k .. ": " .. _M.show(v[k]) end
  return "{ " .. table.concat(parts, ", ") .. " }"
end

-- A section heading of an example's output.
function _M.heading(text)
  print()
  print("== " .. text)
end

_M.URI = os.getenv("MONGOTX_TEST_URI") or "mongodb://127.0.0.1:27017"
_M.DATABASE = "mongotx_demo"

-- The demo database, connected to MONGOTX_TEST_URI (or a local server).
function _M.connect()
  return assert(mongotx.connect(_M.URI, { database = _M.DATABASE }))
end

-- Drops the named collections of db, and its transactions: an example
-- starts from nothing.
function _M.fresh(db, ...)
  for _, name in ipairs { "transactions", ... } do
    assert(db:collection(name):drop())
  end
end

return _M

-- What `mongotx` prints: JSON lines for scripts (--json) and aligned
-- tables for people, and ids written in the command line's own syntax
-- (mongotx.cli.args) so that one can be pasted back into a command.
--
-- JSON is a small encoder for what the command prints: plain Lua values,
-- decoded documents (their keys in stored order, arrays as arrays) and
-- mongotx.core's values in MongoDB's relaxed Extended JSON ({"$oid": ...},
-- {"$date": "...Z"}, {"$binary": ...}); an Int64 is a plain number.

local core = require "mongotx.core"
local args = require "mongotx.cli.args"

local type, ipairs, tostring, select = type, ipairs, tostring, select
local getmetatable, setmetatable = getmetatable, setmetatable
local rawlen = rawlen or function(t) return #t end -- LuaJIT: the specs load this module too
local format, concat, sort = string.format, table.concat, table.sort
local floor, huge = math.floor, math.huge

local _M = {}

local ESCAPES = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
                  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

-- The string with each byte that is not part of a valid UTF-8 sequence
-- replaced by U+FFFD: JSON text is UTF-8, and a stored string need not be.
local function utf8_only(s)
  if not s:find("[\128-\255]") then return s end
  local out, i, n = {}, 1, #s
  while i <= n do
    local c = s:byte(i)
    local len, lo, hi = 0, 0x80, 0xBF -- hi, lo: bounds of the second byte
    if c < 0x80 then len = 1
    elseif c >= 0xC2 and c <= 0xDF then len = 2
    elseif c >= 0xE0 and c <= 0xEF then
      len = 3
      if c == 0xE0 then lo = 0xA0 elseif c == 0xED then hi = 0x9F end -- overlong, surrogate
    elseif c >= 0xF0 and c <= 0xF4 then
      len = 4
      if c == 0xF0 then lo = 0x90 elseif c == 0xF4 then hi = 0x8F end -- overlong, > U+10FFFF
    end
    local ok = len > 0
    for k = 1, len - 1 do
      local b = s:byte(i + k)
      if not b or b < (k == 1 and lo or 0x80) or b > (k == 1 and hi or 0xBF) then
        ok = false
        break
      end
    end
    if ok then
      out[#out + 1] = s:sub(i, i + len - 1)
      i = i + len
    else
      out[#out + 1] = "\239\191\189"
      i = i + 1
    end
  end
  return concat(out)
end

local function quote(s)
  return '"' .. utf8_only(s):gsub('[%c"\\]', function(c)
    return ESCAPES[c] or format("\\u%04x", c:byte())
  end) .. '"'
end

local VISIBLE = { ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

-- Text for a terminal: control characters written as \n, \r, \t or \xHH,
-- so that no id or reason breaks a table's lines or sends the terminal an
-- escape sequence; with `lines`, newlines are kept (a message of several
-- lines).
function _M.visible(s, lines)
  return (s:gsub("%c", function(c)
    if lines and c == "\n" then return c end
    return VISIBLE[c] or format("\\x%02x", c:byte())
  end))
end

-- Standard output through an object that remembers the first write that
-- failed (a full disk, a closed pipe when SIGPIPE is ignored): the command
-- then exits 1 instead of 0 (mongotx.cli).
local Writer = {}
Writer.__index = Writer

function Writer:write(...)
  local ok, err = self.file:write(...)
  if not ok then self.err = self.err or err end
  return self
end

function Writer:flush()
  local ok, err = self.file:flush()
  if not ok then self.err = self.err or err end
  return self
end

_M.stdout = setmetatable({ file = io.stdout }, Writer)

local math_type = math.type or function() return "float" end -- LuaJIT: doubles only

local function number(n)
  if n ~= n or n == huge or n == -huge then return "null" end
  if math_type(n) == "integer" or (n == floor(n) and n > -2 ^ 53 and n < 2 ^ 53) then
    return format("%d", n)
  end
  local s = format("%.14g", n) -- shorter, unless it would not read back the same
  if tonumber(s) ~= n then s = format("%.17g", n) end
  return s
end

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

local function base64(s)
  return (s:gsub("..?.?", function(chunk)
    local a, b, c = chunk:byte(1, 3)
    local n = a * 65536 + (b or 0) * 256 + (c or 0)
    local out = {}
    for i = 1, 4 do
      local k = floor(n / 64 ^ (4 - i)) % 64
      out[i] = B64:sub(k + 1, k + 1)
    end
    if not b then out[3], out[4] = "=", "=" elseif not c then out[4] = "=" end
    return concat(out)
  end))
end

-- An ISO 8601 UTC time for ms since the epoch.
function _M.iso_time(ms)
  local s = floor(ms / 1000)
  return os.date("!%Y-%m-%dT%H:%M:%S", s) .. format(".%03dZ", floor(ms - s * 1000))
end

-- The keys of a table in the order it prints: a decoded document's (or
-- core.doc's) stored order first, then the others sorted.
local function keys_of(t)
  local mt = getmetatable(t)
  local out, seen = {}, {}
  if type(mt) == "table" then
    for _, k in ipairs(mt) do
      if t[k] ~= nil then out[#out + 1], seen[k] = k, true end
    end
  end
  local rest = {}
  for k in next, t do
    if not seen[k] then rest[#rest + 1] = k end
  end
  sort(rest, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(rest) do out[#out + 1] = k end
  return out
end

local function is_array(t)
  local mt = getmetatable(t)
  if type(mt) == "table" and mt.__mongotx then return mt.__mongotx == "array" end
  local n = 0
  for _ in next, t do n = n + 1 end
  return n > 0 and n == rawlen(t)
end

local json

-- The digits of an Int64, exact (its value() is a double in LuaJIT).
local function int64_digits(v)
  return (tostring(v):match("^Int64%((%-?%d+)%)$"))
end

local VALUES = {
  objectId = function(v) return '{"$oid":' .. quote(v:value()) .. "}" end,
  date = function(v) return '{"$date":' .. quote(_M.iso_time(v:value())) .. "}" end,
  long = function(v) return int64_digits(v) end,
  binData = function(v)
    local bytes, subtype = v:value()
    return format('{"$binary":{"base64":%s,"subType":"%02x"}}', quote(base64(bytes)), subtype)
  end,
}

function json(v)
  local t = type(v)
  if v == nil or v == core.null then return "null" end
  if t == "boolean" then return tostring(v) end
  if t == "number" then return number(v) end
  if t == "string" then return quote(v) end
  if t == "table" then
    local parts = {}
    if is_array(v) then
      for i = 1, rawlen(v) do parts[i] = json(v[i]) end
      return "[" .. concat(parts, ",") .. "]"
    end
    for _, k in ipairs(keys_of(v)) do
      parts[#parts + 1] = quote(tostring(k)) .. ":" .. json(v[k])
    end
    return "{" .. concat(parts, ",") .. "}"
  end
  local kind = core.type(v)
  if VALUES[kind] then return VALUES[kind](v) end
  return quote(tostring(v)) -- decimal, timestamp, regex, ...: as mongotx prints them
end
_M.json = json

-- A table that prints its keys in the order given: record("a", 1, "b",
-- 2, ...); a nil value leaves its key out.  add(rec, k, v) appends one.
function _M.record(...)
  local order, t = { __mongotx = "document" }, {}
  for i = 1, select("#", ...), 2 do
    local k, v = select(i, ...)
    order[#order + 1], t[k] = k, v
  end
  return setmetatable(t, order)
end

function _M.add(rec, k, v)
  local order = getmetatable(rec)
  order[#order + 1], rec[k] = k, v
end

-- An id as the command line takes it (mongotx.cli.args), for each type a
-- transaction id may have: a string that reads as something else gets
-- the str: prefix.  A number is one whatever its BSON type (Lua 5.4
-- decodes an Int64 to an integer, LuaJIT one within 2^53 to a double): the
-- server matches an _id by its numeric value.  Anything else (an op's
-- document id may be a document) prints as JSON.
function _M.id_text(id)
  local t = type(id)
  if t == "number" then return number(id) end
  if t == "boolean" then return "bool:" .. tostring(id) end
  if t == "string" then
    if args.plain_string(id) then return id end
    return "str:" .. id
  end
  local kind = core.type(id)
  if kind == "objectId" then return "oid:" .. id:value() end
  if kind == "long" then return "long:" .. int64_digits(id) end
  if kind == "date" then return format("date:%d", id:value()) end
  if kind == "binData" then
    local bytes, subtype = id:value()
    local hex = bytes:gsub(".", function(c) return format("%02x", c:byte()) end)
    return subtype == 0 and "bin:" .. hex or format("bin:%d:%s", subtype, hex)
  end
  return json(id)
end

-- An error as tostring() writes it, without its leading "mongotx: " (to
-- be quoted in a line that says it already) and with its transaction id
-- as the command line takes it (id_text) instead of as Lua prints it.
function _M.reason(err)
  local s = tostring(err):gsub("^mongotx: ", "")
  if type(err) == "table" and err.step ~= nil and err.id ~= nil then
    local from = " of " .. tostring(err.id) .. ": " -- as csrc/error.c writes it
    local at = s:find(from, 1, true)
    if at then s = s:sub(1, at - 1) .. " of " .. _M.id_text(err.id) .. ": " .. s:sub(at + #from) end
  end
  return s
end

-- A value in a table cell (made visible by table() and fields()).
function _M.cell(v)
  if v == nil or v == core.null then return "-" end
  if type(v) == "number" then return number(v) end
  if type(v) == "table" or type(v) == "userdata" then
    local s = json(v)
    if core.type(v) == "date" then s = _M.iso_time(v:value()) end
    return s
  end
  return tostring(v)
end

-- Prints rows (lists of strings) under headers, each column as wide as
-- its widest cell, control characters made visible; returns the widths.
-- Given the widths an earlier call returned, prints more rows of that
-- table: no header, the same widths (a wider cell pushes the rest of its
-- row), so a long table is printed a page at a time.
function _M.table(out, headers, rows, widths)
  for _, row in ipairs(rows) do
    for i, c in ipairs(row) do row[i] = _M.visible(c) end
  end
  local more = widths ~= nil
  if not more then
    widths = {}
    for i, h in ipairs(headers) do widths[i] = #h end
    for _, row in ipairs(rows) do
      for i, c in ipairs(row) do
        if #c > widths[i] then widths[i] = #c end
      end
    end
  end
  local function line(cells)
    local parts = {}
    for i, c in ipairs(cells) do
      parts[i] = i < #cells and c .. (" "):rep(widths[i] - #c) or c
    end
    out:write(concat(parts, "  "), "\n")
  end
  if not more then line(headers) end
  for _, row in ipairs(rows) do line(row) end
  return widths
end

-- Prints name: value lines, names aligned, control characters made
-- visible.
function _M.fields(out, list)
  for i, c in ipairs(list) do list[i] = _M.visible(c) end
  local width = 0
  for i = 1, #list, 2 do
    if #list[i] > width then width = #list[i] end
  end
  for i = 1, #list, 2 do
    out:write(list[i], ":", (" "):rep(width - #list[i] + 1), list[i + 1], "\n")
  end
end

return _M

-- Transaction ids on the command line, typed by their look:
--
--   42, -7, 1.5, 1e3     a number
--   oid:<24 hex digits>  an ObjectId
--   long:<digits>        an Int64
--   bin:<hex>            a Binary of subtype 0; bin:<subtype>:<hex> another
--   date:<ms>            a Date, in ms since 1970
--   bool:true, bool:false  a boolean
--   str:<text>           the string <text>, whatever it looks like
--   anything else        that string
--
-- These are the id types a transaction may have (validate.check_tid), and
-- mongotx.cli.output prints every id so, to be pasted back.
--
-- Text that starts with "{" or "[" is refused unless given as str:...:
-- it looks like JSON, and an id on the command line is never a document
-- or a query.  Every id then goes through the library's check of
-- transaction ids (validate.check_tid, core.id_key), as any caller's id
-- does, so the answer is the same as the API's.

local core = require "mongotx.core"
local validate = require "mongotx.validate"

local _M = {}

local NUMBER = "^[-+]?%d+%.?%d*[eE]?[-+]?%d*$"
local floor = math.floor

local function is_number(s)
  return s:find(NUMBER) ~= nil and tonumber(s) ~= nil
end

-- math.tointeger; LuaJIT has none, and its numbers are exact to 2^53
local tointeger = math.tointeger or function(n)
  if n == floor(n) and n > -2 ^ 53 and n < 2 ^ 53 then return n end
end

local PREFIXES = { str = true, oid = true, long = true, bin = true, date = true, bool = true }

-- Is this string printed as it is (it reads back as the same string, and
-- is not empty: "" prints as str:)?
function _M.plain_string(s)
  local prefix = s:match("^(%l+):")
  return s ~= "" and not is_number(s) and not PREFIXES[prefix] and not s:find("^[%[{]")
end

local SYNTAX = "ids are a number, oid:<24 hex digits>, long:<digits>, bin:[<subtype>:]<hex>, " ..
  "date:<ms>, bool:true|false, str:<text> or other text"

-- The bytes that `hex` (an even number of hex digits) stands for.
local function unhex(hex)
  return (hex:gsub("..", function(h) return string.char(tonumber(h, 16)) end))
end

local function parse(text)
  local rest = text:match("^str:(.*)$")
  if rest then return rest end
  rest = text:match("^oid:(.*)$")
  if rest then
    if #rest ~= 24 or not rest:find("^%x+$") then
      return nil, "oid: takes 24 hex digits"
    end
    return core.ObjectId(rest:lower())
  end
  rest = text:match("^long:(.*)$")
  if rest then
    if not rest:find("^[-+]?%d+$") then return nil, "long: takes digits" end
    local ok, v = pcall(core.Int64, rest)
    if not ok then return nil, "long: " .. tostring(v):gsub("^mongotx: ", "") end
    return v
  end
  rest = text:match("^bin:(.*)$")
  if rest then
    local subtype, hex = rest:match("^(%d+):(%x*)$")
    hex = hex or rest
    subtype = tonumber(subtype or 0)
    if #hex % 2 == 1 or not hex:find("^%x*$") or subtype > 255 then
      return nil, "bin: takes an even number of hex digits, after a subtype from 0 to 255 and :"
    end
    return core.Binary(unhex(hex), subtype)
  end
  rest = text:match("^date:(.*)$")
  if rest then
    local ms = rest:find("^-?%d+$") and tonumber(rest)
    if not ms or not tointeger(ms) then return nil, "date: takes whole ms since 1970" end
    return core.Date(tointeger(ms))
  end
  rest = text:match("^bool:(.*)$")
  if rest then
    if rest ~= "true" and rest ~= "false" then return nil, "bool: takes true or false" end
    return rest == "true"
  end
  if is_number(text) then
    local n = tonumber(text)
    if not text:find("[.eE]") and not tointeger(n) then
      -- past 2^53 in LuaJIT, 2^63 in Lua 5.4, the text would read as the
      -- nearest double (another id): an Int64 is the same _id, exactly
      local ok, v = pcall(core.Int64, text)
      if ok then return v end
      return nil, "a number without a point or exponent must be a whole number from " ..
        "-2^63 to 2^63-1"
    end
    return tointeger(n) or n
  end
  if text:find("^[%[{]") then
    return nil, "it looks like JSON (use str:" .. text .. " for that text)"
  end
  return text
end

-- The id that `text` stands for, checked as a transaction id; or nil and
-- a message naming the text and what is wrong.
function _M.id(text)
  local id, why = parse(text)
  if id ~= nil then
    local err
    id, err = validate.check_tid(id)
    if id == nil then why = err.message end
  end
  if id == nil then
    return nil, string.format("malformed id %q: %s (%s)", text, why, SYNTAX)
  end
  return id
end

return _M

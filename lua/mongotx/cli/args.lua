-- Transaction ids on the command line, typed by their look:
--
--   42, -7, 1.5, 1e3     a number
--   oid:<24 hex digits>  an ObjectId
--   long:<digits>        an Int64
--   str:<text>           the string <text>, whatever it looks like
--   anything else        that string
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

local function is_number(s)
  return s:find(NUMBER) ~= nil and tonumber(s) ~= nil
end

-- Is this string printed as it is (it reads back as the same string, and
-- is not empty: "" prints as str:)?
function _M.plain_string(s)
  return s ~= "" and not is_number(s) and not s:find("^oid:") and not s:find("^long:")
    and not s:find("^str:") and not s:find("^[%[{]")
end

local SYNTAX = "ids are a number, oid:<24 hex digits>, long:<digits>, str:<text> or " ..
  "other text"

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
  if is_number(text) then
    local n = tonumber(text)
    if not text:find("[.eE]") and not math.tointeger(n) then
      -- past 2^63 the text would read as the nearest double: another id
      return nil, "a number without a point or exponent must be a whole number from " ..
        "-2^63 to 2^63-1"
    end
    return math.tointeger(n) or n
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

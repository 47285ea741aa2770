-- The Prometheus text exposition format, version 0.0.4 (what
-- Prometheus scrapes and node_exporter's textfile collector reads):
--
--   # HELP <name> <text, with \ and newline escaped>
--   # TYPE <name> counter|gauge|histogram
--   <name>{<label>="<value, with \, " and newline escaped>",...} <number>
--
-- A histogram is <name>_bucket{...,le="<bound>"} (cumulative, the last
-- le="+Inf"), <name>_sum and <name>_count.  mongotx.metrics renders its
-- families with these helpers, and so does `mongotx status --prometheus`.

local format, floor, huge, concat = string.format, math.floor, math.huge, table.concat
local ipairs, type, tostring, tonumber = ipairs, type, tostring, tonumber

local _M = {}

-- The content type of this format (what a scrape handler answers with).
_M.CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

local LABEL_ESCAPES = { ["\\"] = "\\\\", ['"'] = '\\"', ["\n"] = "\\n" }
local HELP_ESCAPES = { ["\\"] = "\\\\", ["\n"] = "\\n" }

-- A label value as it goes between the quotes.
function _M.escape(value)
  return (tostring(value):gsub('[\\"\n]', LABEL_ESCAPES))
end

-- A number as the format writes it: integers without a point, +Inf,
-- -Inf, NaN, and other floats in the fewest digits that read back equal.
function _M.number(v)
  if v ~= v then return "NaN" end
  if v == huge then return "+Inf" end
  if v == -huge then return "-Inf" end
  if v == floor(v) and v > -2^53 and v < 2^53 then return format("%d", v) end
  for digits = 15, 17 do
    local s = format("%." .. digits .. "g", v)
    if tonumber(s) == v then return s end
  end
  return format("%.17g", v)
end

-- The inside of a series' braces for `pairs` = { name1, value1, name2,
-- value2, ... } (names are the caller's constants): name="value",...
function _M.labels(pairs)
  local out = {}
  for i = 1, #pairs, 2 do
    out[#out + 1] = pairs[i] .. '="' .. _M.escape(pairs[i + 1]) .. '"'
  end
  return concat(out, ",")
end

-- Appends a family's HELP and TYPE lines to `out` (a list of lines).
function _M.header(out, name, kind, help)
  out[#out + 1] = format("# HELP %s %s", name, (help:gsub("[\\\n]", HELP_ESCAPES)))
  out[#out + 1] = format("# TYPE %s %s", name, kind)
end

-- Appends one sample: name{labels} value (labels: the inside of the
-- braces, "" for none).
function _M.sample(out, name, labels, value)
  if labels == "" then
    out[#out + 1] = name .. " " .. _M.number(value)
  else
    out[#out + 1] = name .. "{" .. labels .. "} " .. _M.number(value)
  end
end

-- Appends a histogram's samples for one label set: counts[i] the
-- observations in bucket i alone (bounds[i-1] < v <= bounds[i]), then
-- the sum and the count of all.  Buckets are written cumulative; the
-- count is at least the buckets' total (a shared store may be read while
-- an observation is half added: the +Inf bucket and _count stay equal).
function _M.histogram(out, name, labels, bounds, counts, sum, count)
  local sep = labels == "" and "" or labels .. ","
  local cum = 0
  for i, bound in ipairs(bounds) do
    cum = cum + (counts[i] or 0)
    out[#out + 1] = format('%s_bucket{%sle="%s"} %s', name, sep, _M.number(bound),
                           _M.number(cum))
  end
  if type(count) ~= "number" or count < cum then count = cum end
  out[#out + 1] = format('%s_bucket{%sle="+Inf"} %s', name, sep, _M.number(count))
  _M.sample(out, name .. "_sum", labels, sum or 0)
  _M.sample(out, name .. "_count", labels, count)
end

return _M

-- Reads Prometheus text exposition with an independent parser: Python's
-- prometheus_client (spec/support/setup.sh prometheus installs it in a
-- venv under $MONGOTX_CACHE) through spec/support/promparse.py, which also
-- checks what that lenient parser lets through (see there).
--
--   local prom = require "spec.support.prometheus"
--   local families, err = prom.parse(text)   -- nil, err: not valid
--   prom.value(families, "mongotx_transactions_done_total", { application = "a" })

local server = require "spec.support.server"
local cjson = require "cjson"

local M = {}

M.PYTHON = server.cache .. "/venv/bin/python"

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- The families of `text` (promparse.py's JSON: name, type, help, samples
-- { name, labels, value }), or nil and the parser's complaint.
function M.parse(text)
  assert(server.exists(M.PYTHON), "no " .. M.PYTHON .. ": run spec/support/setup.sh prometheus")
  local input, out, err = os.tmpname(), os.tmpname(), os.tmpname()
  local f = assert(io.open(input, "wb"))
  f:write(text)
  f:close()
  local code = server.execute(string.format("%s spec/support/promparse.py <%s >%s 2>%s",
    server.quote(M.PYTHON), input, out, err))
  local o, e = slurp(out), slurp(err)
  os.remove(input); os.remove(out); os.remove(err)
  if code ~= 0 then return nil, e end
  return cjson.decode(o)
end

-- The value (a number) of the sample `name` whose labels are exactly
-- `labels`, or nil.
function M.value(families, name, labels)
  labels = labels or {}
  for _, fam in ipairs(families) do
    for _, s in ipairs(fam.samples) do
      if s.name == name then
        local same = true
        for k, v in pairs(labels) do if s.labels[k] ~= v then same = false end end
        for k in pairs(s.labels) do if labels[k] == nil then same = false end end
        if same then
          if s.value == "+Inf" then return math.huge end
          return tonumber(s.value)
        end
      end
    end
  end
end

-- The family named `name` (as the parser names it: a counter without
-- _total), or nil.
function M.family(families, name)
  for _, fam in ipairs(families) do
    if fam.name == name then return fam end
  end
end

return M

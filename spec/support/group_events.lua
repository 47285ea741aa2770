-- A policies module (mongotx.resty's `policies`) for spec/44: writes each
-- "group" event (mongotx.group: one per batch) as a line "<size> <wait>"
-- to /tmp/mongotx-group-events-<application>, which the spec reads.
--
-- And a hold for the kill case: while the file HOLD .. ".armed" exists,
-- the first batch to commit a begun transaction (ids "b-...") takes it
-- (renames it to HOLD .. ".held", which one thread only can) and stops
-- there for good, its transactions `applied`, until the spec kills the
-- worker.  (HOLD's directory is the spec's, open to nginx's user: in
-- /tmp itself that user may not rename a file the spec made.)
local core = require "mongotx.core"

local _M = {}

-- (not a field of _M: mongotx.resty takes each as a manager option)
local HOLD = "/tmp/mongotx-group-hold/hold"

function _M.on_event(name, info)
  if name == "commit" and type(info.id) == "string" and info.id:find("^b%-")
      and os.rename(HOLD .. ".armed", HOLD .. ".held") then
    core.sleep(120)
  end
  if name ~= "group" then return end
  local f = io.open("/tmp/mongotx-group-events-" .. tostring(info.application), "a")
  if not f then return end
  f:write(string.format("%d %.6f\n", info.size, info.wait))
  f:close()
end

return _M

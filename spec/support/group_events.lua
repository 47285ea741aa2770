-- A policies module (mongotx.resty's `policies`) for spec/44: writes each
-- "group" event (mongotx.group: one per batch) as a line "<size> <wait>"
-- to /tmp/mongotx-group-events-<application>, which the spec reads.
local _M = {}

function _M.on_event(name, info)
  if name ~= "group" then return end
  local f = io.open("/tmp/mongotx-group-events-" .. tostring(info.application), "a")
  if not f then return end
  f:write(string.format("%d %.6f\n", info.size, info.wait))
  f:close()
end

return _M

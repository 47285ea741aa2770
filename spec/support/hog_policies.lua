-- A policies module (mongotx.resty's `policies`) for
-- spec/83-group-busy-takeover_spec.lua: an op that cannot apply holds
-- its worker thread for HOLD seconds (a blocking sleep in on_op_failure),
-- then cancels: a request that takes nginx's only worker thread for that
-- long.
local core = require "mongotx.core"

local HOLD = 1.2

local _M = {}

function _M.on_op_failure()
  core.sleep(HOLD)
  return "cancel"
end

return _M

-- A policies module (mongotx.resty's `policies`) for
-- spec/81-openresty-group-busy_spec.lua: a fixed backoff, so that a busy
-- call's wait is known (retries x BACKOFF).
local _M = {}

_M.BACKOFF = 0.3

function _M.backoff() return _M.BACKOFF end

return _M

-- A policies module (mongotx.resty's `policies`) for
-- spec/81-openresty-group-busy_spec.lua: a fixed backoff of 0.5 s, so
-- that a busy call's wait is known (retries x 0.5 s).
local _M = {}

function _M.backoff() return 0.5 end

return _M

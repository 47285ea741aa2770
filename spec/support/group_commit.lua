-- POST /commit for spec/44-openresty-group_spec.lua: tm:commit of the
-- begun transaction the X-Txid header names, through a manager made with
-- the very options table bank.configure got (the spec's init_worker sets
-- `manager` to it), so that its calls join the same group as /transfer's.
-- 200 {"id", "state", "epoch", "attempts"}, or 404 (no such transaction)
-- and 409 {"error": <code>, "message", "reason"}.
local resty = require "mongotx.resty"
local cjson = require "cjson.safe"

local _M = { manager = nil }

local tm

function _M.commit()
  local ngx = ngx -- luacheck: ignore 113
  if not tm then
    local db = assert(resty.connect(os.getenv("MONGOTX_URI"),
      { database = os.getenv("MONGOTX_DATABASE") }))
    tm = assert(db:manager(_M.manager))
  end
  local T, err = tm:commit({ _id = ngx.var.http_x_txid })
  ngx.header["Content-Type"] = "application/json"
  if T then
    return ngx.say(cjson.encode({ id = T._id, state = T.state, epoch = T.epoch, attempts = T.attempts }))
  end
  ngx.status = err.code == "state" and 404 or 409
  ngx.say(cjson.encode({ error = err.code, message = err.message, reason = err.reason }))
end

return _M

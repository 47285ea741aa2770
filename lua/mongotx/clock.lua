-- The server's clock, for every module that compares times: mongotx
-- never trusts the client's clock, which may be minutes off.  server_now
-- asks the server (one isMaster); a clock object estimates the server's
-- time from the monotonic clock and an isMaster at most a minute old,
-- for the calls that need the time often (the engine's deadlines).

local core = require "mongotx.core"
local errors = require "mongotx.errors"

local setmetatable = setmetatable

local _M = {}

-- The server's clock in ms since the epoch, read now through `client`;
-- nil, err.
function _M.server_now(client)
  local reply, err = client:command("admin", { isMaster = 1 })
  if not reply then return nil, errors.wrap(err, "clock") end
  if core.type(reply.localTime) ~= "date" then
    return nil, errors.new("server", "the server reports no localTime", { step = "clock" })
  end
  return reply.localTime:value()
end

-- The server's time `seconds` ago, in ms since the epoch: what a sweep
-- for things older than `seconds` compares with.  nil, err.
function _M.cutoff(client, seconds)
  local now, err = _M.server_now(client)
  if not now then return nil, err end
  return now - seconds * 1000
end

-- Only the length of a window measured with the estimate depends on its
-- error (a few ms of round trip, the drift over a minute), never safety:
-- the writes that need an exact time compare with the server's own.
local REFRESH_MS = 60000

local Clock = {}
Clock.__index = Clock

function _M.new()
  return setmetatable({ offset = nil, -- server clock - monotonic clock, ms
                        at = nil },   -- monotonic ms when offset was measured
                      Clock)
end

-- The server's clock in ms, estimated; `client` is asked when the
-- estimate is older than a minute.  nil, err.
function Clock:now(client)
  local before = core.monotonic_ms()
  if not self.offset or before - self.at > REFRESH_MS then
    local now, err = _M.server_now(client)
    if not now then return nil, err end
    local after = core.monotonic_ms()
    self.offset, self.at = now - (before + after) / 2, after
    before = after
  end
  return before + self.offset
end

return _M

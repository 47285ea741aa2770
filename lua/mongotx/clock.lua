-- The server's clock, for every module that stamps or compares times
-- (the engine's leases and deadlines, the ledger's entry times): the
-- server's, never the client's, which may be set wrong.
--
--   local c = clock.new(db)   -- db: a database handle (db.client is read per call,
--                             -- so a manager pointed at another client follows)
--   c:server_now()            -- ms since the epoch, read now (one isMaster)
--   c:now()                   -- the same, estimated from a reading a minute old at most

local core = require "mongotx.core"
local errors = require "mongotx.errors"

local _M = {}

local Clock = {}
Clock.__index = Clock

-- How old the reading behind an estimate may be: only the length of an
-- owner's window depends on the estimate, not safety (applies and claims
-- both compare deadlines with the server's clock).
local REFRESH_MS = 60000

function _M.new(db)
  return setmetatable({
    db = db,
    offset = nil, -- server clock - monotonic clock, ms
    at = nil,     -- monotonic ms when offset was measured
  }, Clock)
end

function Clock:server_now()
  local reply, err = self.db.client:command("admin", { isMaster = 1 })
  if not reply then return nil, errors.wrap(err, "clock") end
  if core.type(reply.localTime) ~= "date" then
    return nil, errors.new("server", "the server reports no localTime", { step = "clock" })
  end
  return reply.localTime:value()
end

function Clock:now()
  local before = core.monotonic_ms()
  if not self.offset or before - self.at > REFRESH_MS then
    local now, err = self:server_now()
    if not now then return nil, err end
    local after = core.monotonic_ms()
    self.offset, self.at = now - (before + after) / 2, after
    before = after
  end
  return before + self.offset
end

return _M

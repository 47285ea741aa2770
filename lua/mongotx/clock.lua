-- The server's clock.  Deadlines, leases and the times a module stores
-- are the server's, never the client's: clients' clocks disagree, the
-- server's is the one every writer shares.  read() asks the server
-- (isMaster's localTime); now() estimates it from the monotonic clock and
-- an offset measured at most a minute ago, so that hot paths do not pay a
-- round trip.  Users (the engine, mongotx.queue, ...) compare times with
-- the server's clock in their filters, so an estimate a little off only
-- moves a lease's end, never its safety.

local core = require "mongotx.core"
local errors = require "mongotx.errors"

local setmetatable = setmetatable

local _M = {}

local Clock = {}
Clock.__index = Clock

-- How old the measured offset may get before now() measures it again.
local REFRESH_MS = 60000

-- A clock of the server `db` (a database handle: its `client` is read at
-- every call, so a manager moved to another client by mongotx.pool reads
-- through that one).
function _M.new(db)
  return setmetatable({
    db = db,
    offset = nil, -- server clock - monotonic clock, ms
    at = nil,     -- monotonic ms when the offset was measured
  }, Clock)
end

-- The server's clock in ms since the epoch, asked now; nil, err.
function Clock:read()
  local reply, err = self.db.client:command("admin", { isMaster = 1 })
  if not reply then return nil, errors.wrap(err, "clock") end
  if core.type(reply.localTime) ~= "date" then
    return nil, errors.new("server", "the server reports no localTime", { step = "clock" })
  end
  return reply.localTime:value()
end

-- The server's time `seconds` ago in ms, asked now: what a sweep for
-- things older than `seconds` compares with (sync:repair, versioned:gc);
-- nil, err.
function Clock:ago(seconds)
  local now, err = self:read()
  if not now then return nil, err end
  return now - seconds * 1000
end

-- The server's clock in ms, estimated; nil, err.
function Clock:now()
  local before = core.monotonic_ms()
  if not self.offset or before - self.at > REFRESH_MS then
    local now, err = self:read()
    if not now then return nil, err end
    local after = core.monotonic_ms()
    self.offset, self.at = now - (before + after) / 2, after
    before = after
  end
  return before + self.offset
end

return _M

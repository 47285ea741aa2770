-- The progress bar of a sweep (recover, prune): one line redrawn in place
-- with the count, the rate and the time left,
--
--   recover [##########..........]  1200/2400  50%  310/s  ETA 0:04
--
-- drawn only when standard output is a terminal (and not for --json):
-- piped or redirected output never gets one.

local core = require "mongotx.core"

local format, floor, max = string.format, math.floor, math.max

local _M = {}

local Bar = {}
Bar.__index = Bar

local WIDTH = 30          -- characters of the bar itself
local REDRAW_MS = 100     -- at most this often, but for the last drawing

-- Is standard output a terminal?  Asked of test(1), which inherits it.
function _M.is_terminal()
  if os.getenv("TERM") == "dumb" then return false end
  local ok = os.execute("test -t 1")
  return ok == true or ok == 0
end

-- A bar for `total` items labelled `label` on `out`; one that draws
-- nothing unless `enabled`.
function _M.new(out, label, total, enabled)
  return setmetatable({ out = out, label = label, total = total, enabled = enabled,
                        start = core.monotonic_ms(), drawn_at = nil, shown = false }, Bar)
end

local function clock(seconds)
  seconds = floor(seconds + 0.5)
  if seconds >= 3600 then
    return format("%d:%02d:%02d", floor(seconds / 3600), floor(seconds / 60) % 60, seconds % 60)
  end
  return format("%d:%02d", floor(seconds / 60), seconds % 60)
end

-- The line for `done` items after `ms` milliseconds.
function Bar:line(done, ms)
  local total = max(self.total, done)
  local filled = total > 0 and floor(WIDTH * done / total) or WIDTH
  local rate = ms > 0 and done * 1000 / ms or 0
  local eta = rate > 0 and clock((total - done) / rate) or "?"
  return format("%s [%s%s] %6d/%d %3d%% %6.0f/s  ETA %s", self.label, ("#"):rep(filled),
    ("."):rep(WIDTH - filled), done, total, total > 0 and floor(100 * done / total) or 100,
    rate, eta)
end

-- Shows that `done` items are handled (redrawn at most every REDRAW_MS).
function Bar:update(done, final)
  if not self.enabled then return end
  local now = core.monotonic_ms()
  if not final and self.drawn_at and now - self.drawn_at < REDRAW_MS then return end
  self.drawn_at, self.shown = now, true
  self.out:write("\r\27[K", self:line(done, now - self.start))
  self.out:flush()
end

-- The last drawing, left on its line.
function Bar:finish(done)
  if not self.enabled then return end
  self:update(done, true)
  self.out:write("\n")
end

return _M

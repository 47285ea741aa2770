-- A write of a module whose writes are issued from Lua (mongotx.queue,
-- mongotx.sync, mongotx.versioned), between its crash points: core.crash_point
-- "<module>.<step>" before and after (csrc/fault.c; the torture suite
-- crashes there), and its error named for the step.

local core = require "mongotx.core"
local errors = require "mongotx.errors"

local crash_point = core.crash_point

local _M = {}

-- Calls fn(...) between the points <module>.<step>; its result, or nil
-- and its error (with `step`).  The "after" point is passed only when the
-- write succeeded.
function _M.write(module, step, fn, ...)
  local point = module .. "." .. step
  crash_point(point, "before")
  local res, err = fn(...)
  if res == nil then return nil, errors.wrap(err, step) end
  crash_point(point, "after")
  return res
end

return _M

-- MONGOTX_TORTURE_FENCING=auto|deadline|version (environment, inherited
-- by every worker): every manager the suite makes fences that way unless
-- it names its own fencing, so that a section runs with version fencing
-- on a server that evaluates $$NOW (TESTING.md).  Required by run.lua and
-- worker.lua before their first connect.
local mongotx = require "mongotx"

local want = os.getenv("MONGOTX_TORTURE_FENCING")
if want == nil or want == "" then return {} end
assert(want == "auto" or want == "deadline" or want == "version",
  "MONGOTX_TORTURE_FENCING: auto, deadline or version")

local connect, patched = mongotx.connect, false
mongotx.connect = function(...)
  local db, err = connect(...)
  if db and not patched then
    patched = true
    local class = getmetatable(db).__index
    local manager = class.manager
    class.manager = function(self, opts, ...)
      local o = {}
      for k, v in pairs(opts or {}) do o[k] = v end
      if o.fencing == nil then o.fencing = want end
      return manager(self, o, ...)
    end
  end
  return db, err
end

return { fencing = want }

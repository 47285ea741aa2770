-- `--policy FILE.lua`: a Lua file returning a table of policy overrides,
-- the keys of mongotx.policy (stale_after, may_recover, stale_pending,
-- compensation, ...), given to the manager as an application would give
-- them to db:manager.  The file runs with the usual globals (it may
-- require modules), once, before the command connects, so a bad file
-- stops the command before anything is written.

local default_policy = require "mongotx.policy"
local options = require "mongotx.options"

local _M = {}

local names = {}
for k in pairs(default_policy) do names[k] = true end

-- pcall(fn, ...) with os.exit raising instead of exiting: a policy file,
-- or a policy it gave, that calls os.exit would end the command with an
-- exit code of its choosing (0 for a rollback that did not happen).
local function restore(exit, ...)
  os.exit = exit -- luacheck: ignore 122
  return ...
end

function _M.pcall_no_exit(fn, ...)
  local exit = os.exit
  os.exit = function() error("called os.exit", 2) end -- luacheck: ignore 122
  return restore(exit, pcall(fn, ...))
end

-- The overrides in `path` (a plain copy of the table's raw contents), or
-- nil and one message naming the file and what is wrong with it: it
-- cannot be read, does not compile, raises, does not return a table, or
-- holds an unknown key or a value db:manager would refuse.
function _M.load(path)
  local chunk, err = loadfile(path, "t")
  if not chunk then
    return nil, string.format("policy file %s: %s", path, err)
  end
  local ok, t = _M.pcall_no_exit(chunk)
  if not ok then
    return nil, string.format("policy file %s raised an error: %s", path, tostring(t))
  end
  if type(t) ~= "table" then
    return nil, string.format("policy file %s must return a table of policies, not %s",
      path, type(t))
  end
  local what = "policy file " .. path
  local checked, why
  ok, checked, why = pcall(options.check, t, names, what, 1)
  -- level 1: the raise names pcall, a C function, so it carries no position
  if not ok then return nil, tostring(checked) end
  if not checked then return nil, why.message end
  return checked
end

return _M

-- The version lives in csrc/mongotx.h (MONGOTX_VERSION); the rockspec's
-- file name and version field, the C module and the Lua module must agree.
local helpers = require "spec.helpers"

-- Rockspecs in the repository root (the specs run from there).
local function rockspecs()
  local found = {}
  local p = assert(io.popen("ls -1 mongotx-*.rockspec 2>/dev/null"))
  for name in p:lines() do found[#found + 1] = name end
  p:close()
  return found
end

-- Runs a rockspec (plain Lua assignments) in an empty environment.
local function load_rockspec(path)
  local env = {}
  local chunk, err
  if setfenv then -- LuaJIT / Lua 5.1
    chunk, err = loadfile(path)
    if chunk then setfenv(chunk, env) end
  else
    chunk, err = loadfile(path, "t", env)
  end
  assert(chunk, err)
  chunk()
  return env
end

describe("version", function()
  local core_version = helpers.core._VERSION

  it("of the C module is a semantic version", function()
    assert.is_string(core_version)
    assert.truthy(core_version:match("^%d+%.%d+%.%d+$"), core_version)
  end)

  it("is the rockspec's, in its file name and its version field", function()
    local files = rockspecs()
    assert.are.equal(1, #files, "expected one mongotx-*.rockspec, found: " ..
                     table.concat(files, ", "))
    local file = files[1]
    local name_version, name_rev = file:match("^mongotx%-(.-)%-(%d+)%.rockspec$")
    assert.are.equal(core_version, name_version, file)
    local spec = load_rockspec(file)
    assert.are.equal("mongotx", spec.package)
    assert.are.equal(name_version .. "-" .. name_rev, spec.version)
  end)

  it("is the Lua module's", function()
    local mongotx = require "mongotx"
    assert.are.equal(core_version, mongotx._VERSION)
  end)
end)

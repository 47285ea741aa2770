-- The version lives in one place, csrc/mongotx.h (MONGOTX_VERSION): the C
-- module's _VERSION is that macro and lua/mongotx/init.lua copies it.  The
-- rockspec (file name, version, source tag) and the README state it again.
-- Each is read here from its own file, so that changing one without the
-- others fails.
local helpers = require "spec.helpers"

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- The lines a shell command prints, sorted (the specs run from the root).
local function lines(cmd)
  local found = {}
  local p = assert(io.popen(cmd .. " 2>/dev/null"))
  for line in p:lines() do found[#found + 1] = line end
  p:close()
  table.sort(found)
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

-- The one rockspec in the root, its file name and its contents.
local function rockspec()
  local files = lines("ls -1 mongotx-*.rockspec")
  assert.are.equal(1, #files, "expected one mongotx-*.rockspec, found: " ..
                   table.concat(files, ", "))
  return files[1], load_rockspec(files[1])
end

-- The version as csrc/mongotx.h defines it (the source, not the build).
local function header_version()
  local h = read("csrc/mongotx.h")
  local versions = {}
  for v in h:gmatch('#define%s+MONGOTX_VERSION%s+"([^"]*)"') do
    versions[#versions + 1] = v
  end
  assert.are.equal(1, #versions, "expected one MONGOTX_VERSION in csrc/mongotx.h")
  return versions[1]
end

describe("version", function()
  local version = header_version()

  it("is a semantic version in csrc/mongotx.h", function()
    assert.truthy(version:match("^%d+%.%d+%.%d+$"), version)
  end)

  it("of the built C module is the header's", function()
    assert.are.equal(version, helpers.core._VERSION)
  end)

  it("of the Lua module is the header's", function()
    assert.are.equal(version, require("mongotx")._VERSION)
  end)

  it("is stated by no Lua module of its own", function()
    for _, path in ipairs(lines("find lua -name '*.lua'")) do
      assert.is_nil(read(path):match("%f[%w_]_VERSION%s*=%s*[\"'%[]"),
                    path .. " sets _VERSION to a literal (copy core._VERSION)")
    end
  end)

  it("is the rockspec's, in its file name, version field and source tag", function()
    local file, spec = rockspec()
    local name_version, name_rev = file:match("^mongotx%-(.-)%-(%d+)%.rockspec$")
    assert.are.equal(version, name_version, file)
    assert.are.equal("mongotx", spec.package)
    assert.are.equal(version .. "-" .. name_rev, spec.version)
    if spec.source and spec.source.tag then
      assert.are.equal("v" .. version, spec.source.tag)
    end
  end)

  it("is the one the documentation names the rockspec by", function()
    local file = rockspec()
    local named = 0
    for _, doc in ipairs(lines("ls -1 *.md */*.md")) do
      for mention in read(doc):gmatch("mongotx%-[%w%.]+%-%d+%.rockspec") do
        named = named + 1
        assert.are.equal(file, mention, doc .. " names another rockspec")
      end
    end
    assert.is_true(named > 0, "README.md no longer names the rockspec")
  end)
end)

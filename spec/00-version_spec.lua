-- The version lives in one place, csrc/mongotx.h (MONGOTX_VERSION): the C
-- module's _VERSION is that macro and lua/mongotx/init.lua copies it.  The
-- rockspec (file name, version, source tag) and the README state it again,
-- and the rockspec lists the sources a LuaRocks build compiles.  Each is
-- read here from its own file, so that changing one without the others, or
-- adding a source without the rockspec, fails.
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

-- "a, b" for a message; "(none)" for an empty list.
local function list(t)
  return #t > 0 and table.concat(t, ", ") or "(none)"
end

-- What is in `a` and not in `b` (both lists of strings).
local function minus(a, b)
  local seen, out = {}, {}
  for _, v in ipairs(b) do seen[v] = true end
  for _, v in ipairs(a) do
    if not seen[v] then out[#out + 1] = v end
  end
  table.sort(out)
  return out
end

-- Fails, naming what is missing on each side, unless the lists agree.
local function same_set(tree, declared, what)
  local missing, stale = minus(tree, declared), minus(declared, tree)
  assert(#missing == 0 and #stale == 0, string.format(
    "%s: in the tree but not in the rockspec: %s; in the rockspec but not " ..
    "in the tree: %s", what, list(missing), list(stale)))
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

describe("rockspec", function()
  local _, spec = rockspec()
  local lua_modules, c_modules = {}, {}
  for name, m in pairs(spec.build.modules) do
    if type(m) == "string" then
      lua_modules[#lua_modules + 1] = name .. " = " .. m
    else
      c_modules[#c_modules + 1] = { name = name, sources = m.sources }
    end
  end

  it("lists every Lua module of lua/mongotx and nothing else", function()
    local tree = {}
    for _, path in ipairs(lines("find lua/mongotx -name '*.lua'")) do
      local name = path:gsub("^lua/", ""):gsub("%.lua$", ""):gsub("/init$", "")
                       :gsub("/", ".")
      tree[#tree + 1] = name .. " = " .. path
    end
    assert.is_true(#tree > 0, "no lua/mongotx/*.lua found (run from the root)")
    same_set(tree, lua_modules, "Lua modules")
  end)

  it("builds mongotx.core from exactly csrc/*.c", function()
    assert.are.equal(1, #c_modules, "expected one C module")
    assert.are.equal("mongotx.core", c_modules[1].name)
    local tree = lines("ls -1 csrc/*.c")
    assert.is_true(#tree > 0, "no csrc/*.c found (run from the root)")
    same_set(tree, c_modules[1].sources, "sources of mongotx.core")
  end)
end)

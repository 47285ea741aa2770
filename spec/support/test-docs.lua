-- make test-docs: every Lua code block of README.md and docs/*.md runs
-- against the test server, and so does every script of examples/.
--
-- A block runs in a fresh Lua state after spec/support/docs-prelude.lua
-- (what a block may assume: the test server, db, tm).  Markers, an HTML
-- comment on the last non-blank line before the block's fence:
--   <!-- continues -->        the block runs after the previous block of
--                             the page, as one chunk (its locals are seen)
--   <!-- fragment: why -->    not runnable on its own (why says what it
--                             lacks): only its syntax is checked
--   <!-- standalone -->       a script as a reader saves and runs it: no
--                             prelude, plain `lua` with LUA_PATH and
--                             LUA_CPATH as README's install section sets
--                             them and MONGOTX_TEST_URI set (as for the
--                             examples); it names its own database
-- A block without a marker must run and must not raise.  Every relative
-- link of README.md, docs/, TESTING.md, ARCHITECTURE.md, bench/README.md
-- and bench/results.md must reach its file and, with a #fragment, a
-- heading there.
--
--   spec/support/with-server memory -- lua5.4 spec/support/test-docs.lua [FILE.md...]
-- Prints a line per block and script, then "N passed, N failed"; exit 1
-- when any failed.

local TIMEOUT = 120 -- seconds a block, a chain or a script may take
local LUA = os.getenv("LUA") or "lua5.4"
local LUAC = os.getenv("LUAC") or "luac5.4"

-- Examples that take arguments for a run of test-docs' size.
local EXAMPLE_ARGS = {
  ["examples/06-batch-job.lua"] = "--accounts 2000", -- 100 000 by default: a minute
}
-- Scripts that are not runnable here: checked for syntax only.
local EXAMPLE_FRAGMENTS = {
  ["examples/common.lua"] = "a module the examples require",
  ["examples/openresty/bank.lua"] = "handlers for nginx (make test-openresty runs them)",
}

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- What README's install section exports for a checkout (the build this
-- run uses: MONGOTX_CPATH, as for the examples).
local here = os.getenv("PWD")
local STANDALONE_PATH = shell_quote(here .. "/lua/?.lua;" .. here .. "/lua/?/init.lua;;")
local STANDALONE_CPATH = shell_quote((os.getenv("MONGOTX_CPATH") or here .. "/build/lua54/?.so") .. ";;")

local function lines_of(cmd)
  local p = assert(io.popen(cmd))
  local t = {}
  for l in p:lines() do t[#t + 1] = l end
  p:close()
  return t
end

-- The Lua blocks of one Markdown file: { file, line, text, marker, why }.
local function blocks_of(file)
  local out, inside, cur, last, n = {}, nil, nil, "", 0
  for l in io.lines(file) do
    n = n + 1
    if inside then -- "lua", or "other" for another language's block
      if l:match("^```%s*$") then
        if inside == "lua" then out[#out + 1] = cur end
        inside = nil
      elseif inside == "lua" then
        cur.text[#cur.text + 1] = l
      end
    elseif l:match("^```lua%s*$") then
      inside = "lua"
      cur = { file = file, line = n, text = {} }
      local why = last:match("^<!%-%- fragment: (.-) %-%->$")
      if why then cur.marker, cur.why = "fragment", why
      elseif last:match("^<!%-%- continues %-%->$") then cur.marker = "continues"
      elseif last:match("^<!%-%- standalone %-%->$") then cur.marker = "standalone" end
    elseif l:match("^```") then
      inside = "other"
    end
    if not l:match("^%s*$") then last = l end
  end
  return out
end

local tmp = os.tmpname()
os.remove(tmp)
os.execute("mkdir -p " .. tmp)
local passed, failed = 0, 0
local function report(ok, what, detail)
  if ok then passed = passed + 1 else failed = failed + 1 end
  print(("%-6s %s"):format(ok and "ok" or "FAILED", what))
  if not ok and detail and detail ~= "" then print((detail:gsub("\n*$", ""):gsub("\n", "\n       "))) end
end

-- Runs cmd with its output captured; true when it exits 0.
local function run(cmd)
  local out = tmp .. "/out"
  local ok = os.execute(("timeout %d %s >%s 2>&1"):format(TIMEOUT, cmd, out))
  local f = io.open(out)
  local text = f and f:read("a") or ""
  if f then f:close() end
  return ok, text
end

local function syntax(path)
  return run(LUAC .. " -p " .. shell_quote(path))
end

local files = { table.unpack(arg) }
if not arg[1] then
  files[1] = "README.md"
  for _, f in ipairs(lines_of("ls docs/*.md")) do files[#files + 1] = f end
end

local nblock = 0
for _, file in ipairs(files) do
  local chains = {}
  for _, b in ipairs(blocks_of(file)) do
    if b.marker == "continues" and chains[#chains] and chains[#chains][1].marker ~= "fragment" then
      table.insert(chains[#chains], b)
    else
      if b.marker == "continues" then
        report(false, ("%s:%d"):format(b.file, b.line), "<!-- continues --> with no runnable block before it")
      end
      chains[#chains + 1] = { b }
    end
  end
  for _, chain in ipairs(chains) do
    nblock = nblock + 1
    local path = ("%s/block%d.lua"):format(tmp, nblock)
    local f = assert(io.open(path, "w"))
    local where = {}
    for _, b in ipairs(chain) do
      f:write(("-- %s:%d\n"):format(b.file, b.line), table.concat(b.text, "\n"), "\n")
      where[#where + 1] = ("%s:%d"):format(b.file, b.line)
    end
    f:close()
    local name = table.concat(where, " + ")
    if chain[1].marker == "fragment" then
      local ok, out = syntax(path)
      report(ok, name .. " (fragment: " .. chain[1].why .. "; syntax only)", out)
    elseif chain[1].marker == "standalone" then
      local ok, out = run(("env LUA_PATH=%s LUA_CPATH=%s %s %s"):format(STANDALONE_PATH,
        STANDALONE_CPATH, LUA, shell_quote(path)))
      report(ok, name .. " (standalone)", ok and "" or out .. "\n(the script as run: " .. path .. ")")
    else
      local ok, out = run(("%s spec/support/docs-prelude.lua %s mtxdocs_%d"):format(LUA, shell_quote(path), nblock))
      report(ok, name, ok and "" or out .. "\n(the chunk as run: " .. path .. ")")
    end
  end
end

-- Links: every relative link of the documents resolves, to a file and,
-- with a #fragment, to a heading of that page (GitHub's anchors).
local function anchors(path)
  local set, inside = {}, false
  for l in io.lines(path) do
    if l:match("^```") then inside = not inside end
    local h = not inside and l:match("^#+ (.*)")
    if h then
      set[(h:gsub("[`*]", ""):gsub("^%s+", ""):gsub("%s+$", ""):lower():gsub("[^%w%- _]", ""):gsub(" ", "-"))] = true
    end
  end
  return set
end
local function exists(path)
  local f = io.open(path)
  if f then f:close() end
  return f ~= nil
end
local linked = { "TESTING.md", "ARCHITECTURE.md", "bench/README.md", "bench/results.md" }
for _, f in ipairs(files) do linked[#linked + 1] = f end
for _, file in ipairs(linked) do
  local f = assert(io.open(file))
  local text = f:read("a"):gsub("\n```.-\n```", "")
  f:close()
  local dir, broken = file:match("^(.*)/") or ".", {}
  for link in text:gmatch("%]%(([^)%s]+)%)") do
    if not link:match("^%a+:") then
      local path, frag = link:match("^([^#]*)#?(.*)$")
      local target = path == "" and file or dir .. "/" .. path
      if not exists(target) then
        broken[#broken + 1] = link .. " (no such file)"
      elseif frag ~= "" and target:match("%.md$") and not anchors(target)[frag] then
        broken[#broken + 1] = link .. " (no such heading)"
      end
    end
  end
  report(#broken == 0, file .. " (links)", table.concat(broken, "\n"))
end

if not arg[1] then
  local scripts = lines_of("ls examples/*.lua examples/openresty/*.lua")
  for _, s in ipairs(scripts) do
    if EXAMPLE_FRAGMENTS[s] then
      local ok, out = syntax(s)
      report(ok, s .. " (" .. EXAMPLE_FRAGMENTS[s] .. "; syntax only)", out)
    else
      local ok, out = run(("%s %s %s"):format(LUA, s, EXAMPLE_ARGS[s] or ""))
      report(ok, s, out)
    end
  end
end

print(("%d passed, %d failed"):format(passed, failed))
if failed == 0 then os.execute("rm -rf " .. tmp) end
os.exit(failed == 0 and 0 or 1)

-- Runs the `mongotx` command (bin/mongotx) as an operator does, for the
-- specs of the command: a child process against the test server, with
-- the interpreter that runs the specs (lua5.4 or luajit) and its build,
-- so that `make test` and `make test-luajit` each run the command under
-- their Lua.

local helpers = require "spec.helpers"
local server = require "spec.support.server"

local q = server.quote

local M = {}

M.LUA = jit and "luajit" or "lua5.4"
M.CORE = (jit and "build/luajit" or "build/lua54") .. "/mongotx/core.so"
-- why a case cannot run, or nil
M.no_build = not server.exists(M.CORE) and
  "bin/mongotx under " .. M.LUA .. " needs " .. M.CORE .. " (make)" or nil

-- The shell command that runs bin/mongotx with `args` (a list; the test
-- server's URI comes first unless opts.uri says otherwise, false for
-- none).
function M.command(args, opts)
  opts = opts or {}
  local words = {}
  local uri = opts.uri
  if uri == nil then uri = helpers.uri() end
  if uri then words[#words + 1] = "--uri " .. q(uri) end
  for _, a in ipairs(args) do words[#words + 1] = q(a) end
  return string.format("env -u MONGOTX_URI MONGOTX_CPATH=%s %s bin/mongotx %s",
    q(os.getenv("PWD") .. "/" .. M.CORE:gsub("mongotx/core%.so$", "?.so")), M.LUA,
    table.concat(words, " "))
end

-- stderr without libmongoc's own warnings (as "Falling back to malloc
-- for counters", when the machine has no shared memory to spare).
local function messages(e)
  return (e:gsub("[^\n]*WARNING: +mongoc:[^\n]*\n?", ""))
end

-- Runs it to its end: exit code, stdout, stderr (without libmongoc's
-- warnings).
function M.run(args, opts)
  local out, err = os.tmpname(), os.tmpname()
  local code = server.execute(M.command(args, opts) .. " >" .. out .. " 2>" .. err)
  local o, e = helpers.read_file(out), messages(helpers.read_file(err))
  os.remove(out)
  os.remove(err)
  return code, o, e
end

-- Starts it in the background: a handle with pid (the command's own
-- process, to signal) and wait(seconds) -> exit code, stdout, stderr as
-- run's (nil when it did not end in time).
function M.start(args, opts)
  local base = os.tmpname()
  local files = { pid = base .. ".pid", out = base .. ".out", err = base .. ".err",
                  rc = base .. ".rc" }
  os.remove(base)
  -- sh -c 'echo $$; exec ...': the pid is the command's, whose exit code
  -- the outer shell writes when it ends
  server.execute(string.format("( sh -c %s >%s 2>%s; echo $? >%s ) &",
    q("echo $$ >" .. files.pid .. "; exec " .. M.command(args, opts)), files.out, files.err,
    files.rc))
  assert(helpers.wait_file(files.pid, 10), "the command did not start")
  local pid
  for _ = 1, 100 do
    pid = tonumber(helpers.read_file(files.pid))
    if pid then break end
    require("mongotx").core.sleep(0.01)
  end
  local h = { pid = pid, files = files } -- files.err: its stderr so far
  function h.wait(seconds)
    if not helpers.wait_file(files.rc, seconds) then return nil end
    local code
    for _ = 1, 100 do
      code = tonumber(helpers.read_file(files.rc))
      if code then break end
      require("mongotx").core.sleep(0.01)
    end
    local o, e = helpers.read_file(files.out), messages(helpers.read_file(files.err))
    for _, f in pairs(files) do os.remove(f) end
    return code, o, e
  end
  return h
end

-- `mongotx list` run in this process (mongotx.cli.commands.list) with
-- options `o` on manager tm of database handle db, LIST_PAGE `page`
-- transactions a reply, its output in a file: asserts it ended with code
-- 0, and returns the commands it sent, the documents the server
-- returned, and its output.
function M.list_here(tm, db, o, page)
  local commands = require "mongotx.cli.commands"
  local output = require "mongotx.cli.output"
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  local was_file, was_page = output.stdout.file, commands.LIST_PAGE
  output.stdout.file, commands.LIST_PAGE = f, page
  db.client:reset_counters()
  local ok, code = pcall(commands.list, tm, o, function(c, m) error(tostring(m)) return c end)
  local cmds, read = db.client:counters().commands, db.client:returned()
  output.stdout.file, commands.LIST_PAGE = was_file, was_page
  f:close()
  local text = helpers.read_file(path)
  os.remove(path)
  assert(ok, code)
  assert(code == 0, "mongotx list ended with " .. tostring(code))
  return cmds, read, text
end

-- The last JSON line of a --json command's output, decoded (lua-cjson,
-- another implementation than the command's encoder).
function M.json_last(out)
  local last
  for line in out:gmatch("[^\n]+") do last = line end
  return require("cjson").decode(last)
end

return M

-- Child processes of the torture suite.  spec/helpers.lua's spawn_worker
-- cannot serve here: the suite needs the child's environment (crash
-- points), the interpreter's own pid (to kill -9 it, not a shell) and its
-- exit status (86 = injected crash, 128+n = signal n), so each child runs
-- under a small subshell that waits for it and writes the status to a file.
--
--   local proc = require "torture.proc"
--   local c = proc.spawn({ "crash", uri, db }, { MONGOTX_FAULT = "apply:after:1" })
--   c.pid, c.out                 -- the interpreter's pid, its output file
--   local rc = proc.wait(c, 30)  -- exit status, or nil after 30 s
--   proc.output(c), proc.cleanup(c)

local helpers = require "spec.helpers"
local server = require "spec.support.server"

local q = server.quote
local M = {}

M.FAULT_EXIT = 86 -- MTX_FAULT_EXIT in csrc/mongotx.h

local function read(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- Set while a section runs its children on FerretDB v1, where a manager
-- starts only when told it is the one writer (docs/servers.md): each
-- child there is, one at a time (the crash matrix, its recovery, the
-- one worker of the server faults).
M.single_writer = false

-- Starts `lua torture/worker.lua args...` with env added; returns a child
-- table { pid, out, rcfile }.
function M.spawn(args, env, script)
  local out = os.tmpname()
  local rcfile = out .. ".rc"
  os.remove(rcfile)
  local words = {}
  if M.single_writer then words[1] = "MONGOTX_SINGLE_WRITER=1" end
  for k, v in pairs(env or {}) do words[#words + 1] = k .. "=" .. q(v) end
  words[#words + 1] = helpers.lua()
  words[#words + 1] = q(script or "torture/worker.lua")
  for _, a in ipairs(args) do words[#words + 1] = q(a) end
  -- the subshell prints the interpreter's pid, then waits for it and
  -- records its status; its stdout goes away so the popen can close
  local cmd = ("( env %s > %s 2>&1 & p=$!; echo $p; exec > /dev/null 2>&1; wait $p; "
    .. "echo $? > %s.tmp && mv %s.tmp %s ) &")
    :format(table.concat(words, " "), q(out), q(rcfile), q(rcfile), q(rcfile))
  local p = assert(io.popen(cmd))
  local pid = tonumber(p:read("*l"))
  p:close()
  assert(pid, "could not start a child")
  return { pid = pid, out = out, rcfile = rcfile }
end

-- The child's exit status once it exited, else nil.
function M.status(c)
  local s = read(c.rcfile)
  return s and tonumber(s:match("%d+"))
end

-- Waits up to `seconds` for the child; returns its status, or nil (and
-- kills it with SIGKILL) when it hung.
function M.wait(c, seconds)
  local stop = helpers.core.monotonic_ms() + seconds * 1000
  repeat
    local rc = M.status(c)
    if rc then return rc end
    helpers.core.sleep(0.01)
  until helpers.core.monotonic_ms() > stop
  helpers.signal(c.pid, "CONT")
  helpers.signal(c.pid, "KILL")
  for _ = 1, 200 do
    if M.status(c) then break end
    helpers.core.sleep(0.01)
  end
  return nil
end

function M.output(c)
  return read(c.out) or ""
end

function M.cleanup(c)
  os.remove(c.out)
  os.remove(c.rcfile)
end

-- Recovery in a fresh process (worker.lua recover) over the databases
-- named; returns its exit status (nil when it hung) and its output.
function M.recover(uri, dbnames, direction, seconds)
  local list = os.tmpname()
  local f = assert(io.open(list, "w"))
  f:write(table.concat(dbnames, "\n"), "\n")
  f:close()
  local c = M.spawn({ "recover", uri, list, direction or "forward" })
  local rc = M.wait(c, seconds or 120)
  local out = M.output(c)
  M.cleanup(c)
  os.remove(list)
  return rc, out
end

-- What an exit status means: "ok", "injected" (the fault hook), "killed"
-- (SIGKILL, only ever sent by the suite), or "crash" (anything else: a Lua
-- error, another signal).
function M.classify(rc)
  if rc == 0 then return "ok" end
  if rc == M.FAULT_EXIT then return "injected" end
  if rc == 137 then return "killed" end
  return "crash"
end

return M

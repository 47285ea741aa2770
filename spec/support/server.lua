-- Starts and stops MongoDB-wire-compatible test servers on 127.0.0.1 for
-- mongotx's specs (DESIGN.md section 9).  Plain Lua (5.1/LuaJIT .. 5.4),
-- io and os only; needs a POSIX shell, bash, python3 (FerretDB's port) and
-- the artifacts that spec/support/setup.sh puts in the cache.
--
--   local server = require "spec.support.server"
--   local s = assert(server.start{ kind = "memory" })   -- or "h2", "ferretdb"
--   s.uri, s.port, s.pid, s.kind, s.version, s.dir, s.log
--   s:kill("KILL")   -- any kill(1) signal name: "STOP", "CONT", "TERM"...
--   s:restart()      -- same port, same data
--   s:stop()         -- graceful (SIGTERM), waits for the exit
--
-- start{} options:
--   kind        "memory" (default) | "h2" | "ferretdb"
--   dir         data directory for h2/ferretdb (created; default: a temporary
--               directory, removed by stop()); also holds the log and pid files
--   port        fixed port (default: a free one)
--   durability  h2 only: "commit" (default: the MVStore is committed before
--               each reply, so an acknowledged write survives kill -9),
--               "sync" (also fsync), "background" (H2's stock 1 s auto-commit)
--   log_level   server log level (default "warn")
--   timeout     seconds to wait for the server to accept connections (30)
--   uri_options extra URI options appended to s.uri ("a=1&b=2")
--
-- Each server's stdin is a pipe from this Lua process (io.popen(..., "w")):
-- when the Lua process exits or dies, the pipe closes and the server exits.
-- On failure start() returns nil and a message that includes the log's tail.

local M = {}

local CACHE = os.getenv("MONGOTX_CACHE") or ((os.getenv("HOME") or "/root") .. "/.cache/mongotx")
M.cache = CACHE

-- Timeouts in the URI: fail fast on a dead server instead of waiting for
-- libmongoc's 30 s default; the torture tests kill and restart servers.
M.default_uri_options = "serverSelectionTimeoutMS=5000&connectTimeoutMS=2000"

local function q(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end
M.quote = q

-- os.execute's exit code, the same under Lua 5.1/LuaJIT and 5.2+.
-- (128 + signal number when the shell was killed by a signal.)
local function execute(cmd)
  local a, how, code = os.execute(cmd)
  if type(a) == "number" then -- 5.1: raw wait status
    if a % 256 ~= 0 then return 128 + a % 256 end
    return math.floor(a / 256)
  end
  if how == "signal" then return 128 + code end
  return code or (a and 0 or 1)
end
M.execute = execute

local function capture(cmd)
  local f = assert(io.popen(cmd, "r"))
  local out = f:read("*a")
  f:close()
  return out
end
M.capture = capture

local function readfile(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end
M.readfile = readfile

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end
M.exists = exists

local function tail(path, n)
  local s = readfile(path)
  if not s or s == "" then return "(log empty: " .. path .. ")" end
  local lines = {}
  for line in s:gmatch("[^\n]*") do
    -- skip Java stack frames, keep the messages
    if not line:match("^%s+at ") and not line:match("^%s+%.%.%. %d+ more") then
      lines[#lines + 1] = line
    end
  end
  local first = math.max(1, #lines - (n or 20))
  return "log " .. path .. ":\n" .. table.concat(lines, "\n", first)
end

local function sleep(sec)
  execute("sleep " .. sec)
end
M.sleep = sleep

-- true while pid exists and is not a zombie
local function alive(pid)
  local stat = readfile("/proc/" .. pid .. "/stat")
  if not stat then return false end
  local state = stat:match("%) (%a)")
  return state ~= nil and state ~= "Z"
end
M.alive = alive

local function free_port()
  local out = capture("python3 -c 'import socket;s=socket.socket();"
    .. "s.bind((\"127.0.0.1\",0));print(s.getsockname()[1])' 2>/dev/null")
  return tonumber(out:match("%d+"))
end
M.free_port = free_port

-- shell code: wait until pid itself listens on 127.0.0.1:port (its fds
-- include the LISTEN socket of /proc/net/tcp), or exit 3 when pid dies
local function wait_port_script(pid, port, timeout)
  return ("for i in $(seq %d); do "
    .. "st=$(sed 's/.*) //;s/ .*//' /proc/%d/stat 2>/dev/null) || exit 3; "
    .. "[ \"$st\" = Z ] && exit 3; "
    .. "ino=$(awk '$2 == \"0100007F:%04X\" && $4 == \"0A\" {print $10}' /proc/net/tcp); "
    .. "for n in $ino; do ls -l /proc/%d/fd 2>/dev/null | grep -q \"socket:\\[$n\\]\" && exit 0; done; "
    .. "sleep 0.05; done; exit 4")
    :format(math.floor(timeout * 20), pid, port, pid)
end

local Server = {}
Server.__index = Server

local function java_command(self)
  local cp = readfile(CACHE .. "/server.classpath")
  if not cp or not exists(CACHE .. "/classes/MongoServerMain.class") then
    return nil, "mongo-java-server is not set up in " .. CACHE
      .. ": run spec/support/setup.sh java"
  end
  cp = cp:gsub("%s+$", "")
  local args = { "--port", self.port or 0 }
  if self.kind == "h2" then
    args[#args + 1] = "--durability"
    args[#args + 1] = self.durability
    args[#args + 1] = "h2"
    args[#args + 1] = self.dir .. "/mongo-java-server.mv.db"
  else
    args[#args + 1] = "memory"
  end
  for i = 1, #args do args[i] = q(args[i]) end
  local java = os.getenv("MONGOTX_JAVA") or "java"
  -- the heap: 1g holds what the specs and `make bench` store; a backlog of
  -- a million transactions (bench/scale.lua) needs more
  local heap = os.getenv("MONGOTX_SERVER_HEAP") or "1g"
  if not heap:match("^%d+[mg]$") then return nil, "MONGOTX_SERVER_HEAP: not a size like 4g: " .. heap end
  return ("echo $$ > %s; exec %s -XX:+UseSerialGC -Xmx" .. heap
    .. " -Dorg.slf4j.simpleLogger.defaultLogLevel=%s -cp %s MongoServerMain %s"
    .. " > %s 2>> %s")
    :format(q(self.pidfile), java, q(self.log_level), q(CACHE .. "/classes:" .. cp),
      table.concat(args, " "), q(self.outfile), q(self.log))
end

local function ferretdb_command(self)
  local bin = CACHE .. "/bin/ferretdb"
  if not exists(bin) then
    return nil, "FerretDB is not set up in " .. CACHE .. ": run spec/support/setup.sh ferretdb"
  end
  if not self.port then
    self.port = free_port()
    if not self.port then return nil, "cannot pick a free port (python3 missing?)" end
  end
  if not self.version then
    local v = capture(q(bin) .. " --version 2>/dev/null"):match("version: (v[%w%.%-]+)")
    self.version = "FerretDB " .. (v or "?")
  end
  execute("mkdir -p " .. q(self.dir .. "/sqlite"))
  -- FerretDB ignores its stdin: the wrapping shell reads the pipe and kills
  -- FerretDB at EOF (when this Lua process closes the pipe or dies).
  local cmd = ("%s --handler=sqlite --sqlite-url=%s --listen-addr=127.0.0.1:%d"
    .. " --state-dir=%s --telemetry=disable --debug-addr=- --log-level=%s")
    :format(q(bin), q("file:" .. self.dir .. "/sqlite/"), self.port, q(self.dir),
      q(self.log_level:upper()))
  return ("%s < /dev/null >> %s 2>&1 & echo $! > %s; cat > /dev/null; kill $! 2>/dev/null; wait")
    :format(cmd, q(self.log), q(self.pidfile))
end

-- wait for "PORT n" from MongoServerMain
local function wait_java(self)
  local script = ("for i in $(seq %d); do grep -q '^PORT ' %s 2>/dev/null && exit 0; "
    .. "[ -s %s ] || { sleep 0.05; continue; }; "
    .. "st=$(sed 's/.*) //;s/ .*//' /proc/$(cat %s)/stat 2>/dev/null) || exit 3; "
    .. "[ \"$st\" = Z ] && exit 3; sleep 0.05; done; exit 4")
    :format(math.floor(self.timeout * 20), q(self.outfile), q(self.pidfile), q(self.pidfile))
  local rc = execute("bash -c " .. q(script))
  if rc ~= 0 then
    return nil, rc == 3 and "exited" or "timed out"
  end
  local out = readfile(self.outfile) or ""
  self.port = tonumber(out:match("PORT (%d+)"))
  self.version = out:match("VERSION ([^\n]+)") or "mongo-java-server"
  return true
end

function Server:_launch()
  local cmd, err
  if self.kind == "ferretdb" then
    cmd, err = ferretdb_command(self)
  else
    cmd, err = java_command(self)
  end
  if not cmd then return nil, err end
  os.remove(self.pidfile)
  os.remove(self.outfile)
  local f = io.open(self.log, "ab")
  if f then
    f:write(("---- %s: starting %s\n"):format(os.date("!%Y-%m-%dT%H:%M:%SZ"), self.kind))
    f:close()
  end
  self.pipe = assert(io.popen(cmd, "w"))
  local ok, why
  if self.kind == "ferretdb" then
    -- the pid file is written at once by the wrapper
    for _ = 1, 100 do
      if (readfile(self.pidfile) or ""):match("%d+") then break end
      sleep(0.02)
    end
    self.pid = tonumber((readfile(self.pidfile) or ""):match("%d+"))
    if not self.pid then
      why = "no pid"
    else
      local rc = execute("bash -c " .. q(wait_port_script(self.pid, self.port, self.timeout)))
      ok, why = rc == 0, (rc == 3 and "exited" or "timed out")
    end
  else
    ok, why = wait_java(self)
    self.pid = tonumber((readfile(self.pidfile) or ""):match("%d+"))
  end
  if not ok then
    local msg = ("%s server %s while starting (port %s, dir %s)\n%s")
      :format(self.kind, why or "failed", tostring(self.port or "auto"), self.dir, tail(self.log))
    self:_reap(true)
    return nil, msg
  end
  local opts = M.default_uri_options
  if self.uri_options and self.uri_options ~= "" then
    opts = opts .. "&" .. self.uri_options
  end
  self.uri = ("mongodb://127.0.0.1:%d/?%s"):format(self.port, opts)
  return self
end

-- stop the process (TERM, then KILL after `grace` s) and close the pipe
function Server:_reap(force, grace)
  local pid = self.pid
  if pid and alive(pid) then
    execute(("kill -%s %d 2>/dev/null; kill -CONT %d 2>/dev/null")
      :format(force and "KILL" or "TERM", pid, pid))
    local script = ("for i in $(seq %d); do "
      .. "st=$(sed 's/.*) //;s/ .*//' /proc/%d/stat 2>/dev/null) || exit 0; "
      .. "[ \"$st\" = Z ] && exit 0; sleep 0.05; done; kill -KILL %d 2>/dev/null; exit 1")
      :format(math.floor((grace or 10) * 20), pid, pid)
    execute("bash -c " .. q(script))
  end
  if self.pipe then
    self.pipe:close() -- EOF for the server or its wrapper; reaps the shell
    self.pipe = nil
  end
end

function Server:stop()
  self:_reap(false)
  self.stopped = true
  if self.tmpdir and not self.keep then
    execute("rm -rf " .. q(self.tmpdir))
  end
  return true
end

function Server:kill(sig)
  sig = tostring(sig or "KILL"):gsub("^SIG", "")
  assert(self.pid, "server not running")
  return execute(("kill -%s %d"):format(sig, self.pid)) == 0
end

function Server:alive()
  return self.pid ~= nil and alive(self.pid)
end

function Server:restart()
  self:_reap(false)
  self.pid = nil
  return self:_launch()
end

function M.start(opts)
  opts = opts or {}
  local kind = opts.kind or "memory"
  if kind ~= "memory" and kind ~= "h2" and kind ~= "ferretdb" then
    return nil, "unknown server kind '" .. tostring(kind) .. "' (memory|h2|ferretdb)"
  end
  local self = setmetatable({
    kind = kind,
    port = opts.port,
    durability = opts.durability or "commit",
    log_level = opts.log_level or "warn",
    timeout = opts.timeout or 30,
    uri_options = opts.uri_options,
    keep = opts.keep,
  }, Server)
  if opts.dir then
    self.dir = opts.dir
    if execute("mkdir -p " .. q(self.dir)) ~= 0 then
      return nil, "cannot create " .. self.dir
    end
  else
    local d = capture("mktemp -d \"${TMPDIR:-/tmp}/mongotx-" .. kind .. ".XXXXXX\""):gsub("%s+$", "")
    if d == "" then return nil, "mktemp -d failed" end
    self.dir, self.tmpdir = d, d
  end
  local name = kind == "ferretdb" and "ferretdb" or "mongo-java-server"
  self.log = self.dir .. "/" .. name .. ".log"
  self.pidfile = self.dir .. "/" .. name .. ".pid"
  self.outfile = self.dir .. "/" .. name .. ".out"
  local ok, err = self:_launch()
  if not ok then
    if self.tmpdir and not self.keep then execute("rm -rf " .. q(self.tmpdir)) end
    return nil, err
  end
  return self
end

return M

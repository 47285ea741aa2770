-- bench/servercpu.lua: the CPU time the test server (or any process:
-- of(pid)) spends, read from /proc/<pid>/stat (user + system, all its
-- threads: the JVM's request threads, its collector and compiler), so that the table can show what a
-- transfer costs the server beside what it costs the client.  Client and
-- server share this machine's cores, and on loopback the server's work
-- per document written, not the round trips, bounds every mode.
--
-- The pid comes from MONGOTX_TEST_SERVER_PID (spec/support/with-server
-- sets it); against another server (MONGOTX_TEST_URI given) there is none
-- and read() returns nil, so the column stays empty.

local _M = {}

local pid = tonumber(os.getenv("MONGOTX_TEST_SERVER_PID") or "")

local function ticks_per_second()
  local f = io.popen("getconf CLK_TCK 2>/dev/null")
  local n = f and tonumber(f:read("*l") or "")
  if f then f:close() end
  return n or 100
end
local HZ -- clock ticks a second, read at the first use

-- Seconds of CPU process `p` (all its threads) has used so far, or nil
-- when unknown.
function _M.of(p)
  local f = io.open("/proc/" .. p .. "/stat")
  if not f then return nil end
  local stat = f:read("*a")
  f:close()
  -- fields after the command name, which is in parentheses and may hold
  -- spaces: state is field 3, utime 14, stime 15
  local rest = stat:match("%) (.*)$")
  if not rest then return nil end
  local fields = {}
  for w in rest:gmatch("%S+") do fields[#fields + 1] = w end
  local utime, stime = tonumber(fields[12]), tonumber(fields[13])
  if not (utime and stime) then return nil end
  HZ = HZ or ticks_per_second()
  return (utime + stime) / HZ
end

-- Seconds of CPU the server has used so far, or nil when unknown.
function _M.read()
  return pid and _M.of(pid)
end

-- The seconds used since `since` (a read()), or nil.
function _M.since(since)
  local now = _M.read()
  return since and now and now - since
end

return _M

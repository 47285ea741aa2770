-- Implementation of spec/support/with-server (see there).
local root = (arg[0]:match("^(.*)/spec/support/[^/]*$") or ".")
package.path = root .. "/?.lua;" .. package.path
local server = require "spec.support.server"

local function usage(msg)
  io.stderr:write("with-server: ", msg, "\n",
    "usage: spec/support/with-server <memory|h2|ferretdb> [--] cmd args...\n")
  os.exit(2)
end

local kind = arg[1]
if not kind then usage("missing server kind") end
local first = 2
if arg[2] == "--" then first = 3 end
if not arg[first] then usage("missing command") end
local words = {}
for i = first, #arg do words[#words + 1] = server.quote(arg[i]) end
-- libmongoc keeps its counters in /dev/shm/mongoc-<pid>, which a process
-- killed with SIGKILL (as many specs do) leaves behind; a later process
-- given that pid then prints "Falling back to malloc for counters".  The
-- specs read no such counters: they are kept in memory.
local cmd = "MONGOC_DISABLE_SHM=1 " .. table.concat(words, " ")

if os.getenv("MONGOTX_TEST_URI") and os.getenv("MONGOTX_TEST_URI") ~= "" then
  local env = os.getenv("MONGOTX_TEST_SERVER") and "" or "MONGOTX_TEST_SERVER=external "
  os.exit(server.execute(env .. cmd))
end

local s, err = server.start{ kind = kind }
if not s then
  io.stderr:write("with-server: ", err, "\n")
  os.exit(1)
end
io.stderr:write(("with-server: %s on %s (pid %d, log %s)\n"):format(s.version, s.uri, s.pid, s.log))
-- FerretDB v1 loses money under two writers, so a manager refuses it
-- unless told there is one (docs/servers.md): the specs that run there
-- have one writer, those that need more skip there (helpers.no_concurrency)
local single = kind == "ferretdb" and "MONGOTX_SINGLE_WRITER=1 " or ""
local rc = server.execute(("%sMONGOTX_TEST_URI=%s MONGOTX_TEST_SERVER=%s MONGOTX_TEST_SERVER_LOG=%s"
  .. " MONGOTX_TEST_SERVER_PID=%d %s")
  :format(single, server.quote(s.uri), server.quote(kind), server.quote(s.log), s.pid, cmd))
s:stop()
os.exit(rc)

-- The end of a process that used the process-wide pools (csrc/client.c,
-- csrc/core.c).  lua_close unloads the C modules the state loaded, but a
-- pool's monitoring threads outlive the state: unless the module is
-- pinned they wake from their heartbeat wait in unmapped code and the
-- process dies with SIGSEGV after its last Lua line, losing what stdio
-- still held (a busted run that passed every spec, then crashed before its
-- summary).  The window between lua_close and the end of the process is
-- short, so each child here makes it long and certain: it fills its
-- stdout pipe (64 KiB, Linux's default) and leaves its last line in
-- stdio's buffer, which exit() flushes only once the reader drains the
-- pipe, 1.5 s later; with heartbeatFrequencyMS=500 (libmongoc's least)
-- the pool's thread wakes at least twice meanwhile.
local helpers = require "spec.helpers"

local CHILD = [[
package.cpath = %q .. ";" .. package.cpath
local core = require "mongotx.core"
local uri, db, id, how = ...
local client = assert(core.connect(uri, { pool = true }))
assert(client:collection(db, "exits"):insert_one({ _id = id, how = how }))
if how == "closed" then client:close() end
io.stdout:write(string.rep("x", 65536)) -- fills the pipe
io.stdout:write("\nthe end\n")          -- held by stdio until exit()
-- "open" exits without closing the state: the client is still out
os.exit(0, how ~= "open")
]]

-- The test server's URI, with the heartbeat as often as libmongoc allows
-- (options after a `/`: libmongoc refuses mongodb://host:port?options).
local function uri_with_heartbeat()
  local uri = helpers.uri()
  if uri:find("?", 1, true) then return uri .. "&heartbeatFrequencyMS=500" end
  if not uri:find("^mongodb[^:]*://[^/]*/") then uri = uri .. "/" end
  return uri .. "?heartbeatFrequencyMS=500"
end

-- Runs the child with a reader that waits 1.5 s before draining its
-- stdout; returns the child's exit status (128 + signal when killed) and
-- the last line it printed.
local function run_child(db, id, how)
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write(CHILD:format(os.getenv("MONGOTX_CPATH") or "./build/lua54/?.so"))
  f:close()
  local status, out = os.tmpname(), os.tmpname()
  local cmd = string.format("{ %s %s '%s' %s %s %s 2>/dev/null; echo $? > %s; } | { sleep 1.5; cat > %s; }",
    helpers.lua(), script, uri_with_heartbeat(), db, id, how, status, out)
  require("spec.support.server").execute(cmd)
  local code = tonumber(helpers.read_file(status):match("%d+"))
  local last = helpers.read_file(out):match("\n([^\n]*)\n$") -- (anchored on a newline: linear)
  os.remove(script)
  os.remove(status)
  os.remove(out)
  return code, last
end

describe("#server a process with a pool", function()
  local db, coll

  before_each(function()
    db = helpers.db_name()
    coll = helpers.client():collection(db, "exits")
  end)

  -- Each case asserts the child's write reached the database, so a child
  -- that failed before its exit cannot pass for one that exited cleanly.
  for _, case in ipairs {
    { how = "closed", what = "closes its Lua state (all clients back) and exits cleanly" },
    { how = "collected",
      what = "closes its Lua state with a client not closed (its __gc gives it back) and exits cleanly" },
    { how = "open", what = "exits without closing its Lua state, a client still out, and exits cleanly" },
  } do
    it(case.what, function()
      local code, last = run_child(db, "exit-" .. case.how, case.how)
      assert.are.equal(0, code) -- 139 (SIGSEGV) with neither the pin nor the exit handler
      assert.are.equal("the end", last)
      assert.are.same({ { _id = "exit-" .. case.how, how = case.how } }, helpers.dump(coll))
    end)
  end
end)

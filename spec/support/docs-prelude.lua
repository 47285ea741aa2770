-- What every Lua block of README.md and docs/ may assume (make test-docs,
-- spec/support/test-docs.lua runs each block, or chain of blocks marked
-- <!-- continues -->, through this file in a fresh Lua 5.4 state):
--
--   * package.path and package.cpath find the checkout's lua/ and core.so;
--   * mongotx.connect(uri, opts) connects to the test server
--     ($MONGOTX_TEST_URI) whatever uri says, and to a database of the
--     block's own whatever opts.database says, so that the blocks can show
--     real URIs and names;
--   * globals: mongotx (require "mongotx"), db (that database) and tm (a
--     manager on it, application "docs"), for blocks that show one call.
--
--   lua5.4 spec/support/docs-prelude.lua BLOCK.lua DATABASE
-- The database is dropped afterwards.  Exits 1 when the block raises.

-- luacheck: globals mongotx db tm (what the blocks may use)
package.path = "./lua/?.lua;./lua/?/init.lua;" .. package.path
package.cpath = (os.getenv("MONGOTX_CPATH") or "./build/lua54/?.so") .. ";" .. package.cpath

local block, database = arg[1], arg[2]
local uri = assert(os.getenv("MONGOTX_TEST_URI"), "MONGOTX_TEST_URI is not set: run under spec/support/with-server")

mongotx = require "mongotx"
local connect = mongotx.connect
function mongotx.connect(_, opts) -- luacheck: ignore 122 (the documented redirect)
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  o.database = database
  return connect(uri, o)
end

db = assert(mongotx.connect(uri))
tm = assert(db:manager{ application = "docs" })

local chunk, err = loadfile(block)
local ok
if chunk then ok, err = xpcall(chunk, debug.traceback) end
local dropped, derr = db.client:command(database, mongotx.doc("dropDatabase", 1))
if not dropped then io.stderr:write("docs-prelude: cannot drop ", database, ": ", tostring(derr), "\n") end
if not chunk or not ok then
  io.stderr:write(tostring(err), "\n")
  os.exit(1)
end

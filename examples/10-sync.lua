-- Sync flags (mongotx.sync): renaming a user rewrites the name in all
-- their comments without a transaction.  The rename and the flag are one
-- write; the comments follow; the flag is cleared.  A crash between the
-- steps leaves the flag, and the sweeper (sync:repair) finishes the job.
--
--   lua5.4 examples/10-sync.lua
--
-- The propagation is idempotent (it sets the name, it never appends) and
-- monotone (a comment only takes a name with a newer userSeq than the one
-- it holds), so running it twice, or late, is harmless.
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (default ./build/lua54/?.so); MONGOTX_TEST_URI is the server
-- (default mongodb://127.0.0.1:27017).  Uses the database mongotx_demo
-- and drops its users and comments collections first.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local show, heading = common.show, common.heading

local db = common.connect()
local users, comments = db:collection("users"), db:collection("comments")

local function propagate(user)
  local filter = { author = user._id }
  if user.syncSeq then -- none yet: a flag set without sync:change
    filter.authorSeq = { ["$not"] = { ["$gte"] = user.syncSeq } }
  end
  local ok, err = comments:update_many(filter,
    { ["$set"] = { authorName = user.name, authorSeq = user.syncSeq } })
  if not ok then return nil, tostring(err) end
  return true
end

local sync = assert(db:sync { collection = "users", propagate = propagate })

-- The child: renames ada and crashes right after the rename's write,
-- before the comments were touched (MONGOTX_FAULT, as a kill -9 would).
if arg[1] == "--crash" then
  sync:change("ada", { ["$set"] = { name = "Ada King" } })
  os.exit(0) -- not reached
end

local function dump(title)
  print(title)
  for _, d in ipairs(assert(users:find_all({}, { sort = { _id = 1 } }))) do
    print("  user    " .. show(d))
  end
  for _, d in ipairs(assert(comments:find_all({}, { sort = { _id = 1 } }))) do
    print("  comment " .. show(d))
  end
end

common.fresh(db, "users", "comments")
assert(users:insert_many { { _id = "ada", name = "Ada" }, { _id = "bob", name = "Bob" } })
assert(comments:insert_many {
  { _id = 1, author = "ada", authorName = "Ada", text = "first!" },
  { _id = 2, author = "bob", authorName = "Bob", text = "hello" },
  { _id = 3, author = "ada", authorName = "Ada", text = "again" },
})

heading("rename bob: the flag is set and cleared, the comments follow")
assert(sync:change("bob", { ["$set"] = { name = "Robert" } }))
dump("after sync:change")

heading("rename ada in a process that crashes between the rename and the comments")
local cmd = ("MONGOTX_FAULT=sync.change:after:1 %s examples/10-sync.lua --crash 2>/dev/null")
  :format(os.getenv("MONGOTX_LUA") or "lua5.4")
os.execute(cmd)
dump("after the crash: ada renamed and flagged (syncing), her comments still say Ada")

heading("the sweeper: sync:repair{ older_than = 0 } (a real one waits a minute or so)")
local report = assert(sync:repair { older_than = 0 })
print(("  repaired %d, failed %d, parked %d"):format(report.repaired, #report.failed,
  report.parked))
dump("after repair")

-- Versioned structures (mongotx.versioned): a folder tree edited by two
-- writers at once.  Each writer inserts new versions of the nodes it
-- changes and publishes them all with one write to the root; readers see
-- the tree as of the root's published version, so a half-written change
-- never shows, and of two writers that started from the same version one
-- publishes and the other gets `conflict` and starts again.
--
--   lua5.4 examples/09-versioned.lua
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (default ./build/lua54/?.so); MONGOTX_TEST_URI is the server
-- (default mongodb://127.0.0.1:27017).  Uses the database mongotx_demo
-- and drops its trees and nodes collections first.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local heading = common.heading

local db = common.connect()
common.fresh(db, "trees", "nodes")
local trees = assert(db:versioned { roots = "trees", items = "nodes" })

-- Prints the tree as readers see it: each node under its parent.
local function show_tree(title)
  local tree = assert(trees:read("home"))
  local children = {}
  for _, it in ipairs(tree.items) do
    local parent = it.doc.parent or ""
    children[parent] = children[parent] or {}
    table.insert(children[parent], it)
  end
  print(("%s (version %d)"):format(title, tree.version))
  local function walk(id, depth)
    for _, it in ipairs(children[id] or {}) do
      print(("  %s%s%s"):format(string.rep("  ", depth), it.doc.name,
        children[it.id] and "/" or ""))
      walk(it.id, depth + 1)
    end
  end
  walk("", 0)
end

heading("the first version: one write per node, then publish")
local w = assert(trees:begin("home"))
assert(w:put("docs", { name = "docs" }))
assert(w:put("src", { name = "src" }))
assert(w:put("readme", { name = "README", parent = "docs" }))
assert(w:put("main", { name = "main.lua", parent = "src" }))
assert(w:put("notes", { name = "notes.txt" }))
assert(w:publish())
show_tree("published")

heading("two writers start from the same version")
local alice, bob = assert(trees:begin("home")), assert(trees:begin("home"))
print(("  alice writes version %d, bob version %d, both from %d"):format(alice.version,
  bob.version, alice.base))
-- alice moves notes.txt into docs/ and renames src/ to lib/
assert(alice:put("notes", { name = "notes.txt", parent = "docs" }))
show_tree("alice has written one node: readers still see")
assert(alice:put("src", { name = "lib" }))
-- bob deletes README (a tombstone) and adds a file
assert(bob:delete("readme"))
assert(bob:put("todo", { name = "TODO", parent = "docs" }))

heading("alice publishes first; bob's publish is refused")
assert(alice:publish())
local ok, err = bob:publish()
print("  bob:publish() -> " .. tostring(ok) .. ", " .. tostring(err))
show_tree("published")

heading("bob starts again from alice's version and publishes")
bob = assert(trees:begin("home"))
assert(bob:delete("readme"))
assert(bob:put("todo", { name = "TODO", parent = "docs" }))
assert(bob:publish())
show_tree("published")

heading("gc: nothing left to remove (bob's first try was discarded when it lost)")
local report = assert(trees:gc { older_than = 0 })
print(("  aborted %d, removed %d"):format(report.aborted, report.removed))

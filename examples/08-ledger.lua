-- A ledger (mongotx.ledger): each transfer is ONE inserted entry with a
-- per-account sequence number; balances are the cached balance plus the
-- entries after it; a committer caches balances; a mistake is undone by a
-- counter-transfer.  Run it with `make demo`'s server, or:
--   spec/support/with-server memory -- lua5.4 examples/08-ledger.lua
local common = dofile("examples/common.lua")
local show, heading = common.show, common.heading

local db = common.connect()
db:collection("ledger"):drop()
db:collection("ledger_accounts"):drop()
local L = assert(db:ledger {})

heading("opening balances: one entry with two changes")
assert(L:post({ { account = "A", value = 1000 }, { account = "B", value = 1000 } }))

heading("A -> B 100, with the floor min = 0: one insert")
local t = assert(L:transfer("A", "B", 100, { min = 0 }))
print(show(db:collection("ledger"):find_one({ _id = t._id })))
print("A:", L:balance("A"), "B:", L:balance("B"))

heading("A -> B 5000 is refused at the balance of the seqId it would take")
local ok, err = L:transfer("A", "B", 5000, { min = 0 })
print(ok, tostring(err))

heading("the committer caches balances (cacheBal) and marks entries COMMITTED")
print(show(assert(L:commit())))
print(show(db:collection("ledger"):find_one({ _id = t._id })))
print(show(db:collection("ledger_accounts"):find_one({ _id = "A" })))

heading("undo by a counter-transfer, never by deleting")
local r = assert(L:reverse(t._id))
print(show(db:collection("ledger"):find_one({ _id = r._id })))
assert(L:commit())
print("A:", L:balance("A"), "B:", L:balance("B"))

heading("replay from the first entry: equals the cache")
print(show(assert(L:reconcile("A"))))
db:close()

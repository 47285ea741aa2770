-- A job queue instead of a transaction (seed 002's second pattern): A and
-- B become friends, each must be on the other's list, and it does not
-- matter that the two writes are not simultaneous, only that both happen.
-- One job carries the work; a worker claims it (findAndModify, with a
-- lease by the server's clock), applies both writes idempotently
-- ($addToSet: running the job twice has the effect of running it once)
-- and marks it done.  A worker that dies leaves its job running until its
-- lease expires; requeue_stale() then gives it to another worker.
--
--   MONGOTX_TEST_URI=mongodb://host:27017 lua5.4 examples/07-queue.lua
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (default ./build/lua54/?.so).  Uses the database mongotx_demo and
-- drops its users and jobs collections first.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local show, heading = common.show, common.heading
local core = common.mongotx.core

local db = common.connect()
common.fresh(db, "users", "jobs")
local users = db:collection("users")
assert(users:insert_many { { _id = "A", friends = common.mongotx.array() },
                           { _id = "B", friends = common.mongotx.array() } })
local q = assert(db:queue { collection = "jobs", lease = 1 })

-- The handler: two idempotent writes.  $addToSet adds a friend only if he
-- is not there, so a second run (the job retaken after a crash between
-- the writes, or after a stalled worker's lease ran out) changes nothing.
local function befriend(job)
  local a, b = job.details.a, job.details.b
  for _, pair in ipairs { { a, b }, { b, a } } do
    local res, err = users:update_one({ _id = pair[1] }, { ["$addToSet"] = { friends = pair[2] } })
    if not res then return nil, err end
  end
  return { friends = true }
end

heading("push: one job; pushing the same id again is the same job")
print(show(assert(q:push("befriend", { a = "A", b = "B" }, { id = "A+B" }))))
assert(q:push("befriend", { a = "A", b = "B" }, { id = "A+B" }))
print("jobs:", q.jobs:count({}))

heading("a worker claims it and dies after the first write (its lease is 1 s)")
local job = assert(q:claim("worker-1"))
print(show(job))
assert(users:update_one({ _id = "A" }, { ["$addToSet"] = { friends = "B" } }))
print(show(assert(users:find_one({ _id = "A" }))), show(assert(users:find_one({ _id = "B" }))))

heading("after the lease, another worker's loop requeues it and runs it from the start")
core.sleep(1.2)
local stats = assert(q:work({ befriend = befriend }, { worker = "worker-2", idle = 0 }))
print(show(stats))
print(show(assert(users:find_one({ _id = "A" }))), show(assert(users:find_one({ _id = "B" }))))
print(show(assert(q:get("A+B"))))

heading("worker-1 comes back and says done: refused, it no longer holds the job")
local ok, err = q:done(job)
print(ok, err and err.code, err)

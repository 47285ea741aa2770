-- The child processes of torture/queue.lua (started by torture/proc.lua):
--
--   queue_worker.lua scenario <uri> <db>   the crash-matrix scenario
--       (MONGOTX_FAULT in the environment makes it crash at a point)
--   queue_worker.lua finish <uri> <db>     push the scenario's jobs again,
--       wait out the leases and work until the queue is empty
--   queue_worker.lua work <uri> <db> <name> <stop-file>   a worker loop
--       (jobs taking a few ms) until the stop file exists, then until the
--       queue is drained;
--       prints "fenced <n>" (its done or fail calls refused) at the end
--
-- Output is one line per fact, flushed at once.

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local tq = require "torture.queue"
local exists = require("spec.support.server").exists

local mode, uri, name = arg[1], arg[2], arg[3]
local q, targets = tq.open(uri, name)

if mode == "scenario" then
  tq.prepare(targets)
  tq.scenario(q, targets)
elseif mode == "finish" then
  tq.finish(q, targets)
elseif mode == "work" then
  local worker, stop_file = arg[4], arg[5]
  -- a job takes a few ms before and after its effect, so that workers
  -- are stopped or killed while holding jobs, on either side of it
  local effect = tq.effect(targets)
  local sleep = require("mongotx").core.sleep
  local handlers = { effect = function(job)
    sleep(math.random() * 0.03)
    local res, err = effect(job)
    sleep(math.random() * 0.03)
    return res, err
  end }
  local busy = assert(q:work(handlers, { worker = worker, idle = 1e6, poll = 0.05,
    stop = function() return exists(stop_file) end }))
  local drain = assert(q:work(handlers, { worker = worker, idle = tq.LEASE + 1, poll = 0.1 }))
  io.stdout:write(("fenced %d\n"):format(busy.fenced + drain.fenced))
else
  error("usage: queue_worker.lua scenario|finish|work <uri> <db> ...")
end

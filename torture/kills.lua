-- Section 2, random kills: 6 workers run the random workload
-- (torture/workload.lua: guarded transfers, batches, rollbacks,
-- compensations on 20 accounts with a floor, 3 of them hot) while the
-- driver, at random moments, kill -9s a random worker and starts a new one
-- or (one time in four) stops one with SIGSTOP past its 1 s lease and
-- continues it; at the end one recovery pass in a fresh process, then the
-- invariants and the audit of torture/check.lua (each transaction a
-- caller was told is done is done, and its effect is there exactly once),
-- and the floor observer's sightings (torture/observer.lua: a balance
-- below its floor at any moment of the run).
-- mongo-java-server only (see torture/run.lua).

local fleet = require "torture.fleet"
local helpers = require "spec.helpers"
local core = require "mongotx.core"

local M = {}

M.WORKERS = 6
M.ACCOUNTS = 20

local function run(ctx, name, seconds, mixed)
  local f = fleet.new(ctx.uri, name, { accounts = M.ACCOUNTS, tokens = 300 }, mixed)
  for _ = 1, ctx.workers or M.WORKERS do f:spawn() end
  local stop = core.monotonic_ms() + seconds * 1000
  local stops = 0
  while core.monotonic_ms() < stop do
    core.sleep(0.1 + math.random() * 0.9)
    local w = f:pick()
    if math.random(4) == 1 then
      helpers.signal(w.pid, "STOP")
      core.sleep(1.1 + math.random() * 0.9)
      helpers.signal(w.pid, "CONT")
      stops = stops + 1
    else
      f:kill(w)
      f:spawn()
    end
  end
  local r = f:finish()
  r.notes = ("%d s, %d stops; %s"):format(seconds, stops, r.notes)
  ctx.say("  %s: %s", name, r.notes)
  return r
end

function M.run(ctx)
  return run(ctx, "kills", ctx.seconds or (ctx.full and 300 or 45))
end

-- Section "mixed" (issue 27): the same with managers configured
-- differently on the same documents (torture/fleet.lua, mixed): one
-- worker in three runs in the other transactions collection under the
-- ids of the worker started before it, one in three with the other
-- marker and version field; each recovers what its configuration sees.
function M.mixed(ctx)
  return run(ctx, "mixed", ctx.seconds or (ctx.full and 120 or 30), true)
end

return M

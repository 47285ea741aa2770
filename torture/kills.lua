-- Section 2, random kills: 8 workers run random transfers and
-- multi-collection transactions on a few hot accounts (torture/workload.lua)
-- while the driver kill -9s a random worker at a random moment and starts
-- a new one; at the end one recovery pass in a fresh process, then the
-- invariants and the audit of torture/check.lua (each transaction a
-- caller was told is done is done, and its effect is there exactly once).
-- mongo-java-server only (see torture/run.lua).

local fleet = require "torture.fleet"
local core = require "mongotx.core"

local M = {}

local WORKERS = 8

function M.run(ctx)
  local seconds = ctx.full and 300 or 45
  local f = fleet.new(ctx.uri, "kills", { accounts = 5, tokens = 300 })
  for _ = 1, WORKERS do f:spawn() end
  local stop = core.monotonic_ms() + seconds * 1000
  while core.monotonic_ms() < stop do
    core.sleep(0.1 + math.random() * 0.9)
    f:kill(f:pick())
    f:spawn()
  end
  local r = f:finish()
  ctx.say("  kills: %s", r.notes)
  return r
end

return M

-- mongotx.manager.counts: what a manager's transactions collection holds,
-- counted: stats (by state, and the parked ones) and backlog (what
-- recovery has before it), as functions taking the manager, which
-- mongotx.manager makes its methods; and the states they count.

--- The manager's counts (its methods `tm:stats` and `tm:backlog`).
-- @submodule mongotx.manager

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local OWN = require("mongotx.stored").OWN
local holds = require "mongotx.holds"

local ipairs = ipairs
local format = string.format

local _M = {}

local STATES = { "initial", "pending", "applied", "done", "canceling", "cancelled" }
local ACTIVE = { ["$in"] = { "initial", "pending", "applied", "canceling" } }
_M.ACTIVE = ACTIVE

-- How many (state, parked) groups tm:stats() reads in its one reply: the
-- engine writes `parked = true` or nothing, so there are up to 12; more
-- means the documents were written by something else.
local STATS_GROUPS = 1000
local OPEN = { initial = true, pending = true, applied = true, canceling = true }

-- Counts by state, plus `parked`: the unfinished ones recovery gave up on
-- (the final transitions clear the flag; one an older version left on a
-- finished transaction is not counted).  Foreign documents (stored.OWN)
-- are not counted.  One aggregation, grouped by
-- state and `parked` (FerretDB v1 has no $cond to count inside a group):
-- one round trip and one pass over the collection where there were seven
-- counts, and seven scans on a server without secondary indexes
-- (mongo-java-server).

--- Counts of transactions by state, plus `parked`: one aggregation, one round trip.
-- @syntax counts, err = tm:stats()
-- @treturn table `{ initial, pending, applied, done, canceling, cancelled, parked }`
-- @errors database errors; `server` when the documents carry 1 000 kinds of `parked`
-- @usage local s = assert(tm:stats())
-- @function Manager:stats
function _M.stats(self)
  local name = self.engine.vctx.collection
  local reply, err = self.db.client:command(self.db.name, core.doc(
    "aggregate", name,
    "pipeline", { { ["$match"] = { state = { ["$in"] = STATES }, ops = OWN } },
                  { ["$group"] = { _id = { state = "$state", parked = "$parked" },
                                   n = { ["$sum"] = 1 } } } },
    "cursor", { batchSize = STATS_GROUPS }))
  if not reply then return nil, errors.wrap(err, "stats") end
  local groups = reply.cursor.firstBatch
  if #groups >= STATS_GROUPS then
    self.db.client:command(self.db.name, core.doc("killCursors", name,
      "cursors", { reply.cursor.id }))
    return nil, errors.new("server", format("stats: %d or more kinds of `parked` values",
      STATS_GROUPS), { step = "stats" })
  end
  local out = { parked = 0 }
  for _, state in ipairs(STATES) do out[state] = 0 end
  for _, g in ipairs(groups) do
    local state = g._id.state
    out[state] = out[state] + g.n
    if g._id.parked == true and OPEN[state] then out.parked = out.parked + g.n end
  end
  return out
end

-- What recovery has before it, by the server's clock: `active` (in
-- initial, pending, applied or canceling and not parked: what recover
-- reads), `stale` (those of them last changed more than stale_after
-- seconds ago), `oldest` (seconds since the last change of the oldest
-- open transaction, parked ones included; nil when none) and `oldest_id`,
-- all of mongotx's transactions; `foreign`: the documents of the
-- collection mongotx did not write (stored.OWN), which it leaves alone.
-- A hold open and not past its expiry is active, but neither stale nor
-- the oldest: it waits for its caller, not for recovery (mongotx.holds).

--- What recovery has to do, by the server's clock.
-- @syntax b, err = tm:backlog()
-- @treturn table `{ active, stale, oldest, oldest_id, foreign }`: `foreign` counts the
-- documents without `ops` (another writer's, such as the tutorial's recipe), which
-- recovery, `stats` and `prune` leave alone
-- @errors database errors
-- @usage local b = assert(tm:backlog())
-- @function Manager:backlog
function _M.backlog(self)
  local now, err = self.engine:server_now()
  if not now then return nil, err end
  local out = {}
  out.active, err = self.tx:count({ state = ACTIVE, parked = { ["$ne"] = true }, ops = OWN })
  if not out.active then return nil, errors.wrap(err, "backlog") end
  local since = core.Date(math.floor(now - self.policy.stale_after * 1000))
  local waiting = { holds.not_due(now) }
  out.stale, err = self.tx:count({ state = ACTIVE, parked = { ["$ne"] = true }, ops = OWN,
                                   lastModified = { ["$lt"] = since }, ["$nor"] = waiting })
  if not out.stale then return nil, errors.wrap(err, "backlog") end
  local first
  first, err = self.tx:find_all({ state = ACTIVE, ops = OWN, lastModified = { ["$type"] = "date" },
                                  ["$nor"] = waiting },
    { sort = { lastModified = 1 }, limit = 1, projection = { lastModified = 1 } })
  if not first then return nil, errors.wrap(err, "backlog") end
  if first[1] then
    out.oldest = (now - first[1].lastModified:value()) / 1000
    out.oldest_id = first[1]._id
  end
  out.foreign, err = self.tx:count({ ops = { ["$exists"] = false } })
  if not out.foreign then return nil, errors.wrap(err, "backlog") end
  return out
end

return _M

-- The backlog of a transactions collection as Prometheus gauges, for
-- node_exporter's textfile collector: `mongotx status --prometheus` prints
-- them and `mongotx recover --metrics-file PATH` writes them after every
-- sweep (docs/metrics.md).  Read with tm:stats() and tm:backlog(), by the
-- server's clock; labelled with the database and the collection.

local exposition = require "mongotx.metrics.exposition"

local format = string.format

local _M = {}

local OPEN = { "initial", "pending", "applied", "canceling" }

local GAUGES = {
  { "mongotx_open_transactions", "Open transactions by state (parked ones included)." },
  { "mongotx_active_transactions", "Open transactions that are not parked: what recovery reads." },
  { "mongotx_stale_transactions",
    "Active transactions unchanged for more than stale_after seconds." },
  { "mongotx_parked_transactions", "Open transactions recovery parked for an operator." },
  { "mongotx_oldest_open_seconds",
    "Seconds since the last change of the oldest open transaction (0: none is open)." },
  { "mongotx_foreign_documents",
    "Documents of the collection mongotx did not write (no ops): another writer's, left alone." },
  { "mongotx_lease_seconds", "The lease policy: seconds before another owner may take over." },
  { "mongotx_stale_after_seconds", "The stale_after policy the stale count used." },
}

-- The gauges of tm's collection (`database`, `collection`: its names) as
-- exposition text, or nil, err.
function _M.render(tm, database, collection)
  local stats, err = tm:stats()
  local backlog
  if stats then backlog, err = tm:backlog() end
  if not backlog then return nil, err end
  local value = {
    mongotx_active_transactions = backlog.active,
    mongotx_stale_transactions = backlog.stale,
    mongotx_parked_transactions = stats.parked,
    mongotx_oldest_open_seconds = backlog.oldest or 0,
    mongotx_foreign_documents = backlog.foreign,
    mongotx_lease_seconds = tm.policy.lease,
    mongotx_stale_after_seconds = tm.policy.stale_after,
  }
  local base = { "database", database, "collection", collection }
  local labels = exposition.labels(base)
  local out = {}
  for _, g in ipairs(GAUGES) do
    local name = g[1]
    exposition.header(out, name, "gauge", g[2])
    if name == "mongotx_open_transactions" then
      for _, state in ipairs(OPEN) do
        exposition.sample(out, name, exposition.labels { "database", database, "collection",
          collection, "state", state }, stats[state])
      end
    else
      exposition.sample(out, name, labels, value[name])
    end
  end
  return table.concat(out, "\n") .. "\n"
end

-- The time the recovery worker last finished a pass (Unix seconds, the
-- worker's clock; 0: none yet) as exposition text: what an alert on a
-- dead or stuck worker compares with time() (docs/metrics.md, "Alerts").
function _M.last_pass(database, collection, time)
  local out, name = {}, "mongotx_recovery_last_pass_timestamp_seconds"
  exposition.header(out, name, "gauge",
    "When the recovery worker last finished a pass, in Unix seconds (0: not yet).")
  exposition.sample(out, name, exposition.labels { "database", database, "collection", collection },
    time or 0)
  return table.concat(out, "\n") .. "\n"
end

-- Where write() puts the text before renaming it over `path`: the same
-- directory (a rename is atomic within one file system), and a name the
-- textfile collector skips (it reads *.prom only).
local function temporary(path)
  return path .. ".tmp"
end

-- Can `path` be written the way write() will (its temporary file created
-- and renamed over it)?  Creates nothing that stays.  Returns true, or
-- nil and why not.
function _M.check(path)
  if path == "" then return nil, "an empty path" end
  local f = io.open(path, "rb")
  if f then
    local _, why = f:read(0)
    f:close()
    if why then return nil, format("%s: %s", path, why) end
  end
  local tmp = temporary(path)
  local w, why = io.open(tmp, "wb")
  if not w then return nil, why end
  w:close()
  os.remove(tmp)
  return true
end

-- Writes `text` to `path` atomically: a reader sees the old file or the
-- new one, never half of one.  Returns true, or nil and why not.
function _M.write(path, text)
  local tmp = temporary(path)
  local f, why = io.open(tmp, "wb")
  if not f then return nil, why end
  local ok, err = f:write(text)
  if ok then ok, err = f:flush() end
  f:close()
  if ok then ok, err = os.rename(tmp, path) end
  if not ok then
    os.remove(tmp)
    return nil, format("%s: %s", path, tostring(err))
  end
  return true
end

return _M

-- bench/stats.lua: the arithmetic of the benchmark, kept apart from the
-- measuring so that it can be read (and checked) on its own.
--
-- A sample is what one run of a mode measured:
--   { n, wall_ms, cpu_s, server_s (the server's CPU, nil when unknown),
--     commands, writes, lat = { ms per transfer, ... }, ok, failed }
-- summarise() turns several samples of one mode into the median figures
-- the table prints, with the min and max of the throughput.

local floor, huge = math.floor, math.huge
local sort = table.sort

local _M = {}

-- The p-th percentile (0 < p <= 100) of a sorted list, nearest rank.
function _M.percentile(sorted, p)
  local n = #sorted
  if n == 0 then return nil end
  local rank = math.ceil(p / 100 * n)
  if rank < 1 then rank = 1 end
  return sorted[rank]
end

function _M.median(list)
  local copy = {}
  for i, v in ipairs(list) do copy[i] = v end
  sort(copy)
  local n = #copy
  if n == 0 then return nil end
  if n % 2 == 1 then return copy[(n + 1) / 2] end
  return (copy[n / 2] + copy[n / 2 + 1]) / 2
end

local function min_max(list)
  local lo, hi = huge, -huge
  for _, v in ipairs(list) do
    if v < lo then lo = v end
    if v > hi then hi = v end
  end
  return lo, hi
end

-- Figures of one sample: per-transfer rates and costs.  Transfers that
-- did not complete (cancelled under contention) still cost their round
-- trips, so costs are divided by the transfers attempted and the rate
-- counts the completed ones only.
function _M.figures(s)
  local lat = {}
  for i, v in ipairs(s.lat) do lat[i] = v end
  sort(lat)
  local ok = s.ok or s.n
  return {
    tps = ok / (s.wall_ms / 1000),
    p50 = _M.percentile(lat, 50),
    p99 = _M.percentile(lat, 99),
    commands = s.commands / s.n,
    writes = s.writes / s.n,
    cpu_us = s.cpu_s * 1e6 / s.n,
    server_us = s.server_s and s.server_s * 1e6 / s.n,
    failed = s.failed or 0,
    busy = s.busy,
    call_commands = s.call_commands and s.call_commands / s.n,
    typical_call_commands = s.typical_call_commands,
  }
end

-- Median of each figure over the samples, plus min/max throughput.
function _M.summarise(samples)
  local per = {}
  for i, s in ipairs(samples) do per[i] = _M.figures(s) end
  local out = { runs = #samples, n = samples[1].n }
  for _, key in ipairs { "tps", "p50", "p99", "commands", "writes", "cpu_us", "server_us", "failed",
                         "busy", "call_commands", "typical_call_commands" } do
    local list = {}
    for i, f in ipairs(per) do list[i] = f[key] end -- nil when a mode has no such figure
    out[key] = _M.median(list)
    if key == "tps" then out.tps_min, out.tps_max = min_max(list) end
    if key == "busy" and #list > 0 then out.busy_max = select(2, min_max(list)) end
  end
  return out
end

-- Rounds to d decimals for printing (nil stays nil).
function _M.round(x, d)
  if x == nil then return nil end
  local m = 10 ^ (d or 0)
  return floor(x * m + 0.5) / m
end

return _M

-- The cost of mongotx.metrics.shared in nginx, for bench/openresty.lua
-- (make bench-openresty; bench/README.md, "OpenResty"): opts.metrics
-- rounds of one wrk run (2 workers, POST /transfer offloaded, 16
-- connections, opts.seconds) with the manager's metrics off and on, the
-- order alternating per round so that drift hits both alike; prints the
-- medians of requests/s and their difference, and what the events of one
-- transfer cost in a worker (a loop of 20 000 transfers' events into the
-- shared dict), and the CPU each request cost with metrics off and on.
-- Returns how many runs failed their database check.

local nginx = require "spec.support.nginx"

-- One transfer's events as a batch reports them, counted into the dict
-- by a manager's on_event; µs per transfer.
local COST = [[
  location = /_metrics_cost { content_by_lua_block {
    local core = require "mongotx.core"
    local on = require("mongotx.metrics.shared").new("mongotx_metrics"):on_event("cost")
    local N, ids, NS = 20000, {}, "bank.transactions"
    for i = 1, N do ids[i] = core.ObjectId() end
    local t0 = core.monotonic_ms()
    for i = 1, N do
      local id = ids[i]
      on("create", { id = id }, NS); on("apply", { id = id }, NS); on("commit", { id = id }, NS)
      on("finish", { id = id }, NS); on("done", { id = id }, NS)
    end
    ngx.say((core.monotonic_ms() - t0) * 1000 / N)
  } }
]]

local function median(values)
  local list = { unpack(values) } -- luacheck: ignore 113 (LuaJIT's unpack)
  table.sort(list)
  local n = #list
  if n % 2 == 1 then return list[(n + 1) / 2] end
  return (list[n / 2] + list[n / 2 + 1]) / 2
end

local function rates(list)
  local t = {}
  for i, v in ipairs(list) do t[i] = string.format("%.0f", v) end
  return table.concat(t, ", ")
end

return function(opts, env)
  local rate, failed, cost = { off = {}, on = {} }, 0, {}
  local nginx_us, total_us = { off = {}, on = {} }, { off = {}, on = {} }
  for round = 1, opts.metrics do
    local order = round % 2 == 1 and { "off", "on" } or { "on", "off" }
    for _, mode in ipairs(order) do
      local name = env.fresh(1000 + 2 * round + (mode == "on" and 1 or 0))
      local manager = mode == "on" and "{ application = 'bench', metrics = 'mongotx_metrics' }"
        or "{ application = 'bench' }"
      local n = assert(nginx.start { uri = env.srv.uri, database = name, workers = 2,
        threads = opts.threads, vms = env.vms, locations = COST,
        configure = "{ manager = " .. manager .. ", recovery = { every = 1 } }" })
      for _ = 1, 8 do n:request("POST", "/transfer", '{"from":"a1","to":"a2","amount":1}') end
      local r = env.measure(n, 16)
      if mode == "on" then
        local status, body = n:request("GET", "/_metrics_cost")
        if status == 200 then cost[#cost + 1] = tonumber(body) end
      end
      n:stop()
      local ok, what = env.check(name)
      if not r.requests then ok, what = false, "wrk: " .. r.out end
      if not ok then failed = failed + 1 end
      local total = 0
      for _, k in ipairs(env.CPU) do total = total + r[k] end
      rate[mode][#rate[mode] + 1], nginx_us[mode][#nginx_us[mode] + 1] = r.rps, r.nginx
      total_us[mode][#total_us[mode] + 1] = total
      io.stderr:write(string.format("metrics %s, round %d: %.0f requests/s, CPU a request: nginx " ..
        "%.0f µs, all %.0f µs; %s\n", mode, round, r.rps, r.nginx, total,
        (ok and "ok: " or "FAILED: ") .. what))
    end
  end
  local off, on = median(rate.off), median(rate.on)
  local us = #cost > 0 and median(cost) or 0 / 0
  print()
  print(string.format("Metrics (mongotx.metrics.shared) off and on, 2 workers, offloaded, 16 " ..
    "connections, %d rounds of %d s, alternating: median %.0f requests/s off, %.0f on " ..
    "(%+.1f %%); runs off: %s; on: %s. The events of one transfer cost %.2f µs in a " ..
    "worker (median of %d loops of 20 000): at %.0f requests/s, %.2f %% of one core.",
    opts.metrics, opts.seconds, off, on, (on - off) / off * 100, rates(rate.off),
    rates(rate.on), us, #cost, off, us * off / 1e6 * 100))
  -- The CPU each request cost, which load moves far less than requests/s:
  -- the stack is CPU-bound on this machine, so the extra CPU a request
  -- is the share of requests/s the metrics cost.
  local n_off, n_on = median(nginx_us.off), median(nginx_us.on)
  local t_off, t_on = median(total_us.off), median(total_us.on)
  print()
  print(string.format("CPU a request (medians): nginx %.0f µs off, %.0f on; the whole stack " ..
    "(nginx, server, wrk) %.0f off, %.0f on: the metrics cost %+.1f %% of the CPU a request, so " ..
    "of requests/s where the CPU bounds them.", n_off, n_on, t_off, t_on, (t_on - t_off) / t_on * 100))
  return failed
end

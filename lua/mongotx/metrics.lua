-- mongotx.metrics: counters and latency histograms fed from the engine's
-- events (policy.on_event: the same call on every path, one at a time,
-- batched or recovering; docs/metrics.md), rendered in the Prometheus
-- text exposition format (mongotx.metrics.exposition).
--
--   local metrics = require "mongotx.metrics"
--   local m = metrics.new()
--   local tm = db:manager(m:wrap{ application = "shop", on_event = mine })
--   io.write(m:render())          -- mine still gets every event
--
-- Labels are few and bounded: the manager's `application`, and where a
-- family says so a `reason` (why a transaction was cancelled or a step
-- tried again) or an `outcome`; never a transaction id.
--
-- Where the figures live is a store: { incr = function(self, key, n),
-- set = function(self, key, v), get = function(self, key), keys =
-- function(self) -> list }, and the marks of the transactions counted
-- begun and not yet ended (mark, unmark, marked, touch: mongotx.metrics.marks;
-- a store without them keeps them in this Lua state).  By default
-- a table of this Lua state;
-- mongotx.metrics.shared keeps them in an nginx lua_shared_dict, summed
-- over the workers of an instance.  A key is "<family>\t<labels>\t<part>"
-- (labels as rendered, part "" for a counter or gauge, "b<i>", "s" or "c"
-- for a histogram's bucket i, sum and count), so any store renders alike.

--- Counters and histograms of the engine's events, in the Prometheus text format (docs/metrics.md).
-- @module mongotx.metrics

local exposition = require "mongotx.metrics.exposition"
local marks = require "mongotx.metrics.marks"
local core = require "mongotx.core"
local engine = require "mongotx.engine"

local pairs, ipairs, type, pcall, setmetatable, tostring = pairs, ipairs, type, pcall,
  setmetatable, tostring
local sort, concat = table.sort, table.concat
local key_of, now_ms = engine.key, core.monotonic_ms

local _M = {}

-- Seconds (latencies and waits) and sizes (group commit batches).
local SECONDS = { 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30 }
local SIZES = { 1, 2, 4, 8, 16, 32, 64, 128, 256, 512 }

-- The families, in the order rendered: name, type, help, histogram bounds.
local FAMILIES = {
  { "mongotx_transactions_begun_total", "counter",
    "Transactions this registry's managers created (begin, run, transfer and their batches)." },
  { "mongotx_transactions_done_total", "counter",
    "Of the transactions counted begun, those that ended done, whoever moved them." },
  { "mongotx_transactions_cancelled_total", "counter",
    "Of the transactions counted begun, those that ended cancelled, by reason: an op that could not apply " ..
    "(guard, missing, conflict, busy, removing, contention), rollback (a caller or operator), " ..
    "recovery (a stale pending one rolled back), expired (a stale initial one, or a hold past " ..
    "its expiry), voided (a hold voided), unknown." },
  { "mongotx_transaction_seconds", "histogram",
    "Seconds from a transaction's create (or first claim) in this process to done or " ..
    "cancelled (outcome).", SECONDS },
  { "mongotx_retries_total", "counter",
    "Steps tried again after a backoff: reason is a transient error's code, or busy " ..
    "(a guard waited for an open transaction) and the other op failures a policy retries." },
  { "mongotx_recovery_passes_total", "counter", "Recovery passes (tm:recover) run." },
  { "mongotx_recovery_pass_seconds", "histogram",
    "Seconds one recovery pass (tm:recover) took, from its read of the stale ones to its report.",
    SECONDS },
  { "mongotx_recovered_total", "counter",
    "Transactions recovery passes examined, by outcome: done, cancelled, parked, skipped " ..
    "(not stale enough, or taken by another), failed." },
  { "mongotx_recovery_malformed", "gauge",
    "Malformed transaction documents the last recovery pass found (left for an operator)." },
  { "mongotx_parked_total", "counter",
    "Transactions recovery parked after max_attempts tries." },
  { "mongotx_unparked_total", "counter", "Transactions unparked (tm:unpark)." },
  { "mongotx_compensations_total", "counter", "Compensating transactions created." },
  { "mongotx_holds_opened_total", "counter", "Holds opened (tm:hold) by this manager." },
  { "mongotx_holds_decided_total", "counter",
    "Holds this manager decided, by outcome: captured, voided, expired (by a capture or void " ..
    "that met it past its expiry, or by recovery)." },
  { "mongotx_holds_captured_amount_total", "counter",
    "The sum of the amounts captured (the part posted to `to`)." },
  { "mongotx_holds_amount", "gauge",
    "The amount this manager's holds reserve: added when one opens, taken off when any " ..
    "manager of this registry decides it (summed over the processes of an application, the " ..
    "amount held)." },
  { "mongotx_group_size", "histogram",
    "Transactions per group-commit batch.", SIZES },
  { "mongotx_group_wait_seconds", "histogram",
    "Seconds a group-commit batch waited for its calls before it ran.", SECONDS },
  { "mongotx_round_trips_total", "counter",
    "Commands the manager's client sent to the server (client:counters(); metrics.new's " ..
    "client option), mongotx's and any other." },
  { "mongotx_metrics_dropped_total", "counter",
    "Metric updates lost because the lua_shared_dict was full (mongotx.metrics.shared)." },
}
local FAMILY = {}
for _, f in ipairs(FAMILIES) do FAMILY[f[1]] = f end
_M.FAMILIES = FAMILIES

-- Why a transaction was cancelled: the cause stored on it
-- (cancel_reason(reason, cause); engine.cause_of reads an older one's
-- reason).
local cancel_reason = engine.cause_of
_M.cancel_reason = cancel_reason

-- The default store: a table in this Lua state.
local Table = {}
Table.__index = Table

function Table:incr(key, n) self.values[key] = (self.values[key] or 0) + n end
function Table:set(key, v) self.values[key] = v end
function Table:get(key) return self.values[key] end
function Table:keys()
  local list = {}
  for k in pairs(self.values) do list[#list + 1] = k end
  return list
end

--- The default store: the figures in a table of this Lua state.
-- @syntax store = metrics.table_store()
-- @treturn table a store: `incr(key, n)`, `set(key, v)`, `get(key)`, `keys()`, and the marks of the
--   transactions counted begun and not yet ended: `mark(k, id, ms)`, `unmark(k)`, `marked(prefix)`,
--   `touch(k, ms)`
-- @usage local m = metrics.new{ store = metrics.table_store() }
function _M.table_store()
  return setmetatable({ values = {}, marks = {} }, Table)
end
marks.mix(Table)

-- How many transactions a Lua state times at once (two generations of
-- this many: one that never ends here, taken over by another process,
-- is forgotten after two generations of others).
_M.TIMED = 10000

local Metrics = {}
Metrics.__index = Metrics

-- new([opts]): opts.store (default a table store), opts.client (a
-- mongotx.core client whose round trips to render; db.client).

--- A registry of the figures.
-- @syntax m = metrics.new([{ store, client }])
-- @tparam[opt] table opts `store` where the figures live (default `metrics.table_store()`; mongotx.metrics.shared
--   passes a shared dict's), `client` a core client whose round trips `render` reports (`db.client`)
-- @treturn table the registry
-- @usage local m = metrics.new{ client = db.client }
function _M.new(opts)
  opts = opts or {}
  return setmetatable({ store = opts.store or _M.table_store(), client = opts.client,
                        keys = {}, tags = {}, started = {}, older = {}, timed = 0,
                        -- the passes under way, by their report (weak: a
                        -- pass that raised is forgotten)
                        passes = setmetatable({}, { __mode = "k" }) }, Metrics)
end

-- The key of a family's series (`labels` a list of name, value pairs);
-- cached, so an event builds no string once its series was seen.

--- @type Metrics

--- Internal: the store key of a family's series (cached).
-- @local
-- @syntax k = m:key(family, app [, name2, value2 [, part]])
-- @string family the metric's name
-- @string app the application label
-- @string[opt] name2 a second label's name
-- @string[opt] value2 its value
-- @string[opt] part a histogram's part: `"b<i>"`, `"s"`, `"c"`
-- @treturn string the key
-- @usage -- used by count and observe
function Metrics:key(family, app, name2, value2, part)
  local by_app = self.keys[family]
  if not by_app then by_app = {}; self.keys[family] = by_app end
  local id = name2 and value2 .. "\t" .. (part or "") or part or ""
  local of_app = by_app[app]
  if not of_app then of_app = {}; by_app[app] = of_app end
  local k = of_app[id]
  if not k then
    local pairs_ = { "application", app }
    if name2 then pairs_[3], pairs_[4] = name2, value2 end
    k = family .. "\t" .. exposition.labels(pairs_) .. "\t" .. (part or "")
    of_app[id] = k
  end
  return k
end

--- Internal: adds n (default 1) to a counter's series.
-- @local
-- @syntax m:count(family, app [, name2, value2 [, n]])
-- @string family the metric's name
-- @string app the application label
-- @string[opt] name2 a second label's name
-- @string[opt] value2 its value
-- @number[opt] n the increment
-- @usage -- used by the events' handlers
function Metrics:count(family, app, name2, value2, n)
  self.store:incr(self:key(family, app, name2, value2), n or 1)
end

-- One observation v of a histogram: its bucket, its sum, its count.

--- Internal: one observation of a histogram.
-- @local
-- @syntax m:observe(family, app, name2, value2, v)
-- @string family the metric's name
-- @string app the application label
-- @string name2 a second label's name, or nil
-- @string value2 its value, or nil
-- @number v the value observed
-- @usage -- used by the events' handlers
function Metrics:observe(family, app, name2, value2, v)
  local bounds = FAMILY[family][4]
  for i, b in ipairs(bounds) do
    if v <= b then
      self.store:incr(self:key(family, app, name2, value2, "b" .. i), 1)
      break
    end
  end
  self.store:incr(self:key(family, app, name2, value2, "s"), v)
  self.store:incr(self:key(family, app, name2, value2, "c"), 1)
end

-- Timing: when this Lua state first saw a transaction (ms), by its key.

--- Internal: starts timing a transaction (its create or first claim here).
-- @local
-- @syntax m:start(id)
-- @param id the transaction's id
-- @usage -- used by the create and claim events
function Metrics:start(id)
  local k = key_of(id)
  if self.started[k] or self.older[k] then return end
  if self.timed >= _M.TIMED then
    self.older, self.started, self.timed = self.started, {}, 0
  end
  self.started[k], self.timed = now_ms(), self.timed + 1
end

--- Internal: ends a transaction's timing and observes its seconds (none without `app`).
-- @local
-- @syntax m:stop(id [, app, outcome])
-- @param id the transaction's id
-- @string[opt] app the application label
-- @string[opt] outcome `"done"` or `"cancelled"`
-- @usage -- used by the done and cancelled events
function Metrics:stop(id, app, outcome)
  local k = key_of(id)
  local t0 = self.started[k] or self.older[k]
  if not t0 then return end
  if self.started[k] then self.started[k], self.timed = nil, self.timed - 1
  else self.older[k] = nil end
  if app then
    self:observe("mongotx_transaction_seconds", app, "outcome", outcome, (now_ms() - t0) / 1000)
  end
end

local OUTCOMES = { "done", "cancelled", "parked", "skipped", "failed" }

-- What each event adds (app: the manager's application).  A step whose
-- result is false did not move the transaction (somebody else did).
local ON = {}

-- Each transaction is counted begun, then done or cancelled, once, by
-- the registry whose mark it took (mongotx.metrics.marks).
function ON.create(m, app, info, ns)
  local res = info.result
  if res == false or type(res) == "table" and res.created == false then return end
  -- (no room for the mark: counted nowhere, and the store says so)
  if marks.add(m, app, ns, info.id, now_ms()) then
    m:count("mongotx_transactions_begun_total", app)
    m:start(info.id)
  end
end

function ON.claim(m, _, info)
  if info.result ~= false then m:start(info.id) end
end

-- Counts T ended with its outcome (from the stored reason and cause).
local function count_end(m, app, outcome, reason, cause)
  if outcome == "done" then
    m:count("mongotx_transactions_done_total", app)
  else
    m:count("mongotx_transactions_cancelled_total", app, "reason", cancel_reason(reason, cause))
  end
end

function ON.done(m, app, info, ns)
  if info.result == false then return end
  if marks.take(m, app, ns, info.id) then
    count_end(m, app, "done")
    m:stop(info.id, app, "done")
  else
    m:stop(info.id)
  end
end

function ON.cancelled(m, app, info, ns)
  local res = info.result
  if res == false then return end
  local from = type(res) == "table" and res or info
  if marks.take(m, app, ns, info.id) then
    count_end(m, app, "cancelled", from.reason, from.cause)
    m:stop(info.id, app, "cancelled")
  else
    m:stop(info.id)
  end
end

-- At most this many marks are read back per reconcile (one find).
_M.RECONCILE = 100

local function reconcile(m, app, ns, find, clock, age)
  return marks.reconcile(m, app, ns, find, clock, age, _M.RECONCILE, count_end)
end

-- The recovery pass's last event: its `find` reads this manager's
-- transactions collection (namespace ns), `clock` gives the server's time.
function ON.reconcile(m, app, info, ns)
  if type(info.find) == "function" and type(info.clock) == "function" then
    reconcile(m, app, ns, info.find, info.clock, info.age)
  end
end

function ON.retry(m, app, info)
  m:count("mongotx_retries_total", app, "reason", tostring(info.reason))
end

function ON.recovering(m, _, report)
  m.passes[report] = now_ms()
end

function ON.recover(m, app, report)
  m:count("mongotx_recovery_passes_total", app)
  local t0 = m.passes[report]
  if t0 then
    m.passes[report] = nil
    m:observe("mongotx_recovery_pass_seconds", app, nil, nil, (now_ms() - t0) / 1000)
  end
  for _, outcome in ipairs(OUTCOMES) do
    local n = report[outcome]
    if type(n) == "number" and n > 0 then
      m:count("mongotx_recovered_total", app, "outcome", outcome, n)
    end
  end
  if type(report.malformed) == "number" then
    m.store:set(m:key("mongotx_recovery_malformed", app), report.malformed)
  end
end

function ON.park(m, app) m:count("mongotx_parked_total", app) end
function ON.unpark(m, app) m:count("mongotx_unparked_total", app) end
function ON.compensate(m, app) m:count("mongotx_compensations_total", app) end

local function amount(info, name)
  local n = info[name or "amount"]
  return type(n) == "number" and n or 0
end

function ON.hold(m, app, info, ns)
  -- open until its expiry: its mark is not read back before
  if type(info.expires) == "number" then marks.later(m, app, ns, info.id, info.expires * 1000) end
  m:count("mongotx_holds_opened_total", app)
  m:count("mongotx_holds_amount", app, nil, nil, amount(info))
end

function ON.capture(m, app, info)
  m:count("mongotx_holds_decided_total", app, "outcome", "captured")
  m:count("mongotx_holds_captured_amount_total", app, nil, nil, amount(info))
  m:count("mongotx_holds_amount", app, nil, nil, -amount(info, "held"))
end

function ON.void(m, app, info)
  m:count("mongotx_holds_decided_total", app, "outcome", "voided")
  m:count("mongotx_holds_amount", app, nil, nil, -amount(info))
end

function ON.expire(m, app, info)
  m:count("mongotx_holds_decided_total", app, "outcome", "expired")
  m:count("mongotx_holds_amount", app, nil, nil, -amount(info))
end

function ON.group(m, app, info)
  if type(info.size) == "number" then m:observe("mongotx_group_size", app, nil, nil, info.size) end
  if type(info.wait) == "number" then
    m:observe("mongotx_group_wait_seconds", app, nil, nil, info.wait)
  end
end

-- An on_event for managers of application `app` that counts, then calls
-- `chained` (the caller's own on_event, if any) with the same arguments:
-- a failure of the counting never keeps it from the caller's.

--- An `on_event` policy that counts the events of application `app`, then calls `chained`.
-- @syntax f = m:on_event(app [, chained])
-- @string app the manager's application
-- @tparam[opt] function chained the caller's own `on_event`
-- @treturn function the policy function
-- @usage local tm = assert(db:manager{ application = "shop", on_event = m:on_event("shop") })
function Metrics:on_event(app, chained)
  app = tostring(app or "mongotx")
  local m = self
  return function(name, info, ns)
    local f = ON[name]
    if f and type(info) == "table" then pcall(f, m, app, info, ns) end
    if chained then return chained(name, info, ns) end
  end
end

-- Reconciles now (what tm:recover's pass does at its end) this
-- registry's marks of tm's application and namespace against tm's
-- transactions: through tm's engine, or (a mongotx.pool or
-- mongotx.resty manager: in a worker thread) through tm:find.

--- Counts the transactions of `tm`'s application this registry counted begun that ended uncounted.
-- `tm:recover` does it at the end of each pass; call it where a process counts transactions and runs
-- no recovery (docs/metrics.md). Marks older than `age` seconds are read back, at most `metrics.RECONCILE`
-- in one find; with none due it reads nothing.
-- @syntax n, err = m:reconcile(tm [, { age = seconds }])
-- @tparam table tm a manager whose events count into this registry (`mongotx`'s, `mongotx.pool`'s or
--   `mongotx.resty`'s)
-- @tparam[opt] table opts `age` (default the manager's `stale_after`)
-- @treturn number how many it counted done or cancelled now
-- @return[2] nil
-- @return[2] err the read's error
-- @usage local n = assert(m:reconcile(tm))
function Metrics:reconcile(tm, opts)
  local age = opts and opts.age or tm.policy.stale_after
  local eng, find, clock = tm.engine
  if eng then
    find = function(ids) return eng:states(ids) end
    clock = function() return eng:clock() end
  else
    find = function(ids)
      return tm:find({ _id = { ["$in"] = ids } }, { projection = engine.STATES, limit = #ids })
    end
    clock = function() return tm:server_now() end
  end
  return reconcile(self, tostring(tm.application), tm.namespace, find, clock, age)
end

-- A copy of db:manager's options `opts` whose on_event counts into this
-- registry and then calls opts.on_event.

--- A copy of `db:manager`'s options whose `on_event` counts into this registry, then calls theirs.
-- @syntax opts2 = m:wrap(opts)
-- @tparam[opt] table opts the manager's options
-- @treturn table the options to give `db:manager`
-- @usage local tm = assert(db:manager(m:wrap{ application = "shop" }))
function Metrics:wrap(opts)
  local out = {}
  for k, v in pairs(opts or {}) do out[k] = v end
  out.on_event = self:on_event(out.application, out.on_event)
  return out
end

-- The figures in the exposition format (a string ending in a newline,
-- or "" when there are none yet).

--- The figures in the Prometheus text exposition format.
-- @syntax text = m:render()
-- @treturn string the text, ending in a newline (`""` before any event)
-- @usage io.write(m:render())
function Metrics:render()
  local store = self.store
  if self.client then
    local counters = self.client:counters()
    store:set("mongotx_round_trips_total\t\t", counters.commands)
  end
  -- series by family, then by labels: { [labels] = { [part] = value } }
  local by_family = {}
  for _, k in ipairs(store:keys()) do
    local family, labels, part = k:match("^([^\t]*)\t(.*)\t([^\t]*)$")
    if family and FAMILY[family] then
      local v = store:get(k)
      if type(v) == "number" then
        local series = by_family[family] or {}
        by_family[family] = series
        series[labels] = series[labels] or {}
        series[labels][part] = v
      end
    end
  end
  local out = {}
  for _, f in ipairs(FAMILIES) do
    local name, kind, help, bounds = f[1], f[2], f[3], f[4]
    local series = by_family[name]
    if series then
      exposition.header(out, name, kind, help)
      local list = {}
      for labels in pairs(series) do list[#list + 1] = labels end
      sort(list)
      for _, labels in ipairs(list) do
        local parts = series[labels]
        if kind == "histogram" then
          local counts = {}
          for i = 1, #bounds do counts[i] = parts["b" .. i] end
          exposition.histogram(out, name, labels, bounds, counts, parts.s, parts.c)
        else
          exposition.sample(out, name, labels, parts[""] or 0)
        end
      end
    end
  end
  if #out == 0 then return "" end
  return concat(out, "\n") .. "\n"
end

return _M

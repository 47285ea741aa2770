-- The subcommands of `mongotx` (mongotx.cli parses the command line and
-- connects).  Each is command(tm, o, fail): tm the manager, o the parsed
-- options (o.id already a checked id), fail(code, message) prints a
-- message on stderr and returns its code; each returns the exit code.
-- They use the manager's public API only.

local core = require "mongotx.core"
local output = require "mongotx.cli.output"
local progress = require "mongotx.cli.progress"
local gauges = require "mongotx.metrics.backlog"

local json, id_text, cell = output.json, output.id_text, output.cell
local record, add = output.record, output.add
local format, floor = string.format, math.floor
local stdout = output.stdout

local OK, FAILED = 0, 1
local ACTIVE = { "initial", "pending", "applied", "canceling" }

local _M = {}

local function say(line) stdout:write(output.visible(line), "\n") end

-- Seconds since a Date by the server's clock `now` (ms), or nil.
local function age(date, now)
  if core.type(date) ~= "date" then return nil end
  return (now - date:value()) / 1000
end

local function seconds_text(s)
  if s == nil then return "-" end
  return format("%.1f s", s)
end

local STATES = { "initial", "pending", "applied", "done", "canceling", "cancelled" }

function _M.status(tm, o, fail)
  if o.prometheus then
    local text, err = gauges.render(tm, o.database_name, o.collection)
    if not text then return fail(FAILED, tostring(err)) end
    stdout:write(text)
    return OK
  end
  local stats, err = tm:stats()
  local backlog
  if stats then backlog, err = tm:backlog() end
  if not backlog then return fail(FAILED, err) end
  if o.json then
    local rec = record()
    for _, s in ipairs(STATES) do add(rec, s, stats[s]) end
    for _, k in ipairs { "active", "stale", "oldest", "oldest_id", "foreign" } do
      add(rec, k, backlog[k])
    end
    add(rec, "parked", stats.parked)
    add(rec, "stale_after", tm.policy.stale_after)
    say(json(rec))
    return OK
  end
  local list = {}
  for _, s in ipairs(STATES) do
    list[#list + 1], list[#list + 2] = s, tostring(stats[s])
  end
  local oldest = "-"
  if backlog.oldest then
    oldest = format("%s (%s)", seconds_text(backlog.oldest), id_text(backlog.oldest_id))
  end
  for _, pair in ipairs {
    { "parked", tostring(stats.parked) },
    { "active", format("%d (not parked: what recover reads)", backlog.active) },
    { "stale", format("%d (unchanged for more than %s)", backlog.stale,
      seconds_text(tm.policy.stale_after)) },
    { "oldest open", oldest },
    { "foreign", format("%d (documents without ops, another writer's: left alone)",
      backlog.foreign) },
  } do
    list[#list + 1], list[#list + 2] = pair[1], pair[2]
  end
  output.fields(stdout, list)
  return OK
end

local function shorten(s, n)
  if #s > n then return s:sub(1, n - 3) .. "..." end
  return s
end

local LIST_HEADERS = { "ID", "STATE", "APPLICATION", "AGE", "ATTEMPTS", "PARKED", "OPS", "REASON" }
-- Transactions `list` reads and prints at a time (a spec makes it small).
_M.LIST_PAGE = 1000

function _M.list(tm, o, fail)
  local now, err = tm:server_now()
  if not now then return fail(FAILED, err) end
  local filter = {}
  if o.state then filter.state = o.state end
  if o.parked then -- unfinished ones, as status counts them
    filter.parked, filter.state = true, o.state or { ["$in"] = ACTIVE }
  end
  if o.holds then filter.hold = { ["$exists"] = true } end
  if o.older_than then
    filter.lastModified = { ["$lt"] = core.Date(floor(now - o.older_than * 1000)) }
  end
  -- streamed: a reply of LIST_PAGE transactions at a time, printed as it
  -- comes (the table's columns as wide as its first page needs)
  local cursor
  cursor, err = tm:scan(filter, { sort = { lastModified = 1 }, limit = o.limit,
                                  batch_size = _M.LIST_PAGE })
  if not cursor then return fail(FAILED, err) end
  local page, widths = {}, nil
  -- prints the page read, its holds' status as tm:get says it (their
  -- marks read for the whole page at once)
  local function print_page()
    local ok, why = tm:hold_views(page)
    if not ok then return why end
    local rows = {}
    for i, T in ipairs(page) do
      if o.json then
        say(json(T))
      else
        local state = cell(T.state)
        if type(T.hold) == "table" then state = state .. " (" .. T.hold.status .. ")" end
        rows[i] = { id_text(T._id), state, cell(T.application),
          seconds_text(age(T.lastModified, now)), cell(T.attempts), T.parked and "yes" or "",
          tostring(type(T.ops) == "table" and #T.ops or "-"), shorten(cell(T.reason), 50) }
      end
    end
    if not o.json and (#rows > 0 or not widths) then
      widths = output.table(stdout, LIST_HEADERS, rows, widths)
    end
    page = {}
  end
  while true do
    local T
    T, err = cursor:next()
    if T then page[#page + 1] = T end
    if not T or #page == _M.LIST_PAGE then
      local why = print_page()
      if why then
        cursor:close()
        return fail(FAILED, why)
      end
    end
    if not T then break end
  end
  cursor:close()
  if err then return fail(FAILED, err) end
  return OK
end

local TX_FIELDS = { "state", "application", "instance", "epoch", "attempts", "lease",
                    "deadline", "lastModified", "triedAt", "parked", "reason", "compensates",
                    "source", "destination", "value", "meta" }

-- What `show` says of a hold: its status, amounts and expiry.
local function hold_text(T, now)
  local h, status = T.hold, T.hold.status
  local text = format("%s: %s", status, cell(h.amount))
  if status == "captured" then
    text = format("captured %s of %s", cell(h.captured or h.amount), cell(h.amount))
  end
  if core.type(h.expires) == "date" then
    local left = (h.expires:value() - now) / 1000
    text = text .. format(", expires %s (%s)", cell(h.expires),
      left > 0 and "in " .. seconds_text(left) or seconds_text(-left) .. " ago")
  end
  return text
end

function _M.show(tm, o, fail)
  local T, docs, why = tm:inspect(o.id)
  if not T then
    return fail(FAILED, docs and tostring(docs) or "no such transaction " .. id_text(o.id))
  end
  if type(T.hold) == "table" and not why then
    local ok, err = tm:hold_views({ T })
    if not ok then return fail(FAILED, err) end
  end
  if o.json then
    say(json(record("transaction", T, "documents", core.array(docs), "malformed", why)))
    return OK
  end
  local now, err = tm:server_now()
  if not now then return fail(FAILED, err) end
  local list = { "id", id_text(T._id) }
  for _, f in ipairs(TX_FIELDS) do
    if T[f] ~= nil then
      local v = cell(T[f])
      if f == "lastModified" then v = v .. format(" (%s ago)", seconds_text(age(T[f], now))) end
      list[#list + 1], list[#list + 2] = f, v
    end
  end
  if type(T.hold) == "table" and not why then
    list[#list + 1], list[#list + 2] = "hold", hold_text(T, now)
  end
  if why then list[#list + 1], list[#list + 2] = "malformed", why end
  output.fields(stdout, list)
  if type(T.ops) ~= "table" then return OK end
  say("")
  local rows = {}
  for i, op in ipairs(T.ops) do
    local d = docs[i] or {}
    local change = op.update or op.doc or (op.kind == "remove" and "(remove)") or nil
    rows[i] = { tostring(i), cell(op.kind), cell(op.collection), id_text(op.id),
                shorten(cell(change), 40), shorten(cell(op.undo), 30), shorten(cell(op.where), 30),
                d.exists == nil and "?" or (d.exists and "yes" or "no"),
                cell(d.marker), cell(d.version), cell(d.held), cell(d.removing),
                cell(d.pending), cell(d.escrow) }
  end
  output.table(stdout, { "OP", "KIND", "COLLECTION", "DOCUMENT", "CHANGE", "UNDO", "WHERE",
                         "EXISTS", "MARKER", "VERSION", "HELD", "REMOVING", "PENDING", "ESCROW" },
               rows)
  return OK
end

-- One line (JSON) or row (table) per failed or malformed transaction of
-- a recover report that an earlier pass of the sweep did not list
-- (`seen`, by core.id_key): each pass reads the malformed ones and the
-- failed ones still active again.  Returns how many failed ones are new.
local function report_errors(o, report, rows, seen)
  local failed = 0
  for _, e in ipairs(report.errors) do
    local key = core.id_key(e.id)
    if seen[key] then goto next_error end
    seen[key] = true
    if e.error.code ~= "malformed" then failed = failed + 1 end
    local code, message = e.error.code, e.error.message or tostring(e.error)
    if o.json then
      say(json(record("event", "failed", "id", e.id, "code", code, "message", message)))
    else
      rows[#rows + 1] = { id_text(e.id), tostring(code), shorten(message, 80) }
    end
    ::next_error::
  end
  return failed
end

local COUNTS = { "examined", "done", "cancelled", "skipped", "parked", "failed", "malformed" }

-- One sweep: tm:recover{ limit = batch } pass after pass until a pass
-- moves nothing (the rest are not stale yet, or fail) or o.limit
-- transactions were looked at.  A pass that moved nothing but was full
-- may have had unmovable ones before movable ones: the next pass reads
-- twice as many, until one is not full.
-- A SIGINT or SIGTERM (core.catch_signals, set by mongotx.cli) stops the
-- sweep before its next pass, and total.stopped names the signal.
-- Under --loop the --json lines of the passes are held until a pass
-- moves, fails or finds a malformed one: a sweep that did nothing says
-- nothing (total.quiet), so a worker does not fill its log every few
-- seconds.
local function sweep(tm, o, bar)
  local total = { passes = 0, quiet = true }
  for _, k in ipairs(COUNTS) do total[k] = 0 end
  local rows, batch, moved, seen = {}, o.batch, 0, {}
  local held = o.loop and {} or nil
  while true do
    total.stopped = core.signal_caught()
    if total.stopped then break end
    local n = batch
    if o.limit then n = math.min(n, o.limit - total.examined) end
    if n <= 0 then break end
    local report, err = tm:recover { limit = n }
    if not report then return nil, err end
    o.last_pass = os.time() -- a finished pass (mongotx_recovery_last_pass_timestamp_seconds)
    total.passes = total.passes + 1
    for _, k in ipairs(COUNTS) do
      if k ~= "failed" and k ~= "malformed" then total[k] = total[k] + report[k] end
    end
    -- a transaction counts once: failed ones by id, malformed ones as the
    -- most one pass saw (every pass counts all of them)
    total.failed = total.failed + report_errors(o, report, rows, seen)
    total.malformed = math.max(total.malformed, report.malformed)
    local moved_now = report.done + report.cancelled + report.parked
    if moved_now + total.failed + total.malformed > 0 then total.quiet = false end
    if o.json then
      local rec = record("event", "pass")
      for _, k in ipairs(COUNTS) do add(rec, k, report[k]) end
      if held then held[#held + 1] = json(rec) else say(json(rec)) end
    end
    if held and not total.quiet then
      for _, line in ipairs(held) do say(line) end
      held = nil
    end
    moved = moved + moved_now
    bar:update(moved + total.failed)
    if report.examined < n and moved_now == 0 then break end
    if report.examined == 0 then break end
    if moved_now == 0 then batch = batch * 2 end
  end
  total.rows = rows
  return total
end

-- The one line a recover stopped by a signal ends with (on standard
-- error, --json or not), and its exit code: 128 + the signal's number.
-- Every pass that ran is complete: the transactions it settled hold no
-- claim; one that failed is tried again after stale_after, as always.
local function stopped(tm, o, fail, total, secs)
  local text = format("recover stopped by %s after %d passes in %.1f s: %d examined, %d done, " ..
    "%d cancelled, %d parked, %d failed; no transaction is left half-driven or claimed",
    total.stopped, total.passes, secs, total.examined, total.done, total.cancelled,
    total.parked, total.failed)
  if total.failed > 0 then
    text = text .. format(" (the failed ones are tried again after %s)",
      seconds_text(tm.policy.stale_after))
  end
  o.stopped = true
  return fail(128 + select(2, core.signal_caught()), text)
end

-- A sweep that failed (the server does not answer, say): said on stderr
-- at once, then, under --loop while the sweeps go on failing, at most once
-- a minute, so that a server away for a while does not fill the log; the
-- first sweep that works again says so (recover_once).
local SAY_AGAIN_MS = 60000
local function failed_sweep(o, fail, err)
  local now = core.monotonic_ms()
  local f = o.failing
  if not f then
    if o.loop then o.failing = { since = now, said = now, n = 1 } end
    return fail(FAILED, err)
  end
  f.n = f.n + 1
  if now - f.said < SAY_AGAIN_MS then return FAILED end
  f.said = now
  return fail(FAILED, format("%s (still: %d failed sweeps in %.0f s)",
    output.reason(err), f.n, (now - f.since) / 1000))
end

local function recover_once(tm, o, fail)
  -- the bar's total is counted only for a bar drawn (four round trips)
  local drawn, todo = not o.json and progress.is_terminal(), 0
  if drawn then
    local backlog, err = tm:backlog()
    if not backlog then return fail(FAILED, err) end
    todo = o.limit and math.min(o.limit, backlog.active) or backlog.active
  end
  local bar = progress.new(stdout, "recover", todo, drawn)
  local start = core.monotonic_ms()
  local total, err = sweep(tm, o, bar)
  if not total then
    bar:finish(0)
    return failed_sweep(o, fail, err)
  end
  if o.failing then
    fail(OK, format("recover --loop: the server answers again, after %d failed sweep%s in %.0f s",
      o.failing.n, o.failing.n == 1 and "" or "s", (core.monotonic_ms() - o.failing.since) / 1000))
    o.failing = nil
  end
  local moved = total.done + total.cancelled + total.parked
  bar:finish(moved + total.failed)
  if o.loop and total.quiet and not total.stopped then return OK end
  local secs = (core.monotonic_ms() - start) / 1000
  if o.json then
    local rec = record("event", "summary")
    for _, k in ipairs(COUNTS) do add(rec, k, total[k]) end
    add(rec, "passes", total.passes)
    add(rec, "seconds", secs)
    add(rec, "stopped", total.stopped)
    say(json(rec))
  end
  if total.stopped then
    if not o.json and #total.rows > 0 then
      output.table(stdout, { "ID", "CODE", "MESSAGE" }, total.rows)
    end
    return stopped(tm, o, fail, total, secs)
  end
  if not o.json then
    local list = {}
    for _, k in ipairs(COUNTS) do list[#list + 1], list[#list + 2] = k, tostring(total[k]) end
    list[#list + 1], list[#list + 2] = "time", format("%.1f s, %d passes, %.0f/s", secs,
      total.passes, secs > 0 and moved / secs or 0)
    output.fields(stdout, list)
    if #total.rows > 0 then
      say("")
      output.table(stdout, { "ID", "CODE", "MESSAGE" }, total.rows)
    end
  end
  if total.failed > 0 or total.malformed > 0 then
    return fail(FAILED, format("recover: %d failed, %d malformed (listed above)",
      total.failed, total.malformed))
  end
  return OK
end

-- A sweep, then with --metrics-file the backlog gauges, the time of the
-- worker's last finished pass and its counters since it started
-- (o.metrics) written there.  When the backlog cannot be read (the server
-- does not answer) the file is written without it: its age says the
-- worker lives, the last pass's time that it gets nothing done.  A failure
-- to write is named on stderr; the next sweep tries again.
local function sweep_and_write(tm, o, fail)
  local code = recover_once(tm, o, fail)
  if not o.metrics_file then return code end
  local backlog, err = gauges.render(tm, o.database_name, o.collection)
  if not backlog and not o.failing then -- (a failed sweep said why)
    fail(FAILED, "--metrics-file: the backlog gauges are left out: " .. output.reason(err))
  end
  local written
  written, err = gauges.write(o.metrics_file, (backlog or "") ..
    gauges.last_pass(o.database_name, o.collection, o.last_pass) .. o.metrics:render())
  if not written then return fail(FAILED, "--metrics-file: " .. output.reason(err)) end
  return backlog and code or FAILED
end

-- recover, or with --loop a worker that sweeps every o.loop seconds until
-- stopped, carrying on after failures (a server away for a while).
function _M.recover(tm, o, fail)
  if not o.loop then return sweep_and_write(tm, o, fail) end
  while true do
    local code = sweep_and_write(tm, o, fail)
    if o.stopped then return code end
    stdout:flush()
    -- in slices, so that a signal ends the wait within one
    local wake = core.monotonic_ms() + o.loop * 1000
    while core.monotonic_ms() < wake do
      local signal, number = core.signal_caught()
      if signal then
        o.stopped = true
        return fail(128 + number, format("recover --loop stopped by %s between sweeps", signal))
      end
      core.sleep(math.max(0, math.min(0.1, (wake - core.monotonic_ms()) / 1000)))
    end
  end
end

function _M.rollback(tm, o, fail)
  local ok, err = tm:rollback({ _id = o.id }, o.reason)
  if not ok then return fail(FAILED, err) end
  if o.json then
    say(json(record("id", o.id, "state", "cancelled")))
  else
    say(format("%s: cancelled", id_text(o.id)))
  end
  return OK
end

function _M.compensate(tm, o, fail)
  local C, err = tm:compensate({ _id = o.id }, { floors = not o.no_floors })
  if not C then return fail(FAILED, err) end
  if o.json then
    say(json(record("id", o.id, "compensation", C._id, "state", C.state)))
  else
    say(format("%s: compensated by %s (%s)", id_text(o.id), id_text(C._id), tostring(C.state)))
  end
  return OK
end

function _M.unpark(tm, o, fail)
  local ok, err = tm:unpark(o.id)
  if not ok then return fail(FAILED, err) end
  if o.json then
    say(json(record("id", o.id, "parked", false)))
  else
    say(format("%s: unparked; recovery takes it up again", id_text(o.id)))
  end
  return OK
end

-- prune in steps of o.batch, with a bar; --dry-run only counts.
function _M.prune(tm, o, fail)
  local todo, err = tm:prune { older_than = o.older_than, dry_run = true }
  if not todo then return fail(FAILED, err) end
  if o.dry_run then
    if o.json then say(json(record("event", "summary", "would_delete", todo)))
    else say(format("would delete %d finished transactions", todo)) end
    return OK
  end
  local bar = progress.new(stdout, "prune", todo, not o.json and progress.is_terminal())
  local start, deleted = core.monotonic_ms(), 0
  while true do
    local signal, number = core.signal_caught()
    if signal then -- each step deletes what it deletes whole: stop between two
      bar:finish(deleted)
      if o.json then say(json(record("event", "summary", "deleted", deleted, "stopped", signal))) end
      o.stopped = true
      return fail(128 + number, format("prune stopped by %s: deleted %d of %d finished " ..
        "transactions in %.1f s", signal, deleted, todo, (core.monotonic_ms() - start) / 1000))
    end
    local n
    n, err = tm:prune { older_than = o.older_than, limit = o.batch }
    if not n then
      bar:finish(deleted)
      return fail(FAILED, format("prune: %s (%d deleted before)", output.reason(err), deleted))
    end
    deleted = deleted + n
    bar:update(deleted)
    if o.json and n > 0 then say(json(record("event", "pass", "deleted", n))) end
    if n < o.batch then break end
  end
  bar:finish(deleted)
  local secs = (core.monotonic_ms() - start) / 1000
  if o.json then
    say(json(record("event", "summary", "deleted", deleted, "seconds", secs)))
  else
    say(format("deleted %d finished transactions in %.1f s", deleted, secs))
  end
  return OK
end

return _M

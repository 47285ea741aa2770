-- Section 4, server faults.
--   durability: a child inserts documents one at a time (each acknowledged
--     with j = true) while the server is killed with kill -9; the server is
--     restarted on the same files and every acknowledged document must be
--     there.  Measured for FerretDB (SQLite), mongo-java-server H2 with
--     spec/support/server's "commit" durability (what kind "h2" runs), and
--     H2's stock background commit, which is known to lose about a second
--     of writes: that row is a measurement, not a check.
--   kill -9 mid-run: the random workload runs (3 workers on H2, 1 on
--     FerretDB, which does not isolate concurrent writers) while the
--     server is killed and restarted on its files; then one recovery pass
--     and the invariants: nothing lost, nothing doubled; the floor
--     observer (torture/observer.lua) polls throughout, reconnecting
--     while the server is down.
--   connection drop: a transaction waits after each of its step events in
--     turn while the server is stopped (SIGSTOP); the rest of commit() must
--     return nil, err within the bound its timeouts give; the server is
--     continued, a recovery process settles the transaction, the
--     invariants hold (and the floor observer saw no balance below 0).
--     After the last event, when the engine has nothing left to ask the
--     server, commit() may return done at once (and must be done).

local proc = require "torture.proc"
local check = require "torture.check"
local fleet = require "torture.fleet"
local scenarios = require "torture.scenarios"
local observer = require "torture.observer"
local server = require "spec.support.server"
local mongotx = require "mongotx"
local core = mongotx.core

local M = {}

local function add(r, sub, label)
  r.cases = r.cases + (sub.cases or 0)
  r.violations = r.violations + (sub.violations or 0)
  r.crashes = r.crashes + (sub.crashes or 0)
  for _, v in ipairs(sub.failures or {}) do r.failures[#r.failures + 1] = label .. ": " .. v end
end

local function started(kind, opts)
  opts = opts or {}
  opts.kind = kind
  return assert(server.start(opts))
end

-- Acknowledged inserts, kill -9 after `after` s, restart, count.
local function durability(ctx, kind, how)
  local s = started(kind, { durability = how })
  local w = proc.spawn({ "acked", s.uri, "durable", 1000000 })
  core.sleep(ctx.full and 4 or 2)
  s:kill("KILL")
  proc.wait(w, 30)
  local acked = 0
  for i in proc.output(w):gmatch("ack (%d+)") do acked = math.max(acked, tonumber(i)) end
  proc.cleanup(w)
  assert(s:restart())
  local n = assert(check.db(s.uri, "durable"):collection("acked")
    :count({ _id = { ["$lte"] = acked } }))
  s:stop()
  return acked, acked - n
end

local function midrun(ctx, kind, workers)
  local s = started(kind)
  proc.single_writer = kind == "ferretdb" and workers == 1
  local f = fleet.new(s.uri, "midrun", { accounts = 20, tokens = 300 })
  for _ = 1, workers do f:spawn() end
  local kills = ctx.full and 5 or 2
  for _ = 1, kills do
    core.sleep(2 + math.random() * 2)
    s:kill("KILL")
    core.sleep(0.5)
    assert(s:restart())
  end
  core.sleep(2)
  local r = f:finish()
  proc.single_writer = false
  s:stop()
  r.notes = ("%s: %d server kills, %s"):format(kind, kills, r.notes)
  return r
end

-- URI timeouts of the connection-drop cases, and the bound they give one
-- failing call: each try (the first and policy.retries more) waits at most
-- for a socket timeout, then for server selection, whose rescan of a
-- server that accepts connections but never answers its hello waits
-- connectTimeoutMS (libmongoc's default of 10 s when the URI leaves it
-- out: a call then took 21.6 s here), plus the backoffs between tries.
local DROP = { select = 1500, socket = 1500, connect = 1000 }

local function bound_ms()
  local policy = require "mongotx.policy"
  local ms = (policy.retries + 1) * (DROP.select + DROP.connect + DROP.socket)
  for a = 1, policy.retries do ms = ms + policy.backoff(a) * 1000 end
  return ms + 1000 -- process scheduling on a busy machine
end

local function drop(ctx)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local s = started("memory")
  local uri = ("mongodb://127.0.0.1:%d/?serverSelectionTimeoutMS=%d&socketTimeoutMS=%d"
    .. "&connectTimeoutMS=%d"):format(s.port, DROP.select, DROP.socket, DROP.connect)
  local bound, worst, events, at = bound_ms(), 0, nil, -1
  repeat
    -- case 0 never waits: it counts the step events of a transaction
    at = at + 1
    local dbname = "drop" .. at
    local db = check.db(s.uri, dbname)
    local fixture = scenarios.fixture("insert")
    check.load(db, fixture)
    local ready, go = os.tmpname(), os.tmpname()
    os.remove(ready)
    os.remove(go)
    local obs = observer.start(s.uri, dbname)
    local w = proc.spawn({ "hold", uri, dbname, at, ready, go })
    local paused = false
    for _ = 1, 1000 do
      if io.open(ready) then paused = true break end
      if proc.status(w) then break end
      core.sleep(0.01)
    end
    if paused then s:kill("STOP") end
    assert(io.open(go, "w")):close()
    local rc = proc.wait(w, 60)
    if paused then s:kill("CONT") end
    local out = proc.output(w)
    proc.cleanup(w)
    os.remove(ready)
    os.remove(go)
    if at == 0 then events = tonumber(out:match("events (%d+)")) end
    local elapsed = tonumber(out:match("elapsed_ms (%d+)"))
    r.cases = r.cases + 1
    if rc ~= 0 then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = ("drop after event %d: status %s: %s"):format(at,
        tostring(rc), out)
    elseif at > 0 and not paused then
      r.violations = r.violations + 1
      r.failures[#r.failures + 1] = ("drop after event %d: never got there: %s"):format(at, out)
    elseif paused then
      worst = math.max(worst, elapsed or math.huge)
      -- after the last event nothing may be left to ask the server (the
      -- final transition returns the moved transaction): done at once is
      -- then right, and the audit below checks it
      local settled = out:find("result done") and at == events
      if not (out:find("result failed") or settled) or not elapsed or elapsed > bound then
        r.violations = r.violations + 1
        r.failures[#r.failures + 1] = ("drop after event %d: want nil, err within %d ms: %s")
          :format(at, bound, out:gsub("\n", " "))
      end
    end
    -- the server may still run what it read before it stopped: let it,
    -- then recover in a fresh process
    core.sleep(0.3)
    local rrc, said = proc.recover(s.uri, { dbname })
    if rrc ~= 0 then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = "drop recovery: " .. said
    end
    observer.add(r, obs:stop(), dbname .. " observer")
    local word = out:match("result (%a+)")
    local rep = check.database(db, fixture, { reported = { [scenarios.ID] = word == "done"
      and "done" or nil } })
    r.violations = r.violations + #rep.violations
    for _, v in ipairs(rep.violations) do r.failures[#r.failures + 1] = dbname .. ": " .. v end
    ctx.say("  connection drop after event %2d: %s, %s ms (bound %d), final %s", at,
      (out:match("result (%a+ ?%S*)") or "?"), tostring(elapsed), bound,
      tostring(rep.states[scenarios.ID]))
  until not events or at >= events
  s:stop()
  r.notes = ("connection drop: %d cases, slowest %d ms (bound %d)"):format(r.cases, worst, bound)
  return r
end

function M.run(ctx)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local notes = {}
  for _, d in ipairs { { "ferretdb" }, { "h2", "commit" }, { "h2", "background" } } do
    local acked, lost = durability(ctx, d[1], d[2])
    local label = d[1] .. (d[2] and ("/" .. d[2]) or "")
    ctx.say("  durability %-14s: %d acknowledged before kill -9, %d lost", label, acked, lost)
    notes[#notes + 1] = ("%s lost %d/%d"):format(label, lost, acked)
    if d[2] ~= "background" then
      r.cases = r.cases + 1
      if lost ~= 0 or acked == 0 then
        r.violations = r.violations + 1
        r.failures[#r.failures + 1] = ("durability %s: %d of %d acknowledged writes lost")
          :format(label, lost, acked)
      end
    end
  end
  for _, m in ipairs { { "h2", 3 }, { "ferretdb", 1 } } do
    local sub = midrun(ctx, m[1], m[2])
    ctx.say("  kill -9 mid-run %s", sub.notes)
    add(r, sub, "mid-run " .. m[1])
    notes[#notes + 1] = sub.notes
  end
  local sub = drop(ctx)
  add(r, sub, "drop")
  notes[#notes + 1] = sub.notes
  r.notes = table.concat(notes, "; ")
  return r
end

return M

-- The torture suite's child processes (each started by torture/proc.lua):
--
--   worker.lua run <uri> <db> <scenario> <kind> <prepare|run>
--       one phase of a crash-matrix scenario (torture/scenarios.lua);
--       MONGOTX_FAULT in the environment makes it crash at a point
--   worker.lua recover <uri> <dbs-file> [forward|back]
--       recovery in a fresh process: for each database named in the file,
--       recover() until no transaction is left in flight (rolling stale
--       pending ones back with "back"), in `transactions` and in the
--       other configuration's collection (torture/check.lua, OTHER)
--   worker.lua mix <uri> <db> <name> <accounts> <tokens> <stop-file> [stall]
--       random transactions (torture/workload.lua) until the stop file
--       exists, recover() every 20 of them (manager options by
--       workload.role(name)); with "stall", stops itself
--       (SIGSTOP) once, at a random step event, and carries on when
--       continued
--   worker.lua stall <uri> <db> <event> <direction>
--       one transaction that stops itself (SIGSTOP) after its <event>th
--       step event, for the stall section to take over and continue
--   worker.lua acked <uri> <db> <n>
--       n single inserts, "ack <i>" after each acknowledged one
--   worker.lua observe <uri> <db> <stop-file> <interval-ms>
--       the floor observer (torture/observer.lua): reads the accounts
--       that have a floor every <interval-ms> until the stop file exists
--       (then once more), and the shared logs of torture/serial.lua;
--       prints "ready" after its first poll, "below ..." for the first
--       sightings, "serial ..." for the first serial-order violations,
--       "orphan ..." for the first txHeld entries seen without their
--       marker and a "polls ..." summary line
--   worker.lua hold <uri> <db> <event> <ready-file> <go-file>
--       one transaction that, after its <event>th step event, writes the
--       ready file and waits for the go file, then times how long the rest
--       of commit() takes to return (the server is stopped meanwhile)
--
-- Output is one line per fact, flushed at once (a crash loses nothing
-- that was printed).

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local mongotx = require "mongotx"
require "torture.fencing"
local scenarios = require "torture.scenarios"
local workload = require "torture.workload"
local serial = require "torture.serial"
local core = mongotx.core

local function say(...)
  io.stdout:write(table.concat({ ... }, " "), "\n")
  io.stdout:flush()
end

local function outcome(res, err)
  if res then return "done" end
  return "failed " .. tostring(err and err.code) .. " " .. tostring(err):gsub("%s+", " ")
end

local exists = require("spec.support.server").exists

-- Stops this process with SIGSTOP (its parent shell's $PPID is us); it
-- goes on when the driver sends SIGCONT.
local function stop_self()
  os.execute("kill -STOP $PPID")
end

local mode, uri = arg[1], arg[2]

local function connect(dbname)
  return assert(mongotx.connect(uri, { database = dbname }))
end

if mode == "run" then
  local dbname, name, kind, phase = arg[3], arg[4], arg[5], arg[6]
  local s = assert(scenarios.find(name), "no scenario " .. tostring(name))
  local opts = { application = "torture", lease = 1, stale_after = 1 }
  if phase == "run" and s.manager then opts = s.manager end
  if phase == "prepare" and s.prepare_manager then opts = s.prepare_manager end
  local tm = assert(connect(dbname):manager(opts))
  local ctx = { kind = kind, failing = s.failing }
  say("result", outcome(s[phase](tm, ctx)))
elseif mode == "recover" then
  local f = assert(io.open(arg[3]))
  for dbname in f:lines() do
    local db = connect(dbname)
    local direction = arg[4] or "forward"
    local left = 0
    -- both transactions collections of the mixed managers (check.OTHER)
    for _, coll in ipairs { "transactions", require("torture.check").OTHER.collection } do
      local tm = assert(db:manager(scenarios.recovery_manager {
        collection = coll, stale_pending = function() return direction end }))
      for _, T in ipairs(assert(tm:find({ state = { ["$nin"] = { "done", "cancelled" } } },
                                        { limit = 100000 }))) do
        local after = scenarios.settle(tm, T._id, 15)
        if after and after.state ~= "done" and after.state ~= "cancelled" then left = left + 1 end
      end
    end
    say(left == 0 and "settled" or "unsettled", dbname, left)
    db:close()
  end
  f:close()
elseif mode == "mix" then
  local dbname, name = arg[3], arg[4]
  local sizes = { accounts = tonumber(arg[5]), tokens = tonumber(arg[6]) }
  local stopfile, stall = arg[7], arg[8] == "stall"
  math.randomseed(os.time() + tonumber(tostring({}):match("0x(%x+)") or "0", 16) % 1000003)
  local stall_at = stall and math.random(1, 60) or nil
  local events = 0
  local tm = assert(connect(dbname):manager(workload.manager_options(name, {
    on_event = stall and function()
      events = events + 1
      if events == stall_at then say("stopping", events) stop_self() say("continued") end
    end or nil,
  })))
  -- a worker of the other transactions collection ("w<k>t") uses the ids
  -- of worker w<k> and logs them as the checks key them ("tx2:<id>")
  local prefix, log = name, say
  if name:find("t$") then
    prefix = name:sub(1, -2)
    log = function(line) say((line:gsub("^(%S+) ", "%1 " .. tm.engine.vctx.collection .. ":", 1))) end
  end
  local done, n = {}, 0
  while not exists(stopfile) do
    n = n + 1
    workload.step(tm, prefix .. "-" .. n, sizes, log, done)
    if n % 20 == 0 then tm:recover() end
  end
  workload.close(tm, name)
elseif mode == "stall" then
  local dbname, at, direction = arg[3], tonumber(arg[4]), arg[5]
  local events = 0
  local tm = assert(connect(dbname):manager {
    application = "staller", lease = 1, stale_after = 1,
    on_event = function(name)
      events = events + 1
      if events == at then say("stopping", events, name) stop_self() say("continued") end
    end,
  })
  local T = assert(tm:begin(scenarios.ops("insert"), { id = scenarios.ID }))
  say("result", outcome(tm:commit(T)), direction)
  say("events", events)
elseif mode == "acked" then
  local coll = connect(arg[3]):collection("acked")
  for i = 1, tonumber(arg[4]) do
    local ok, err = coll:insert_one({ _id = i }, { write_concern = { w = 1, j = true } })
    if not ok then say("error", i, tostring(err)) break end
    say("ack", i)
  end
elseif mode == "observe" then
  local dbname, stopfile, interval = arg[3], arg[4], tonumber(arg[5]) / 1000
  local coll = connect(dbname):collection("accounts")
  local check = require "torture.check"
  local scoll = connect(dbname):collection(serial.COLLECTION)
  local found = {} -- serial-order violations seen, each counted once
  local filter = { floor = { ["$exists"] = true } }
  local opts = { projection = { balance = 1, floor = 1, [check.MARKER] = 1,
                                [check.OTHER.marker] = 1, [check.HELD] = 1 } }
  local polls, readings, sightings, errors, printed = 0, 0, 0, 0, 0
  local orphans, orphaned = 0, {} -- txHeld entries seen without their marker
  local lowest, below, gap = nil, {}, 0
  local t0 = core.monotonic_ms()
  local last = t0
  local function poll()
    local docs, err = coll:find_all(filter, opts)
    if not docs then
      errors = errors + 1
      if errors <= 3 then say("error", tostring(err):gsub("%s+", " ")) end
      core.sleep(0.05) -- a server killed and restarting (server faults)
      return
    end
    local now = core.monotonic_ms()
    gap, last = math.max(gap, now - last), now
    polls = polls + 1
    -- a document missing from one poll (a server may not show it to a
    -- scan while it rewrites it) keeps its last status
    for _, d in ipairs(docs) do
      local id = tostring(d._id)
      for _, k in ipairs(check.orphan_holds(d)) do
        if not orphaned[id .. "\0" .. k] then
          orphaned[id .. "\0" .. k], orphans = true, orphans + 1
          if orphans <= 50 then
            say(("orphan %.0f ms: %s/accounts/%s holds %s in txHeld without its marker"):format(
              now - t0, dbname, id, k))
          end
        end
      end
      if type(d.balance) == "number" and type(d.floor) == "number" and d.balance < d.floor then
        readings = readings + 1
        lowest = math.min(lowest or d.balance, d.balance)
        if not below[id] then
          sightings = sightings + 1
          if printed < 50 then
            printed = printed + 1
            local markers = {}
            for i, m in ipairs(type(d.pendingTransactions) == "table" and d.pendingTransactions
                or {}) do markers[i] = tostring(m) end
            say(("below %.0f ms: %s/accounts/%s balance %s floor %s markers [%s]"):format(
              now - t0, dbname, id, tostring(d.balance), tostring(d.floor),
              table.concat(markers, ",")))
          end
        end
        below[id] = true
      else
        below[id] = nil
      end
    end
    -- the serial-order check (torture/serial.lua) on the shared logs
    local sdocs = scoll:find_all({}, { projection = { log = 1 } })
    for _, why in ipairs(sdocs and serial.poll(sdocs) or {}) do
      if not found[why] then
        found[why], found[1] = true, (found[1] or 0) + 1
        if found[1] <= 50 then say(("serial %.0f ms: %s"):format(now - t0, why)) end
      end
    end
    if polls == 1 then say("ready") end
  end
  while not exists(stopfile) do
    poll()
    core.sleep(interval)
  end
  poll()
  say(("polls %d readings %d sightings %d errors %d lowest %s gap %.0f serial %d orphans %d")
    :format(polls, readings, sightings, errors, tostring(lowest or "none"), gap, found[1] or 0,
      orphans))
elseif mode == "hold" then
  local dbname, at, ready, go = arg[3], tonumber(arg[4]), arg[5], arg[6]
  local events, t0 = 0, nil
  local tm = assert(connect(dbname):manager {
    application = "holder", lease = 1, stale_after = 1,
    on_event = function(name)
      events = events + 1
      if events == at then
        local f = assert(io.open(ready, "w")); f:write(name, "\n"); f:close()
        while not exists(go) do core.sleep(0.01) end
        t0 = core.monotonic_ms()
      end
    end,
  })
  local T = assert(tm:begin(scenarios.ops("insert"), { id = scenarios.ID }))
  local res, err = tm:commit(T)
  say("result", outcome(res, err))
  say("events", events)
  if t0 then say("elapsed_ms", math.floor(core.monotonic_ms() - t0)) end
end
say("exit")

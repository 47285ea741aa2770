-- A fleet of `mix` workers (torture/worker.lua, torture/workload.lua) on
-- one database, for the kill, stall and server-fault sections: start
-- them, kill or stop some, end them, recover in a fresh process and check.
-- The floor observer (torture/observer.lua) watches the database from
-- before the first worker starts until after the final recovery.
--
--   local f = fleet.new(uri, dbname, { accounts = 20, tokens = 300 })
--   f:spawn()            -- one more worker; f.live lists the running ones
--   f:kill(w)           -- kill -9, expected (other signals: helpers.signal)
--   local r = f:finish() -- stop, recover, check: { violations, crashes, ... }

local proc = require "torture.proc"
local check = require "torture.check"
local workload = require "torture.workload"
local observer = require "torture.observer"
local helpers = require "spec.helpers"

local M = {}
local Fleet = {}
Fleet.__index = Fleet

-- mixed: the workers' configurations differ (issue 27; see spawn).
function M.new(uri, dbname, sizes, mixed)
  local self = setmetatable({ uri = uri, dbname = dbname, sizes = sizes, live = {}, all = {},
    mixed = mixed,
    stopfile = os.tmpname(), fixture = workload.fixture(sizes.accounts, sizes.tokens),
    killed = 0 }, Fleet)
  os.remove(self.stopfile)
  check.load(check.db(uri, dbname), self.fixture)
  self.observer = observer.start(uri, dbname)
  return self
end

-- A worker's name says its configuration (torture/workload.lua,
-- manager_options): in a mixed fleet, "w<n>" the defaults, "w<n-1>t" the
-- other transactions collection with the ids of worker w<n-1> (so ids
-- repeat across the two collections), "w<n>m" the other marker.
function Fleet:spawn()
  local n = #self.all + 1
  local name = "w" .. n
  if self.mixed and n % 3 == 2 then name = "w" .. (n - 1) .. "t"
  elseif self.mixed and n % 3 == 0 then name = name .. "m" end
  local w = proc.spawn({ "mix", self.uri, self.dbname, name, self.sizes.accounts,
                         self.sizes.tokens, self.stopfile })
  w.name = name
  self.all[#self.all + 1] = w
  self.live[#self.live + 1] = w
  return w
end

function Fleet:pick()
  return self.live[math.random(#self.live)]
end

-- kill -9 w and forget it (its status file says 137 once reaped)
function Fleet:kill(w)
  helpers.signal(w.pid, "KILL")
  w.killed = true
  self.killed = self.killed + 1
  for i, x in ipairs(self.live) do
    if x == w then table.remove(self.live, i) break end
  end
end

-- What every worker told its callers: id -> "done" or the error code.
local function reports(workers)
  local said, counts = {}, { begun = 0, done = 0, failed = 0, codes = {} }
  for _, w in ipairs(workers) do
    for line in proc.output(w):gmatch("[^\n]+") do
      local word, id, code = line:match("^(%a+) (%S+) ?(%S*)")
      if word == "begin" then
        counts.begun = counts.begun + 1
      elseif word == "done" then
        said[id] = "done"
        counts.done = counts.done + 1
      elseif word == "failed" then
        said[id] = code
        counts.failed = counts.failed + 1
        counts.codes[code] = (counts.codes[code] or 0) + 1
      end
    end
  end
  return said, counts
end

-- Ends the fleet (stop file, then waits), runs one recovery pass in a
-- fresh process, and checks the database.  recover_direction: see
-- worker.lua recover.
function Fleet:finish(recover_direction)
  local f = assert(io.open(self.stopfile, "w"))
  f:close()
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  for _, w in ipairs(self.all) do
    helpers.signal(w.pid, "CONT")
    local rc = proc.wait(w, 60)
    local how = rc and proc.classify(rc) or "hung"
    if not (how == "ok" or (how == "killed" and w.killed)) then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = ("worker %s %s (status %s): %s"):format(w.name, how,
        tostring(rc), proc.output(w):sub(-600))
    end
  end
  os.remove(self.stopfile)
  local said, counts = reports(self.all)
  for _, w in ipairs(self.all) do proc.cleanup(w) end

  local rc, out = proc.recover(self.uri, { self.dbname }, recover_direction, 300)
  if rc ~= 0 or not out:find("settled") or out:find("unsettled") then
    r.crashes = r.crashes + 1
    r.failures[#r.failures + 1] = "final recovery (status " .. tostring(rc) .. "): " .. out
  end

  local o = self.observer:stop()
  observer.add(r, o, "observer")

  local db = check.db(self.uri, self.dbname)
  local rep = check.database(db, self.fixture, { reported = said })
  local taken = assert(db:collection("transactions"):count({ epoch = { ["$gte"] = 2 } }))
  r.cases = rep.transactions
  r.violations = r.violations + #rep.violations
  for _, v in ipairs(rep.violations) do r.failures[#r.failures + 1] = v end
  r.counts, r.said, r.taken, r.observed = rep.counts, counts, taken, o
  local codes = { "done " .. counts.done }
  for code, k in pairs(counts.codes) do codes[#codes + 1] = code .. " " .. k end
  table.sort(codes, function(a, b) return a:match("%d+$") + 0 > b:match("%d+$") + 0 end)
  r.notes = ("%d workers, %d killed; %d done, %d cancelled (told: %s); %d taken over; %s")
    :format(#self.all, self.killed, rep.counts.done, rep.counts.cancelled,
      table.concat(codes, ", "), taken, observer.notes(o))
  return r
end

return M

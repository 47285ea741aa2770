-- The floor observer: a process of its own (torture/worker.lua observe),
-- with its own connection, that reads the guarded fields of a database
-- every few milliseconds while a section runs and records every moment a
-- balance is below its floor.  Guarded debits (`where balance >= floor +
-- amount`, tm:transfer's `min`) promise that no balance ever goes below
-- its floor, at any moment, not only at the end (DESIGN.md section 3: a
-- guard must never pass on the effects of a transaction that later ends
-- cancelled); the checks of torture/check.lua only see the end.  It
-- also reads the shared logs of torture/serial.lua at each poll: a cycle
-- or an entry twice is a serial-order violation, counted once.
--
-- The floored documents are those of `accounts` with a `floor` field
-- (torture/workload.lua gives every guarded account one; accounts without
-- it, such as the workload's spare accounts that compensations debit
-- without a guard, are not watched).  Each poll is one find of them all;
-- a document read is atomic, so every value seen is one the document
-- really had.  A sighting (one violation) is a document seen below its
-- floor after it was last seen at or above it: the episode is counted
-- once however many polls see it.
--
--   local obs = observer.start(uri, dbname)  -- returns once it has polled
--   ... start workers, kill them, recover ...
--   local o = obs:stop()  -- after the final recovery: one last poll, then
--   -- { polls, readings, sightings, errors, lowest, gap, first = {lines}, problem }
--   observer.add(r, o, label)  -- adds o's sightings to a section result

local proc = require "torture.proc"
local core = require "mongotx.core"

local M = {}

M.INTERVAL_MS = 3 -- pause between two polls
M.SHOW = 5        -- sightings printed in a section's failures

local Obs = {}
Obs.__index = Obs

function M.start(uri, dbname)
  local stopfile = os.tmpname()
  os.remove(stopfile)
  local c = proc.spawn({ "observe", uri, dbname, stopfile, M.INTERVAL_MS })
  local self = setmetatable({ c = c, stopfile = stopfile, dbname = dbname }, Obs)
  -- the workers start after its first poll
  local stop = core.monotonic_ms() + 30000
  while not proc.output(c):find("ready", 1, true) do
    if proc.status(c) or core.monotonic_ms() > stop then
      self.problem = "the observer did not start: " .. proc.output(c):sub(-400)
      break
    end
    core.sleep(0.01)
  end
  return self
end

-- Ends the observer (it polls once more first) and reads what it saw.
function Obs:stop()
  local f = assert(io.open(self.stopfile, "w"))
  f:close()
  local rc = proc.wait(self.c, 60)
  local out = proc.output(self.c)
  proc.cleanup(self.c)
  os.remove(self.stopfile)
  local o = { polls = 0, readings = 0, sightings = 0, errors = 0, gap = 0, first = {},
              problem = self.problem }
  o.serial, o.serial_first = 0, {}
  for line in out:gmatch("[^\n]+") do
    if line:match("^below ") then o.first[#o.first + 1] = line:sub(7) end
    if line:match("^serial ") then o.serial_first[#o.serial_first + 1] = line:sub(8) end
    local p, rd, s, e, low, gap, ser = line:match("^polls (%d+) readings (%d+) sightings (%d+) "
      .. "errors (%d+) lowest (%S+) gap (%d+) serial (%d+)")
    if p then
      o.polls, o.readings, o.sightings, o.errors = tonumber(p), tonumber(rd), tonumber(s),
        tonumber(e)
      o.lowest, o.gap, o.serial = tonumber(low), tonumber(gap), tonumber(ser)
    end
  end
  if rc ~= 0 or o.polls == 0 then
    o.problem = (o.problem and o.problem .. "; " or "") .. ("observer of %s: status %s, %d polls: %s")
      :format(self.dbname, tostring(rc), o.polls, out:sub(-400))
  end
  return o
end

-- Adds the observer's findings to a section result r ({ violations,
-- crashes, failures }): each sighting is a violation, the first M.SHOW
-- are printed; an observer that did not run is a crash (the section
-- proved nothing about floors).
function M.add(r, o, label)
  r.violations = r.violations + o.sightings + (o.serial or 0)
  for i = 1, math.min(#(o.serial_first or {}), M.SHOW) do
    r.failures[#r.failures + 1] = ("%s: serial order at %s"):format(label, o.serial_first[i])
  end
  for i = 1, math.min(#o.first, M.SHOW) do
    r.failures[#r.failures + 1] = ("%s: below its floor at %s"):format(label, o.first[i])
  end
  if o.sightings > M.SHOW then
    r.failures[#r.failures + 1] = ("%s: ... %d sightings below a floor in all (%d readings, "
      .. "lowest %s)"):format(label, o.sightings, o.readings, tostring(o.lowest))
  end
  if o.problem then
    r.crashes = r.crashes + 1
    r.failures[#r.failures + 1] = label .. ": " .. o.problem
  end
end

-- The observer's figures for a section's notes.
function M.notes(o)
  return ("observer: %d polls (longest gap %d ms), %d below-floor sightings, %d serial-order "
    .. "violations"):format(o.polls, o.gap or 0, o.sightings, o.serial or 0)
end

return M

-- Rows of the summary table that come from teammates' suites, run as they
-- are (`make torture` only; CI runs them as their own targets):
--   hostile  busted spec/30-hostile_spec.lua against a memory server:
--            cases = its tests, violations = failures + errors
--   fuzz     make fuzz-ci: cases = runs, crashes = crashes, from its
--            "fuzz: <harness> runs=<n> crashes=<k>" lines
-- A suite that does not exist yet is a "missing" row, counted as failed.

local server = require "spec.support.server"

local M = {}

local function capture(cmd)
  local f = assert(io.popen(cmd .. " 2>&1; echo \"rc=$?\""))
  local out = f:read("*a")
  f:close()
  local rc = tonumber(out:match("rc=(%d+)%s*$"))
  return out:gsub("rc=%d+%s*$", ""), rc
end

local exists = server.exists

function M.hostile()
  local spec = "spec/30-hostile_spec.lua"
  if not exists(spec) then return { cases = 0, violations = 0, crashes = 0, failed = "missing: " .. spec } end
  local out, rc = capture("spec/support/with-server memory -- spec/support/busted-lua5.4 -o utfTerminal "
    .. server.quote(spec))
  local plain = out:gsub("\27%[[%d;]*m", "")
  local s, f, e = plain:match("(%d+) successes? / (%d+) failures? / (%d+) errors?")
  if not s then
    return { cases = 0, violations = 0, crashes = 1, failed = "no busted summary (exit "
      .. tostring(rc) .. "): " .. plain:sub(-400) }
  end
  local r = { cases = s + f + e, violations = f + e, crashes = 0, failures = {} }
  if rc ~= 0 and r.violations == 0 then r.crashes = 1 end
  if r.violations > 0 then r.failures[1] = plain:sub(-2000) end
  r.notes = ("busted %s: %s successes, %s failures, %s errors"):format(spec, s, f, e)
  return r
end

function M.fuzz()
  local build = os.getenv("MONGOTX_TORTURE_BUILD")
  local make = "make --no-print-directory" .. (build and (" BUILD=" .. server.quote(build)) or "")
  local _, has = capture(make .. " -n fuzz-ci")
  if has ~= 0 then return { cases = 0, violations = 0, crashes = 0, failed = "missing: make fuzz-ci" } end
  local out, rc = capture(make .. " fuzz-ci")
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local harnesses = {}
  for h, runs, crashes in out:gmatch("fuzz: (%S+) runs=(%d+) crashes=(%d+)") do
    r.cases = r.cases + tonumber(runs)
    r.crashes = r.crashes + tonumber(crashes)
    harnesses[#harnesses + 1] = ("%s %s runs"):format(h, runs)
  end
  if #harnesses == 0 then
    r.failed = "make fuzz-ci printed no fuzz: lines (exit " .. tostring(rc) .. "): " .. out:sub(-400)
  elseif rc ~= 0 and r.crashes == 0 then
    r.crashes = 1
    r.failures[1] = "make fuzz-ci exited " .. tostring(rc) .. ": " .. out:sub(-600)
  end
  r.notes = "make fuzz-ci: " .. table.concat(harnesses, ", ")
  return r
end

return M

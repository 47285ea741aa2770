-- Child processes for the sync and versioned workloads
-- (spec/support/patterns.lua), started by spec/63, spec/64 and
-- torture/patterns.lua.  <fault> is a crash point spec
-- ("sync.clear:after:1", see csrc/fault.c) or "-" for none; MONGOTX_FAULT
-- in the environment works too.
--
--   pattern_worker.lua sync-rename <uri> <db> <user> <name> <fail> <fault>
--       one change (<fail>: "-", "raise" or "return": the propagation fails)
--   pattern_worker.lua sync-loop <uri> <db> <stop-file>
--       random renames until the stop file exists
--   pattern_worker.lua versioned-move <uri> <db> <fault>
--       one move (spec/support/patterns.lua)
--   pattern_worker.lua versioned-new <uri> <db> <fault>
--       a move on a root nobody wrote yet (NEW_ROOT): creates it
--   pattern_worker.lua versioned-race <uri> <db> <fault>
--       two writers from one version: the first publishes, the second
--       gets conflict and is aborted
--   pattern_worker.lua versioned-loop <uri> <db> <stop-file>
--       moves until the stop file exists
--   pattern_worker.lua repair <uri> <db> <sync|versioned> [<stop-file>]
--       sync:repair / versioned:gc with older_than = 0, once; with a stop
--       file, with older_than = 2 every half second until it exists
--
-- Output: one line per fact, flushed at once.

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local patterns = require "spec.support.patterns"
local core = require "mongotx.core"
local exists = require("spec.support.server").exists

local function say(...)
  io.stdout:write(table.concat({ ... }, " "), "\n")
  io.stdout:flush()
end

local function outcome(res, err)
  if res then return "ok " .. tostring(type(res) == "table" and res.syncSeq or res) end
  return "failed " .. tostring(err and err.code)
end

local mode, uri, dbname = arg[1], arg[2], arg[3]
local db = patterns.db(uri, dbname)
math.randomseed(os.time() + math.floor(core.monotonic_ms()))

local function arm(fault)
  if fault and fault ~= "-" then core.fault(fault) end
end

if mode == "sync-rename" then
  local fail = arg[6] ~= "-" and arg[6] or nil
  local s = patterns.syncer(db, fail)
  arm(arg[7])
  say("result", outcome(s:change(arg[4], { ["$set"] = { name = arg[5] } })))
elseif mode == "sync-loop" then
  local s = patterns.syncer(db)
  local i = 0
  while not exists(arg[4]) do
    i = i + 1
    local user = patterns.USERS[math.random(#patterns.USERS)]
    say("rename", user, outcome(s:change(user, { ["$set"] = { name = "p" .. i } })))
  end
elseif mode == "versioned-move" then
  local trees = patterns.trees(db)
  arm(arg[4])
  say("result", outcome(patterns.move(trees)))
elseif mode == "versioned-new" then
  local trees = patterns.trees(db)
  arm(arg[4])
  local w = assert(trees:begin(patterns.NEW_ROOT))
  assert(w:put("a", { n = patterns.TOTAL }))
  say("result", outcome(w:publish()))
elseif mode == "versioned-race" then
  local trees = patterns.trees(db)
  arm(arg[4])
  local w1, w2 = assert(trees:begin(patterns.ROOT)), assert(trees:begin(patterns.ROOT))
  assert(w1:put("a", { n = 19 }))
  assert(w1:put("b", { n = 21 }))
  assert(w2:put("c", { n = 30 }))
  say("first", outcome(w1:publish()))
  say("second", outcome(w2:publish()))
elseif mode == "versioned-loop" then
  local trees = patterns.trees(db)
  while not exists(arg[4]) do
    say("move", outcome(patterns.move(trees, math.random() * 0.02)))
  end
elseif mode == "repair" then
  local stop = arg[5]
  local which = arg[4]
  local s = which == "sync" and patterns.syncer(db) or patterns.trees(db)
  repeat
    local report, err
    if which == "sync" then
      report, err = s:repair { older_than = stop and 2 or 0 }
    else
      report, err = s:gc { older_than = stop and 2 or 0 }
    end
    say("repair", report and "ok" or "failed " .. tostring(err))
    if stop then core.sleep(0.5) end
  until not stop or exists(stop)
else
  error("unknown mode " .. tostring(mode))
end

-- bench/concurrent.lua: the multi-process mode.  ctx.procs processes
-- (bench/worker.lua) share ctx.n tm:transfer calls among ctx.accounts
-- accounts: 10 accounts is the hot case (every process fights over the
-- same documents), 10 000 the cold one.  With ctx.min every transfer
-- has that floor guard (the hot-account rows: 3 accounts against 1 000),
-- and the sample counts the calls answered `busy` or `contention` (in
-- `busy`).  ctx.fencing: the workers' managers' fencing.  With ctx.set (seconds)
-- each process runs tm:run calls that `$set` two random accounts for that
-- long instead (the hot-`$set` rows: 5 accounts against 1 000); every one
-- must end done or cancelled.  Throughput is the completed
-- transfers over the span from the first process's start to the last
-- one's end; CPU, round trips and writes are the processes' sums.

local helpers = require "spec.helpers"
local server = require "spec.support.server"
local bank = require "bench.bank"
local servercpu = require "bench.servercpu"

local _M = { label = "tm:transfer, processes" }

local function parse(lines)
  local out = {}
  for line in lines do
    local key, rest = line:match("^(%a+) ?(.*)$")
    if key then
      local words = {}
      for w in rest:gmatch("%S+") do words[#words + 1] = tonumber(w) end
      out[key] = words
    end
  end
  return out
end

function _M.run(ctx)
  local db = bank.open(ctx.uri, "procs" .. ctx.procs .. "_" .. ctx.accounts, ctx.accounts)
  local go = os.tmpname()
  os.remove(go)
  local pipes = {}
  local each = math.floor(ctx.n / ctx.procs)
  for p = 1, ctx.procs do
    -- MONGOC_DISABLE_SHM: libmongoc's shared-memory statistics, which
    -- warn when several processes start at once; nothing here reads them
    local cmd = table.concat({ "MONGOC_DISABLE_SHM=1", helpers.lua(), "bench/worker.lua", server.quote(ctx.uri),
      db.name, ctx.accounts, each, math.random(1, 1e9) + p, go, ctx.fencing or "auto", ctx.min or "-",
      ctx.set }, " ")
    pipes[p] = assert(io.popen(cmd, "r"))
  end
  for p = 1, ctx.procs do
    assert(pipes[p]:read("*l") == "ready", "worker " .. p .. " did not start")
  end
  local server0 = servercpu.read()
  assert(io.open(go, "w")):close()
  local sample = { n = each * ctx.procs, ok = 0, failed = 0, busy = 0, cpu_s = 0, commands = 0,
                   writes = 0, lat = {} }
  local first, last, moved = math.huge, -math.huge, {}
  for p = 1, ctx.procs do
    local r = parse(pipes[p]:lines())
    assert(pipes[p]:close(), "worker " .. p .. " failed")
    assert(r.span and r.counts and r.lat and r.moved, "worker " .. p .. " printed no result")
    first, last = math.min(first, r.span[1]), math.max(last, r.span[2])
    sample.ok, sample.failed = sample.ok + r.counts[1], sample.failed + r.counts[2]
    sample.cpu_s = sample.cpu_s + r.counts[3]
    sample.commands, sample.writes = sample.commands + r.counts[4], sample.writes + r.counts[5]
    sample.busy = sample.busy + r.counts[6]
    for _, v in ipairs(r.lat) do sample.lat[#sample.lat + 1] = v end
    for k = 1, #r.moved, 2 do
      moved[r.moved[k]] = (moved[r.moved[k]] or 0) + r.moved[k + 1]
    end
  end
  os.remove(go)
  if ctx.set then sample.n = sample.ok + sample.failed end -- as many as the time allowed
  sample.wall_ms = last - first
  sample.server_s = servercpu.since(server0) -- with the workers' exits: idle time
  bank.check_accounts(db, ctx.accounts, moved)
  bank.check_transactions(db, { done = sample.ok, cancelled = sample.failed })
  bank.drop(db)
  return sample
end

return _M

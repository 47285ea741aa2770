-- One serial order under concurrent writers (docs/guards.md, "Isolation";
-- issue 39): processes run transactions that push their name onto two of
-- four shared documents (torture/serial.lua: `$push` undone by `$pop`,
-- exclusive), by run, begin+commit, commit_many, and tm:step rolled back
-- while it holds a document; one more process rolls stale ones back.
-- This process reads the documents all along and checks at every read
-- that their logs admit one serial order (no cycle in the precedence
-- graph they give, no entry twice); at the end, that every done
-- transaction's entry is on each of its documents and nobody else's is.
-- Without isolation an undo's `$pop` takes another transaction's entry
-- (lost) and two transactions' pushes interleave (a cycle).
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local serial = require "torture.serial"

local concurrency = helpers.no_concurrency()

local WORKER = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
local serial = require "torture.serial"
local core = mongotx.core

local mode, uri, dbname, n, seed = arg[1], arg[2], arg[3], tonumber(arg[4]), tonumber(arg[5])
local db = assert(mongotx.connect(uri, { database = dbname }))
math.randomseed(seed)
local tm = assert(db:manager { application = mode .. "-" .. seed, lease = 0.5, stale_after = 0.5 })

local function report(t, err)
  if t then print("done") else print("cancelled " .. tostring(err and err.code)) end
  io.stdout:flush()
end

for k = 1, n do
  local name = ("%s%d-%d"):format(mode, seed, k)
  if mode == "run" then
    report(tm:run(serial.ops(name), { id = name }))
  elseif mode == "commit" then
    local t, err = tm:begin(serial.ops(name), { id = name })
    if t then report(tm:commit(t)) else report(nil, err) end
  elseif mode == "batch" then
    local list = {}
    for i = 1, 3 do list[i] = { ops = serial.ops(name .. "." .. i), id = name .. "." .. i } end
    local res, errs = tm:commit_many(list)
    for i = 1, 3 do report(res[i], errs[i]) end
  elseif mode == "step" then
    -- holds one document a moment, then rolled back (its $pop undo) or
    -- committed
    local t = tm:begin(serial.ops(name), { id = name })
    if t and tm:step("claim", t) and tm:step("apply", t, 1) then
      core.sleep(math.random() * 0.02)
      if k % 2 == 0 then
        report(nil, tm:rollback(t) and { code = "rolled back" })
      else
        report(tm:commit(t))
      end
    else
      report(nil, { code = "step" })
    end
  elseif mode == "recover" then
    local rec = assert(db:manager { application = "rec", stale_after = 0, lease = 0,
                                    stale_pending = function() return "back" end })
    rec:recover()
    core.sleep(0.05)
  end
end
print("exit")
]]

describe("#server #concurrency serial order under concurrent writers", function()
  if concurrency then
    it("runs on servers that isolate concurrent writers", function() pending(concurrency) end)
    return
  end

  it("the shared logs admit one serial order at every read and at the end", function()
    local dbname = helpers.db_name()
    local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    local coll = db:collection(serial.COLLECTION)
    assert(coll:insert_many(serial.fixture()))
    local procs = {}
    local function spawn(mode, n, seed)
      local pid, out, script = helpers.spawn_script(WORKER, mode, helpers.uri(), dbname, n, seed)
      procs[#procs + 1] = { pid = pid, out = out, script = script, mode = mode }
    end
    spawn("run", 40, 1)
    spawn("commit", 40, 2)
    spawn("batch", 12, 3)
    spawn("step", 20, 4)
    spawn("recover", 40, 5)

    local polls, violations, seen = 0, {}, {}
    local deadline = mongotx.core.monotonic_ms() + 180000
    while mongotx.core.monotonic_ms() < deadline do
      local running = false
      for _, p in ipairs(procs) do running = running or helpers.alive(p.pid) end
      if not running then break end
      local docs = coll:find_all({}, { projection = { log = 1 } })
      if docs then
        polls = polls + 1
        for _, why in ipairs(serial.poll(docs)) do
          if not seen[why] then
            seen[why] = true
            violations[#violations + 1] = ("poll %d: %s"):format(polls, why)
          end
        end
      end
    end
    local said, counts = {}, {}
    for _, p in ipairs(procs) do
      if helpers.alive(p.pid) then helpers.signal(p.pid, "KILL") end
      said[#said + 1] = helpers.read_file(p.out)
      os.remove(p.out)
      os.remove(p.script)
    end
    for i, p in ipairs(procs) do
      assert.truthy(said[i]:find("exit"), p.mode .. " worker: " .. said[i])
      for word in said[i]:gmatch("(%S+)\n") do counts[word] = (counts[word] or 0) + 1 end
    end
    assert.are.same({}, violations)

    -- whatever a worker left pending ends, then the end is checked
    local rec = assert(db:manager { application = "final", stale_after = 0, lease = 0 })
    mongotx.core.sleep(0.6)
    assert(rec:recover())
    local txs = assert(rec:find({}, { limit = 1000 }))
    for _, T in ipairs(txs) do
      assert.is_true(T.state == "done" or T.state == "cancelled", tostring(T._id) .. " " .. T.state)
    end
    local docs = assert(coll:find_all({}))
    assert.are.same({}, serial.final(docs, txs, function(T) return tostring(T._id) end))
    for _, d in ipairs(docs) do
      assert.are.same({}, d.pendingTransactions or {})
      assert.is_nil(d.txHeld and d.txHeld[1])
    end
    assert.is_true((counts.done or 0) > 20, "enough transactions ended done: " .. table.concat(said, "\n"):sub(1, 3000))
    print(("\n  serial order: %d transactions (%d done), %d polls, entries %d"):format(#txs,
      counts.done or 0, polls, (function()
        local n = 0
        for _, d in ipairs(docs) do n = n + #d.log end
        return n
      end)()))
    db:close()
  end)
end)

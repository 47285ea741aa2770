-- At most one outcome for a hold (docs/holds.md): captures (of several
-- amounts), voids, expiry and recovery racing from several processes end
-- each hold in exactly one of captured (one amount), voided or expired,
-- and every answer agrees with it; a process killed at every crash point
-- of a hold's opening, capture and void (MONGOTX_FAULT, as the torture
-- suite's matrix) leaves it recoverable to that one outcome (and so does
-- one killed while a capture expires a hold it met past its expiry); holds and
-- transfers on one hot account never take a balance below its floor at
-- any poll, and the sums, counting what open holds reserve, are
-- conserved.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local observer = require "torture.observer"

local concurrency = helpers.no_concurrency()
local Date = mongotx.core.Date

local PRELUDE = [[
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"
]]

local function balances(accounts)
  local out = {}
  for _, d in ipairs(helpers.dump(accounts)) do
    out[d._id] = { d.balance, d.txPending and d.txPending.balance or 0,
                   #(d.pendingTransactions or {}) }
  end
  return out
end

-- Each process decides every hold in its own order: capture of its own
-- amount (even ones) or void (odd ones); the last one also recovers.
local RACER = PRELUDE .. [[
local uri, dbname, me, n = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4])
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = "racer-" .. me, stale_after = 0, lease = 0 })
-- every racer starts when the spec opens the gate, once all are running
-- (a slow parent, under valgrind say, would let the first decide all)
local gate, waited = db:collection("gate"), 0
while not gate:find_one({ _id = "go" }) do
  assert(waited < 60, "the gate never opened")
  mongotx.core.sleep(0.005)
  waited = waited + 0.005
end
-- capturers (even) go up the holds, voiders (odd) down: they meet in the
-- middle, so both win some whatever the load (a random order let the
-- voiders win all 20 once on a loaded machine), and racers of one kind
-- race each other all along
local order = {}
for i = 1, n do order[i] = me % 2 == 0 and i or n + 1 - i end
for _, i in ipairs(order) do
  local id = "h" .. i
  local T, err, what
  if me % 2 == 0 then
    what = "capture " .. me
    T, err = tm:capture(id, me)
  else
    what = "void 0"
    T, err = tm:void(id)
  end
  if T then
    print(("%s %s ok %s %s"):format(id, what, T.hold.status, tostring(T.hold.captured)))
  else
    print(("%s %s err %s %s %s"):format(id, what, tostring(err.code), tostring(err.status),
      tostring(err.captured)))
  end
  if me == 1 then assert(tm:recover()) end
end
print("exit")
]]

describe("#server #concurrency holds decided by several processes at once", function()
  if concurrency then
    it("runs on servers that isolate concurrent writers", function() pending(concurrency) end)
    return
  end

  it("end each hold in one outcome, and every answer agrees with it", function()
    local N, START = 30, 10000
    local dbname = helpers.db_name()
    local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    local accounts, txs = db:collection("accounts"), db:collection("transactions")
    assert(accounts:insert_many { { _id = "A", balance = START }, { _id = "B", balance = 0 } })
    local tm = assert(db:manager { application = "setup" })
    for i = 1, N do assert(tm:hold("accounts", "A", "B", 10, { id = "h" .. i, min = 0 })) end
    -- a third of them are past their expiry before the race starts
    local past = Date(math.floor(assert(tm:server_now()) - 1000))
    for i = 1, N, 3 do
      assert(txs:update_one({ _id = "h" .. i }, { ["$set"] = { ["hold.expires"] = past, deadline = past } }))
    end
    local procs = {}
    for me = 1, 4 do
      local pid, out, script = helpers.spawn_script(RACER, helpers.uri(), dbname, me, N)
      procs[me] = { pid = pid, out = out, script = script }
    end
    assert(db:collection("gate"):insert_one({ _id = "go" }))
    local answers = {}
    for _, p in ipairs(procs) do
      local said = helpers.script_output(p.pid, p.out, p.script, 120)
      assert.truthy(said:find("exit"), said)
      for line in said:gmatch("[^\n]+") do
        local id, op, amt, res, a, b, c = line:match("^(h%d+) (%a+) (%d+) (%a+) (%S+) (%S+) ?(%S*)$")
        if id then
          answers[id] = answers[id] or {}
          table.insert(answers[id], { op = op, amount = tonumber(amt), ok = res == "ok",
            status = res == "ok" and a or b, code = res == "err" and a or nil,
            captured = tonumber(res == "ok" and b or c) })
        end
      end
    end
    local captured, outcomes = 0, {}
    for i = 1, N do
      local id = "h" .. i
      local T = assert(tm:get(id))
      local status = T.hold.status
      outcomes[status] = (outcomes[status] or 0) + 1
      assert.are.equal(4, #answers[id], id)
      if i % 3 == 1 then
        assert.are.equal("expired", status, id) -- never captured after its expiry
      end
      if status == "captured" then
        assert.are.equal("done", T.state, id)
        captured = captured + T.hold.captured
        for _, a in ipairs(answers[id]) do
          if a.op == "capture" and a.ok then
            assert.are.equal(T.hold.captured, a.amount, id) -- one amount
          else
            assert.is_false(a.ok, id)
            assert.are.equal("captured", a.status, id)
            assert.are.equal(T.hold.captured, a.captured, id)
          end
        end
      else
        assert.are.equal("cancelled", T.state, id)
        assert.truthy(status == "voided" or status == "expired", id .. " " .. status)
        for _, a in ipairs(answers[id]) do
          if a.op == "capture" then
            assert.is_false(a.ok, id)
            assert.are.equal(status, a.status, id)
          else
            assert.is_true(a.ok, id .. " " .. tostring(a.code) .. " " .. tostring(a.status))
            assert.are.equal(status, a.status, id)
          end
        end
      end
    end
    assert.truthy((outcomes.captured or 0) > 0 and (outcomes.expired or 0) > 0, "no race of both kinds")
    local b = balances(accounts)
    assert.are.same({ START - captured, 0, 0 }, b.A)
    assert.are.same({ captured, 0, 0 }, b.B)
    print(("\n  holds: 4 processes decided %d holds: %d captured, %d voided, %d expired")
      :format(N, outcomes.captured or 0, outcomes.voided or 0, outcomes.expired or 0))
    db:close()
  end)
end)

-- One call in a child that ends at crash point arg[4] (point:when:n),
-- or traces its points into the file MONGOTX_FAULT_TRACE names.
local CRASHER = PRELUDE .. [[
local uri, dbname, call, fault = arg[1], arg[2], arg[3], arg[4]
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = "crasher" })
if fault and fault ~= "" then mongotx.core.fault(fault) end
if call == "hold" then
  assert(tm:hold("accounts", "A", "B", 60, { id = "h1", min = 0 }))
elseif call == "capture" then
  assert(tm:capture("h1", 25))
elseif call == "expire" then
  local _, err = tm:capture("h1", 25) -- meets it past its expiry: expires it
  assert(err.status == "expired", tostring(err))
else
  assert(tm:void("h1"))
end
print("finished")
]]

describe("#server holds killed at every crash point", function()
  local function run_child(dbname, call, fault, trace)
    local env = trace and ("MONGOTX_FAULT_TRACE='" .. trace .. "' ") or ""
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write(CRASHER)
    f:close()
    local out = os.tmpname()
    -- (a crash exits with the fault's code: what the child printed tells)
    os.execute(("%s%s %s '%s' '%s' %s '%s' > %s 2>&1"):format(env, helpers.lua(), script,
      helpers.uri(), dbname, call, fault or "", out))
    local said = helpers.read_file(out)
    os.remove(script)
    os.remove(out)
    return said
  end

  local function fresh(call)
    local dbname = helpers.db_name()
    local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    assert(db:collection("accounts"):insert_many { { _id = "A", balance = 100 }, { _id = "B", balance = 0 } })
    local tm = assert(db:manager { application = "spec", stale_after = 0 })
    if call ~= "hold" then assert(tm:hold("accounts", "A", "B", 60, { id = "h1", min = 0 })) end
    if call == "expire" then
      local past = mongotx.core.Date(math.floor(assert(tm:server_now()) - 1000))
      assert(db:collection("transactions"):update_one({ _id = "h1" },
        { ["$set"] = { ["hold.expires"] = past, deadline = past } }))
    end
    return db, tm
  end

  local function points(call)
    local db = fresh(call)
    local trace = os.tmpname()
    os.remove(trace)
    local said = run_child(db.name, call, nil, trace)
    assert.truthy(said:find("finished"), said)
    local list, seen = {}, {}
    for line in io.lines(trace) do
      local point, when = line:match("^(%S+) (%S+)$")
      local k = point .. ":" .. when
      seen[k] = (seen[k] or 0) + 1
      list[#list + 1] = k .. ":" .. seen[k]
    end
    os.remove(trace)
    db:close()
    return list
  end

  -- After the crash: what the hold is may be only "not decided" or the
  -- call's outcome; recovery (the crasher's lease aged away) and the call
  -- again settle it to that outcome, with the money where it says.
  local expect = {
    hold = { A = 40, B = 60 }, capture = { A = 75, B = 25 }, void = { A = 100, B = 0 },
    expire = { A = 100, B = 0 },
  }
  for _, call in ipairs { "hold", "capture", "void", "expire" } do
    it("leave the " .. call .. " recoverable to its one outcome", function()
      local list = points(call)
      assert.truthy(#list >= 4, table.concat(list, " "))
      for _, case in ipairs(list) do
        local db, tm = fresh(call)
        local txs, accounts = db:collection("transactions"), db:collection("accounts")
        local said = run_child(db.name, call, case)
        assert.truthy(said:find("fault injected", 1, true), case .. ": the child did not crash: " .. said)
        local T = txs:find_one({ _id = "h1" })
        local state = T and T.state or "absent"
        if call == "capture" then
          assert.truthy(state == "pending" or state == "applied" or state == "done", case .. " " .. state)
        elseif call ~= "hold" then
          assert.truthy(state == "pending" or state == "canceling" or state == "cancelled", case .. " " .. state)
        end
        -- open: both marks on (the opener sent its applies, each once)
        local open = T and T.state == "pending"
          and accounts:count({ pendingTransactions = T.mark or T._id }) == 2
        if T then
          helpers.age(txs, "h1", 3600)
          if T.state == "pending" and call ~= "expire" then
            -- undecided: recovery must leave it alone until its expiry
            local back = assert(txs:find_one({ _id = "h1" }))
            assert(txs:update_one({ _id = "h1" }, { ["$set"] = { deadline = back.hold.expires } }))
          end
          assert(tm:recover())
        end
        local now = txs:find_one({ _id = "h1" })
        if call == "hold" then
          if open then
            assert.are.equal("pending", now.state, case) -- held: nobody decided it
            assert(tm:capture("h1"))
          elseif now and now.state == "pending" then
            -- its opener died before both applies landed: nobody may
            -- decide it (an apply could still land), recovery rolls it
            -- back once it expired
            local none, err = tm:capture("h1")
            assert.is_nil(none, case)
            assert.are.equal("opening", err.status, case)
            local past = Date(math.floor(assert(tm:server_now()) - 1000))
            assert(txs:update_one({ _id = "h1" }, { ["$set"] = { ["hold.expires"] = past, deadline = past } }))
            assert(tm:recover())
            now = txs:find_one({ _id = "h1" })
            assert.are.equal("cancelled", now.state, case)
            assert.are.equal("expired", tm:get("h1").hold.status, case)
          else
            -- it never opened: rolled back, or never created
            assert.truthy(not now or now.state == "cancelled", case)
          end
        elseif call == "capture" then
          local T2 = assert(tm:capture("h1", 25), case)
          assert.are.equal(25, T2.hold.captured, case)
          local none, err = tm:void("h1")
          assert.is_nil(none)
          assert.are.equal("captured", err.status, case)
        else
          -- void: voided; expire: expired, whoever settled it (the
          -- capture again, or recovery: the hold's deadline passed)
          local status = call == "void" and "voided" or "expired"
          local T2 = assert(tm:void("h1"), case)
          assert.are.equal(status, T2.hold.status, case)
          local none, err = tm:capture("h1")
          assert.is_nil(none)
          assert.are.equal(status, err.status, case)
        end
        local want = expect[call]
        if call == "hold" and not open then want = { A = 100, B = 0 } end
        local b = balances(accounts)
        assert.are.same({ want.A, 0, 0 }, b.A, case)
        assert.are.same({ want.B, 0, 0 }, b.B, case)
        db:close()
      end
      print(("\n  holds: %s killed at %d crash points (%s)"):format(call, #list, table.concat(list, " ")))
    end)
  end
end)

-- Holds and transfers on one hot account, and the observer's polls.
local HOT = PRELUDE .. [[
local uri, dbname, mode, n, seed = arg[1], arg[2], arg[3], tonumber(arg[4]), tonumber(arg[5])
local db = assert(mongotx.connect(uri, { database = dbname }))
local tm = assert(db:manager { application = "hot-" .. seed })
math.randomseed(seed)
local others = { "X1", "X2", "X3" }
local busy = 0
for k = 1, n do
  local to = others[math.random(3)]
  local amount = math.random(1, 20)
  local T, err
  if mode == "hold" then
    local id = ("h%d-%d"):format(seed, k)
    T, err = tm:hold("accounts", "H", to, amount, { min = 0, id = id, expires = 600 })
    if T then
      local r = math.random(3)
      if r == 1 then T, err = tm:capture(id, math.random(1, amount))
      elseif r == 2 then T, err = tm:void(id) end -- r == 3: left open
    end
  elseif math.random(2) == 1 then
    T, err = tm:transfer("accounts", "H", to, amount, { min = 0 })
  else
    T, err = tm:transfer("accounts", to, "H", amount, { min = 0 })
  end
  if not T and err.code == "busy" then busy = busy + 1 end
end
print("busy " .. busy)
print("exit")
]]

describe("#server #concurrency holds and transfers on one hot account", function()
  if concurrency then
    it("runs on servers that isolate concurrent writers", function() pending(concurrency) end)
    return
  end

  it("never cross a floor at any poll; the sums, counting what holds reserve, are whole", function()
    -- H has far less than the holds and transfers would take from it:
    -- its floor is what stops them
    local START, TOTAL = 500, 100 + 3 * 500
    local dbname = helpers.db_name()
    local db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    local accounts = db:collection("accounts")
    -- floor: the torture suite's observer watches them too (its own
    -- process, a poll every 3 ms)
    assert(accounts:insert_many { { _id = "H", balance = 100, floor = 0 },
      { _id = "X1", balance = START, floor = 0 }, { _id = "X2", balance = START, floor = 0 },
      { _id = "X3", balance = START, floor = 0 } })
    local obs = observer.start(helpers.uri(), dbname)
    assert.is_nil(obs.problem)
    local procs = {}
    for i, mode in ipairs { "hold", "hold", "transfer", "transfer" } do
      local pid, out, script = helpers.spawn_script(HOT, helpers.uri(), dbname, mode, 40, i)
      procs[i] = { pid = pid, out = out, script = script }
    end
    local polls, problems, reserved_seen = 0, {}, 0
    local deadline = mongotx.core.monotonic_ms() + 180000
    repeat
      local running = false
      for _, p in ipairs(procs) do running = running or helpers.alive(p.pid) end
      -- each document read is atomic, the find of them all is not: a
      -- poll checks each balance against its floor; the sums are checked
      -- once everything stopped (a poll could read A before a transfer's
      -- debit and B after its credit)
      local docs = accounts:find_all({})
      if docs then
        polls = polls + 1
        for _, d in ipairs(docs) do
          if (d.txPending and d.txPending.balance or 0) > 0 then reserved_seen = reserved_seen + 1 end
          if d.balance < 0 then problems[#problems + 1] = ("%s at %d"):format(d._id, d.balance) end
        end
      end
    until not running or mongotx.core.monotonic_ms() > deadline
    local seen = obs:stop()
    assert.is_nil(seen.problem)
    assert.truthy(seen.polls > 0)
    assert.are.equal(0, seen.sightings, table.concat(seen.first, "; "))
    local busy = 0
    for _, p in ipairs(procs) do
      local said = helpers.script_output(p.pid, p.out, p.script, 10)
      assert.truthy(said:find("exit"), said)
      busy = busy + tonumber(said:match("busy (%d+)"))
    end
    assert.are.same({}, problems)
    assert.are.equal(0, busy) -- holds make no floor wait
    assert.truthy(reserved_seen > 0, "no poll saw money in escrow: the spec tested nothing")
    -- the open holds' credits wait in escrow: counted, the sum is whole
    local open, reserved = 0, 0
    local tm = assert(db:manager { application = "check" })
    for _, T in ipairs(helpers.dump(db:collection("transactions"))) do
      if T.hold and T.state == "pending" then
        open, reserved = open + 1, reserved + T.hold.amount
        assert.are.equal("held", assert(tm:get(T._id)).hold.status)
      else
        assert.truthy(T.state == "done" or T.state == "cancelled", T.state)
      end
    end
    local sum, escrow = 0, 0
    for _, d in ipairs(helpers.dump(accounts)) do
      sum = sum + d.balance
      escrow = escrow + (d.txPending and d.txPending.balance or 0)
    end
    assert.are.equal(reserved, escrow)
    assert.are.equal(TOTAL, sum + escrow)
    print(("\n  holds: 2 processes holding and 2 transferring on one account, %d polls " ..
      "(observer: %d), %d open holds reserve %d"):format(polls, seen.polls, open, reserved))
    db:close()
  end)
end)

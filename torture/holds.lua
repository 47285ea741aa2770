-- Section "holds" (issue 44): holds, captures of all or part, voids,
-- expiries and ordinary transfers on one hot account under kill -9.
--
-- Workers (torture/holds_worker.lua) hold from the hot account H (and
-- into it), capture, void and transfer (min = 0), and recover now and
-- then, deciding their own holds and each other's, while the driver kill
-- -9s one at random every 0.3-1 s and starts another.  The floor
-- observer (torture/observer.lua) reads every account all along: no
-- balance below its floor at any moment.  Then, the workers gone:
--   1. recovery leaves the holds that have not expired open and settles
--      everything else; the sums are then conserved counting what the
--      open holds reserve: the balances plus the debits of the pending
--      holds sum to the start, and the escrowed credits are exactly the
--      pending holds' credits that applied;
--   2. every hold is expired (its expiry moved into the past), a final
--      recovery in a fresh process settles them, and torture/check.lua
--      checks the database (replaying the captured parts: `settle`) and
--      what the workers were told of transfers, captures and voids;
--   3. each hold has one outcome and every answer agrees with it: a
--      capture that succeeded names the amount the hold was captured
--      with, a void that succeeded the status it ended in, a refusal
--      (`state`) the outcome that refused it; a hold answered open did
--      open (it is captured, voided or expired, never failed).
-- mongo-java-server only (concurrent writers on one document).

local proc = require "torture.proc"
local check = require "torture.check"
local observer = require "torture.observer"
local scenarios = require "torture.scenarios"
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local holds = require "mongotx.holds"
local core = mongotx.core

local M = {}

local SCRIPT = "torture/holds_worker.lua"
M.WORKERS, M.START = 4, 1000
local ACCOUNTS = { "H", "X1", "X2", "X3" }

-- The answers the workers printed: { [id] = { {op, ok, amount, code, status, captured} } },
-- and what check.database audits (reported: id -> "done" | code).
local function answers(outputs)
  local by_id, reported, n = {}, {}, 0
  local function add(id, a)
    by_id[id] = by_id[id] or {}
    table.insert(by_id[id], a)
    n = n + 1
  end
  for _, out in ipairs(outputs) do
    for line in out:gmatch("[^\n]+") do
      local w = {}
      for x in line:gmatch("%S+") do w[#w + 1] = x end
      local op, id = w[1], w[2]
      if op == "hold" then
        add(id, { op = op, ok = w[3] == "ok", code = w[4] })
      elseif op == "capture" and w[4] == "ok" then
        add(id, { op = op, ok = true, captured = tonumber(w[5]) })
        reported[id] = "done"
      elseif op == "capture" and w[4] == "err" then
        add(id, { op = op, ok = false, code = w[5], status = w[6], captured = tonumber(w[7]) })
      elseif op == "void" and w[3] == "ok" then
        add(id, { op = op, ok = true, status = w[4] })
        reported[id] = "cancelled"
      elseif op == "void" and w[3] == "err" then
        add(id, { op = op, ok = false, code = w[4], status = w[5] })
      elseif op == "transfer" then
        reported[id] = w[3] == "done" and "done" or w[4]
        n = n + 1
      end
    end
  end
  return by_id, reported, n
end

-- Why the answers about hold T (nil: never created) disagree with it, or nil.
local function disagrees(T, list)
  local status = T and holds.status(T)
  for _, a in ipairs(list) do
    local why
    if a.op == "hold" and a.ok and not (status == "captured" or status == "voided"
        or status == "expired") then
      why = "answered open"
    elseif a.op == "hold" and a.code == "guard" and status ~= "failed" then
      why = "refused by its guard"
    elseif a.op == "capture" and a.ok and not (status == "captured" and T.hold.captured == a.captured) then
      why = "captured with " .. tostring(a.captured)
    elseif a.op == "void" and a.ok and status ~= a.status then
      why = "voided as " .. tostring(a.status)
    elseif a.code == "state" and (a.status == "captured" or a.status == "voided"
        or a.status == "expired") and (status ~= a.status
        or (a.captured and T.hold.captured ~= a.captured)) then
      why = ("refused as %s %s"):format(a.status, tostring(a.captured or ""))
    end
    if why then
      return ("%s: %s, but it ended %s (captured %s)"):format(a.op, why, tostring(status),
        tostring(T and T.hold.captured))
    end
  end
end

-- Recovers (in this process) until only holds not yet expired are in
-- flight; then the sums, counting what those holds reserve.  Returns the
-- open holds and a list of violations.
local function reserved(db, tm)
  local txs, accounts = db:collection("transactions"), db:collection("accounts")
  local open
  for _ = 1, 100 do
    assert(tm:recover())
    local now = assert(tm:server_now())
    local left = assert(txs:count({ state = { ["$nin"] = { "done", "cancelled" } },
      ["$nor"] = { holds.not_due(now) } }))
    if left == 0 then break end
    core.sleep(0.2)
  end
  open = assert(txs:find_all({ state = { ["$nin"] = { "done", "cancelled" } } }))
  local docs = {}
  for _, d in ipairs(assert(accounts:find_all({}))) do docs[d._id] = d end
  local function marked(id, T)
    for _, m in ipairs(docs[id].pendingTransactions or {}) do
      if m == (T.mark or T._id) then return true end
    end
    return false
  end
  local sum, debits, escrow, credits, bad = 0, 0, 0, 0, {}
  for _, d in pairs(docs) do
    sum = sum + d.balance
    escrow = escrow + (d.txPending and d.txPending.balance or 0)
  end
  for _, T in ipairs(open) do
    if type(T.hold) ~= "table" or T.state ~= "pending" then
      bad[#bad + 1] = ("%s is %s after recovery, not an open hold"):format(tostring(T._id), T.state)
    else
      if marked(T.source, T) then debits = debits + T.hold.amount end
      if marked(T.destination, T) then credits = credits + T.hold.amount end
    end
  end
  if sum + debits ~= M.START * #ACCOUNTS then
    bad[#bad + 1] = ("the balances (%d) and the open holds' debits (%d) sum to %d, not %d")
      :format(sum, debits, sum + debits, M.START * #ACCOUNTS)
  end
  if escrow ~= credits then
    bad[#bad + 1] = ("%d in escrow, but the open holds' credits are %d"):format(escrow, credits)
  end
  return open, bad, debits
end

function M.run(ctx)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local dbname = ("holds_%d"):format(os.time() % 100000)
  local fixture = { accounts = {} }
  for i, id in ipairs(ACCOUNTS) do fixture.accounts[i] = { _id = id, balance = M.START, floor = 0 } end
  local db = check.db(ctx.uri, dbname)
  check.load(db, fixture)
  local obs = observer.start(ctx.uri, dbname)
  local seconds = ctx.seconds or (ctx.full and 120 or 30)
  local workers, outputs, seed, killed = {}, {}, 0, 0
  local function spawn()
    seed = seed + 1
    return proc.spawn({ "work", ctx.uri, dbname, seed }, nil, SCRIPT)
  end
  local function reap(w)
    helpers.signal(w.pid, "KILL")
    local rc = proc.wait(w, 10)
    outputs[#outputs + 1] = proc.output(w)
    if not rc or proc.classify(rc) ~= "killed" then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = ("worker ended %s: %s"):format(tostring(rc),
        proc.output(w):sub(-600))
    end
    proc.cleanup(w)
  end
  for i = 1, ctx.workers or M.WORKERS do workers[i] = spawn() end
  local stop = core.monotonic_ms() + seconds * 1000
  while core.monotonic_ms() < stop do
    core.sleep(0.3 + math.random() * 0.7)
    local i = math.random(#workers)
    reap(workers[i])
    workers[i] = spawn()
    killed = killed + 1
  end
  for _, w in ipairs(workers) do reap(w) end

  local tm = assert(db:manager(scenarios.recovery_manager()))
  core.sleep(1.2) -- the killed workers' leases (1 s)
  local open, bad, debits = reserved(db, tm)
  -- then every hold expires, and a fresh process settles them
  local txs = db:collection("transactions")
  local past = core.Date(math.floor(assert(tm:server_now()) - 1000))
  assert(txs:update_many({ state = "pending", hold = { ["$exists"] = true } },
    { ["$set"] = { ["hold.expires"] = past, deadline = past } }))
  local rc, out = proc.recover(ctx.uri, { dbname }, "back", 300)
  if rc ~= 0 or not out:find("settled") or out:find("unsettled") then
    r.crashes = r.crashes + 1
    r.failures[#r.failures + 1] = "final recovery (status " .. tostring(rc) .. "): " .. out
  end
  local o = obs:stop()
  observer.add(r, o, "observer")

  local by_id, reported, said = answers(outputs)
  local rep = check.database(db, fixture, { reported = reported })
  for _, v in ipairs(bad) do rep.violations[#rep.violations + 1] = v end
  local outcomes, nholds = {}, 0
  for id, list in pairs(by_id) do
    local T = tm:get(id)
    if T then
      nholds = nholds + 1
      local s = holds.status(T)
      outcomes[s] = (outcomes[s] or 0) + 1
    end
    local why = disagrees(T, list)
    if why then rep.violations[#rep.violations + 1] = id .. ": " .. why end
  end
  r.cases = rep.transactions
  r.violations = r.violations + #rep.violations
  for _, v in ipairs(rep.violations) do r.failures[#r.failures + 1] = v end
  local kinds = {}
  for s, n in pairs(outcomes) do kinds[#kinds + 1] = s .. " " .. n end
  table.sort(kinds)
  r.notes = ("%d s, %d workers killed; %d answers; %d holds (%s), %d transactions in all; " ..
    "%d left open reserved %d; %s"):format(seconds, killed, said, nholds, table.concat(kinds, ", "),
    rep.transactions, #open, debits, observer.notes(o))
  ctx.say("  holds: %s", r.notes)
  return r
end

return M

-- Section "ledger": mongotx.ledger under crashes (issue 12).
--
-- 1. Its crash matrix: a clean run of the scenario (torture/ledger_worker.lua)
--    lists the ledger's crash points it passes (MONGOTX_FAULT_TRACE); then
--    for each (point, before|after, nth time) a fresh database, a child that
--    crashes exactly there, the committer in a fresh process, and the
--    invariants below.
-- 2. Random kill -9: workers transfer at random between accounts with
--    min = 0 (single and batched, committing now and then) while the
--    driver kill -9s one at random and starts another; meanwhile it polls
--    every account's reconciled balance (never below 0) and audits one
--    account at a time with reconcile (no problem).  At the end the
--    committer runs in a fresh process.
--
-- Invariants: the sum of all balances is what was deposited, no balance is
-- below 0, every account reconciles (seqIds 1..n, every cached balance
-- equals the replay from the first entry, balance() agrees) and no entry
-- is left UNCOMMITTED.  mongo-java-server only: FerretDB v1.24's unique
-- index does not reach into arrays of documents (spec/60).

local proc = require "torture.proc"
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local core = mongotx.core

local M = {}

local SCRIPT = "torture/ledger_worker.lua"
M.WORKERS, M.ACCOUNTS, M.START = 4, 12, 100

local serial = 0
local function fresh(uri, tag)
  serial = serial + 1
  local name = ("ledger_%s_%d_%d"):format(tag, os.time() % 100000, serial)
  local db = assert(mongotx.connect(uri, { database = name }))
  return db, assert(db:ledger {}), name
end

-- The invariants over `accounts`; returns a list of violations.
local function violations(L, db, accounts, total)
  local out, sum = {}, 0
  for _, a in ipairs(accounts) do
    local r, err = L:reconcile(a)
    if not r then
      out[#out + 1] = a .. ": " .. tostring(err)
    else
      if not r.ok then out[#out + 1] = a .. ": " .. table.concat(r.problems, "; ") end
      if r.balance < 0 then out[#out + 1] = ("%s: balance %d below 0"):format(a, r.balance) end
      sum = sum + r.balance
    end
  end
  if sum ~= total then out[#out + 1] = ("the balances sum to %d, not %d"):format(sum, total) end
  local left = db:collection("ledger"):count({ proc = "UNCOMMITTED" })
  if left ~= 0 then out[#out + 1] = ("%s entries left UNCOMMITTED"):format(tostring(left)) end
  return out
end

local function run_child(args, env, seconds)
  local c = proc.spawn(args, env, SCRIPT)
  local rc = proc.wait(c, seconds or 60)
  local out = proc.output(c)
  proc.cleanup(c)
  return rc and proc.classify(rc) or "hung", out
end

local function crash_matrix(ctx, r)
  local trace = os.tmpname()
  local db, L, name = fresh(ctx.uri, "trace")
  assert(L:post({ { account = "A", value = 50 } }))
  local kind, out = run_child({ "scenario", ctx.uri, name }, { MONGOTX_FAULT_TRACE = trace })
  assert(kind == "ok", "the clean scenario failed: " .. out)
  local points = require("torture.crashpoints").trace_points(trace)
  os.remove(trace)
  db:close()
  for _, fault in ipairs(points) do
    r.cases = r.cases + 1
    db, L, name = fresh(ctx.uri, "cp")
    assert(L:post({ { account = "A", value = 50 } }))
    kind, out = run_child({ "scenario", ctx.uri, name }, { MONGOTX_FAULT = fault })
    if kind ~= "injected" then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = fault .. ": the child ended " .. kind .. ": " .. out
    end
    kind, out = run_child({ "commit", ctx.uri, name })
    local bad = kind == "ok" and violations(L, db, { "A", "B", "C" }, 50)
      or { "the committer ended " .. kind .. ": " .. out }
    for _, v in ipairs(bad) do r.failures[#r.failures + 1] = fault .. ": " .. v end
    r.violations = r.violations + #bad
    db:close()
  end
  return #points
end

local function kills(ctx, r, seconds)
  local db, L, name = fresh(ctx.uri, "kills")
  local accounts, deposits = {}, {}
  for i = 1, M.ACCOUNTS do
    accounts[i] = "acc" .. i
    deposits[i] = { account = accounts[i], value = M.START }
  end
  assert(L:post(deposits))
  local total = M.START * M.ACCOUNTS
  local workers, seed, killed, running_bad = {}, 0, 0, 0
  local function spawn()
    seed = seed + 1
    return proc.spawn({ "work", ctx.uri, name, M.ACCOUNTS, seed }, nil, SCRIPT)
  end
  for i = 1, ctx.workers or M.WORKERS do workers[i] = spawn() end
  local stop = core.monotonic_ms() + seconds * 1000
  local next_kill = core.monotonic_ms() + 300 + math.random(700)
  while core.monotonic_ms() < stop do
    for _, a in ipairs(accounts) do -- the floor, watched while they run
      local b = L:balance(a)
      if b and b < 0 then
        running_bad = running_bad + 1
        r.failures[#r.failures + 1] = ("%s seen at %d while running"):format(a, b)
      end
    end
    -- an audit while they run: a replay of one account finds no problem
    local a = accounts[math.random(#accounts)]
    local audit = L:reconcile(a)
    if audit and not audit.ok then
      running_bad = running_bad + 1
      r.failures[#r.failures + 1] = ("%s audited while running: %s"):format(a,
        table.concat(audit.problems, "; "))
    end
    if core.monotonic_ms() >= next_kill then
      local i = math.random(#workers)
      helpers.signal(workers[i].pid, "KILL")
      proc.wait(workers[i], 10)
      proc.cleanup(workers[i])
      workers[i] = spawn()
      killed = killed + 1
      next_kill = core.monotonic_ms() + 300 + math.random(700)
    end
  end
  for _, w in ipairs(workers) do
    helpers.signal(w.pid, "KILL")
    local rc = proc.wait(w, 10)
    local out = proc.output(w)
    if rc and proc.classify(rc) ~= "killed" then
      r.crashes = r.crashes + 1
      r.failures[#r.failures + 1] = "a worker ended by itself: " .. out
    end
    proc.cleanup(w)
  end
  local kind, out = run_child({ "commit", ctx.uri, name }, nil, 300)
  local bad = kind == "ok" and violations(L, db, accounts, total)
    or { "the committer ended " .. kind .. ": " .. out }
  for _, v in ipairs(bad) do r.failures[#r.failures + 1] = "kills: " .. v end
  r.violations = r.violations + #bad + running_bad
  r.cases = r.cases + 1
  local entries = db:collection("ledger"):count({})
  db:close()
  return killed, entries
end

function M.run(ctx)
  local r = { cases = 0, violations = 0, crashes = 0, failures = {} }
  local points = crash_matrix(ctx, r)
  local seconds = ctx.seconds or (ctx.full and 120 or 20)
  local killed, entries = kills(ctx, r, seconds)
  r.notes = ("%d crash points; kill -9: %d s, %d kills, %d entries"):format(points, seconds,
    killed, entries)
  ctx.say("  ledger: %s", r.notes)
  return r
end

return M

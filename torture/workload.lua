-- The random workload of the kill, stall and server-fault sections: a few
-- hot accounts, transfers between them and multi-collection transactions
-- (a ledger insert, a token removal, an assert, a counter), plus now and
-- then the compensation of an earlier transfer.  Every transaction has a
-- caller-supplied id "<worker>-<n>", logged by the worker before it
-- begins and with its outcome after, so the audit (torture/check.lua) can
-- tell what each caller was promised.

local manager = require "mongotx.manager"

local M = {}

M.BALANCE = 300

function M.fixture(accounts, tokens)
  local f = { accounts = {}, tokens = {}, flags = { { _id = "open", open = true } },
              counters = {}, ledger = {} }
  for i = 1, accounts do f.accounts[i] = { _id = "acct" .. i, balance = M.BALANCE } end
  for i = 1, tokens do f.tokens[i] = { _id = "tok" .. i } end
  for i = 1, 3 do f.counters[i] = { _id = "c" .. i, n = 0 } end
  return f
end

local function pick_two(n)
  local a = math.random(n)
  local b
  repeat b = math.random(n) until b ~= a
  return "acct" .. a, "acct" .. b
end

-- Runs one random transaction `id` with manager tm; log(line) records what
-- happens.  `done` lists this worker's committed transfers (compensation
-- candidates).
function M.step(tm, id, sizes, log, done)
  local r = math.random(100)
  local from, to = pick_two(sizes.accounts)
  local amount = math.random(1, 60)
  local res, err
  if r <= 10 and #done > 0 then
    local orig = table.remove(done, math.random(#done))
    id = manager.compensation_id(orig)
    log("begin " .. id)
    res, err = tm:compensate({ _id = orig })
  elseif r <= 50 then
    log("begin " .. id)
    res, err = tm:transfer("accounts", from, to, amount, { id = id, min = 0 })
    if res then done[#done + 1] = id end
  else
    local ops = {
      { collection = "accounts", id = from, update = { ["$inc"] = { balance = -amount } },
        where = { balance = { ["$gte"] = amount } } },
      { collection = "accounts", id = to, update = { ["$inc"] = { balance = amount } } },
      { collection = "ledger", id = id, kind = "insert",
        doc = { from = from, to = to, amount = amount } },
    }
    if r <= 70 then
      ops[#ops + 1] = { collection = "tokens", id = "tok" .. math.random(sizes.tokens),
                        kind = "remove" }
    elseif r <= 85 then
      ops[#ops + 1] = { collection = "flags", id = "open", kind = "assert",
                        where = { open = true } }
    else
      ops[#ops + 1] = { collection = "counters", id = "c" .. math.random(3),
                        update = { ["$inc"] = { n = 1 } } }
    end
    log("begin " .. id)
    local T
    T, err = tm:begin(ops, { id = id })
    if T then res, err = tm:commit(T) end
  end
  if res then
    log("done " .. id)
  else
    log(("failed %s %s %s"):format(id, tostring(err and err.code),
      tostring(err):gsub("%s+", " ")))
  end
end

return M

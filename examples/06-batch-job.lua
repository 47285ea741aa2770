-- A resumable batch job: this month's interest on every account, one
-- transaction per account through tm:each (batches of commit_many), each
-- under an id made of the job's id and the account's.  Kill it at any
-- moment (kill -9 included) and run it again with the same job id: the
-- second run finishes what the first left in flight, applies nothing twice
-- and says what it skipped.
--
--   lua5.4 examples/06-batch-job.lua [--accounts N] [--job ID] [--rate BP]
--          [--batch N] [--lease SEC] [--wait SEC] [--database NAME] [--fresh]
--          [--quiet]
--
--   --accounts N   accounts to create when the collection is empty
--                  (default 100000); balances in cents, from 0 to 99 999
--   --job ID       the job's id (default interest-<this month>); the same
--                  id resumes the job, another id is another job
--   --rate BP      monthly interest in basis points (default 50: 0.5 %),
--                  rounded down to the cent; an account due nothing is left
--                  out (fn returns nil)
--   --fresh        drop the accounts and transactions first
--   --lease SEC    the manager's lease and stale_after (default 10): a
--                  killed run's transactions are held that long
--   --wait SEC     how long a re-run waits, at most, for the transactions
--                  a killed run still holds (default twice the lease);
--                  those still held then are reported failed (`owned`)
--   --quiet        no progress lines
--
-- Every op also sets the account's `lastInterest` to the job's id, and
-- applies only where it is not that already (a guard): even a re-run after
-- the job's transactions were pruned cannot pay the month twice.
--
-- Output ends with one line `report items=... committed=... ...`; exit
-- status 0 when nothing failed, 1 otherwise, 2 for bad usage.  Run from the
-- repository root; MONGOTX_CPATH says where mongotx/core.so is (default
-- ./build/lua54/?.so); MONGOTX_TEST_URI is the server (default
-- mongodb://127.0.0.1:27017).  Uses the database mongotx_demo unless told.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local mongotx = common.mongotx

local USAGE = "usage: lua5.4 examples/06-batch-job.lua [--accounts N] [--job ID] [--rate BP] " ..
  "[--batch N] [--lease SEC] [--wait SEC] [--database NAME] [--fresh] [--quiet]\n"

local args = { accounts = 100000, job = "interest-" .. os.date("!%Y-%m"), rate = 50,
               batch = 100, lease = 10, wait = false, database = common.DATABASE }
do
  local numeric = { accounts = true, rate = true, batch = true, lease = true, wait = true }
  local i = 1
  while arg[i] do
    local name = arg[i]:match("^%-%-(%w+)$")
    if name == "fresh" or name == "quiet" then
      args[name] = true
    elseif name and args[name] ~= nil and arg[i + 1] then
      local v = arg[i + 1]
      if numeric[name] then v = tonumber(v) end
      if v == nil then io.stderr:write(USAGE) os.exit(2) end
      args[name], i = v, i + 1
    else
      io.stderr:write(USAGE)
      os.exit(2)
    end
    i = i + 1
  end
end

local db = assert(mongotx.connect(common.URI, { database = args.database }))
local accounts = db:collection("accounts")
if args.fresh then common.fresh(db, "accounts") end

-- The opening balance of account i (cents): the same on every run, so a
-- checker can compute what each account must hold afterwards; one account
-- in ten holds under 2.00, too little to earn a cent.
local function opening(i) return (i * 7919) % (i % 10 == 0 and 200 or 100000) end

if assert(accounts:count({})) == 0 then
  for first = 1, args.accounts, 1000 do
    local docs = {}
    for i = first, math.min(first + 999, args.accounts) do
      docs[#docs + 1] = { _id = i, balance = opening(i) }
    end
    assert(accounts:insert_many(docs))
  end
  print(("created %d accounts"):format(args.accounts))
end

local tm = assert(db:manager { application = "interest-job", lease = args.lease,
                               stale_after = args.lease })
local job = args.job

-- One account's transaction: the interest, and the mark that this job
-- paid it (undone to the mark it had before, should the transaction be
-- rolled back).
local function interest(account)
  local amount = math.floor(account.balance * args.rate / 10000)
  if amount <= 0 then return nil end
  local undo_mark = account.lastInterest == nil and { ["$unset"] = { lastInterest = "" } }
    or { ["$set"] = { lastInterest = account.lastInterest } }
  undo_mark["$inc"] = { balance = -amount }
  return { {
    collection = "accounts", id = account._id,
    update = { ["$inc"] = { balance = amount }, ["$set"] = { lastInterest = job } },
    undo = undo_mark,
    where = { lastInterest = { ["$ne"] = job } },
  } }, { job = job, interest = amount }
end

local started = mongotx.core.monotonic_ms()
local cursor = accounts:find({}, { sort = { _id = 1 } })
local report, err = tm:each(cursor, interest, {
  id = job, key = function(account) return account._id end, batch = args.batch,
  wait = args.wait or nil,
  progress = not args.quiet and function(r)
    if r.batches % 100 == 0 then
      print(("%d accounts: %d paid, %d done before, %d due nothing, %.0f/s"):format(r.items,
        r.committed, r.skipped, r.excluded,
        r.items * 1000 / math.max(1, mongotx.core.monotonic_ms() - started)))
    end
  end or nil,
})
cursor:close()
if not report then
  io.stderr:write("the job stopped: ", tostring(err), "\n")
  report = err.report
  if not report then os.exit(1) end
end

for _, c in ipairs(report.cancellations) do
  print(("cancelled: account %s (%s)%s"):format(tostring(c.key), tostring(c.reason),
    c.earlier and ", by an earlier run" or ""))
end
for _, f in ipairs(report.failures) do
  print(("failed: account %s: %s"):format(tostring(f.key), tostring(f.error)))
end
print(("job %s: %d accounts seen, %d paid now (%d of them left in flight by an earlier run), " ..
  "%d paid by an earlier run and skipped, %d due nothing, %d cancelled, %d failed, in %.1f s")
  :format(job, report.items, report.committed, report.recovered, report.skipped, report.excluded,
    report.cancelled, report.failed, (mongotx.core.monotonic_ms() - started) / 1000))
print(("report items=%d committed=%d recovered=%d skipped=%d excluded=%d cancelled=%d failed=%d")
  :format(report.items, report.committed, report.recovered, report.skipped, report.excluded,
    report.cancelled, report.failed))
os.exit((err or report.failed > 0) and 1 or 0)

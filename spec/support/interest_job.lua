-- examples/06-batch-job.lua seen from outside, for spec/17-each_spec.lua
-- and torture/batchjob.lua: its accounts, running it (in the foreground,
-- or in the background to kill it), its report line, and the check of
-- exactly-once for every account.

local server = require "spec.support.server"
local helpers = require "spec.helpers"

local M = {}

M.RATE = 50 -- basis points: the example's default

-- The example's opening balance of account i, and the interest it pays.
function M.opening(i) return (i * 7919) % (i % 10 == 0 and 200 or 100000) end
function M.interest(i) return math.floor(M.opening(i) * M.RATE / 10000) end

-- Accounts 1..n as the example would create them.
function M.create(accounts, n)
  for first = 1, n, 1000 do
    local docs = {}
    for i = first, math.min(first + 999, n) do docs[#docs + 1] = { _id = i, balance = M.opening(i) } end
    assert(accounts:insert_many(docs))
  end
end

-- How many accounts of 1..n are due interest.
function M.due(n)
  local d = 0
  for i = 1, n do if M.interest(i) > 0 then d = d + 1 end end
  return d
end

local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- The shell command running the example on database `name` with job `job`;
-- env: extra environment variables (MONGOTX_FAULT, ...).
function M.command(uri, name, job, args, env)
  local parts = { "MONGOTX_TEST_URI=" .. quote(uri) }
  for k, v in pairs(env or {}) do parts[#parts + 1] = k .. "=" .. quote(v) end
  parts[#parts + 1] = helpers.lua() .. " examples/06-batch-job.lua --quiet --database " ..
    quote(name) .. " --job " .. quote(job)
  for _, a in ipairs(args or {}) do parts[#parts + 1] = quote(a) end
  return table.concat(parts, " ")
end

-- The report line of the example's output as a table, or nil.
function M.parse(out)
  local line = out:match("report ([^\n]*)")
  if not line then return nil end
  local r = {}
  for k, v in line:gmatch("(%w+)=(%d+)") do r[k] = tonumber(v) end
  return r
end

-- Runs the example to its end: exit code, output, report.
function M.run(uri, name, job, args, env)
  local out = os.tmpname()
  local rc = server.execute(M.command(uri, name, job, args, env) .. " > " .. out .. " 2>&1")
  local text = helpers.read_file(out)
  os.remove(out)
  return rc, text, M.parse(text)
end

-- Starts the example in the background: its pid and output file.
function M.start(uri, name, job, args, env)
  local out = os.tmpname()
  local p = assert(io.popen(M.command(uri, name, job, args, env) .. " > " .. out ..
    " 2>&1 & echo $!"))
  local pid = tonumber(p:read("*l"))
  p:close()
  return pid, out
end

-- Checks accounts 1..n against job `job`, which may be half done (final
-- false) or must be complete (final true).  Every account holds its
-- opening balance or that plus its interest, never more; it is marked
-- paid by this job exactly when the interest is in its balance; at the
-- end every account due interest has it, once, with no marker left.
-- Returns the list of violations (empty when none) and how many are paid.
function M.check(accounts, n, job, final)
  local bad, paid = {}, 0
  local docs = assert(accounts:find_all({}, { sort = { _id = 1 } }))
  if #docs ~= n then bad[#bad + 1] = ("%d accounts, not %d"):format(#docs, n) end
  for _, d in ipairs(docs) do
    local i = d._id
    local open, due = M.opening(i), M.interest(i)
    local marked = d.lastInterest == job
    if d.balance == open + due and due > 0 then
      paid = paid + 1
      if not marked then bad[#bad + 1] = ("account %d has its interest, unmarked"):format(i) end
    elseif d.balance ~= open then
      bad[#bad + 1] = ("account %d holds %s: neither %d nor %d"):format(i, tostring(d.balance),
        open, open + due)
    elseif marked then
      bad[#bad + 1] = ("account %d is marked paid without its interest"):format(i)
    end
    if final then
      if due > 0 and d.balance ~= open + due then
        bad[#bad + 1] = ("account %d was not paid"):format(i)
      end
      if d.pendingTransactions and #d.pendingTransactions > 0 then
        bad[#bad + 1] = ("account %d keeps a marker"):format(i)
      end
    end
  end
  return bad, paid
end

return M

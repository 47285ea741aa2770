-- mongotx.manager.batches: how the manager runs the specs its calls
-- checked (mongotx.manager.checks), as functions taking the manager:
-- batches of at most CHUNK through mongotx.batch, the committed
-- transactions then finished at once or queued for tm:finish
-- (policy.finish).  mongotx.group runs its batches through run_batch too.

local batch = require "mongotx.batch"
local errors = require "mongotx.errors"

local ipairs, error = ipairs, error

local _M = {}

-- The most transactions one batch.run takes: a caller's bigger batch runs
-- as several.  The server matches each transaction of a commit or done
-- update against the whole `$in` list of the batch's ids, so a step's cost
-- per transaction grows with the batch; on mongo-java-server, batches of
-- 50-100 cost the least per transaction, 1000 three times more in those
-- steps (bench/README.md, "Client CPU and batch size").
local CHUNK = 100

-- Runs specs as batches of at most CHUNK; the i-th result, or false and
-- its error, and late[i] = true for those settled after the others of
-- their batch (batch.run).
function _M.run_batch(self, specs, errs)
  local results, late, todo, where, m = {}, {}, {}, {}, 0
  local function run()
    local res, bad, committed, slow = batch.run(self.engine, todo)
    for k = 1, m do
      local i = where[k]
      results[i], errs[i], late[i] = res[k], bad[k], slow[k] or nil
    end
    _M.finish_committed(self, committed)
    todo, where, m = {}, {}, 0
  end
  for i = 1, #errs do
    results[i] = false
    local spec = specs[i]
    if spec then
      m = m + 1
      todo[m], where[m] = spec, i
      if m == CHUNK then run() end
    end
  end
  if m > 0 then run() end
  return results, errs, late
end

-- One spec, as tm:run and tm:transfer run it: the transaction, or nil,
-- err.  A policy that raised while it settled (batch.run fails its entry
-- with the raise, code "policy") raises here, as it did before it reached
-- the batch's guard: the call's own raise.
function _M.run_one(self, spec)
  local results, errs = _M.run_batch(self, { spec }, { false })
  if results[1] then return results[1] end
  if errors.is_policy(errs[1]) then error(errs[1], 0) end
  return nil, errs[1]
end

-- The committed transactions of a batch: finished now (policy.finish =
-- "inline"; on failure they stay applied and recovery finishes them), or
-- queued for finish() ("deferred"), which runs by itself every
-- policy.finish_batch of them.
function _M.finish_committed(self, committed)
  if self.policy.finish == "deferred" then
    local queue = self.finishing
    for _, T in ipairs(committed) do queue[#queue + 1] = T end
    if #queue >= self.policy.finish_batch then self:finish() end
  elseif #committed > 0 then
    batch.finish(self.engine, committed)
  end
end

return _M

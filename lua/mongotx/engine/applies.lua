-- mongotx.engine.applies: a claimed transaction's applies under
-- policy.on_op_failure: each op tried (Engine:apply_one), an op that
-- cannot apply yet retried after a backoff (apply_more hands the wait to
-- its caller: apply_ops sleeps it, mongotx.batch.settle sleeps once for a
-- batch's entries that wait), the documents held given back first when
-- an older holder outranks it (give_back), else cancelled.  Methods of
-- the Engine class (mongotx.engine adds `methods` to it).

local bands = require "mongotx.engine.bands"
local phases = require "mongotx.engine.phases"

local ipairs, pairs, pcall, error, next = ipairs, pairs, pcall, error, next
local op_failure = phases.op_failure

local _M = {}

-- The Engine methods of this module.
local Engine = {}
_M.methods = Engine

-- Undoes the ops of pending T that `applied` lists (i -> true), which
-- T holds and gives back to wait without holding them (apply_all, and a
-- batch's transaction that could not take all its documents); each one
-- undone leaves the list.  Each undo is fenced by this owner's deadline
-- as the applies are: a new owner may drive T forward once it passed,
-- and a late undo would then take a committed effect back.  Without a
-- deadline (fencing by versions alone) nothing is given back: false.
-- Returns true, false, or nil, err.
function Engine:give_back(T, applied, deadline)
  if not deadline then return false end
  for i, op in ipairs(T.ops) do
    if applied[i] then
      local res, err = self:op_step(T, "undo", self:coll(op.collection), op, deadline,
        bands.takeover(T))
      if not res then return nil, err end
      if res.undone then applied[i] = nil end
    end
  end
  return true
end

-- pending (held) -> applied, or -> canceling when an op cannot apply.
-- Returns the transaction's next document and, after a cancel, the error
-- that explains it.
function Engine:apply_all(T, versions, hand, tries)
  local ok, err, failure, busy = self:apply_ops(T, versions, hand, tries)
  if ok ~= true then return ok, err, failure, busy end
  return self:move(T, "commit", T.epoch)
end

-- Applies T's ops not yet applied (versions[i].marked), guarded ops
-- first, under policy.on_op_failure.  Returns true when all applied (T
-- still pending: apply_all commits it, mongotx.holds leaves it open),
-- else what apply_all returns: T as now read (taken over), or cancelled
-- and the failure, or nil, err.  With `hand`, a retry is not slept
-- here: nil, nil, nil, { st = <the apply's state>, wait = <seconds> }
-- (its caller waits: mongotx.group.busy).  `tries`: each op's tries so
-- far (an apply handed before: Engine:resolve).  Only here, without
-- `hand`, does an apply sleep its own retries: self.waits says so to
-- Engine:resolve while it runs (a dead holder it meets is driven to its
-- end here; anywhere else its retry is not waited for inside the apply).
function Engine:apply_ops(T, versions, hand, tries)
  local st = self:apply_start(T, versions, tries)
  local waits = self.waits
  while true do
    self.waits = not hand
    local ok, a, b, c = pcall(self.apply_more, self, st)
    self.waits = waits
    if not ok then error(a, 0) end
    if a ~= false then return a, b, c end
    if hand then return nil, nil, nil, { st = st, wait = b } end
    self.policy.sleep(b)
  end
end

-- The state of T's apply for apply_more: its ops in the order they
-- apply (the guarded ones first: a transaction whose guard fails then
-- has nothing else applied to undo, and holds no document meanwhile),
-- those applied (held[i]) and each op's tries (from `tries`, when given).
function Engine:apply_start(T, versions, tries) -- luacheck: no self
  local order, held = {}, {}
  for i, op in ipairs(T.ops) do
    if op.where then order[#order + 1] = i end
  end
  for i, op in ipairs(T.ops) do
    if not op.where then order[#order + 1] = i end
  end
  for i, v in ipairs(versions) do
    if v.marked then held[i] = true end
  end
  local n = {}
  for i, c in pairs(tries or {}) do n[i] = c end
  return { T = T, versions = versions, order = order, held = held, tries = n, k = 1 }
end

-- Runs the apply of apply_start's state st on until it ends (what
-- apply_ops returns) or an op is to be retried after a backoff: then
-- false and the seconds to wait (policy.backoff), its `retry` event
-- emitted.  The caller sleeps, then calls again: apply_ops for one
-- transaction, mongotx.batch once for all of a batch's that wait.
function Engine:apply_more(st)
  local T, versions, order, held, tries = st.T, st.versions, st.order, st.held, st.tries
  -- No cycle of waits (docs/guards.md, "Isolation"): a T that holds
  -- documents and meets an open holder with an older mark gives its
  -- documents back (undoes its applies, still pending, fenced by its
  -- deadline: give_back) before it waits, then applies them again.  So a
  -- T waits holding documents only for younger holders.
  while st.k <= #order do
    local i = order[st.k]
    if held[i] then
      st.k = st.k + 1
    else
      local ok, why, extra = self:apply_one(T, i, versions[i])
      -- (busy: whether an older holder outranks T; refused: the server's error)
      local outranked, refusal = why == "busy" and extra, why == "refused" and extra or nil
      if ok then
        held[i], st.k = true, st.k + 1
      elseif ok == nil then
        if why.code == "fenced" then return self:get(T._id) end
        return nil, why
      else
        local decision = self.policy.on_op_failure(T, i, why)
        tries[i] = (tries[i] or 0) + 1
        if decision == "retry" and tries[i] <= self.policy.retries then
          if outranked and next(held) then
            local gave, err = self:give_back(T, held, versions[i].deadline)
            if gave == nil then return nil, err end
            if gave then st.k = 1 end
          end
          self:event("retry", { id = T._id, step = "apply", reason = why })
          return false, self.policy.backoff(tries[i])
        elseif decision == "fail" then
          return nil, op_failure(T, i, why, refusal)
        else
          local failure = op_failure(T, i, why, refusal)
          failure.cause = why
          local moved, err = self:cancel(T, failure.message, why, i)
          if not moved then return nil, err end
          return moved, nil, failure
        end
      end
    end
  end
  return true
end

return _M

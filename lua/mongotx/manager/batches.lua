-- mongotx.manager.batches: how the manager runs the specs its calls
-- checked (mongotx.manager.checks), as functions taking the manager:
-- batches of at most CHUNK through mongotx.batch, the committed
-- transactions then finished at once or queued for tm:finish
-- (policy.finish).  mongotx.group runs its batches through run_batch too;
-- mongotx.resty's ungrouped calls go through tm:later.

--- The manager's internal call for mongotx.resty (`tm:later`).
-- @submodule mongotx.manager

local batch = require "mongotx.batch"
local settling = require "mongotx.batch.settle"
local errors = require "mongotx.errors"

local ipairs, pairs, pcall, error, select, tostring = ipairs, pairs, pcall, error, select, tostring
local unpack = table.unpack or unpack -- luacheck: ignore 143

-- Its arguments as a list, and how many (n).
local function pack(...) return { n = select("#", ...), ... } end

local _M = { pack = pack }

-- The most transactions one batch.run takes: a caller's bigger batch runs
-- as several.  The server matches each transaction of a commit or done
-- update against the whole `$in` list of the batch's ids, so a step's cost
-- per transaction grows with the batch; on mongo-java-server, batches of
-- 50-100 cost the least per transaction, 1000 three times more in those
-- steps (bench/README.md, "Client CPU and batch size").
local CHUNK = 100
_M.CHUNK = CHUNK

-- The held ones of a batch once waited for (out[k]: T as read, it left
-- pending or its owner's lease passed; else false and bad[k]: why not),
-- each driven alone into results[where[k]], errs[where[k]]: its outcome
-- (finished where it committed; taken over where its owner's lease
-- passed) or its error, a policy's raise included (the others' answers
-- stand).  Within _M.later one held again is answered `in_progress` and
-- listed.
local function settle(self, out, bad, where, results, errs)
  local eng, later = self.engine, self.held_later
  for k, i in ipairs(where) do
    local T, err = out[k], bad[k]
    if T then
      local ok, held
      ok, T, err, held = pcall(eng.drive, eng, T, nil, later ~= nil)
      if not ok then
        if not errors.is_policy(T) then error(T, 0) end
        T, err = nil, T
      elseif held then
        local info = eng:held_info(held)
        info.i, later[#later + 1] = i, info
      end
    end
    results[i], errs[i] = T or false, not T and err or false
  end
end

-- The held ones of a batch (batch.run's held: transactions other calls
-- hold within their lease), once the others finished: waited for all at
-- once (Engine:await_many, at most policy.holder_wait), then settled, or
-- answered `in_progress`.
local function await_held(self, held, results, errs)
  local list, where = {}, {}
  for i, T in pairs(held) do
    list[#list + 1], where[#where + 1] = T, i
  end
  local out, bad = self.engine:await_many(list)
  settle(self, out, bad, where, results, errs)
end

-- tm:later("held", ids): the held items of a batch that mongotx.resty's
-- handler waited for (they left pending, or their owner's lease passed),
-- read again and settled as await_held settles them: results[k], errs[k]
-- for ids[k].
local function held_by_id(self, ids)
  local eng, out, bad, where, results, errs = self.engine, {}, {}, {}, {}, {}
  for k, id in ipairs(ids) do
    local T, err = eng:get(id)
    out[k], bad[k], where[k] = T or false, err or not T and errors.disappeared(id), k
  end
  settle(self, out, bad, where, results, errs)
  return results, errs
end

-- Runs specs as batches of at most CHUNK; the i-th result, or false and
-- its error, and late[i] = true for those settled after the others of
-- their batch (batch.run).  The ones other calls hold within their
-- lease hold none of the others: they are waited for once the others
-- finished (await_held), or with `answer_held` answered at once,
-- `in_progress`, and held[i] the transaction as read (mongotx.group:
-- their callers wait); within _M.later, answered at once too and listed.
-- With `answer_held` an item whose apply must wait for a retry is not
-- waited for either: busy[i] says how its caller goes on with it
-- (batch.run's, its `after` as indices of specs); within _M.later, listed
-- so (`one`: run_one's, whose policy's raise is the call's).
-- One chunk of run_batch: todo[k] = specs[where[k]], k = 1..m, run and
-- finished; true when one of them is held.
local function run_chunk(self, todo, where, m, results, errs, late, held, busy)
  local res, bad, committed, slow, waits, handed = batch.run(self.engine, todo, busy ~= nil)
  local any = false
  for k = 1, m do
    local i = where[k]
    results[i], errs[i], late[i], held[i] = res[k], bad[k], slow[k] or nil, waits[k]
    any = any or waits[k] ~= nil
    local b = handed[k]
    if b then
      for n, j in ipairs(b.after) do b.after[n] = where[j] end
      busy[i] = b
    end
  end
  _M.finish_committed(self, committed)
  return any
end

function _M.run_batch(self, specs, errs, answer_held, one)
  local results, late, held, todo, where, m = {}, {}, {}, {}, {}, 0
  local any, busy = false, (answer_held or self.held_later) and {} or nil
  for i = 1, #errs do
    results[i] = false
    local spec = specs[i]
    if spec then
      m = m + 1
      todo[m], where[m] = spec, i
      if m == CHUNK then
        any = run_chunk(self, todo, where, m, results, errs, late, held, busy) or any
        todo, where, m = {}, {}, 0
      end
    end
  end
  if m > 0 then any = run_chunk(self, todo, where, m, results, errs, late, held, busy) or any end
  if answer_held then return results, errs, late, held, busy end
  for i, b in pairs(busy or {}) do -- (within _M.later: listed; a batch's item answers a policy's raise)
    b.kind, b.i, b.item = "run", i, not one or nil
    self.held_later[#self.held_later + 1] = { busy = b }
  end
  if any and self.held_later then
    local eng, list = self.engine, self.held_later
    for i, T in pairs(held) do
      local info = eng:held_info(T)
      info.i, list[#list + 1] = i, info
    end
  elseif any then
    await_held(self, held, results, errs)
  end
  return results, errs, late
end

-- Within _M.later, a call's transaction another call holds (held: T as
-- read) or whose apply must wait for a retry (busy: its drive's, with
-- later = "hand"), listed so that its caller waits.
function _M.listed(self, held, busy)
  local list = self.held_later
  if held then list[#list + 1] = self.engine:held_info(held) end
  if busy then
    local e = {}
    settling.handing(e, busy)
    local b = settling.handed(e)
    b.kind = "drive"
    list[#list + 1] = { busy = b }
  end
end

-- The calls _M.later runs.
local LATER = { transfer = true, run = true, commit = true, commit_many = true,
                transfer_many = true }
_M.LATER = LATER

-- tm:later(method, ...): tm[method](...) as itself, but a transaction
-- another call holds within its lease is not waited for here: the call
-- answers it `in_progress` at once (a batch: that item; the others as
-- usual) and lists it, so that its caller waits elsewhere (mongotx.resty:
-- the handler, not a worker thread) and then asks again: a call of one
-- transaction is made again, a batch's held items settled by their id
-- (method "held": held_by_id).  So does a transfer, run or commit whose
-- apply must wait for a retry (`busy`: run_one and listed list { busy =
-- <info> }); its caller waits, then goes on with it by method "busy", as
-- with a call a group batch handed to its caller (mongotx.group.busy's
-- resume).

--- Internal: `tm[method](...)` that waits for no transaction another call holds (mongotx.resty's handler waits).
-- @local
-- @syntax held, ... = tm:later(method, ...)
-- @string method "transfer", "run", "commit", "commit_many", "transfer_many", "held" (a batch's held items,
--   by id, once waited for: results, errs) or "busy" (a group batch's item its caller goes on with: its answer)
-- @treturn table the held ones, answered `in_progress`: `{ id, wait, lapse [, i] }` each (`i`: a batch's item)
-- @return the call's results
-- @usage -- mongotx.resty's ungrouped calls use it
-- @function Manager:later
function _M.later(self, method, ...)
  local call = method == "held" and held_by_id or LATER[method] and self[method]
  if method == "busy" then call = require("mongotx.group.busy").resume end
  if not call then error("no call " .. tostring(method) .. " answers held keys later", 2) end
  local list = {}
  self.held_later = list
  local res = pack(pcall(call, self, ...))
  self.held_later = nil
  if not res[1] then error(res[2], 0) end
  for _, h in ipairs(list) do -- (how long its caller tries for a manager: mongotx.group.busy)
    if h.busy then h.busy.holder_wait = self.engine.policy.holder_wait end
  end
  return list, unpack(res, 2, res.n)
end

-- One spec, as tm:run and tm:transfer run it: the transaction, or nil,
-- err.  Within _M.later, one whose apply must wait for a retry is not
-- waited for: listed { busy = <mongotx.group.busy's info> }, its caller
-- waits and goes on with it (tm:later("busy", info)).  A policy that raised while it settled (batch.run fails its entry
-- with the raise, code "policy") raises here, as it did before it reached
-- the batch's guard: the call's own raise.
function _M.run_one(self, spec)
  local results, errs = _M.run_batch(self, { spec }, { false }, false, true)
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

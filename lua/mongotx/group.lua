-- mongotx.group: group commit.  Calls of tm:transfer, tm:run, tm:commit
-- and tm:hold that concurrent callers make one at a time are collected
-- and run as one batch (the way tm:transfer_many runs; begun transactions
-- the way batched recovery drives them; holds the way tm:hold_many opens
-- them), and each caller gets exactly what its own call would have
-- returned alone.
--
-- Two halves:
--
--   group.new{...}   the queue, scheduler-neutral: the first call to find
--                    no batch in flight starts a driver (spawn); the
--                    driver waits until `max` calls are queued or the
--                    oldest has waited `delay` seconds, runs them as one
--                    batch (run), wakes every caller with its own result,
--                    and goes on with the calls that arrived meanwhile.
--                    With inflight > 1, up to that many batches run at
--                    once, over documents and ids none of the others
--                    holds (mongotx.group.queue's new says how).
--                    How to wait, wake and start a driver is injected:
--                    ngx.semaphore and ngx.timer in mongotx.resty, or a
--                    coroutine scheduler's (spec/43-group_spec.lua).
--   run_calls(tm, calls, wait)
--                    the batch, on the manager's side (tm:run_calls): each
--                    call checked as its call alone checks it, then the
--                    ones that passed as one batch of the protocol.
--
-- For a program with its own scheduler (mongotx.pool users):
--
--   local g = group.wrap(tm, { max = 100, delay = 0,
--     signal = function() return <object with :wait(seconds), :post()> end,
--     spawn = function(fn) <run fn in a new task>; return true end,
--     now = function() return <seconds> end })
--   local t, err = g:transfer("accounts", "A", "B", 100, { min = 0 })
--
-- signal():wait(seconds) returns when post() was called (true) or when the
-- time is up (false); it and every call of g yield to the scheduler.
-- inflight > 1 pays only where a batch yields while the server works (a
-- worker thread, as in mongotx.resty): mongotx's calls block their Lua
-- state, so there the batches run one after another anyway.

--- Group commit: concurrent `tm:transfer`, `run`, `commit`, `hold` calls as one batch (docs/openresty.md#group-commit).
-- @module mongotx.group

local errors = require "mongotx.errors"
local stored = require "mongotx.stored"
local engine = require "mongotx.engine"
local checks = require "mongotx.manager.checks"
local batches = require "mongotx.manager.batches"
local forward = require "mongotx.engine.forward"
local holds = require "mongotx.holds"
local queue = require "mongotx.group.queue"
local busy = require "mongotx.group.busy"
local backoff = require("mongotx.policy").backoff

local type, ipairs, pairs, pcall, error, select, setmetatable, tostring, next =
  type, ipairs, pairs, pcall, error, select, setmetatable, tostring, next
local format = string.format
local unpack = table.unpack or unpack -- luacheck: ignore 143
local id_key, tid_key, is_floor = stored.id_key, engine.key, stored.is_floor
local commutes = require("mongotx.batch.settle").commutes

local _M = {}

-- The queue (mongotx.group.queue): group.new, Group:call, group.AGAIN,
-- group.START.
_M.new, _M.AGAIN, _M.START = queue.new, queue.AGAIN, queue.START
local AGAIN = _M.AGAIN

-- A document's key: its collection and its _id's key (1, 1.0 and
-- Int64(1) alike), or nil for an _id that has none.  Shared by the keys
-- that keep batches apart and by admit, which keeps calls of one batch
-- apart.
local function doc_key(collection, id)
  local k = id_key(id)
  return k and collection .. "\0" .. k
end

-- What a call touches, as Group:call's keys: "d", collection and _id per
-- document, "t" and the id when the caller names its transaction.  Nil
-- (it may touch anything) for a commit, whose documents are stored, and
-- for arguments whose ids have no key (they fail their checks anyway).
local function call_keys(method, a1, a2, a3, _, a5)
  local docs, id
  if method == "transfer" or method == "hold" then
    docs, id = { { collection = a1, id = a2 }, { collection = a1, id = a3 } }, a5 and a5.id
  elseif method == "run" then
    docs, id = a1, a2 and a2.id
  else
    return nil
  end
  local keys = {}
  for i, op in ipairs(docs) do
    local k = type(op.collection) == "string" and doc_key(op.collection, op.id)
    if not k then return nil end
    keys[i] = "d\0" .. k
  end
  if #keys == 0 then return nil end
  if id ~= nil then keys[#keys + 1] = "t\0" .. tid_key(id) end
  return keys
end

--- The keys of a grouped call (`Group:call`'s second argument): the documents and transaction id it touches.
-- @syntax keys = group.keys(method, ...)
-- @tparam string method "transfer", "run", "commit" or "hold"
-- @param ... the call's arguments
-- @treturn ?table the keys, or nil when the call may touch any document (a commit, or arguments that fail their
--   checks)
-- @usage g:call(item, group.keys("transfer", "accounts", "A", "B", 10))
function _M.keys(method, ...)
  local ok, keys = pcall(call_keys, method, ...)
  return ok and keys or nil
end

-- The batch, on the manager's side ------------------------------------------

-- What each method checks before it runs (mongotx.manager.checks:
-- transfer_call, run_call, tx_ref), with the level that leaves a raise without a position, as
-- the ungrouped call's is when it runs under pcall.
local CHECK = {
  transfer = function(tm, c) return pcall(checks.transfer_call, tm, c[1], c[2], c[3], c[4], c[5], 1) end,
  run = function(tm, c) return pcall(checks.run_call, tm, c[1], c[2], nil, 1) end,
  commit = function(_, c) return pcall(checks.tx_ref, c[1], "commit", 1) end,
  hold = function(tm, c) return pcall(holds.check, tm, c[1], c[2], c[3], c[4], c[5], 1) end,
}

_M.METHODS = { "transfer", "run", "commit", "hold" }

-- May spec join the batch whose admitted ops are `ops` (by document key:
-- "any" when some op there is no floor guard, "floor" when all are) and
-- ids `ids`?  A guard must read what it would read alone after the calls
-- before it: the debits of floor guards before it (they apply in order,
-- first in a batch), but never an effect that a batch applies after its
-- guards (mongotx.batch, "apply").  So a guard on a document that an
-- earlier call changes otherwise, and an id already in the batch, wait
-- for the next batch.
local function admit(spec, ops, ids)
  local id = spec.id ~= nil and tid_key(spec.id)
  if id and ids[id] then return false end
  local keys = {}
  for i, op in ipairs(spec.ops) do
    local k = doc_key(op.collection, op.id) or op.collection .. "\0" .. tostring(op.id)
    keys[i] = k
    if op.where ~= nil and (ops[k] == "any" or (ops[k] and not is_floor(op.where))) then
      return false
    end
  end
  if id then ids[id] = true end
  for i, op in ipairs(spec.ops) do
    local k = keys[i]
    if op.where ~= nil and is_floor(op.where) then
      ops[k] = ops[k] or "floor"
    else
      ops[k] = "any"
    end
  end
  return true
end

-- The answer of a call the batch ran: { n = 1, T } or { n = 2, nil, err }
-- as the call alone returns, or { raise = err } for a policy's raise
-- (errors.is_policy: the batch failed that call's entry with it, the
-- others went on; alone, the call raises it).
-- fn(...) -> a, b, c, d, e, a part of the batch (the transfers and runs, or the
-- commits): a policy's raise in a step the whole part shares (a retry's
-- backoff, ...) is nil, <the raise>, as each of its calls alone would
-- raise it, and the other part runs on; any other raise goes up.
local function shared(fn, ...)
  local ok, a, b, c, d, e = pcall(fn, ...)
  if ok then return a, b, c, d, e end
  if not errors.is_policy(a) then error(a, 0) end
  return nil, a
end

local answer = busy.answer

-- The caller's side of a call the batch answered `in_progress` at once
-- (its `held`: Engine:held_info's), so that it held none of the others: reads
-- the transaction every backoff (policy.backoff's default: the policy's
-- own may not reach the caller's side).

--- Internal: the caller's wait for a held call of a batch (mongotx.group.wrap and mongotx.resty use it).
-- @local
-- @syntax again = group.await_held(held, get, sleep, now)
-- @tparam table held the answer's `held`: `{ id, wait, lapse }`
-- @func get `get(id)` reads the transaction
-- @func sleep `sleep(seconds)` without blocking the scheduler
-- @func now `now()` in seconds
-- @treturn boolean true when the call should now run alone (the transaction left pending, or its owner's lease
--   passed: it answers the outcome, or takes it over), false when its holder kept it `wait` seconds (the batch's
--   `in_progress` stands)
-- @usage if group.await_held(r.held, get, sleep, now) then return tm:transfer(...) end
function _M.await_held(held, get, sleep, now)
  local start, attempt = now(), 0
  while true do
    local spent = now() - start
    if held.lapse and spent >= held.lapse then return true end
    local left = held.wait - spent
    if left <= 0 then return false end
    attempt = attempt + 1
    sleep(math.min(backoff(attempt), left, held.lapse and held.lapse - spent or left))
    local T = get(held.id)
    if not T or T.state ~= "pending" then return true end
  end
end

-- A call whose own transaction (handed to its caller: mongotx.group.busy)
-- another owner held, once waited for, is not made again (without an
-- id, a second transaction): that transaction is settled by its id
-- (tm:later("held")), as the call alone settles it (mongotx.manager.batches,
-- await_held); a policy's raise raises, as there.

--- Internal: the answer of a call whose own transaction another owner held, once waited for (mongotx.group.wrap).
-- @local
-- @syntax T, err = group.settle_own(tm, id)
-- @tparam table tm the manager
-- @param id the transaction's id
-- @treturn ?table the transaction, settled
-- @treturn ?table the error
function _M.settle_own(tm, id)
  local list, results, errs = tm:later("held", { id })
  -- (mongotx.pool: no client came free: its outcome is unknown, not the pool's error)
  if list == nil then return nil, busy.stranded(id, results) end
  if results[1] then return results[1] end
  if errors.is_policy(errs[1]) then error(errs[1], 0) end
  return nil, errs[1]
end

-- A call its part handed to its caller (eng: the engine; info: settle.handed's, its
-- `after` as indices of the part's list, where: their calls): its answer
-- { busy = info }, its documents (ops) added to gone (gone[d]: whether
-- every such op there commutes with any other that does: settle's
-- commutes).  info.keys: its id and the documents where its order shows
-- (as group.keys says them; a commit's too, now that they are known),
-- which its ticket keeps while its caller goes on with it.
local function handed(eng, info, kind, where, ops, gone)
  info.kind = info.drive and "drive" or kind -- (one its drive handed: goes on as drive)
  info.holder_wait = eng.policy.holder_wait -- (how long its caller tries for a manager: mongotx.group.busy)
  for n, k in ipairs(info.after) do info.after[n] = where[k] end
  local keys = { "t\0" .. tid_key(info.id) }
  for _, op in ipairs(ops) do
    local k, free = doc_key(op.collection, op.id), commutes(op)
    local d = k or op.collection
    gone[d] = free and gone[d] ~= false
    if k and not free then keys[#keys + 1] = "d\0" .. k end
  end
  info.keys = keys
  return { busy = info }
end

-- The calls of a later part (list[k] the call where[k]; ops(list[k]) its
-- ops) with those on a document of a call handed to its caller, where
-- their order shows, put off to the next batch (AGAIN; never the first
-- call): they go after it, as batch order says, not beside its open
-- effects.
local function put_off(list, where, gone, out, ops)
  if next(gone) == nil then return list, where end
  local keep, at = {}, {}
  for k, x in ipairs(list) do
    local meets = false
    for _, op in ipairs(ops(x)) do
      local g = gone[doc_key(op.collection, op.id) or op.collection]
      meets = meets or (g ~= nil and not (g and commutes(op)))
    end
    if meets and where[k] > 1 then
      out[where[k]] = AGAIN
    else
      keep[#keep + 1], at[#at + 1] = x, where[k]
    end
  end
  return keep, at
end

-- run_calls(tm, calls, wait): calls[i] = { method = "transfer" | "run" |
-- "commit" | "hold", n = <how many arguments>, <the arguments> }.  Returns one
-- result per call: { n = 1, T } or { n = 2, nil, err } as the call alone
-- returns, { raise = <message or error> } for what it raises, or
-- group.AGAIN (the call conflicts with one before it here); and the
-- order the calls answered took effect in.  A call whose transaction
-- another call holds within its lease is not waited for: { n = 2, nil,
-- <in_progress>, held = <Engine:held_info> }, and its caller waits
-- (await_held), then runs it alone.  Nor is one whose apply must wait for
-- a retry (`busy`): { busy = <what its caller needs> }, and its caller
-- waits, then goes on with it alone (mongotx.group.busy).
--
-- The transfers and runs go first, as one batch (mongotx.batch); then the
-- commits: their transactions loaded in one find, the begun ones
-- (`initial`) claimed, applied, committed and finished as one batch
-- (mongotx.engine.forward), any other driven alone as tm:commit drives it;
-- then the holds, opened as one batch of their own (holds.open_entries:
-- one insert, their applies), their guards reading what the parts before
-- left.
-- The order is theirs within each part, but those settled one at a time
-- after the others of their part had committed (a guard that failed at
-- first is tried again then: mongotx.batch) come after them, and those
-- handed to their callers after all the others (a later part's call on
-- one of their documents waits for the next batch: put_off).  So each
-- answer is what its call alone gives when the calls run one at a time in
-- that order.  Emits on_event("group", { size = <calls answered>, wait =
-- wait, application }) once.
function _M.run_calls(tm, calls, wait)
  local out, checked, sent = {}, {}, {}
  for i, c in ipairs(calls) do
    local check = CHECK[c.method]
    if not check then error(format("mongotx.group: no grouped method %s", tostring(c.method)), 2) end
    local ok, v, err = check(tm, c)
    if not ok then
      out[i] = { raise = type(v) == "string" and v or tostring(v) }
    elseif v == nil then
      out[i] = { n = 2, nil, err }
    else
      checked[i] = v
      if c.method == "commit" then sent[#sent + 1] = v end
    end
  end
  -- the transactions to commit, in one read
  local found, load_err
  if #sent > 0 then found, load_err = forward.load(tm.engine, sent) end
  -- which join: a part's ops by document (admit), ids across both parts
  local specs, errs, where, items, cwhere, opening, hwhere = {}, {}, {}, {}, {}, {}, {}
  local ops, cops, hops, ids = {}, {}, {}, {}
  for i, c in ipairs(calls) do
    local v = checked[i] -- (nil: answered above)
    if v ~= nil and c.method == "hold" then
      if admit(v.spec, hops, ids) then
        local k = #opening + 1
        opening[k], hwhere[k] = v, i
      else
        out[i] = AGAIN
      end
    elseif v ~= nil and c.method ~= "commit" then
      if admit(v, ops, ids) then
        local k = #specs + 1
        specs[k], errs[k], where[k] = v, false, i
      else
        out[i] = AGAIN -- (never the first: it meets an empty batch)
      end
    elseif v ~= nil then
      local id = c[1]._id
      local k = tid_key(id)
      local item = found and found[k]
      if ids[k] or (item and item.ready and not admit({ id = id, ops = item.T.ops }, cops, ids)) then
        out[i] = AGAIN
      else
        ids[k] = true
        if not found then
          out[i] = { n = 2, nil, load_err }
        elseif not item then
          out[i] = { n = 2, nil, errors.new("state", "no such transaction", { step = "commit", id = id }) }
        else
          local n = #items + 1
          items[n], cwhere[n] = item, i
        end
      end
    end
  end
  -- part (1 the batch, 2 settled after it, 3 the commits, 4 those
  -- settled or driven after them, 5 the holds, 6 those opened alone after
  -- them, 7 those handed to their callers: mongotx.group.busy) of each
  -- call the batch ran; gone: the documents of those handed over
  local part, gone = {}, {}
  if #specs > 0 then
    local results, late, held, gave
    results, errs, late, held, gave = shared(batches.run_batch, tm, specs, errs, true)
    for k, i in ipairs(where) do
      out[i], part[i] = results and answer(results[k], errs[k]) or { raise = errs }, late and late[k] and 2 or 1
      if held and held[k] then out[i].held = tm.engine:held_info(held[k]) end
      if gave and gave[k] then
        out[i], part[i] = handed(tm.engine, gave[k], "run", where, specs[k].ops, gone), 7
      end
    end
  end
  items, cwhere = put_off(items, cwhere, gone, out, function(item) return item.T.ops end)
  if #items > 0 then
    local results, cerrs, late, held, gave = shared(forward.commit, tm.engine, items, true)
    for k, i in ipairs(cwhere) do
      out[i], part[i] = results and answer(results[k], cerrs[k]) or { raise = cerrs }, late and late[k] and 4 or 3
      if held and held[k] then out[i].held = tm.engine:held_info(held[k]) end
      if gave and gave[k] then
        out[i], part[i] = handed(tm.engine, gave[k], "commit", cwhere, items[k].T.ops, gone), 7
      end
    end
  end
  opening, hwhere = put_off(opening, hwhere, gone, out, function(e) return e.spec.ops end)
  if #opening > 0 then
    local _, raise = shared(holds.open_entries, tm, opening, true)
    local at = {}
    for k, e in ipairs(opening) do at[e] = k end
    for k, i in ipairs(hwhere) do
      local e = opening[k]
      out[i], part[i] = raise and { raise = raise } or answer(e.out, e.err), e.late and 6 or 5
      if e.busy and not raise then
        for n, m in ipairs(e.busy.after) do e.busy.after[n] = at[m] end
        e.busy.expires = e.expires
        out[i], part[i] = handed(tm.engine, e.busy, "hold", hwhere, e.spec.ops, gone), 7
      end
    end
  end
  local order = {}
  for p = 1, 7 do
    for i = 1, #calls do
      if out[i] ~= AGAIN and (part[i] or 1) == p then order[#order + 1] = i end
    end
  end
  tm.engine:event("group", { size = #order, wait = wait, application = tm.application })
  return out, order
end

-- A manager (mongotx, or mongotx.pool's) behind a group: group.wrap(tm,
-- opts) with opts as group.new's but run (tm:run_calls).  Its transfer,
-- run, commit and hold answer as tm's.

--- For a program with its own scheduler.
-- @section scheduler
local Wrapped = {}
Wrapped.__index = Wrapped

--- A manager behind a group, for a program with its own scheduler: its calls answer as `tm`'s.
-- @syntax g = group.wrap(tm, { signal, spawn, now [, max = 100] [, delay = 0] [, inflight = 1] })
-- @tparam table tm a manager (mongotx's or mongotx.pool's)
-- @tparam table opts as `group.new`'s, without `run`
-- @treturn table an object with `g:transfer(...)`, `g:run(...)`, `g:commit(t)` and `g:hold(...)`, each answering
--   exactly as the manager's call alone (its transaction, `nil, err`, or its raise), run in batches with the
--   concurrent ones
-- @errors a bad option raises; each call's errors are its own.  A call whose apply must wait for a retry (`busy`)
--   waits in its own task (`signal():wait`, not `policy.sleep`: a `sleep` that raises cannot fail it), then goes on
--   alone; with mongotx.pool, when no client comes free for its next try in `holder_wait` seconds it answers
--   `in_progress` naming its pending transaction (`err.id`)
-- @usage local g = group.wrap(tm, { signal = signal, spawn = spawn, now = now })
-- local t, err = g:transfer("accounts", "A", "B", 100, { min = 0 })
function _M.wrap(tm, opts)
  if type(opts) ~= "table" then error("group.wrap takes a manager and a table of options", 2) end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.run = function(items, info)
    local out, order = tm:run_calls(items, info.wait)
    if out then return out, order end
    local err = order
    out = {} -- (mongotx.pool: no client came free) each caller gets err
    for i = 1, #items do out[i] = { n = 2, nil, err } end
    return out
  end
  return setmetatable({ tm = tm, group = _M.new(o) }, Wrapped)
end

for _, method in ipairs(_M.METHODS) do
  Wrapped[method] = function(self, ...)
    local g, tm = self.group, self.tm
    local r, ticket = g:call({ method = method, n = select("#", ...), ... }, _M.keys(method, ...))
    local own = r.busy ~= nil -- (its own transaction: handed to it)
    if own then
      -- its apply waits for a retry: in this task, then goes on alone
      local err
      r, err = busy.go_on(g, ticket, r, function(seconds) g.signal():wait(seconds) end, function(info)
        local list, out = tm:later("busy", info)
        if list == nil then return nil, out end -- (mongotx.pool: no client came free)
        return out
      end, g.now)
      r = r or { n = 2, nil, err } -- (none came free in holder_wait: in_progress, its id)
    end
    if r.held then
      local function sleep(seconds) g.signal():wait(seconds) end
      local function get(id) return self.tm:get(id) end
      if _M.await_held(r.held, get, sleep, g.now) then
        -- its own transaction (handed to it, then taken over): settled by
        -- its id as the call alone settles it, not made again
        if own then return _M.settle_own(tm, r.held.id) end
        return self.tm[method](self.tm, ...)
      end
    end
    if r.raise then
      -- as the call alone raises: at the caller, unless it says where
      -- (or is an error value: a policy's raise)
      if type(r.raise) ~= "string" or r.raise:find("^[^\n]-:%d+: ") then error(r.raise, 0) end
      error(r.raise, 2)
    end
    return unpack(r, 1, r.n)
  end
end

return _M

-- mongotx.group.busy: a call of a group batch whose apply must wait for
-- a retry (an op on a document another open transaction holds: `busy`)
-- holds none of the others.  The batch answers it { busy = <info> }
-- (mongotx.batch.settle's hand_all and handed: its transaction created,
-- maybe partly applied or given back, its tries so far) and its caller
-- goes on with it alone (go_on): it waits the backoff in its own task
-- (group.wrap's signal, ngx.sleep in nginx), then resume continues the
-- apply from there, by the transaction's epoch, in whichever manager of
-- the same options it lands on (each nginx worker thread has its own).
-- So it takes the tries, and ends as the call alone ends.  An item the
-- batch handed over because it goes after such a one on a document goes
-- on once that one's caller is done (Group:after).  Ungrouped, in nginx,
-- tm:later hands a transfer's, run's or commit's busy wait to its
-- handler the same way (mongotx.resty.held).
--
-- Version fencing (mongotx.engine.bands) keeps, per engine, the
-- documents an apply may still land on twice (eng.unsure), which a
-- resume in another Lua state does not know.  A handed call has none:
-- a document turns unsure only on a transient error of an apply, and
-- the apply is then tried again in place (Engine:retry) with the bump
-- first, or it fails the transaction's entry (e.err, nil, err); only an
-- op failure (`busy`) is handed over, and its write was answered.  So
-- its documents are sure when it leaves.  Another transaction's unsure
-- document is that one's to clear (its undo here bumps; a takeover
-- moves the band).

--- @submodule mongotx.group

local errors = require "mongotx.errors"
local settle = require "mongotx.batch.settle"
local batch = require "mongotx.batch"
local batches = require "mongotx.manager.batches"
local opening = require "mongotx.holds.open"

local ipairs, pairs, pcall, error, next = ipairs, pairs, pcall, error, next

local _M = {}

-- The answer of a call, as mongotx.group's run_calls gives it: { n = 1, T
-- } or { n = 2, nil, err }, { raise = err } for a policy's raise.
function _M.answer(T, err)
  if T then return { n = 1, T } end
  if errors.is_policy(err) then return { raise = err } end
  return { n = 2, nil, err or errors.new("internal", "no result", { step = "group" }) }
end
local answer = _M.answer

-- How each kind of call ends once its apply is over (e.T, or e.err):
-- as the part of run_calls that ran it ends it.
local ENDS = {
  -- transfer, run: committed, finished as the batch finishes them
  run = function(tm, e)
    if not e.err and e.T.state == "applied" then batches.finish_committed(tm, { e.T }) end
  end,
  -- commit: finished to `done` (mongotx.engine.forward's commit)
  commit = function(tm, e)
    local eng = tm.engine
    if not e.err and e.T.state == "applied" then
      local _, err = batch.finish(eng, { e.T })
      if e.T.state == "done" then eng:hold(e.T._id, nil) else settle.fail(e, err) end
    end
    if not e.err and e.T.state ~= "done" then
      settle.fail(e, errors.new("state", "the transaction did not settle", { id = e.T._id }))
    end
  end,
  -- one a drive handed (Engine:drive's later = "hand": a grouped commit
  -- driven alone, tm:commit under tm:later, ...): driven on to its end
  drive = function(tm, e)
    if e.err or e.T.state == "done" or e.T.state == "cancelled" then return end
    local T, err, held = tm.engine:drive(e.T, nil, true)
    if held then e.held = held end
    if T then e.T = T else settle.fail(e, err) end
  end,
  -- hold: left open (mongotx.holds.open's open)
  hold = function(tm, e, info)
    local eng = tm.engine
    eng:hold(e.T._id, nil)
    if not e.err then
      eng:event("hold", { id = e.T._id, amount = e.T.hold.amount, expires = info.expires })
      e.T.hold.status = "held"
    end
  end,
}

--- Internal: goes on with a call a group batch handed to its caller `busy` (tm:later("busy", info) runs it).
-- @local
-- @syntax r = busy.resume(tm, info)
-- @tparam table tm the manager
-- @tparam table info the batch's answer's `busy`
-- @treturn table the call's answer as run_calls gives it, or `{ busy = <info> }` when it must wait again
function _M.resume(tm, info)
  local eng = tm.engine
  local T, err = eng:get(info.id)
  if not T then return answer(nil, err or errors.disappeared(info.id)) end
  local e = { T = T, err = false, slow = "apply", applied = {}, sent = {}, later = "hand", held = false,
              failure = false, busy = false }
  local hold = info.kind == "hold"
  local ok, st, wait = true, nil, nil
  if T.state == "pending" and T.epoch == info.epoch then
    -- still this call's: its apply goes on where the batch left it
    eng:hold(T._id, T.epoch)
    local stepper = hold and opening.opener(eng) or eng
    st = stepper:apply_start(T, info.versions)
    for i, n in ipairs(info.tries) do
      if n > 0 then st.tries[i] = n end
    end
    ok, st, wait = pcall(hold and opening.open_slow or settle.step, stepper, e, st)
  elseif hold then
    -- (taken over once its deadline passed: as its opener alone finds it)
    e.err = errors.new("fenced", "another owner took the hold over while it opened",
      { step = "hold", id = T._id })
  else
    ok, st = pcall(settle.conclude, eng, e, T) -- as an apply alone that finds it moved on
  end
  if not ok then settle.raised_in(e, st) end
  if ok and (st or e.busy) then
    -- its apply waits again (or a drive's did: settle.handing): handed back
    eng:hold(T._id, nil)
    local b = e.busy or { st = st, wait = wait, after = {} }
    local again = settle.handed({ T = T, busy = b })
    again.kind = b.drive and "drive" or info.kind
    again.expires, again.i, again.item = info.expires, info.i, info.item
    again.holder_wait = eng.policy.holder_wait
    return { busy = again }
  end
  ENDS[info.kind](tm, e, info)
  local out = answer(not e.err and e.T, e.err)
  if info.item and out.raise then out = { n = 2, nil, out.raise } end -- (a batch's item: its error)
  if e.held then out.held = eng:held_info(e.held) end
  return out
end

-- The caller's side --------------------------------------------------------

-- A caller whose next try finds no manager to go on with its call (no
-- client of mongotx.pool, no worker thread in nginx: `overloaded`) must
-- not answer that error: it says nothing was done, yet the transaction
-- is created, maybe partly applied, and recovery would end it after its
-- lease (a client that retries would pay twice).  The transaction is
-- still the call's, so the caller tries again after another wait, for at
-- most info.holder_wait seconds in all: the most a call waits for what
-- others hold (here the clients or threads).  Not its lease: safety does
-- not need it (an owner past its deadline renews it while it still
-- holds the transaction, and a resume that finds it taken over ends by
-- its epoch as such), and it can be far longer (30 s) or 0.  Then it
-- answers in_progress naming the transaction, as a held key does.
local RETRY = 0.05 -- seconds between tries for a manager when the backoff is 0

--- Internal: the error of a call that could not go on with or settle its own transaction (no manager came free).
-- @local
-- @syntax err = busy.stranded(id, err)
-- @param id the transaction's id
-- @tparam table err why no manager came free (`client`, `overloaded`, ...)
-- @treturn table an `in_progress` error naming the transaction
function _M.stranded(id, err)
  return errors.new("in_progress", ("the call's transaction is pending and no client or worker thread came " ..
    "free to go on with it (%s): read it by its id before making the call again; once its lease passed, " ..
    "recovery or a retry with its id ends it"):format(tostring(err and err.message or err)),
    { id = id, step = "busy", cause = type(err) == "table" and err.code or nil })
end

-- The next try of a call, info, that found no manager (err) at `now`
-- (since: the first such try in a row, or nil): the seconds to wait
-- before it tries again and since, or nil and the call's error.
local function missed(info, err, since, now)
  since = since or now
  local left = (info.holder_wait or 0) - (now - since)
  if left <= 0 then return nil, _M.stranded(info.id, err) end
  return math.min(math.max(info.wait, RETRY), left), since
end

--- Internal: an ungrouped batch's items handed to their caller `busy`, gone on with side by side (mongotx.resty.held).
-- @local
-- @syntax held = busy.settle_items(list, results, errs, sleep, now, resume, unpack_answer)
-- @tparam table list tm:later's `{ busy = <info> }` entries (info.i: the item)
-- @tparam table results the call's results, filled in
-- @tparam table errs its errs, filled in
-- @func sleep `sleep(seconds)`
-- @func now `now()` in seconds
-- @func resume `resume(info)`: the item's answer as resume gives it (`{ ok = <pack()ed> }` from a thread too), or
--   nil and the error when no manager came free (then tried again: `missed`)
-- @func unpack_answer `unpack_answer(r)` -> T, err of an answer
-- @treturn table the items another call holds meanwhile (Engine:held_info's, with `i`), to wait for as held
function _M.settle_items(list, results, errs, sleep, now, resume, unpack_answer)
  table.sort(list, function(a, b) return a.busy.i < b.busy.i end)
  local open, due, at, held, since = {}, {}, {}, {}, {}
  for k, h in ipairs(list) do
    open[k], due[k], at[h.busy.i] = h.busy, now() + h.busy.wait, k
  end
  -- one goes after the items it names (their order on a document) once they ended
  local function ready(k)
    for _, j in ipairs(open[k].after or {}) do
      if at[j] and open[at[j]] then return false end
    end
    return true
  end
  while next(open) do
    local first
    for k in pairs(open) do
      if ready(k) and (first == nil or due[k] < first) then first = due[k] end
    end
    local left = first - now()
    if left > 0 then sleep(left) end
    for k = 1, #list do
      if open[k] and ready(k) and due[k] <= now() then
        local info = open[k]
        local r, none = resume(info)
        local wait, from
        if r == nil then wait, from = missed(info, none, since[k], now()) end
        since[k] = wait and from or nil
        if wait then
          due[k] = now() + wait
        elseif r == nil then
          results[info.i], errs[info.i], open[k] = false, from, nil
        elseif r.busy then
          open[k], due[k] = r.busy, now() + r.busy.wait
        else
          local T, err = unpack_answer(r)
          results[info.i], errs[info.i], open[k] = T or false, not T and err or false, nil
          if r.held then
            r.held.i = info.i
            held[#held + 1] = r.held
          end
        end
      end
    end
  end
  return held
end

--- Internal: the caller of a call its group batch answered `busy` goes on with it (group.wrap and mongotx.resty).
-- @local
-- @syntax r = busy.go_on(g, ticket, r, sleep, resume)
-- @tparam ?table g the group (nil: an ungrouped call, tm:later's)
-- @tparam ?table ticket the call's ticket (Group:call's second result)
-- @tparam table r its answer, with `busy`
-- @func sleep `sleep(seconds)` without blocking the scheduler
-- @func resume `resume(info)`: resume's answer, in a manager, or nil and the error when no manager came free
--   (then tried again: `missed`)
-- @func now `now()` in seconds
-- @treturn ?table the call's answer as run_calls gives it
-- @treturn ?table or nil and an `in_progress` error (stranded) when no manager came free in holder_wait
function _M.go_on(g, ticket, r, sleep, resume, now)
  local ok, res, err = pcall(function()
    while r.busy do
      local info = r.busy
      local wait = info.wait
      if g then
        g:after(ticket)
        g:linger(ticket, wait)
      end
      if wait > 0 then sleep(wait) end
      local nr, none = resume(info)
      local since
      while nr == nil do -- (no manager came free: still the call's, tried again)
        local again, from = missed(info, none, since, now())
        if not again then return nil, from end -- (from: its in_progress error)
        since = from
        if g then g:linger(ticket, again) end
        sleep(again)
        nr, none = resume(info)
      end
      r = nr
    end
    return r
  end)
  if g then g:settled(ticket) end
  if not ok then error(res, 0) end
  return res, err
end

return _M

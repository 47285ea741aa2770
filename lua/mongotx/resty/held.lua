-- mongotx.resty.held: an ungrouped call (transfer, run, commit,
-- commit_many, transfer_many) whose transaction another call holds waits
-- for it in the handler's own coroutine, not in a worker thread: the
-- thread runs tm:later (mongotx.manager.batches.later), which answers a
-- held one `in_progress` at once and names it; the handler then sleeps
-- (ngx.sleep) between short reads of it (mongotx.group.await_held), at
-- most holder_wait in all, and asks again once it left pending or its
-- owner's lease passed (then the call takes it over).  So a held key
-- never holds one of the pool's threads while it waits, and calls on
-- other keys are answered meanwhile.  A transfer, run or commit, or an
-- item of a batch, whose apply must wait for a retry (`busy`) is listed
-- by tm:later too: the handler sleeps its backoffs and a thread goes on
-- with it alone (mongotx.group.busy; a batch's side by side, in batch
-- order on a document: settle_items), as with group commit.  Each
-- answer is the plain path's (the call waiting in its own process:
-- mongotx.manager.batches).

local group = require "mongotx.group"
local busy = require "mongotx.group.busy"
local batches = require "mongotx.manager.batches"
local wire = require "mongotx.resty.wire"

local ipairs = ipairs
local unpack = table.unpack or unpack -- luacheck: ignore 143
local pack, now = batches.pack, wire.now

local _M = {}

-- The phases where a handler may wait on a semaphore or sleep: elsewhere
-- a call goes alone (mongotx.resty), and waits for a held key in its thread.
_M.YIELDS = { rewrite = true, server_rewrite = true, access = true, content = true, timer = true }

-- The calls that answer a held key later (tm:later).
_M.LATER = batches.LATER

-- Waits for held ({ id, wait, lapse }, as the thread answered `took`
-- seconds ago) at most `left` seconds: true when the call should ask
-- again (it left pending, is gone, or its owner's lease passed), false
-- when its holder kept it; nil and the error when a read failed (the
-- call's answer, as on the plain path: Engine:await_many).
local function await(tm, held, took, left)
  local lapse = held.lapse and math.max(held.lapse - took, 0)
  local failed
  local again = group.await_held({ id = held.id, wait = left, lapse = lapse }, function(id)
    local T, err = tm:get(id)
    failed = err
    return T
  end, ngx.sleep, now) -- luacheck: ignore 113
  if failed then return nil, failed end
  return again
end

-- The held items of a batch ({ id, wait, lapse, i } each; results and
-- errs its answer, filled in here): waited for, then those that left
-- pending or whose owner's lease passed settled by id in a thread
-- (tm:later("held"): a policy's raise is that item's error), and any held
-- again waited for again, until give_up; then the `in_progress` answer
-- stands.  (Making the batch again would make its other items again.)
-- own: the call's own transaction (_M.own), which no thread answers as
-- in_progress with its id (mongotx.group.busy's stranded).
local function settle(tm, up, held, give_up, results, errs, own)
  while held[1] do
    local asked, ids, where = now(), {}, {}
    for _, h in ipairs(held) do
      local again, err = await(tm, h, now() - asked, give_up - now())
      if again then
        ids[#ids + 1], where[#where + 1] = h.id, h.i
      elseif err then
        results[h.i], errs[h.i] = false, err
      end
    end
    if not ids[1] then return end
    local res = pack(wire.call(tm.db, up + 1, "call", tm.spec, "later", "held", ids))
    held = res[1]
    for k, i in ipairs(where) do
      if held == nil then -- no thread came free: each one's answer (its own: its outcome is unknown)
        results[i], errs[i] = false, own and busy.stranded(ids[k], res[2]) or res[2]
      else
        results[i], errs[i] = res[2][k], res[3][k]
      end
    end
    if held == nil or now() >= give_up then return end
    for _, h in ipairs(held) do h.i = where[h.i] end
  end
end

-- The answer r (as a thread sends it: { ok = <pack()ed>, held }) of a
-- call whose own transaction, handed to its handler busy
-- (mongotx.group.busy), another owner held: waited for and settled by
-- its id (settle), as the call alone settles it, never made again (a
-- second transaction); past holder_wait r's `in_progress` stands.
function _M.own(tm, up, r)
  local T, err = wire.unpack_all(r.ok)
  local results, errs = { T or false }, { err or false }
  r.held.i = 1
  settle(tm, up + 1, { r.held }, now() + r.held.wait, results, errs, true)
  if results[1] then return results[1] end
  return nil, errs[1]
end

-- tm[method](...) through tm:later in a worker thread (wire.call's `up`:
-- 1 when the public method tail-calls this).  The held ones are waited
-- for here, at most holder_wait: a call of one transaction (transfer,
-- run, commit) is made again; a batch's held items are settled
-- (settle).  Past holder_wait the `in_progress` answer stands.
function _M.call(tm, method, up, ...)
  local res = pack(wire.call(tm.db, up + 1, "call", tm.spec, "later", method, ...))
  local held = res[1]
  if held == nil then return nil, res[2] end -- no thread, no manager: nil, err
  -- a busy one (mongotx.group.busy): this handler sleeps, then a thread
  -- goes on with it, until it ends
  local function resume(info) -- (nil, err: no thread came free; mongotx.group.busy tries again)
    return wire.call(tm.db, up + 3, "group", tm.spec, nil, { busy = info }, 0)
  end
  if method == "commit_many" or method == "transfer_many" then
    local waiting, rest = {}, {}
    for _, h in ipairs(held) do
      if h.busy then waiting[#waiting + 1] = h else rest[#rest + 1] = h end
    end
    if waiting[1] then
      local more = busy.settle_items(waiting, res[2], res[3], ngx.sleep, now, resume, -- luacheck: ignore 113
        function(r) return wire.unpack_all(r.ok) end)
      for _, h in ipairs(more) do rest[#rest + 1] = h end
    end
    if rest[1] then settle(tm, up + 1, rest, now() + rest[1].wait, res[2], res[3]) end
    return unpack(res, 2, res.n)
  end
  if held[1] and held[1].busy then
    local r, err = busy.go_on(nil, nil, held[1], ngx.sleep, resume, now) -- luacheck: ignore 113
    if not r then return nil, err end -- (none came free in holder_wait: in_progress, its id)
    if r.raise then wire.reraise(r.raise, up + 1) end
    if r.held then return _M.own(tm, up + 1, r) end
    return wire.unpack_all(r.ok)
  end
  if not held[1] then return unpack(res, 2, res.n) end
  local give_up = now() + held[1].wait
  -- (a lapse of 0 answers at once: asked again until give_up at most)
  while held[1] and now() < give_up do
    local again, err = await(tm, held[1], 0, give_up - now())
    if err then return nil, err end
    if not again then break end
    res = pack(wire.call(tm.db, up + 1, "call", tm.spec, "later", method, ...))
    held = res[1]
    if held == nil then return nil, res[2] end
  end
  return unpack(res, 2, res.n)
end

return _M

-- mongotx.resty.held: an ungrouped call (transfer, run, commit,
-- commit_many, transfer_many) whose transaction another call holds waits
-- for it in the handler's own coroutine, not in a worker thread: the
-- thread runs tm:later (mongotx.manager.batches.later), which answers a
-- held one `in_progress` at once and names it; the handler then sleeps
-- (ngx.sleep) between short reads of it (mongotx.group.await_held), at
-- most holder_wait in all, and asks again once it left pending or its
-- owner's lease passed (then the call takes it over).  So a held key
-- never holds one of the pool's threads while it waits, and calls on
-- other keys are answered meanwhile.

local group = require "mongotx.group"
local batches = require "mongotx.manager.batches"
local wire = require "mongotx.resty.wire"

local ipairs, select = ipairs, select
local unpack = table.unpack or unpack -- luacheck: ignore 143

local _M = {}

-- The phases where a handler may wait on a semaphore or sleep: elsewhere
-- a call goes alone (mongotx.resty), and waits for a held key in its thread.
_M.YIELDS = { rewrite = true, server_rewrite = true, access = true, content = true, timer = true }

-- The calls that answer a held key later (tm:later).
_M.LATER = batches.LATER

local function pack(...) return { n = select("#", ...), ... } end

local function now()
  local ngx = ngx -- luacheck: ignore 113
  ngx.update_time()
  return ngx.now()
end

-- Waits for held ({ id, wait, lapse }, as the thread answered `took`
-- seconds ago) at most `left` seconds: true when the call should ask
-- again (it left pending, or its owner's lease passed).
local function await(tm, held, took, left)
  local lapse = held.lapse and math.max(held.lapse - took, 0)
  return group.await_held({ id = held.id, wait = left, lapse = lapse },
    function(id) return tm:get(id) end, ngx.sleep, now) -- luacheck: ignore 113
end

-- tm[method](...) through tm:later in a worker thread (wire.call's `up`:
-- 1 when the public method tail-calls this).  The held ones are waited
-- for here, until `give_up` (now() + holder_wait when nil): a call of one
-- transaction (transfer, run, commit) is made again; a batch's held
-- items are committed alone by their id (the others are done: making the
-- batch again would make its items without an id again).  Past
-- `give_up` the `in_progress` answer stands.
local function ask(tm, method, up, give_up, ...)
  local res = pack(wire.call(tm.db, up + 1, "call", tm.spec, "later", method, ...))
  local held = res[1]
  if held == nil then return nil, res[2] end -- no thread, no manager: nil, err
  if held[1] and not give_up then give_up = now() + held[1].wait end
  if method == "commit_many" or method == "transfer_many" then
    local asked, results, errs = now(), res[2], res[3]
    for _, h in ipairs(held) do
      if await(tm, h, now() - asked, give_up - now()) then
        local T, err = ask(tm, "commit", up + 1, give_up, { _id = h.id })
        results[h.i], errs[h.i] = T or false, not T and err or false
      end
    end
  else
    -- (a lapse of 0 answers at once: asked again until give_up at most)
    while held[1] and now() < give_up and await(tm, held[1], 0, give_up - now()) do
      res = pack(wire.call(tm.db, up + 1, "call", tm.spec, "later", method, ...))
      held = res[1]
      if held == nil then return nil, res[2] end
    end
  end
  return unpack(res, 2, res.n)
end

function _M.call(tm, method, up, ...)
  return ask(tm, method, up, nil, ...)
end

return _M

-- bench/holds.lua: holds (docs/holds.md) beside the transfers they
-- replace.  A "transfer" of these rows is a hold and its capture of all
-- of it, both timed.
--
--   hold_capture       on the plan's accounts, as tm:transfer runs;
--   hold_capture_open  every hold from account 1, which carries ctx.open
--                      open holds (made before the timing, voided after
--                      it).  Its check: a hold and a capture there take
--                      the round trips and writes of one on two quiet
--                      accounts (it fails otherwise), and it prints their
--                      times, and the server's time for a plain $inc of
--                      each document (what the open holds' marks cost it);
--                      then one recovery pass with limit 100 over those
--                      holds with 100 of them past their expiry: its round
--                      trips, writes, time and the Lua memory it allocated.
--   hold_many_capture  ctx.batch holds opened by one tm:hold_many (one
--                      insert, their applies in one bulk write), then each
--                      captured (a capture is one decision a hold: the
--                      at-most-once point).

local mongotx = require "mongotx"
local bank = require "bench.bank"
local modes = require "bench.modes"

local now = mongotx.core.monotonic_ms
local COLL = bank.COLLECTION

local _M = {}

local function hold_capture(tm, pair)
  local H = tm:hold(COLL, pair[1], pair[2], 1, { min = 0 })
  return H and tm:capture(H._id)
end

_M.hold_capture = { label = "tm:hold+capture", run = modes.single("hold", nil, hold_capture) }

_M.hold_many_capture = {
  label = "tm:hold_many+capture",
  run = function(ctx)
    return modes.with_bank(ctx, "hold_many" .. ctx.batch, function(db)
      local tm = assert(modes.manager(db, { application = "bench" }))
      return function(from, to, lat, moved)
        local ok = 0
        for first = 1, #from, ctx.batch do
          local last = math.min(first + ctx.batch - 1, #from)
          local list = {}
          for i = first, last do
            list[#list + 1] = { collection = COLL, from = from[i], to = to[i], amount = 1, min = 0 }
          end
          local t = now()
          local results = assert(tm:hold_many(list))
          for k = 1, #list do
            local i = first + k - 1
            if results[k] and tm:capture(results[k]._id) then
              ok = ok + 1
              modes.move(moved, from[i], to[i])
            end
          end
          local per = (now() - t) / #list
          for k = 1, #list do lat[first + k - 1] = per end
        end
        return ok
      end
    end, modes.done_only)
  end,
}

-- The counters and ms of a hold from `from` to `to` and of its capture.
local function counted(db, tm, from, to)
  db.client:reset_counters()
  local t = now()
  local H = assert(tm:hold(COLL, from, to, 1, { min = 0 }))
  local hold = db.client:counters()
  hold.ms = now() - t
  db.client:reset_counters()
  t = now()
  assert(tm:capture(H._id))
  local capture = db.client:counters()
  capture.ms = now() - t
  return hold, capture
end

-- ms of one $inc of account id's balance by 0, the median of 11.
local function inc_ms(db, id)
  local coll, times = db:collection(COLL), {}
  for i = 1, 11 do
    local t = now()
    assert(coll:update_one({ _id = id }, { ["$inc"] = { balance = 0 } }))
    times[i] = now() - t
  end
  table.sort(times)
  return times[6]
end

_M.hold_capture_open = {
  label = "tm:hold+capture, 10 000 open holds on the debited account",
  run = function(ctx)
    local db = bank.open(ctx.uri, "holds_open", ctx.accounts)
    local tm = assert(modes.manager(db, { application = "bench", stale_after = 0 }))
    local open = ctx.open or 10000
    for k = 1, open do
      assert(tm:hold(COLL, 1, 2 + k % (ctx.accounts - 1), 1, { min = 0, id = "open-" .. k,
                                                                 expires = 3600 }))
    end
    -- the round trips and writes of a quiet pair, then of account 1
    local quiet_h, quiet_c = counted(db, tm, 2, 3)
    local hot_h, hot_c = counted(db, tm, 1, 2)
    io.write(("\n  %d open holds on account 1: a hold %d round trips, %d writes, %.1f ms " ..
      "(quiet: %d, %d, %.1f ms); a capture %d, %d, %.1f ms (quiet: %d, %d, %.1f ms); " ..
      "the server's $inc of account 1 %.2f ms, of a quiet one %.2f ms\n"):format(open,
      hot_h.commands, hot_h.writes, hot_h.ms, quiet_h.commands, quiet_h.writes, quiet_h.ms,
      hot_c.commands, hot_c.writes, hot_c.ms, quiet_c.commands, quiet_c.writes, quiet_c.ms,
      inc_ms(db, 1), inc_ms(db, 3)))
    assert(hot_h.commands == quiet_h.commands and hot_h.writes == quiet_h.writes,
      "a hold from the account with open holds took more round trips or writes")
    assert(hot_c.commands == quiet_c.commands and hot_c.writes == quiet_c.writes,
      "a capture from the account with open holds took more round trips or writes")
    local from, to = {}, {}
    for i = 1, ctx.n do from[i], to[i] = 1, 2 + math.random(ctx.accounts - 2) end
    local sample, moved = modes.timed(db, ctx.n, function(lat, moved)
      local ok = 0
      for i = 1, ctx.n do
        local t = now()
        if hold_capture(tm, { from[i], to[i] }) then
          ok = ok + 1
          moved[from[i]] = (moved[from[i]] or 0) - 1
          moved[to[i]] = (moved[to[i]] or 0) + 1
        end
        lat[i] = now() - t
      end
      return ok
    end)
    -- (and the two counted ones: 2 -> 3, 1 -> 2)
    moved[1], moved[3] = (moved[1] or 0) - 1, (moved[3] or 0) + 1
    -- one recovery pass over them, 100 of them past their expiry
    local txs = db:collection("transactions")
    local past = mongotx.Date(math.floor(assert(tm:server_now()) - 1000))
    local due = math.min(100, open)
    for k = 1, due do
      assert(txs:update_one({ _id = "open-" .. k }, { ["$set"] = { ["hold.expires"] = past,
                                                                  deadline = past } }))
    end
    collectgarbage()
    collectgarbage("stop")
    local kb = collectgarbage("count")
    db.client:reset_counters()
    local t0 = now()
    local report = assert(tm:recover { limit = 100 })
    local c = db.client:counters()
    local ms = now() - t0
    kb = collectgarbage("count") - kb
    collectgarbage("restart")
    io.write(("  recovery pass, limit 100, %d open holds of which %d expired: %d examined, " ..
      "%d expired, %d round trips, %d writes, %.0f ms, %.0f KB of Lua memory allocated\n")
      :format(open, due, report.examined, report.cancelled, c.commands, c.writes, ms, kb))
    assert(report.cancelled == due, "the pass did not expire the holds past their expiry")
    assert(report.examined <= 100, "the pass read more than its limit")
    for k = due + 1, open do assert(tm:void("open-" .. k)) end
    bank.check_accounts(db, ctx.accounts, moved)
    bank.drop(db)
    return sample
  end,
}

return _M

-- bench/holds.lua: holds (docs/holds.md) beside the transfers they
-- replace.  A "transfer" of these rows is a hold and its capture of all
-- of it, both timed.
--
--   hold_capture       on the plan's accounts, as tm:transfer runs;
--   hold_capture_open  every hold from account 1, which carries ctx.open
--                      open holds (made before the timing, voided after
--                      it); then one recovery pass with limit 100 over
--                      those holds with 100 of them past their expiry:
--                      its round trips and time are printed.

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
    -- one recovery pass over them, 100 of them past their expiry
    local txs = db:collection("transactions")
    local past = mongotx.Date(math.floor(assert(tm:server_now()) - 1000))
    local due = math.min(100, open)
    for k = 1, due do
      assert(txs:update_one({ _id = "open-" .. k }, { ["$set"] = { ["hold.expires"] = past,
                                                                  deadline = past } }))
    end
    db.client:reset_counters()
    local t0 = now()
    local report = assert(tm:recover { limit = 100 })
    local c = db.client:counters()
    io.write(("\n  recovery pass, limit 100, %d open holds of which %d expired: %d examined, " ..
      "%d expired, %d round trips, %d writes, %.0f ms\n"):format(open, due, report.examined,
      report.cancelled, c.commands, c.writes, now() - t0))
    assert(report.cancelled == due, "the pass did not expire the holds past their expiry")
    for k = due + 1, open do assert(tm:void("open-" .. k)) end
    bank.check_accounts(db, ctx.accounts, moved)
    bank.drop(db)
    return sample
  end,
}

return _M

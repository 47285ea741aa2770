-- mongotx.manager.holds: the manager's calls on holds (hold, hold_many,
-- capture, void), as functions taking the manager, which mongotx.manager makes its
-- methods; what they do is mongotx.holds.

--- The manager's holds (its methods `tm:hold`, `tm:hold_many`, `tm:capture`, `tm:void`).
-- @submodule mongotx.manager

local holds = require "mongotx.holds"

local type = type

local _M = {}

-- The level of a misuse's error: the caller of the method.
local CALLER = 2

--- Reserves `amount`: `from` is debited at once (its floor checked now), `to` credited only in escrow.
-- The hold is decided later by `capture` (all or part) or `void`, or expires by the server's clock
-- ([holds](../docs/holds.md)).
-- @syntax T, err = tm:hold(collection, from, to, amount [, { field = "balance", min, id, expires = 3600, meta }])
-- @string collection the accounts' collection
-- @param from the debited document's id
-- @param to the document credited once captured
-- @number amount finite and positive
-- @tparam[opt] table opts `field`, `min`, `id`, `meta` as for `transfer`; `expires`: seconds until it expires
--   (default 3600)
-- @treturn table the hold's transaction, `hold = { amount, expires, status = "held" }` on it
-- @errors `guard` (below `min`: nothing stays applied), `missing`, `invalid` (also on a manager with
--   `escrow = false`), `idempotency`, `state` (it did not open: `err.status`), database errors
-- @usage local H = assert(tm:hold("accounts", "buyer", "shop", 100, { min = 0, id = "cart-7", expires = 900 }))
-- @function Manager:hold
function _M.hold(self, collection, from, to, amount, opts)
  local T, err = holds.hold(self, collection, from, to, amount, opts, CALLER)
  return T, err
end

--- Opens several holds in one batch: one insert of them all and their applies in one bulk write.
-- Each item is a `hold`'s arguments; each hold has its own outcome (one refused by its floor fails
-- alone) and is then decided as any hold. Bad input in any item: nothing is written.
-- @syntax results, errs = tm:hold_many(list)
-- @tparam table list items `{ collection =, from =, to =, amount = [, field, min, id, expires, meta] }`
-- @treturn table results: `results[i]` item i's hold, as `hold` returns it, or false
-- @treturn table errs: `errs[i]` why item i did not open (as `hold`'s errors), or false
-- @errors nil, err: bad input in an item (`err.item` says which; nothing written), or the server's
--   clock unread
-- @usage local results, errs = tm:hold_many { { collection = "accounts", from = "A", to = "B", amount = 10 } }
-- @function Manager:hold_many
function _M.hold_many(self, list)
  local results, errs = holds.hold_many(self, list, CALLER)
  return results, errs
end

--- Captures a hold: `amount` (default all of it) to `to`, the rest back to `from`, in the finish's writes.
-- A capture repeated with the same amount returns the first one's result.
-- @syntax T, err = tm:capture(id [, amount])
-- @param id the hold's id
-- @number[opt] amount at most what is held
-- @treturn table the hold's transaction, `done`, `hold.captured` the amount
-- @errors `invalid` (more than held, not a hold: nothing changed), `state` (`err.status`: "voided",
--   "expired", "captured" with another amount, "opening"), database errors (retry: it returns the outcome)
-- @usage local T, err = tm:capture("cart-7", 60)
-- @function Manager:capture
function _M.capture(self, id, amount)
  if amount ~= nil and type(amount) ~= "number" then
    error("capture: amount must be a number", CALLER)
  end
  local T, err = holds.capture(self, id, amount, CALLER)
  return T, err
end

--- Voids a hold: everything back to `from`.  A hold past its expiry ends "expired" instead.
-- @syntax T, err = tm:void(id)
-- @param id the hold's id
-- @treturn table the hold's transaction, `cancelled`, `hold.status` "voided" or "expired"
-- @errors `invalid` (not a hold), `state` (`err.status` "captured" or "opening"), database errors
-- @usage assert(tm:void("cart-7"))
-- @function Manager:void
function _M.void(self, id)
  local T, err = holds.void(self, id, CALLER)
  return T, err
end

--- Internal: sets `hold.status` on the holds of a page of transactions (`mongotx list`, `show`), as `tm:get` says it.
-- The pending ones' marks are read in one find per collection, not one a hold.
-- @local
-- @syntax list, err = tm:hold_views(list)
-- @tparam table list transaction documents (`tm:scan`'s)
-- @treturn table the list
-- @errors nil, err: a database error
-- @usage assert(tm:hold_views({ T }))
-- @function Manager:hold_views
function _M.hold_views(self, list)
  return holds.views(self.engine, list)
end

return _M

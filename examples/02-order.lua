-- An order across three collections as one transaction: take the widgets
-- from stock, insert the order, charge the customer's wallet.  Each guard
-- (`where`) is checked when its op applies; the first order succeeds, the
-- second asks for more widgets than there are and is cancelled, with the
-- order it had inserted deleted and the payment it had taken given back.
--
--   MONGOTX_TEST_URI=mongodb://host:27017 lua5.4 examples/02-order.lua
--
-- Run from the repository root; MONGOTX_CPATH says where mongotx/core.so
-- is (default ./build/lua54/?.so).  Uses the database mongotx_demo and
-- drops its stock, orders, wallets and transactions collections first.

package.path = "./examples/?.lua;" .. package.path
local common = require "common"
local show = common.show

local db = common.connect()
local names = { "stock", "orders", "wallets" }
common.fresh(db, table.unpack(names))

local tm = assert(db:manager{ application = "shop" })
local stock, orders, wallets = db:collection("stock"), db:collection("orders"),
                               db:collection("wallets")

local heading = common.heading

local function print_collections()
  for _, name in ipairs(names) do
    local docs = assert(db:collection(name):find_all({}, { sort = { _id = 1 } }))
    print(("  %s (%d):"):format(name, #docs))
    for _, doc in ipairs(docs) do print("    " .. show(doc)) end
  end
end

local PRICE = 20

-- The ops of an order of n widgets paid from `customer`'s wallet.  The
-- stock op comes last so that a failing stock guard has something to undo.
local function order_ops(order_id, customer, n)
  local total = n * PRICE
  return {
    { collection = "orders", id = order_id,
      doc = { customer = customer, item = "widget", qty = n, total = total } },
    { collection = "wallets", id = customer,
      update = { ["$inc"] = { balance = -total } },
      where = { balance = { ["$gte"] = total } } },
    { collection = "stock", id = "widget",
      update = { ["$inc"] = { qty = -n } },
      where = { qty = { ["$gte"] = n } } },
  }
end

heading("before: 5 widgets in stock, alice has 200 in her wallet, no orders")
assert(stock:insert_one({ _id = "widget", qty = 5 }))
assert(wallets:insert_one({ _id = "alice", balance = 200 }))
print_collections()

heading("order-1: alice buys 3 widgets for " .. 3 * PRICE)
local t = assert(tm:begin(order_ops("order-1", "alice", 3), { meta = { kind = "order" } }))
local done, err = tm:commit(t)
assert(done, err)
print("  transaction " .. show(done._id) .. " ended " .. done.state)
print_collections()
assert(stock:find_one({ _id = "widget" }).qty == 2)
assert(wallets:find_one({ _id = "alice" }).balance == 140)
assert(orders:count({}) == 1)

heading("order-2: alice wants 4 widgets, only 2 are left")
t = assert(tm:begin(order_ops("order-2", "alice", 4), { meta = { kind = "order" } }))
done, err = tm:commit(t)
assert(done == nil and err, "order-2 should fail")
print("  commit returned nil and err: " .. tostring(err))
print(("  err.code %s, err.op %s"):format(err.code, tostring(err.op)))
local T = assert(tm:get(t._id))
print(("  transaction %s: state %s, reason %q"):format(show(T._id), T.state, T.reason))
assert(err.code == "guard" and err.op == 3)
assert(T.state == "cancelled")
heading("after order-2: the order it inserted is gone, alice got her 80 back")
print_collections()
assert(stock:find_one({ _id = "widget" }).qty == 2)
assert(wallets:find_one({ _id = "alice" }).balance == 140)
assert(orders:count({}) == 1)
assert(orders:find_one({ _id = "order-2" }) == nil)
assert(#wallets:find_one({ _id = "alice" }).pendingTransactions == 0)

heading("tm:stats()")
print("  " .. show(assert(tm:stats())))
db:close()

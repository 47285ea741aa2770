-- bench/openresty.lua's control: POST /bare does a transfer's five round
-- trips (create, apply both accounts in one update, commit, finish both,
-- done) with plain commands in a worker thread, without mongotx: no
-- validation, guard, version, marker rule, event or recovery.  Its tail
-- beside mongotx's ungrouped one, in the same run, is what nginx's thread
-- pool, the server and the machine give any client.
--
--   location = /bare { content_by_lua_block { require("bench.bare").handler(16) } }

local core = require "mongotx.core"

local _M = {}

local client -- a thread VM's own connection, kept between its calls

local function must(reply, err)
  if not reply then error(tostring(err), 0) end
  return reply
end

local function update(db, coll, ...)
  local updates = {}
  for i = 1, select("#", ...), 2 do
    updates[#updates + 1] = core.doc("q", { _id = (select(i, ...)) }, "u", (select(i + 1, ...)))
  end
  must(client:command(db, core.doc("update", coll, "updates", updates)))
end

-- In a worker thread: amount from `from` to `to`.
function _M.transfer(uri, db, from, to, amount)
  client = client or must(core.connect(uri))
  local id = core.ObjectId()
  must(client:command(db, core.doc("insert", "transactions", "documents",
    { { _id = id, state = "pending", from = from, to = to, amount = amount } })))
  update(db, "accounts", from, { ["$inc"] = { balance = -amount }, ["$push"] = { bare = id } },
    to, { ["$inc"] = { balance = amount }, ["$push"] = { bare = id } })
  update(db, "transactions", id, { ["$set"] = { state = "applied" } })
  update(db, "accounts", from, { ["$pull"] = { bare = id } }, to, { ["$pull"] = { bare = id } })
  update(db, "transactions", id, { ["$set"] = { state = "done" } })
  return true
end

local line

-- The content handler: the body of bench/openresty-wrk.lua's /transfer.
-- At most `inflight` calls of a worker run in its worker threads at once,
-- the others waiting in line (FIFO, as mongotx.resty.wire's line): fewer
-- than nginx's VMs, so that no call finds none free.
function _M.handler(inflight)
  local ngx = ngx -- luacheck: ignore 113
  line = line or require("ngx.semaphore").new(inflight)
  ngx.req.read_body()
  local from, to, amount = (ngx.req.get_body_data() or ""):match(
    '"from":"([^"]+)","to":"([^"]+)","amount":(%d+)')
  if not amount then return ngx.exit(400) end
  if not line:wait(60) then return ngx.exit(503) end
  local done, ok, err = ngx.run_worker_thread("mongotx", "bench.bare", "transfer",
    os.getenv("MONGOTX_URI"), os.getenv("MONGOTX_DATABASE"), from, to, tonumber(amount))
  line:post(1)
  if not (done and ok) then
    ngx.log(ngx.ERR, "bench.bare: ", tostring(ok), " ", tostring(err))
    return ngx.exit(500)
  end
  ngx.say('{"status":"done"}')
end

return _M

-- The handlers of examples/openresty/nginx.conf: a bank whose transfers
-- are mongotx transactions, run by mongotx.resty in nginx's worker threads
-- so that a slow database never holds the nginx worker.
--
--   POST /transfer   {"from": "A", "to": "B", "amount": 100}, header
--                    Idempotency-Key (optional): a retry with the same key
--                    returns the same transaction instead of a second one.
--                    200 {"id", "state", "from", "to", "amount"}; 4xx/5xx
--                    {"error": <name>, "message": <what>}.
--   POST /hold       {"from", "to", "amount", "expires"?}, header
--                    Idempotency-Key (required: the hold's id): reserves
--                    the amount (docs/holds.md); expires in seconds
--                    (default 3600).  200 {"id", "status": "held", ...}.
--   POST /capture    {"id", "amount"?}: all of the hold or part of it;
--                    200 {"id", "status": "captured", "captured", ...}.
--   POST /void       {"id"}: everything back; 200 {"id", "status"}.
--                    A hold decided otherwise answers 409 hold_<status>.
--   GET /tx/<id>     the transaction: 200 {...} or 404.
--   GET /metrics     mongotx's counters of every worker (Prometheus text).
--   init_worker()    the recovery timer (mongotx.resty.recovery): one
--                    worker of the instance finishes what crashed workers
--                    and disconnected clients left.
--
-- Bad input (malformed JSON, missing or unknown fields, amounts that are
-- not whole positive numbers, a body over client_max_body_size, accounts
-- that do not exist) gets a 4xx with a JSON error naming the problem, and
-- nothing is written.  Amounts are whole numbers (cents); the debit is
-- guarded with min = 0, so no account goes below zero.
--
-- Unknown accounts: a read of the accounts before the transfer answers
-- them 404 unknown_account.  Each worker remembers the accounts it found
-- (config.account_cache, an LRU of `size` entries kept `ttl` seconds;
-- false: read every time), so a transfer between accounts it knows skips
-- that read, which costs more CPU than the transfer's share of a grouped
-- batch.  Only accounts found are remembered: one created later works at
-- once.  The trade: an account deleted while remembered is not refused
-- before the transfer, which then ends cancelled (its op failed,
-- `missing`), answered with the same 404; the database keeps that
-- cancelled transaction where the read would have written nothing, and
-- the worker forgets the account.
--
-- Configuration: environment (nginx.conf's env directives) MONGOTX_URI
-- and MONGOTX_DATABASE, or configure{...} from init_by_lua / init_worker.

local cjson = require "cjson.safe"
local lrucache = require "resty.lrucache"
local resty = require "mongotx.resty"
local core = require "mongotx.core"

local ngx = ngx -- luacheck: ignore 113
local type, pairs, tostring, floor = type, pairs, tostring, math.floor

local _M = {}

local config = {
  uri = os.getenv("MONGOTX_URI") or "mongodb://127.0.0.1:27017/?serverSelectionTimeoutMS=5000",
  database = os.getenv("MONGOTX_DATABASE") or "bank",
  accounts = "accounts",
  thread_pool = "mongotx",
  wait = 5,                             -- seconds a call waits for a free thread (then 503)
  -- db:manager's options (data only). metrics: the lua_shared_dict that
  -- counts its events (mongotx.metrics.shared), served at GET /metrics;
  -- group: concurrent transfers of a worker run as one batch
  -- (docs/openresty.md, "Group commit"; the default, written out here;
  -- group = false runs each call alone); lease: a killed worker's
  -- transfers are taken over by their retries 5 s after their last step
  -- (docs/openresty.md, "A key another call holds")
  manager = { application = "bank", metrics = "mongotx_metrics", lease = 5,
              group = { max = 100, delay = 0, inflight = 1 } },
  dict = "mongotx",                     -- lua_shared_dict for the recovery election
  recovery = { every = 5, limit = 1000 },
  max_amount = 2 ^ 53,                  -- exact in a double, and in BSON
  account_cache = { size = 10000, ttl = 60 }, -- accounts known to exist, per worker (false: none)
}

-- The worker's accounts known to exist (a resty.lrucache), false when
-- config.account_cache is off, nil until the first transfer makes it.
local known

-- configure{ key = value, ... }: replaces config's entries (a table value
-- replaces the whole entry).
function _M.configure(t)
  for k, v in pairs(t) do config[k] = v end
  known = nil
end

-- The cache, made by the first transfer after configure (an account_cache
-- that is neither false nor { size >= 1, ttl = seconds } raises there).
local function account_cache()
  if known == nil then
    local c = config.account_cache
    known = false
    if c then
      local err
      known, err = lrucache.new(c.size)
      if not known then error("account_cache.size: " .. tostring(err)) end
    end
  end
  return known
end

-- One database handle and manager per worker process and mode (offload =
-- false runs the calls in the worker itself: a blocking comparison).
local handles = {}

local function manager(offload)
  local h = handles[offload]
  if h then return h.db, h.tm end
  local db, err = resty.connect(config.uri, { database = config.database, offload = offload,
                                              thread_pool = config.thread_pool, wait = config.wait })
  if not db then return nil, nil, err end
  local tm
  tm, err = db:manager(config.manager)
  if not tm then return nil, nil, err end
  handles[offload] = { db = db, tm = tm }
  return db, tm
end

local function reply(status, body)
  ngx.status = status
  ngx.header["Content-Type"] = "application/json"
  ngx.say(cjson.encode(body))
end

local function fail(status, name, message, extra)
  local body = { error = name, message = message }
  for k, v in pairs(extra or {}) do body[k] = v end
  return reply(status, body)
end

-- A BSON value as JSON: ObjectIds as their hex, Dates as ISO 8601 UTC,
-- other values of mongotx.core by their content.
local function jsonable(v, depth)
  depth = depth or 0
  local t = type(v)
  if t == "table" then
    if depth > 20 then return "..." end
    local out = {}
    for k, x in pairs(v) do out[k] = jsonable(x, depth + 1) end
    return out
  elseif t == "userdata" and core.type(v) ~= "null" then
    local kind = v:type()
    if kind == "date" then
      local ms = v:value()
      return os.date("!%Y-%m-%dT%H:%M:%S", floor(ms / 1000)) .. string.format(".%03dZ", ms % 1000)
    elseif kind == "objectId" or kind == "long" then
      return v:value()
    end
    return tostring(v)
  end
  return v
end

local function id_json(id)
  return jsonable(id)
end

local function tx_json(T)
  local out = {
    id = id_json(T._id), state = T.state, from = T.source, to = T.destination,
    amount = T.value, reason = T.reason, lastModified = jsonable(T.lastModified),
  }
  if type(T.hold) == "table" then
    out.status, out.captured, out.expires = T.hold.status, T.hold.captured,
      jsonable(T.hold.expires)
  end
  return out
end

local ACCOUNT = "^[%w%-_.]+$"
local KEY = "^[%w%-_]+$"
local FIELDS = { from = true, to = true, amount = true }

-- The request's body, a JSON object POSTed to `path` with only the
-- fields of `fields` (their names in `names`), or nil, status, error
-- name, message.
local function read_object(path, fields, names)
  if ngx.req.get_method() ~= "POST" then
    return nil, 405, "method", "POST a JSON object to " .. path
  end
  ngx.req.read_body()
  local body = ngx.req.get_body_data()
  if not body then
    if ngx.req.get_body_file() then
      return nil, 413, "too_large", "the body is larger than client_body_buffer_size"
    end
    return nil, 400, "no_body", "the body must be a JSON object {" .. names .. "}"
  end
  local req, jerr = cjson.decode(body)
  if req == nil then return nil, 400, "malformed_json", "the body is not JSON: " .. tostring(jerr) end
  if type(req) ~= "table" or req[1] ~= nil then
    return nil, 400, "not_an_object", "the body must be a JSON object {" .. names .. "}"
  end
  for k in pairs(req) do
    if not fields[k] then
      return nil, 400, "unknown_field", "unknown field " .. tostring(k) .. " (" .. names .. ")"
    end
  end
  return req
end

-- Is amount a whole number from 1 to config.max_amount?  nil, or the
-- status, error name and message.
local function bad_amount(amount)
  if amount == nil then return 400, "missing_field", "field amount is missing" end
  if type(amount) ~= "number" then
    return 400, "bad_amount", "field amount must be a number, not a " ..
      (amount == cjson.null and "null" or type(amount))
  end
  if amount ~= amount or amount <= 0 or amount > config.max_amount or floor(amount) ~= amount then
    return 400, "bad_amount", "field amount must be a whole number from 1 to " ..
      string.format("%.0f", config.max_amount) .. ", not " .. tostring(amount)
  end
end

-- The request's transfer (or hold: `path`, `fields`), or nil, status,
-- error name, message.
local function parse_request(path, fields)
  local req, status, name, message = read_object(path or "/transfer", fields or FIELDS,
    fields and "from, to, amount, expires" or "from, to, amount")
  if not req then return nil, status, name, message end
  for _, f in ipairs { "from", "to" } do
    local v = req[f]
    if v == nil then return nil, 400, "missing_field", "field " .. f .. " is missing" end
    if type(v) ~= "string" or #v > 128 or not v:find(ACCOUNT) then
      return nil, 400, "bad_account", "field " .. f .. " must be an account id " ..
        "(1 to 128 letters, digits, '-', '_', '.')"
    end
  end
  if req.from == req.to then return nil, 400, "same_account", "from and to are the same account" end
  local amount = req.amount
  status, name, message = bad_amount(amount)
  if status then return nil, status, name, message end
  local key = ngx.var.http_idempotency_key
  if key ~= nil and (#key > 128 or not key:find(KEY)) then
    return nil, 400, "bad_idempotency_key", "the Idempotency-Key header must be 1 to 128 " ..
      "letters, digits, '-' or '_'"
  end
  return { from = req.from, to = req.to, amount = amount, key = key, expires = req.expires }
end

-- The HTTP answer to a transfer's error.
local ERRORS = {
  invalid = { 400, "invalid" },
  guard = { 422, "insufficient_funds" },
  missing = { 404, "unknown_account" },
  idempotency = { 409, "idempotency_key_reused" },
  in_progress = { 409, "in_progress" }, -- another request runs this key: ask again later
  overloaded = { 503, "overloaded" },
  busy = { 503, "busy" },            -- the account is held by another open transfer
  contention = { 503, "busy" },
}

-- The account of the transfer's op that found no document, or nil.
local function missing_account(err, req)
  if type(err) ~= "table" or err.code ~= "missing" then return nil end
  if err.op == 1 then return req.from elseif err.op == 2 then return req.to end
end

-- Do both accounts of req exist?  true (those cached are taken as
-- existing, the others read, and cached when found), false and the first
-- that does not, or nil, err.
local function accounts_exist(db, req)
  local cache = account_cache()
  local want = { req.from, req.to }
  if cache then
    want = {}
    if not cache:get(req.from) then want[#want + 1] = req.from end
    if not cache:get(req.to) then want[#want + 1] = req.to end
    if #want == 0 then return true end
  end
  local found, err = db:find(config.accounts, { _id = { ["$in"] = want } },
                             { projection = { _id = 1 } })
  if not found then return nil, err end
  local seen = {}
  for _, d in ipairs(found) do
    seen[d._id] = true
    if cache then cache:set(d._id, true, config.account_cache.ttl) end
  end
  for _, id in ipairs(want) do
    if not seen[id] then return false, id end
  end
  return true
end

local function transfer_error(err, req)
  if type(err) == "table" and err.code == "guard" and req then
    return fail(422, "insufficient_funds", string.format("account %s has less than %.0f",
      req.from, req.amount))
  end
  local e = type(err) == "table" and ERRORS[err.code]
  if e then return fail(e[1], e[2], err.message) end
  if type(err) == "table" and err.code == "cancelled" then
    return fail(409, "cancelled", err.message, { reason = err.reason })
  end
  local transient = type(err) == "table" and err.transient
  ngx.log(ngx.ERR, "transfer: ", tostring(err))
  return fail(transient and 503 or 500, transient and "unavailable" or "internal",
    tostring(err))
end

-- POST /transfer (opts.offload = false: in the worker itself, blocking it).
function _M.transfer(opts)
  local offload = not (opts and opts.offload == false)
  local req, status, name, message = parse_request()
  if not req then return fail(status, name, message) end
  local db, tm, err = manager(offload)
  if not db then return transfer_error(err) end
  -- unknown accounts are a 404 before anything is written
  local exist, missing = accounts_exist(db, req)
  if exist == nil then return transfer_error(missing) end
  if not exist then
    return fail(404, "unknown_account", "no account " .. missing, { account = missing })
  end
  local T
  T, err = tm:transfer(config.accounts, req.from, req.to, req.amount,
                       { min = 0, id = req.key })
  if not T then
    -- an account deleted since it was cached (or read): the transfer
    -- ended cancelled; answered as the read answers it, and forgotten
    missing = missing_account(err, req)
    if not missing then return transfer_error(err, req) end
    if known then known:delete(missing) end
    return fail(404, "unknown_account", "no account " .. missing, { account = missing })
  end
  return reply(200, tx_json(T))
end

-- Holds ---------------------------------------------------------------------

local HOLD_FIELDS = { from = true, to = true, amount = true, expires = true }
local DECIDE_FIELDS = { id = true, amount = true }

-- The answer to a hold's error: one decided otherwise is a 409
-- hold_<status> (voided, expired, captured with another amount, opening).
local function hold_error(err, req)
  if type(err) == "table" and err.code == "state" and err.status then
    return fail(409, "hold_" .. err.status, err.message, { captured = err.captured })
  end
  if type(err) == "table" and err.code == "state" then
    return fail(404, "unknown_hold", err.message)
  end
  if type(err) == "table" and err.code == "in_progress" then
    return fail(409, "in_progress", err.message) -- another request is opening it
  end
  return transfer_error(err, req)
end

-- POST /hold: reserves the amount under the Idempotency-Key.
function _M.hold()
  local req, status, name, message = parse_request("/hold", HOLD_FIELDS)
  if not req then return fail(status, name, message) end
  if not req.key then
    return fail(400, "missing_idempotency_key", "a hold is named by its Idempotency-Key header")
  end
  local e = req.expires
  if e ~= nil and (type(e) ~= "number" or e ~= e or e <= 0 or e > 10 * 365 * 24 * 3600) then
    return fail(400, "bad_expires", "field expires must be seconds, more than 0")
  end
  local db, tm, err = manager(true)
  if not db then return transfer_error(err) end
  local exist, missing = accounts_exist(db, req)
  if exist == nil then return transfer_error(missing) end
  if not exist then
    return fail(404, "unknown_account", "no account " .. missing, { account = missing })
  end
  local T
  T, err = tm:hold(config.accounts, req.from, req.to, req.amount,
                   { min = 0, id = req.key, expires = e })
  if not T then return hold_error(err, req) end
  return reply(200, tx_json(T))
end

-- The body of /capture and /void: { id, amount }, or nil, status, name,
-- message.
local function decision(path, with_amount)
  local req, status, name, message = read_object(path, DECIDE_FIELDS,
    with_amount and "id, amount" or "id")
  if not req then return nil, status, name, message end
  if type(req.id) ~= "string" or #req.id > 128 or not req.id:find(KEY) then
    return nil, 400, "bad_id", "field id must be the hold's Idempotency-Key"
  end
  if req.amount ~= nil then
    if not with_amount then return nil, 400, "unknown_field", "unknown field amount (id)" end
    status, name, message = bad_amount(req.amount)
    if status then return nil, status, name, message end
  end
  return req
end

-- POST /capture: all of the hold, or `amount` of it.
function _M.capture()
  local req, status, name, message = decision("/capture", true)
  if not req then return fail(status, name, message) end
  local _, tm, err = manager(true)
  if not tm then return transfer_error(err) end
  local T
  T, err = tm:capture(req.id, req.amount)
  if not T then return hold_error(err) end
  return reply(200, tx_json(T))
end

-- POST /void: everything back.
function _M.void()
  local req, status, name, message = decision("/void", false)
  if not req then return fail(status, name, message) end
  local _, tm, err = manager(true)
  if not tm then return transfer_error(err) end
  local T
  T, err = tm:void(req.id)
  if not T then return hold_error(err) end
  return reply(200, tx_json(T))
end

-- GET /tx/<id>: a 24-digit hex id is looked up as an ObjectId first.
function _M.get_tx(id)
  if ngx.req.get_method() ~= "GET" then return fail(405, "method", "GET /tx/<id>") end
  if type(id) ~= "string" or #id > 128 or not id:find(KEY) then
    return fail(400, "bad_id", "a transaction id is 1 to 128 letters, digits, '-' or '_'")
  end
  local _, tm, err = manager(true)
  if not tm then return transfer_error(err) end
  local T
  if #id == 24 and id:find("^%x+$") then
    T, err = tm:get(core.ObjectId(id))
    if err then return transfer_error(err) end
  end
  if not T then
    T, err = tm:get(id)
    if err then return transfer_error(err) end
  end
  if not T then return fail(404, "unknown_transaction", "no transaction " .. id) end
  return reply(200, tx_json(T))
end

-- GET /metrics: the counters of every worker, for Prometheus.
function _M.metrics()
  local dict = config.manager and config.manager.metrics
  if not dict then return fail(404, "no_metrics", "metrics are off (manager.metrics)") end
  return require("mongotx.metrics.shared").serve(dict)
end

-- init_worker_by_lua: the recovery timer (one worker of the instance runs
-- it; see mongotx.resty.recovery).
function _M.init_worker()
  local r = config.recovery
  if not r then return end
  return resty.recovery {
    uri = config.uri, connect = { database = config.database, thread_pool = config.thread_pool },
    manager = config.manager, dict = config.dict, every = r.every, limit = r.limit,
    on_report = r.on_report,
  }
end

return _M

-- The transaction manager: the API a caller sees (begin, commit, run,
-- transfer, commit_many, transfer_many, each, finish, rollback, compensate,
-- recover, prune, get, find, stats, backlog, inspect, unpark, step, holds).
-- It checks what callers pass (mongotx.validate, mongotx.options) and holds
-- the policies; the state machine that drives transactions through the
-- protocol's steps is mongotx.engine (with mongotx.batch for batches),
-- recovery is mongotx.recovery and the stepwise API mongotx.stepwise.

--- The transaction manager: `db:manager(opts)` returns one (docs/transactions.md).
-- @module mongotx.manager

local core = require "mongotx.core"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local default_policy = require "mongotx.policy"
local stored = require "mongotx.stored"
local engine = require "mongotx.engine"
local batch = require "mongotx.batch"
local recovery = require "mongotx.recovery"
local each = require "mongotx.each"
local group = require "mongotx.group"
local checks = require "mongotx.manager.checks"
local batches = require "mongotx.manager.batches"
local counts = require "mongotx.manager.counts"
local operate = require "mongotx.manager.operate"
local commands = require "mongotx.engine.commands"
local holds = require "mongotx.holds"
local mholds = require "mongotx.manager.holds"

local canon = validate.canon
local live = stored.live
local ipairs, pairs, type, setmetatable = ipairs, pairs, type, setmetatable
local format = string.format

local _M = {}

local Manager = {}
Manager.__index = Manager

-- Levels for error(), counted from the function that raises or passes
-- the level on: a misuse is reported at the caller of the public method
-- (CALLER from the method, HELPER_CALLER from a helper it calls,
-- ITEM_CALLER from the check of a batch item, which batch_specs calls).
-- The frames between must not be tail calls, which Lua drops.
local CALLER, HELPER_CALLER, ITEM_CALLER = 2, 3, 4

-- find's and scan's order unless the caller gives one: the unique key,
-- so no server's cursor returns a transaction twice or skips one
local BY_ID = { _id = 1 }

local manager_options = {
  collection = true, application = true, marker = true, version_field = true,
  write_concern = true, fencing = true, escrow = true, single_writer = true,
}

for k in pairs(default_policy) do manager_options[k] = true end

-- nil when the manager may write to db's server; else the `unsupported`
-- error.  FerretDB v1 does not isolate concurrent read-modify-write
-- updates of one document (its issue #3040): two writers there lose money
-- (docs/servers.md has the figures), so a manager starts there only when
-- its caller promises one writer, by the option or for a whole process
-- tree (the command, the test targets) by the environment.
local function refuse_server(db, single_writer)
  if single_writer == nil then single_writer = os.getenv("MONGOTX_SINGLE_WRITER") == "1" end
  if single_writer then return nil end
  local version, err = commands.ferretdb_v1(db.client)
  if version == nil then return err end
  if version then
    return errors.new("unsupported", format("FerretDB %s does not isolate concurrent " ..
      "updates of one document (FerretDB issue #3040, mongotx issue 34): two writers lose " ..
      "money. Pass single_writer = true (or set MONGOTX_SINGLE_WRITER=1) only when this " ..
      "process is the one writer of these documents", version), { step = "manager" })
  end
end

-- Options are checked by mongotx.options (types raise; values, fencing's
-- and finish's modes and a marker that clashes give nil, err).  fencing:
-- how owners fence their applies (see mongotx.engine); "auto" uses the
-- server's clock where the server can evaluate $$NOW in a filter.
function _M.new(db, opts)
  local why
  opts, why = validate.options(opts, manager_options, "manager", HELPER_CALLER)
  if not opts then return nil, why end
  local policy = setmetatable({}, { __index = default_policy })
  for k in pairs(default_policy) do
    if opts[k] ~= nil then policy[k] = opts[k] end
    -- a raise of the caller's policy, told apart from any other (recovery)
    if type(opts[k]) == "function" and k ~= "on_event" then
      policy[k] = errors.guard_policy(k, opts[k])
    end
  end
  local collection = opts.collection or "transactions"
  -- its namespace's length, by the function that checks an op's
  -- collection (mongotx.options checked the rest)
  local ok, bad = core.check_collection(collection, nil,
    math.max(0, core.MAX_NAMESPACE - #db.name - 1))
  if not ok then
    return nil, errors.new("invalid", "option collection of manager: " .. bad, { step = "manager" })
  end
  local refused = refuse_server(db, opts.single_writer)
  if refused then return nil, refused end
  local tx = db.client:collection(db.name, collection)
  local self = setmetatable({
    db = db,
    policy = policy,
    tx = tx,
    engine = engine.new {
      db = db, tx = tx, collection = collection, policy = policy,
      application = opts.application or "mongotx",
      marker = opts.marker or "pendingTransactions",
      version_field = opts.version_field or "txVersion",
      write_concern = opts.write_concern or { w = "majority", j = true },
      fencing = opts.fencing or "auto",
      escrow = opts.escrow ~= false,
    },
    finishing = {}, -- committed transactions waiting for finish() (policy.finish)
    stepped = { versions = {}, undone = {} }, -- what tm:step remembers (stepwise)
  }, Manager)
  -- read by callers and examples (namespace: "<database>.<collection>")
  local e = self.engine
  self.application, self.instance, self.namespace = e.application, e.instance, e.namespace
  local err
  ok, err = tx:create_index(core.doc("state", 1, "lastModified", 1))
  if not ok then return nil, err end
  return self
end

-- Makes this manager's calls use `client` (a client of the same
-- deployment, such as one lent by a pool: mongotx.pool) from now on; the
-- handles made from its former client are dropped, so none is used from
-- two threads.

--- @type Manager

--- Internal: makes this manager's calls use another client of the same deployment.
-- Used by mongotx.pool to lend a client per call; handles made from the former client are dropped.
-- @local
-- @syntax tm:use(client)
-- @tparam userdata client a client of `mongotx.core.connect`
-- @usage tm:use(pool_client)
function Manager:use(client)
  self.db.client = client
  self.tx = client:collection(self.db.name, self.engine.vctx.collection)
  self.engine:use(self.tx)
end

-- The transaction with this id, or nil.  The id goes into a query, so it
-- is checked like a caller's id: {$gt = ""} must not find another one.
function Manager:_get(id, step, level)
  local kind = type(id)
  if id == nil or kind == "function" or kind == "thread" then
    error(format("%s needs a transaction id, not a %s", step, kind), level + 1)
  end
  local T, err = self.engine:get(id)
  if err then return nil, errors.wrap(err, step, nil) end
  return T
end

--- The transaction document with this id.
-- @syntax T, err = tm:get(id)
-- @param id a transaction id ([Ids](../docs/transactions.md#ids))
-- @treturn ?table the document, or nil when there is none
-- @errors nil, err: a database error (the C core's codes); an id that is not one raises
-- @usage local T = tm:get("o-1")
function Manager:get(id)
  local T, err = self:_get(id, "get", CALLER)
  if T then T = holds.view(self.engine, T) end
  return T, err
end

function Manager:_load(t, step)
  local _, err = checks.tx_ref(t, step, HELPER_CALLER)
  if err then return nil, err end
  local T
  T, err = self:_get(t._id, step, HELPER_CALLER)
  if err then return nil, err end
  if not T then
    return nil, errors.new("state", "no such transaction", { step = step, id = t._id })
  end
  return T
end

-- The server's clock (ms since the epoch), read now.

--- The server's clock, read now.
-- @syntax ms, err = tm:server_now()
-- @treturn number milliseconds since the epoch
-- @errors nil, err: a database error
-- @usage local now = assert(tm:server_now())
function Manager:server_now()
  return self.engine:server_now()
end

-- The public API ------------------------------------------------------------

-- Checks ops and opts ({ id, meta }) as begin does, writing nothing: true,
-- or nil and begin's error (mongotx.each checks its items so).

--- Runs `begin`'s checks on ops and opts, writing nothing.
-- @syntax ok, err = tm:check(ops [, { id, meta }])
-- @tparam table ops the ops, as for `begin`
-- @tparam[opt] table opts `id`, `meta`, as for `begin`
-- @treturn boolean true when `begin` would take them
-- @errors `invalid` (naming the op, id or meta), as `begin` returns it; a wrong Lua type raises
-- @usage local ok, err = tm:check({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -5 } } } })
function Manager:check(ops, opts)
  local spec, err = checks.spec(self, ops, opts, nil, "check", CALLER)
  if not spec then return nil, err end
  return true
end

-- Creates the transaction (state initial) after checking every op.  With
-- opts.id, repeating begin is safe: the same ops return the existing
-- transaction, other ops are an `idempotency` error.

--- Checks every op and inserts the transaction in state `initial`.
-- @syntax t, err = tm:begin(ops [, { id = key, meta = table }])
-- @tparam table ops a list of ops `{ collection, id, kind?, update?, undo?, doc?, where? }`
-- @tparam[opt] table opts `id`: an idempotency key (the same ops again return the existing transaction); `meta`:
--   stored on it
-- @treturn table the transaction document
-- @errors `invalid` (bad op, id or meta; nothing written), `idempotency` (the id was used for other ops), database
--   errors
-- @usage local t = assert(tm:begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -5 } }
--   } }, { id = "o-1" }))
function Manager:begin(ops, opts)
  local t, err = self:_begin(ops, opts, nil, HELPER_CALLER) -- (not a tail call: a frame more)
  return t, err
end

-- begin, with `extra` fields stored on the transaction (compensate's
-- `compensates`); `level` for a raise.
function Manager:_begin(ops, opts, extra, level)
  local spec, err = checks.spec(self, ops, opts, extra, "begin", level or CALLER)
  if not spec then return nil, err end
  local id = spec.id
  if id == nil then id = core.ObjectId() end
  local eng = self.engine
  -- its owner and lease (no instance: the owner drives it, when it
  -- wants, by commit or rollback), so others take it only after that
  -- lease (policy.may_recover)
  local doc = { _id = id, state = "initial", ops = spec.stored, epoch = 0,
                attempts = 0, meta = spec.meta, markerField = eng.marker,
                application = eng.application, lease = self.policy.lease,
                versionField = eng.version_field, mark = stored.new_mark(eng.vctx.collection, id) }
  for k, v in pairs(extra or {}) do doc[k] = v end
  local res
  res, err = self.engine:step("create", id, self.tx, doc)
  if not res then return nil, err end
  if res.created then
    doc.ops = spec.ops
    return doc
  end
  local existing
  existing, err = self.engine:get(id)
  if err then return nil, err end
  if existing and canon(existing.ops) == canon(spec.ops) then return existing end
  return nil, errors.new("idempotency", "this id was used for other ops",
    { step = "begin", id = id })
end

-- Drives the transaction to done; nil, err when it ended cancelled (err
-- says which op and why) or could not be driven.

--- Drives a transaction to `done`.
-- @syntax T, err = tm:commit(t)
-- @tparam table t the transaction (from `begin`, or any table with its `_id`)
-- @treturn table the final document, state `done`
-- @errors `cancelled` (an op could not apply: `missing`, `guard`, `conflict`, ...; `err.cause` the code,
--   `err.reason` the words), `in_progress` (another call holds it beyond `holder_wait`),
--   `state`, database errors
-- @usage local done, err = tm:commit(t)
function Manager:commit(t)
  local T, err = self:_load(t, "commit")
  if not T then return nil, err end
  if type(T.hold) == "table" then
    return nil, errors.new("invalid", "a hold is decided by capture or void, not commit",
      { step = "commit", id = T._id })
  end
  local later = self.held_later -- (batches.later: held ones answered at once)
  local final, why, held, busy = self.engine:drive(T, nil, later and "hand")
  batches.listed(self, held, busy) -- (with batches.later: answered at once, its caller waits)
  if final then return final end
  return nil, why
end

-- begin + commit in one go, the fast way (batch.lua): the transaction is
-- created pending and owned.  Returns it at `done` (or at `applied` with
-- policy.finish = "deferred"), or nil, err.

--- Begin and commit in one go, the fast way (one bulk write per collection).
-- @syntax T, err = tm:run(ops [, { id, meta }])
-- @tparam table ops the ops, as for `begin`
-- @tparam[opt] table opts `id`, `meta`, as for `begin`
-- @treturn table the transaction: `done`, or `applied` with `finish = "deferred"`
-- @errors as `begin` and `commit`
-- @usage local T = assert(tm:run(ops, { id = "o-2" }))
function Manager:run(ops, opts)
  local spec, err = checks.run_call(self, ops, opts, nil, CALLER)
  if not spec then return nil, err end
  return batches.run_one(self, spec)
end

--- Moves `amount` of `field` from one document to another: `run` of two `$inc` ops.
-- @syntax T, err = tm:transfer(collection, from, to, amount [, { field = "balance", min, id, meta }])
-- @string collection the accounts' collection
-- @param from the debited document's id
-- @param to the credited document's id
-- @number amount finite and positive
-- @tparam[opt] table opts `field` (default `"balance"`), `min` (the debit's floor: guard `field >= min + amount`),
--   `id`, `meta`
-- @treturn table the transaction (`source`, `destination`, `value` on it)
-- @errors `guard` (below `min`: nothing stays applied), `missing`, `invalid`, `idempotency`, `busy`, `in_progress`
--   (a call with the same id holds it beyond `holder_wait`), database errors
-- @usage local T, err = tm:transfer("accounts", "A", "B", 100, { min = 0, id = "order-17" })
function Manager:transfer(collection, from, to, amount, opts)
  local spec, err = checks.transfer_call(self, collection, from, to, amount, opts, CALLER)
  if not spec then return nil, err end
  return batches.run_one(self, spec)
end

-- hold, hold_many, capture, void, hold_views: mongotx.manager.holds.
for name, fn in pairs(mholds) do Manager[name] = fn end

-- Runs calls of tm:transfer, tm:run and tm:commit that concurrent
-- callers made as one batch, each answered as its call alone would be:
-- the batch of mongotx.group's driver (group.wrap; through mongotx.pool
-- and mongotx.resty, which lend it a client).  calls[i] = { method =
-- "transfer" | "run" | "commit", n = <argument count>, <the arguments> }; returns
-- one result per call and the order they took effect in
-- (group.run_calls), or nil, err when no client came free (a pool).

--- Internal: the batch of mongotx.group's driver, concurrent `transfer`, `run`, `commit` and `hold` calls run as one.
-- @local
-- @syntax out, order = tm:run_calls(calls, wait)
-- @tparam table calls `{ method = "transfer" | "run" | "commit" | "hold", n = <argument count>, <the arguments> }`
--   each
-- @number wait the seconds the driver waited for them
-- @treturn table one result per call (as the call alone answers), and the order they took effect in
-- @errors nil, err when no client of a pool came free
-- @usage -- group.wrap(tm, ...) and mongotx.resty's group option call it
function Manager:run_calls(calls, wait)
  local out, order = group.run_calls(self, calls, wait)
  return out, order
end

-- tm:later(method, ...): mongotx.manager.batches.later (mongotx.resty).
Manager.later = batches.later

local many_options = { ops = true, id = true, meta = true }

-- Runs many transactions with one round trip per protocol step for the
-- whole batch.  list[i] is an ops list or { ops =, id =, meta = }.
-- Returns results, errs: results[i] the transaction or false, errs[i]
-- why not (false when it ran); an op that cannot apply cancels only its
-- own transaction, and a policy that raises for one (on_op_failure, ...)
-- fails only that one, with its raise as the error (code "policy"; the
-- transaction is left to recovery) while the others settle as usual.

--- Runs many transactions as one batch: one round trip per protocol step for the whole batch.
-- @syntax results, errs = tm:commit_many(list)
-- @tparam table list items: an ops list, or `{ ops =, id =, meta = }`
-- @treturn table `results[i]`: the transaction, or false
-- @treturn table `errs[i]`: its error, or false
-- @errors per item, in `errs`: as `run`; a bad item writes nothing for itself only; a policy that raises for
--   an item is that item's error (code `policy`, `err.policy` names it; recovery finishes its transaction), not a
--   raise: the other items settle as usual
-- @usage local results, errs = tm:commit_many({ ops1, { ops = ops2, id = "o-3" } })
function Manager:commit_many(list)
  return batches.run_batch(self, checks.batch_specs(list, "commit_many", function(item, i)
    local spec, err
    if rawget(item, "ops") == nil then
      spec, err = checks.spec(self, item, nil, nil, "commit_many", ITEM_CALLER)
      return spec, err
    end
    local opts
    opts, err = validate.options(item, many_options, "commit_many item " .. i, ITEM_CALLER)
    if not opts then return nil, err end
    spec, err = checks.spec(self, opts.ops, { id = opts.id, meta = opts.meta }, nil, "commit_many",
      ITEM_CALLER)
    return spec, err
  end))
end

local transfer_many_options = { collection = true, from = true, to = true, amount = true }
for k in pairs(checks.transfer_options) do transfer_many_options[k] = true end

-- tm:transfer for many: list[i] = { collection =, from =, to =, amount =
-- [, field =, min =, id =, meta =] }; returns results, errs as commit_many.

--- `commit_many` of transfers.
-- @syntax results, errs = tm:transfer_many(list)
-- @tparam table list items `{ collection =, from =, to =, amount = [, field, min, id, meta] }`
-- @treturn table results, as `commit_many`
-- @treturn table errs, as `commit_many`
-- @errors per item, in `errs`, as `commit_many`
-- @usage local results, errs = tm:transfer_many { { collection = "accounts", from = "A", to = "B", amount = 10 } }
function Manager:transfer_many(list)
  return batches.run_batch(self, checks.batch_specs(list, "transfer_many", function(item, i)
    local opts, err = validate.options(item, transfer_many_options, "transfer_many item " .. i,
      ITEM_CALLER)
    if not opts then return nil, err end
    local spec
    spec, err = checks.transfer_spec(self, opts.collection, opts.from, opts.to, opts.amount, opts,
      ITEM_CALLER)
    return spec, err
  end))
end

-- A resumable batch job (mongotx.each): one transaction per item of
-- `source` (a list or a cursor), fn(item) giving its ops (and meta), under
-- ids derived from opts.id and opts.key(item); a re-run finishes what an
-- earlier run left and skips what it did.  Returns a report, or nil, err.

--- A resumable batch job: one transaction per item of `source`; run it again after a crash and it finishes.
-- @syntax report, err = tm:each(source, fn, { id =, key = [, batch = 100, progress, wait] })
-- @param source a list, or a cursor (anything with a `next` method)
-- @func fn `fn(item)` returns the item's ops (and meta), or nil to leave it out
-- @tparam table opts `id` (the job's), `key(item)` (unique within the run), `batch`, `progress(report)`, `wait`
-- @treturn table the report: `items`, `batches`, `committed`, `recovered`, `skipped`, `excluded`, `cancelled`,
--   `failed`, ...
-- @errors `invalid` (bad option, key, ops; `err.report`: the report so far), database errors; misuse raises
-- @usage local report = assert(tm:each(list, function(a) return ops_for(a) end, { id = "job-1", key = function(a)
--   return a._id end }))
function Manager:each(source, fn, opts)
  local report, err = each.run(self, source, fn, opts, HELPER_CALLER)
  return report, err
end

-- Finishes the transactions committed with policy.finish = "deferred"
-- (it runs by itself every policy.finish_batch commits): pulls their
-- markers and moves them to done, one round trip per collection and one
-- for the states.  Returns how many, and the error of the first that
-- could not finish, or nil, err (they stay `applied`, and recovery
-- finishes them).

--- Finishes the transactions that wait with `finish = "deferred"`.
-- @syntax n, err = tm:finish()
-- @treturn integer how many were finished (a transaction whose finish the server refused stays `applied`)
-- @treturn ?table the error of the first that did not finish
-- @usage tm:finish()
function Manager:finish()
  local list = self.finishing
  self.finishing = {}
  return batch.finish(self.engine, list)
end

--- One recovery pass: drives stale transactions to `done` or `cancelled` under the policies.
-- @syntax report, err = tm:recover([{ limit = 1000, batch = 100 }])
-- @tparam[opt] table opts `limit` (transactions read), `batch` (transactions a round trip)
-- @treturn table `{ examined, done, cancelled, skipped, parked, failed, malformed, errors }`
-- @errors `invalid` (bad option), database errors; per transaction in `report.errors`
-- @usage local report = assert(tm:recover{ limit = 100 })
function Manager:recover(opts)
  local err
  opts, err = validate.options(opts, { limit = true, batch = true }, "recover", CALLER)
  if not opts then return nil, err end
  return recovery.recover(self.engine, opts.limit or 1000, opts.batch or recovery.BATCH)
end

-- rollback, compensate, prune, unpark, inspect: mongotx.manager.operate.
for k, v in pairs(operate.methods) do Manager[k] = v end
_M.compensation_id = operate.compensation_id

--- Transactions matching a filter.
-- The filter holds what a `where` may, on any field (another operator,
-- `$where` or `$expr` is `invalid`); option values are checked first.
-- @syntax list, err = tm:find(filter [, opts])
-- @tparam table filter a query on the transactions collection
-- @tparam[opt] table opts as the core's `find_all`: `sort` (default `_id`
-- order: a server's unsorted cursor may return a document twice across
-- replies, as FerretDB v2's does after updates), `limit` (default
-- 1000, at most 100000: the list is held in memory; page with `skip` or a
-- filter), `projection`, `skip`, `batch_size`, `read_preference`
-- @treturn table a list of at most `limit` transaction documents
-- @errors `invalid` (a bad filter or option value, a limit above 100000), database errors
-- @usage local stuck = tm:find({ state = "pending" }, { limit = 10 })
function Manager:find(filter, opts)
  if filter ~= nil and type(filter) ~= "table" then
    error("bad argument #1 to 'find' (table expected, got " .. type(filter) .. ")", CALLER)
  end
  local err
  filter, err = validate.filter(filter or {})
  if not filter then return nil, err end
  opts, err = options.find(opts, "find", CALLER)
  if not opts then return nil, err end
  if opts.sort == nil then opts.sort = BY_ID end
  local list
  list, err = self.tx:find_all(filter, opts)
  if not list then return nil, errors.wrap(err, "find") end
  for _, T in ipairs(list) do live(T) end
  return list
end

-- scan(filter [, opts]): tm:find's read as a cursor, for readers of any
-- number of transactions (mongotx list): it holds one reply of the server
-- (batch_size documents), so it takes no default limit.
local Scan = {}
Scan.__index = Scan

--- Transactions matching a filter, one at a time: a cursor that holds one reply of the server.
-- @syntax cursor, err = tm:scan(filter [, opts])
-- @tparam table filter as `tm:find`'s
-- @tparam[opt] table opts as `tm:find`'s (`sort`, `limit`, `projection`, `skip`, `batch_size`,
-- `read_preference`), with no limit by default (and in `_id` order by default)
-- @treturn table a cursor: `cursor:next()`, `cursor:close()`
-- @errors `invalid` (a bad filter or option value); errors of the read come from `cursor:next()`
-- @usage local c = assert(tm:scan({ state = "done" }, { batch_size = 1000 }))
-- for T in c.next, c do print(T._id) end
function Manager:scan(filter, opts)
  if filter ~= nil and type(filter) ~= "table" then
    error("bad argument #1 to 'scan' (table expected, got " .. type(filter) .. ")", CALLER)
  end
  local err
  filter, err = validate.filter(filter or {})
  if not filter then return nil, err end
  opts, err = options.check(opts, options.FIND, "scan", CALLER)
  if not opts then return nil, err end
  if opts.sort == nil then opts.sort = BY_ID end
  return setmetatable({ cursor = self.tx:find(filter, opts) }, Scan)
end

--- The next transaction, or nil at the end.
-- @syntax T, err = cursor:next()
-- @treturn ?table the transaction document
-- @errors database errors (then the cursor is done)
-- @usage local T = cursor:next()
function Scan:next()
  local T, err = self.cursor:next()
  if T then
    live(T)
    return T
  end
  if err then return nil, errors.wrap(err, "scan") end
  return nil
end

--- Lets go of the cursor (and its reply) at once.
-- @syntax cursor:close()
-- @usage cursor:close()
function Scan:close()
  self.cursor:close()
end

-- stats and backlog: mongotx.manager.counts.
Manager.stats, Manager.backlog = counts.stats, counts.backlog

return _M

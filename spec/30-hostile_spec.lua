-- Hostile and bad input (DESIGN.md §7-§8): a corpus of cases run by one
-- loop.  Each case calls the API with something hostile and must get a
-- clear error, either nil, err (err.code, and a message saying what is
-- wrong) or, for programming errors (wrong argument types, unknown
-- options), a raise; an option value of the right type that cannot work
-- is bad input (nil, err "invalid"); and the database must hold the same
-- bytes afterwards (helpers.db_dump before and after).
--
-- After the corpus: the cases where mongotx has to write before it can
-- notice (a document deleted mid-transaction, a false guard, an insert
-- whose _id is taken), which end cancelled with every document as it was
-- apart from mongotx's bookkeeping (the transaction document and the
-- version field `txVersion`); and malformed transaction documents, which
-- recovery must skip, report and leave byte for byte as they are.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local NAN, INF = 0 / 0, math.huge
local LUA54 = math.type ~= nil

local function inc(id, n, coll)
  return { collection = coll or "accounts", id = id, update = { ["$inc"] = { balance = n } } }
end

-- An update op with an explicit undo.
local function upd(id, update, undo)
  return { collection = "accounts", id = id, update = update,
           undo = undo or { ["$set"] = { balance = 1000 } } }
end

local function begin(ops, opts)
  return function(e) return e.tm:begin(ops, opts) end
end

local function nested(depth)
  local t = { leaf = 1 }
  for _ = 1, depth do t = { x = t } end
  return t
end

local function cyclic()
  local t = { total = 1 }
  t.self = t
  return t
end

local function many_ops(n)
  local ops = {}
  for i = 1, n do ops[i] = inc(i, 1) end
  return ops
end

-- A transaction begun (state initial) under a fixed id, for the cases that
-- need one to exist.
local function existing(e)
  e.t = assert(e.tm:begin({ inc("A", -1), inc("B", 1) }, { id = "t-1" }))
end

local function committed(e)
  existing(e)
  e.t = assert(e.tm:commit(e.t))
end

local function cancelled(e)
  existing(e)
  assert(e.tm:rollback(e.t))
end

-- Reason to leave a case pending when one of the lead's new functions is
-- not there yet.
local function lacks(name)
  return function(e)
    if e.tm[name] == nil then
      return "tm:" .. name .. " does not exist yet (the lead's batch API): check this case once it does"
    end
  end
end

-- An error of the C core (a database failure): its code names the
-- domain as a string ("server", "stream", ...) and server_code holds the
-- number libmongoc or the server gave (equal to `server_code` if given).
local function core_error(server_code)
  return function(err)
    assert.are.equal("string", type(err.code), "code " .. tostring(err.code) .. ": " .. tostring(err))
    assert.are_not.equal("invalid", err.code, tostring(err))
    assert.are.equal("number", type(err.server_code), tostring(err))
    if server_code then assert.are.equal(server_code, err.server_code, tostring(err)) end
  end
end

-- A table whose pairs() shows `shown` (Lua 5.4 honours __pairs) while it
-- holds `raw`: the BSON encoder sends raw, so raw is what must be checked.
local function lying(raw, shown)
  return setmetatable(raw, { __pairs = function() return next, shown, nil end })
end

local function transfer(from, to, opts)
  return function(e) return e.tm:transfer("accounts", from, to, 10, opts) end
end

-- t-1 walked with tm:step through `steps` ({ name, i }) after begin.
local function walked(steps)
  return function(e)
    existing(e)
    for _, s in ipairs(steps) do assert(e.tm:step(s[1], e.t, s[2])) end
  end
end

local PENDING = walked { { "claim" }, { "apply", 1 } }
local PENDING_APPLIED = walked { { "claim" }, { "apply", 1 }, { "apply", 2 } }
local APPLIED = walked { { "claim" }, { "apply", 1 }, { "apply", 2 }, { "commit" } }
local FINISHED = walked { { "claim" }, { "apply", 1 }, { "apply", 2 }, { "commit" },
                          { "finish", 1 }, { "finish", 2 } }
local CANCELING = walked { { "claim" }, { "apply", 1 }, { "cancel" } }
local UNDONE = walked { { "claim" }, { "apply", 1 }, { "cancel" }, { "undo", 1 } }

-- An op debiting A with a guard.
local function guarded(where)
  return { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } }, where = where }
end

-- Cases: { name, call = function(e) ... end, code = <err.code>, msg =
-- <pattern of err.message> } for nil, err; { name, call, raises =
-- <pattern> } for a raise; `batch = true` for commit_many and
-- transfer_many, which answer results, errs: every item must fail, the
-- first with that code and message.  `setup(e)` runs before the dump; `pending(e)`
-- returns why the case cannot run here, or nil.  e = { db, tm, ... }.
-- `check(err)` replaces the code's comparison (errors of the C core);
-- `may_raise = true` also accepts a raise (a function where a value is
-- expected: a wrong type); `either = true` accepts a raise matching
-- `raises` or nil, err with `code` (an impossible option value, which
-- spec/16-options_spec.lua pins down).
local cases = {
  -- connect -------------------------------------------------------------
  { "connect: a uri that is not a string", raises = "uri must be a string",
    call = function() return mongotx.connect(42) end },
  { "connect: options that are not a table", raises = "connect must be a table",
    call = function() return mongotx.connect(helpers.uri(), "test") end },
  { "connect: an unknown option", raises = "unknown option databse",
    call = function() return mongotx.connect(helpers.uri(), { databse = "x" }) end },
  { "connect: a database that is not a string", raises = "option database of connect must be",
    call = function() return mongotx.connect(helpers.uri(), { database = 5 }) end },
  { "connect: a database name with a dot",
    either = true, code = "invalid", msg = "database", raises = "must be a database name",
    call = function() return mongotx.connect(helpers.uri(), { database = "a.b" }) end },
  { "connect: a database name with $",
    either = true, code = "invalid", msg = "database", raises = "must be a database name",
    call = function() return mongotx.connect(helpers.uri(), { database = "$cmd" }) end },
  { "connect: an empty database name",
    either = true, code = "invalid", msg = "database", raises = "must be a database name",
    call = function() return mongotx.connect(helpers.uri(), { database = "" }) end },
  { "connect: an appname that is not a string", raises = "option appname of connect must be a string",
    call = function() return mongotx.connect(helpers.uri(), { appname = {} }) end },
  { "connect: a write concern that is not a table", raises = "write_concern",
    call = function() return mongotx.connect(helpers.uri(), { write_concern = 1 }) end },
  -- bad input (issue 20), libmongoc's number kept
  { "connect: a URI that is not a MongoDB URI", msg = "URI",
    check = function(err)
      assert.are.equal("invalid", err.code, tostring(err))
      assert.are.equal(22, err.server_code, tostring(err))
    end,
    call = function() return mongotx.connect("http://127.0.0.1/") end },

  -- db:manager ------------------------------------------------------------
  { "manager: options that are not a table", raises = "manager must be a table",
    call = function(e) return e.db:manager("app-1") end },
  { "manager: an unknown option", raises = "unknown option stale for manager",
    call = function(e) return e.db:manager{ application = "app-1", stale = 5 } end },
  { "manager: a number policy given as a string", raises = "stale_after.* must be a number",
    call = function(e) return e.db:manager{ application = "app-1", stale_after = "30" } end },
  { "manager: a function policy given as a string", raises = "on_op_failure.* must be a function",
    call = function(e) return e.db:manager{ application = "app-1", on_op_failure = "cancel" } end },
  { "manager: a collection that is not a string", raises = "option collection of manager must be",
    call = function(e) return e.db:manager{ collection = 5 } end },
  { "manager: an empty collection name",
    either = true, code = "invalid", msg = "collection", raises = "must be a collection name",
    call = function(e) return e.db:manager{ collection = "" } end },
  { "manager: a collection name with $",
    either = true, code = "invalid", msg = "collection", raises = "must be a collection name",
    call = function(e) return e.db:manager{ collection = "tx$" } end },
  { "manager: a system collection",
    either = true, code = "invalid", msg = "collection", raises = "must be a collection name",
    call = function(e) return e.db:manager{ collection = "system.tx" } end },
  { "manager: a marker with a dot",
    either = true, code = "invalid", msg = "marker", raises = "option marker of manager must be a top%-level field",
    call = function(e) return e.db:manager{ marker = "a.b" } end },
  { "manager: a marker that is an operator",
    either = true, code = "invalid", msg = "marker", raises = "option marker of manager must be",
    call = function(e) return e.db:manager{ marker = "$push" } end },
  { "manager: _id as the marker",
    either = true, code = "invalid", msg = "marker", raises = "option marker of manager must be",
    call = function(e) return e.db:manager{ marker = "_id" } end },
  { "manager: an empty version field",
    either = true, code = "invalid", msg = "version_field", raises = "option version_field of manager must be",
    call = function(e) return e.db:manager{ version_field = "" } end },
  { "manager: an application that is not a string", raises = "option application of manager must be",
    call = function(e) return e.db:manager{ application = { "app" } } end },
  { "manager: a write concern that is not a table", raises = "option write_concern of manager must be",
    call = function(e) return e.db:manager{ write_concern = "majority" } end },

  -- begin: the op list ------------------------------------------------------
  { "begin: ops that are not a table", raises = "ops must be a table", call = begin("A -> B") },
  { "begin: an empty op list", code = "invalid", msg = "at least one op", call = begin({}) },
  { "begin: ops that are not a list", code = "invalid", msg = "ops must be a list",
    call = begin({ inc("A", 1), [5] = inc("B", 1) }) },
  { "begin: ops keyed by strings", code = "invalid", msg = "ops must be a list",
    call = begin({ inc("A", 1), first = inc("B", 1) }) },
  { "begin: an op that is not a table", code = "invalid", msg = "op 1: must be a table", call = begin({ "A" }) },
  { "begin: an unknown op key", code = "invalid", msg = "unknown key upsert",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = 1 } },
                     upsert = true } }) },
  { "begin: an unknown kind", code = "invalid", msg = "kind must be",
    call = begin({ { collection = "accounts", id = "A", kind = "upsert" } }) },
  { "begin: a kind that is not a string", code = "invalid", msg = "kind must be",
    call = begin({ { collection = "accounts", id = "A", kind = 1 } }) },
  { "begin: an update on a remove op", code = "invalid", msg = "only an update op",
    call = begin({ { collection = "accounts", id = "A", kind = "remove",
                     update = { ["$inc"] = { balance = 1 } } } }) },
  { "begin: duplicate (collection, id)", code = "invalid", msg = "one op per document",
    call = begin({ inc("A", -1), inc("B", 2), inc("A", -1) }) },
  { "begin: duplicate ids 1 and 1.0 (the same _id to the server)", code = "invalid",
    msg = "one op per document", call = begin({ inc(1, -1), inc(1.0, 1) }) },
  { "begin: more ops than fit in a 16 MiB transaction", code = "invalid", msg = "16 MiB",
    call = function(e) return e.tm:begin(many_ops(200000)) end },
  { "begin: an insert bigger than 16 MiB", code = "invalid", msg = "16 MiB",
    call = begin({ { collection = "orders", id = "big", doc = { blob = ("x"):rep(17 * 1024 * 1024) } } }) },

  -- begin: ids --------------------------------------------------------------
  { "begin: an op id that is a query operator", code = "invalid", msg = "id holds the key \"%$gt\"",
    call = begin({ inc({ ["$gt"] = "" }, 1) }) },
  { "begin: an op id holding an operator deeper down", code = "invalid", msg = "%$ne",
    call = begin({ inc({ a = { ["$ne"] = 1 } }, 1) }) },
  { "begin: an op id that is $where code", code = "invalid", msg = "%$where",
    call = begin({ inc({ ["$where"] = "sleep(1000)" }, 1) }) },
  { "begin: an op id with a dotted key", code = "invalid", msg = "may not hold dots",
    call = begin({ inc({ ["a.b"] = 1 }, 1) }) },
  { "begin: an op id that is a plain table with several keys", code = "invalid", msg = "mongotx.doc",
    call = begin({ inc({ a = 1, b = 2 }, 1) }) },
  { "begin: a missing op id", code = "invalid", msg = "needs an id",
    call = begin({ { collection = "accounts", update = { ["$inc"] = { balance = 1 } } } }) },
  { "begin: an op id that is NaN", code = "invalid", msg = "id may not be", call = begin({ inc(NAN, 1) }) },
  { "begin: an op id that is infinite", code = "invalid", msg = "id may not be inf",
    call = begin({ inc(INF, 1) }) },
  { "begin: an op id that is a function", code = "invalid", msg = "id may not be a function",
    call = begin({ inc(print, 1) }) },
  { "begin: a transaction id that is a query operator", code = "invalid", msg = "%$gt",
    call = begin({ inc("A", -1), inc("B", 1) }, { id = { ["$gt"] = "" } }) },
  { "begin: a transaction id that is NaN", code = "invalid", msg = "id may not be",
    call = begin({ inc("A", -1), inc("B", 1) }, { id = NAN }) },
  { "begin: a transaction id with a dotted key", code = "invalid", msg = "dots",
    call = begin({ inc("A", -1), inc("B", 1) }, { id = { ["x.y"] = 1 } }) },
  { "begin: a transaction id reused for other ops", code = "idempotency", msg = "other ops",
    setup = existing, call = begin({ inc("A", -2), inc("B", 2) }, { id = "t-1" }) },

  -- begin: collections --------------------------------------------------------
  { "begin: a collection name with $", code = "invalid", msg = "bad collection name",
    call = begin({ inc("A", 1, "acc$ounts") }) },
  { "begin: a collection name with a NUL byte", code = "invalid", msg = "bad collection name",
    call = begin({ inc("A", 1, "acc\0ounts") }) },
  { "begin: a system collection", code = "invalid", msg = "bad collection name",
    call = begin({ inc("A", 1, "system.users") }) },
  -- (both went into a stored transaction: a name no server can hold)
  { "begin: a collection name that is not UTF-8", code = "invalid", msg = "bad collection name",
    call = begin({ inc("A", 1, "acc\255ounts") }) },
  { "begin: a collection name starting with a dot", code = "invalid", msg = "bad collection name",
    call = begin({ inc("A", 1, ".accounts") }) },
  -- (a namespace over 120 bytes: stored, then refused by the server at
  -- the apply, which left the transaction pending)
  { "begin: a collection name longer than a namespace holds", code = "invalid",
    msg = "collection name of 300 bytes: at most",
    call = begin({ inc("A", 1, ("c"):rep(300)) }) },
  { "transfer: a collection name longer than a namespace holds", code = "invalid",
    msg = "namespace, <database>.<collection>, is limited to 120 bytes",
    call = function(e) return e.tm:transfer(("c"):rep(200), "A", "B", 1) end },
  { "commit_many: a collection name longer than a namespace holds", code = "invalid",
    msg = "collection name of 130 bytes", batch = true,
    call = function(e) return e.tm:commit_many({ { inc("A", -1, ("c"):rep(130)), inc("B", 1) } }) end },
  { "begin: an empty collection name", code = "invalid", msg = "needs a collection name",
    call = begin({ inc("A", 1, "") }) },
  { "begin: a collection that is not a string", code = "invalid", msg = "needs a collection name",
    call = begin({ { collection = { "accounts" }, id = "A", update = { ["$inc"] = { balance = 1 } } } }) },
  { "begin: the transactions collection itself", code = "invalid", msg = "transactions collection",
    call = begin({ inc("A", 1, "transactions") }) },
  { "begin: a renamed transactions collection", code = "invalid", msg = "transactions collection",
    setup = function(e) e.other = assert(e.db:manager{ application = "app-1", collection = "txlog" }) end,
    call = function(e) return e.other:begin({ inc("A", 1, "txlog") }) end },

  -- begin: update documents ---------------------------------------------------
  { "begin: an update without operators", code = "invalid", msg = "balance is not an update operator",
    call = begin({ upd("A", { balance = 5 }) }) },
  { "begin: an update that is a list", code = "invalid", msg = "1 is not an update operator",
    call = begin({ upd("A", { { ["$inc"] = { balance = 5 } } }) }) },
  -- (stored by begin, then refused at the apply by FerretDB and MongoDB
  -- before 5.0, which left the transaction pending)
  { "begin: an update storing a field name that starts with $", code = "invalid",
    msg = 'update: %$set may not store the field name "%$gt"',
    call = begin({ upd("A", { ["$set"] = { limit = { ["$gt"] = 1 } } }) }) },
  { "begin: an update storing a dollar field name deep inside", code = "invalid",
    msg = 'update: %$set may not store the field name "%$a"',
    call = begin({ upd("A", { ["$set"] = { list = { { x = { ["$a"] = 1 } } } } }) }) },
  { "begin: a $push element holding a dollar field name", code = "invalid",
    msg = 'update: %$push may not store the field name "%$a"',
    call = begin({ upd("A", { ["$push"] = { list = { ["$each"] = { { ["$a"] = 1 } } } } }) }) },
  { "begin: a $push modifier that does not exist", code = "invalid",
    msg = 'update: %$push may not store the field name "%$every"',
    call = begin({ upd("A", { ["$push"] = { list = { ["$every"] = { 1 } } } }) }) },
  { "begin: an update path with a part that starts with $", code = "invalid",
    msg = "update: %$set has a bad field name limit%.%$gt",
    call = begin({ upd("A", { ["$set"] = { ["limit.$gt"] = 1 } }) }) },
  { "begin: an update path with a filtered positional part (no arrayFilters are sent)",
    code = "invalid", msg = "update: %$set has a bad field name list%.%$%[x%]",
    call = begin({ upd("A", { ["$set"] = { ["list.$[x]"] = 1 } }) }) },
  { "begin: a $rename to a path with a part that starts with $", code = "invalid",
    msg = "update: %$rename of name needs a field name",
    call = begin({ upd("A", { ["$rename"] = { name = "old.$name" } }) }) },
  { "begin: a $push value mixing modifiers and fields", code = "invalid",
    msg = "update: %$push of list mixes fields with modifiers",
    call = begin({ upd("A", { ["$push"] = { list = { ["$each"] = { 1 }, x = 1 } } }) }) },
  { "begin: a $push modifier without $each", code = "invalid",
    msg = "update: %$push of list mixes fields with modifiers, or has modifiers without %$each",
    call = begin({ upd("A", { ["$push"] = { list = { ["$slice"] = 2 } } }) }) },
  { "begin: a $currentDate with a field beside $type", code = "invalid",
    msg = "update: %$currentDate of seen takes true, false or",
    call = begin({ upd("A", { ["$currentDate"] = { seen = { ["$type"] = "date", x = 1 } } }) }) },
  { "begin: a $currentDate of a number", code = "invalid",
    msg = "update: %$currentDate of seen takes true, false or",
    call = begin({ upd("A", { ["$currentDate"] = { seen = 1 } }) }) },
  { "begin: a $currentDate of an unknown $type", code = "invalid",
    msg = "update: %$currentDate of seen takes true, false or",
    call = begin({ upd("A", { ["$currentDate"] = { seen = { ["$type"] = "time" } } }) }) },
  { "begin: a $push whose $each is not an array", code = "invalid",
    msg = "update: %$push of list has a modifier of the wrong type",
    call = begin({ upd("A", { ["$push"] = { list = { ["$each"] = 4 } } }) }) },
  { "begin: an $addToSet whose $each is an empty table (a document)", code = "invalid",
    msg = "update: %$addToSet of list has a modifier of the wrong type",
    call = begin({ upd("A", { ["$addToSet"] = { list = { ["$each"] = {} } } }) }) },
  { "begin: a $push whose $slice is not a number", code = "invalid",
    msg = "update: %$push of list has a modifier of the wrong type",
    call = begin({ upd("A", { ["$push"] = { list = { ["$each"] = { 1 }, ["$slice"] = "2" } } }) }) },
  { "begin: the positional $ (nothing in the op's filter matches its array)",
    code = "invalid", msg = "update: %$set has a bad field name list%.%$",
    call = begin({ upd("A", { ["$set"] = { ["list.$"] = 1 } }) }) },
  -- (the derived undo kept the path, and the undo's filter matches the
  -- marker array: the $ named the marker's index, and the rollback
  -- changed another element)
  { "begin: the positional $ with a where on its array", code = "invalid",
    msg = "update: %$inc has a bad field name list%.%$",
    call = begin({ { collection = "accounts", id = "A", where = { list = 1 },
                     update = { ["$inc"] = { ["list.$"] = 10 } } } }) },
  { "begin: a $rename with a positional part", code = "invalid",
    msg = "update: %$rename has a bad field name list%.%$%[%]",
    call = begin({ upd("A", { ["$rename"] = { ["list.$[]"] = "other" } }) }) },
  { "begin: an update storing a field name holding a dot", code = "invalid",
    msg = 'update: %$set may not store the field name "a%.b"',
    call = begin({ upd("A", { ["$set"] = { limit = { ["a.b"] = 1 } } }) }) },
  { "begin: a where path with a part that starts with $", code = "invalid",
    msg = "where has a bad field name",
    call = begin({ { collection = "accounts", id = "A", where = { ["sub.$x"] = 2 },
                     update = { ["$inc"] = { balance = 1 } } } }) },
  { "begin: an undo storing a field name that starts with $", code = "invalid",
    msg = 'undo: %$set may not store the field name "%$a"',
    call = begin({ upd("A", { ["$set"] = { y = 1 } }, { ["$set"] = { y = { ["$a"] = 1 } } }) }) },
  { "begin: an unknown operator", code = "invalid", msg = "%$where is not an update operator",
    call = begin({ upd("A", { ["$where"] = { balance = 5 } }) }) },
  { "begin: an empty update", code = "invalid", msg = "update is empty", call = begin({ upd("A", {}) }) },
  { "begin: an update that is not a table", code = "invalid", msg = "update must be a table",
    call = begin({ upd("A", "balance += 5") }) },
  { "begin: an operator without fields", code = "invalid", msg = "needs a table of fields",
    call = begin({ upd("A", { ["$set"] = {} }) }) },
  { "begin: an update touching _id", code = "invalid", msg = "may not touch _id",
    call = begin({ upd("A", { ["$set"] = { _id = "X" } }) }) },
  { "begin: an update touching a path under _id", code = "invalid", msg = "may not touch _id",
    call = begin({ upd("A", { ["$set"] = { ["_id.x"] = 1 } }) }) },
  { "begin: an update touching the marker", code = "invalid", msg = "may not touch pendingTransactions",
    call = begin({ upd("A", { ["$push"] = { pendingTransactions = "x" } },
                        { ["$pull"] = { pendingTransactions = "x" } }) }) },
  { "begin: an update touching a path under the marker", code = "invalid", msg = "pendingTransactions",
    call = begin({ upd("A", { ["$set"] = { ["pendingTransactions.0"] = "x" } }) }) },
  { "begin: an update unsetting the marker", code = "invalid", msg = "pendingTransactions",
    call = begin({ upd("A", { ["$unset"] = { pendingTransactions = true } }) }) },
  { "begin: an update touching a configured marker field", code = "invalid", msg = "may not touch locks",
    setup = function(e) e.other = assert(e.db:manager{ application = "app-1", marker = "locks" }) end,
    call = function(e) return e.other:begin({ upd("A", { ["$set"] = { locks = mongotx.array() } }) }) end },
  { "begin: an update touching the version field", code = "invalid", msg = "may not touch txVersion",
    call = begin({ upd("A", { ["$inc"] = { txVersion = 1 } }) }) },
  { "begin: a $rename onto the marker", code = "invalid", msg = "pendingTransactions",
    call = begin({ upd("A", { ["$rename"] = { balance = "pendingTransactions" } },
                        { ["$rename"] = { pendingTransactions = "balance" } }) }) },
  { "begin: a $rename to an operator", code = "invalid", msg = "needs a field name",
    call = begin({ upd("A", { ["$rename"] = { balance = "$x" } }) }) },
  { "begin: a $rename to a number", code = "invalid", msg = "needs a field name",
    call = begin({ upd("A", { ["$rename"] = { balance = 5 } }) }) },
  { "begin: an undo touching the marker", code = "invalid", msg = "undo: %$unset may not touch",
    call = begin({ upd("A", { ["$set"] = { x = 1 } }, { ["$unset"] = { pendingTransactions = true } }) }) },
  { "begin: an undo without operators", code = "invalid", msg = "undo: balance is not an update operator",
    call = begin({ upd("A", { ["$set"] = { x = 1 } }, { balance = 1000 }) }) },
  { "begin: $set without an undo", code = "invalid", msg = "needs an explicit undo",
    call = begin({ { collection = "accounts", id = "A", update = { ["$set"] = { balance = 5 } } } }) },
  { "begin: a field path with an empty segment", code = "invalid", msg = "bad field name a%.%.b",
    call = begin({ upd("A", { ["$set"] = { ["a..b"] = 1 } }) }) },
  { "begin: a field path starting with a dot", code = "invalid", msg = "bad field name",
    call = begin({ upd("A", { ["$set"] = { [".a"] = 1 } }) }) },
  { "begin: a field path ending with a dot", code = "invalid", msg = "bad field name",
    call = begin({ upd("A", { ["$inc"] = { ["balance."] = 1 } }) }) },
  { "begin: a field name that is an operator", code = "invalid", msg = "bad field name %$x",
    call = begin({ upd("A", { ["$set"] = { ["$x"] = 1 } }) }) },
  { "begin: $inc by a string", code = "invalid", msg = "needs a number, not string",
    call = begin({ inc("A", "100") }) },
  { "begin: $inc by a table", code = "invalid", msg = "needs a number",
    call = begin({ inc("A", { ["$gt"] = 1 }) }) },
  { "begin: $inc by NaN", code = "invalid", msg = "nan", call = begin({ inc("A", NAN) }) },
  { "begin: $inc by infinity", code = "invalid", msg = "inf", call = begin({ inc("A", INF) }) },
  { "begin: $inc by -infinity", code = "invalid", msg = "inf", call = begin({ inc("A", -INF) }) },
  { "begin: $mul by NaN", code = "invalid", msg = "nan",
    call = begin({ upd("A", { ["$mul"] = { balance = NAN } }) }) },
  { "begin: $inc whose negation overflows", code = "invalid", msg = "overflows",
    pending = function() if not LUA54 then return "LuaJIT has no 64-bit integers to overflow" end end,
    call = function(e) return e.tm:begin({ inc("A", math.mininteger) }) end },

  -- begin: where ------------------------------------------------------------
  { "begin: a where with $where", code = "invalid", msg = "%$where",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                     where = { ["$where"] = "this.balance > 0" } } }) },
  { "begin: a where hiding $where in $or", code = "invalid", msg = "%$where",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                     where = { ["$or"] = { { ["$where"] = "sleep(100)" }, { balance = 1 } } } } }) },
  { "begin: a where running $function in $expr", code = "invalid", msg = "where",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                     where = { ["$expr"] = { ["$function"] = { body = "return true", args = {},
                                                               lang = "js" } } } } }) },
  { "begin: a where on the marker", code = "invalid", msg = "may not constrain pendingTransactions",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                     where = { pendingTransactions = { ["$size"] = 0 } } } }) },
  { "begin: a where on _id", code = "invalid", msg = "may not constrain _id",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                     where = { _id = { ["$ne"] = "A" } } } }) },
  { "begin: a where with a bad field name", code = "invalid", msg = "bad field name",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                     where = { ["balance..x"] = 1 } } }) },
  { "begin: a where that is not a table", code = "invalid", msg = "where must be a table",
    call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                     where = "balance > 0" } }) },

  -- begin: inserted documents -------------------------------------------------
  { "begin: a doc with a $ key", code = "invalid", msg = "doc may not hold the key \"%$set\"",
    call = begin({ { collection = "orders", id = "o2", doc = { ["$set"] = 1 } } }) },
  { "begin: a doc with a nested $ key", code = "invalid", msg = "%$gt",
    call = begin({ { collection = "orders", id = "o2", doc = { total = { ["$gt"] = 1 } } } }) },
  { "begin: a doc with a dotted key", code = "invalid", msg = "dots are paths",
    call = begin({ { collection = "orders", id = "o2", doc = { ["a.b"] = 1 } } }) },
  { "begin: a doc with a nested dotted key", code = "invalid", msg = "dots are paths",
    call = begin({ { collection = "orders", id = "o2", doc = { item = { ["x.y"] = 1 } } } }) },
  { "begin: a doc setting the marker", code = "invalid", msg = "may not set pendingTransactions",
    call = begin({ { collection = "orders", id = "o2", doc = { pendingTransactions = { 1 } } } }) },
  { "begin: a doc setting the version field", code = "invalid", msg = "may not set txVersion",
    call = begin({ { collection = "orders", id = "o2", doc = { txVersion = 7 } } }) },
  { "begin: a doc that sets _id", code = "invalid", msg = "doc may not set _id",
    call = begin({ { collection = "orders", id = "o2", doc = { _id = "o3" } } }) },
  { "begin: a doc holding NaN", code = "invalid", msg = "nan",
    call = begin({ { collection = "orders", id = "o2", doc = { total = NAN } } }) },
  { "begin: a doc that is not a table", code = "invalid", msg = "insert needs a doc",
    call = begin({ { collection = "orders", id = "o2", kind = "insert", doc = "o2" } }) },
  { "begin: a doc that contains itself", code = "invalid", msg = "cannot be stored",
    call = function(e) return e.tm:begin({ { collection = "orders", id = "o2", doc = cyclic() } }) end },
  { "begin: a doc nested 150 levels deep", code = "invalid", msg = "cannot be stored",
    call = function(e) return e.tm:begin({ { collection = "orders", id = "o2", doc = nested(150) } }) end },

  -- begin: options ----------------------------------------------------------
  { "begin: an unknown option", raises = "unknown option idempotency for begin",
    call = begin({ inc("A", -1), inc("B", 1) }, { idempotency = "k" }) },
  { "begin: options that are not a table", raises = "begin must be a table",
    call = begin({ inc("A", -1), inc("B", 1) }, "k") },
  { "begin: meta that is not a table", raises = "option meta of begin must be a table",
    call = begin({ inc("A", -1), inc("B", 1) }, { meta = "alice" }) },

  -- transfer ------------------------------------------------------------------
  { "transfer: a NaN amount", code = "invalid", msg = "finite",
    call = function(e) return e.tm:transfer("accounts", "A", "B", NAN) end },
  { "transfer: an infinite amount", code = "invalid", msg = "finite",
    call = function(e) return e.tm:transfer("accounts", "A", "B", INF) end },
  { "transfer: a -infinite amount", code = "invalid", msg = "finite",
    call = function(e) return e.tm:transfer("accounts", "A", "B", -INF) end },
  { "transfer: a zero amount", code = "invalid", msg = "positive",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 0) end },
  { "transfer: a negative zero amount", code = "invalid", msg = "positive",
    call = function(e) return e.tm:transfer("accounts", "A", "B", -0.0) end },
  { "transfer: a negative amount", code = "invalid", msg = "positive",
    call = function(e) return e.tm:transfer("accounts", "A", "B", -5) end },
  { "transfer: a negative float amount", code = "invalid", msg = "positive",
    call = function(e) return e.tm:transfer("accounts", "A", "B", -0.5) end },
  { "transfer: an amount beyond 2^53", code = "invalid", msg = "2%^53",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 2 ^ 60) end },
  { "transfer: the largest integer as the amount", code = "invalid", msg = "2%^53",
    pending = function() if not LUA54 then return "LuaJIT has no math.maxinteger" end end,
    call = function(e) return e.tm:transfer("accounts", "A", "B", math.maxinteger) end },
  { "transfer: an amount that is a string", raises = "amount must be a number",
    call = function(e) return e.tm:transfer("accounts", "A", "B", "10") end },
  { "transfer: no amount", raises = "amount must be a number",
    call = function(e) return e.tm:transfer("accounts", "A", "B") end },
  { "transfer: from == to", code = "invalid", msg = "one op per document",
    call = function(e) return e.tm:transfer("accounts", "A", "A", 10) end },
  { "transfer: a NaN minimum", code = "invalid", msg = "finite",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { min = NAN }) end },
  { "transfer: a -infinite minimum", code = "invalid", msg = "finite",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { min = -INF }) end },
  { "transfer: a minimum that is a string", raises = "option min of transfer must be a number",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { min = "0" }) end },
  { "transfer: the marker as the field", code = "invalid", msg = "pendingTransactions",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { field = "pendingTransactions" }) end },
  { "transfer: _id as the field", code = "invalid", msg = "_id",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { field = "_id" }) end },
  { "transfer: an operator as the field", code = "invalid", msg = "bad field name",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { field = "$where" }) end },
  { "transfer: a field with an empty path segment", code = "invalid", msg = "bad field name",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { field = "balance..x" }) end },
  { "transfer: a field that is not a string", raises = "field",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { field = 1 }) end },
  { "transfer: an account id that is a query operator", code = "invalid", msg = "%$ne",
    call = function(e) return e.tm:transfer("accounts", { ["$ne"] = "nobody" }, "B", 10) end },
  { "transfer: no account id", code = "invalid", msg = "needs an id",
    call = function(e) return e.tm:transfer("accounts", "A", nil, 10) end },
  { "transfer: the transactions collection", code = "invalid", msg = "transactions collection",
    call = function(e) return e.tm:transfer("transactions", "A", "B", 10) end },
  { "transfer: a collection that is not a string", code = "invalid", msg = "collection name",
    call = function(e) return e.tm:transfer(5, "A", "B", 10) end },
  { "transfer: an unknown option", raises = "unknown option minimum for transfer",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { minimum = 0 }) end },
  { "transfer: meta that is not a table", raises = "option meta of transfer must be a table",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { meta = 5 }) end },
  { "transfer: a transaction id that is a query operator", code = "invalid", msg = "%$gt",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 10, { id = { ["$gt"] = "" } }) end },

  -- commit, rollback, compensate, step on the wrong things ------------------------
  { "commit: something that is not a transaction", raises = "expected a transaction",
    call = function(e) return e.tm:commit("t-1") end },
  { "rollback: a reason that is not a string", raises = "reason must be a string", setup = existing,
    call = function(e) return e.tm:rollback(e.t, { why = "x" }) end },
  { "manager: marker and version field the same",
    either = true, code = "invalid", msg = "different", raises = "must be different fields",
    call = function(e) return e.db:manager { marker = "v", version_field = "v" } end },
  { "manager: a finish mode that does not exist",
    either = true, code = "invalid", msg = "finish", raises = "finish must be",
    call = function(e) return e.db:manager { finish = "later" } end },
  { "manager: a fencing mode that does not exist",
    either = true, code = "invalid", msg = "fencing", raises = "fencing must be",
    call = function(e) return e.db:manager { fencing = "trust" } end },
  { "transfer: a min that is not finite", code = "invalid", msg = "min must be a finite number",
    call = function(e) return e.tm:transfer("accounts", "A", "B", 1, { min = -math.huge }) end },
  { "rollback: a table without _id", raises = "expected a transaction",
    call = function(e) return e.tm:rollback({}) end },
  { "compensate: a number", raises = "expected a transaction",
    call = function(e) return e.tm:compensate(42) end },
  { "commit: a transaction that does not exist", code = "state", msg = "no such transaction",
    call = function(e) return e.tm:commit({ _id = "nope" }) end },
  { "commit: an id that is a query operator", code = "invalid", msg = "%$gt", setup = existing,
    call = function(e) return e.tm:commit({ _id = { ["$gt"] = "" } }) end },
  { "get: an id that is a query operator", code = "invalid", msg = "%$gt", setup = existing,
    call = function(e) return e.tm:get({ ["$gt"] = "" }) end },
  { "get: no id", raises = "id", setup = existing,
    call = function(e) return e.tm:get(nil) end },
  { "get: an id that is a function", raises = "get needs a transaction id, not a function",
    call = function(e) return e.tm:get(print) end },
  { "rollback: a committed transaction", code = "state", msg = "compensate it instead", setup = committed,
    call = function(e) return e.tm:rollback(e.t) end },
  { "commit: a cancelled transaction", code = "cancelled", msg = "rolled back", setup = cancelled,
    call = function(e) return e.tm:commit(e.t) end },
  { "compensate: a transaction never started", code = "state", msg = "only a committed", setup = existing,
    call = function(e) return e.tm:compensate(e.t) end },
  { "compensate: a cancelled transaction", code = "state", msg = "only a committed", setup = cancelled,
    call = function(e) return e.tm:compensate(e.t) end },
  { "step: an unknown step", raises = "unknown step jump", setup = existing,
    call = function(e) return e.tm:step("jump", e.t) end },
  { "step: a step name that is not a string", raises = "unknown step", setup = existing,
    call = function(e) return e.tm:step(5, e.t) end },
  { "step: apply of an op that does not exist", raises = "no op 3", setup = existing,
    call = function(e) return e.tm:step("apply", e.t, 3) end },
  { "step: undo of op 0", raises = "no op 0", setup = existing,
    call = function(e) return e.tm:step("undo", e.t, 0) end },
  { "step: something that is not a transaction", raises = "expected a transaction",
    call = function(e) return e.tm:step("claim", "t-1") end },

  -- recover, prune, find ---------------------------------------------------------
  { "recover: an unknown option", raises = "unknown option max for recover",
    call = function(e) return e.tm:recover{ max = 1 } end },
  { "recover: options that are not a table", raises = "recover must be a table",
    call = function(e) return e.tm:recover(10) end },
  { "recover: a zero limit", code = "invalid", msg = "limit",
    call = function(e) return e.tm:recover{ limit = 0 } end },
  { "recover: a negative limit",
    either = true, code = "invalid", msg = "limit", raises = "positive integer",
    call = function(e) return e.tm:recover{ limit = -1 } end },
  { "recover: a fractional limit",
    either = true, code = "invalid", msg = "limit", raises = "positive integer",
    call = function(e) return e.tm:recover{ limit = 1.5 } end },
  { "recover: a NaN limit",
    either = true, code = "invalid", msg = "limit", raises = "positive integer",
    call = function(e) return e.tm:recover{ limit = NAN } end },
  { "recover: a limit that is a string", raises = "limit",
    call = function(e) return e.tm:recover{ limit = "10" } end },
  { "prune: an unknown option", raises = "unknown option age for prune",
    call = function(e) return e.tm:prune{ age = 1 } end },
  { "prune: a NaN age", code = "invalid", msg = "older_than",
    call = function(e) return e.tm:prune{ older_than = NAN } end },
  { "prune: a negative age",
    either = true, code = "invalid", msg = "older_than", raises = "not negative", setup = committed,
    call = function(e) return e.tm:prune{ older_than = -1 } end },
  { "prune: an age that is a string", raises = "older_than",
    call = function(e) return e.tm:prune{ older_than = "1h" } end },
  { "find: a filter that is not a table", raises = "table expected",
    call = function(e) return e.tm:find("pending") end },
  { "find: an unknown option", raises = "unknown option",
    call = function(e) return e.tm:find({}, { bogus = 1 }) end },

  -- the batch API (the lead's) ------------------------------------------------------
  { "run: an empty op list", code = "invalid", msg = "at least one op", pending = lacks("run"),
    call = function(e) return e.tm:run({}) end },
  { "run: an op id that is a query operator", code = "invalid", msg = "%$gt", pending = lacks("run"),
    call = function(e) return e.tm:run({ inc({ ["$gt"] = "" }, 1) }) end },
  { "run: an unknown option", raises = "unknown option", pending = lacks("run"),
    call = function(e) return e.tm:run({ inc("A", -1), inc("B", 1) }, { bogus = 1 }) end },
  { "run: ops that are not a table", raises = "ops must be a table", pending = lacks("run"),
    call = function(e) return e.tm:run("A -> B") end },
  { "commit_many: a list that is not a table", raises = "commit_many takes a list",
    pending = lacks("commit_many"), call = function(e) return e.tm:commit_many("A -> B") end },
  { "commit_many: an item that is not a table", raises = "item 1 is not a table",
    pending = lacks("commit_many"), call = function(e) return e.tm:commit_many({ "A -> B" }) end },
  { "commit_many: an item with an empty op list", batch = true, code = "invalid", msg = "at least one op",
    pending = lacks("commit_many"), call = function(e) return e.tm:commit_many({ {} }) end },
  { "commit_many: an item with an unknown key", raises = "unknown option idempotency",
    pending = lacks("commit_many"),
    call = function(e)
      return e.tm:commit_many({ { ops = { inc("A", -1), inc("B", 1) }, idempotency = "k" } })
    end },
  { "commit_many: an item id that is a query operator", batch = true, code = "invalid", msg = "%$gt",
    pending = lacks("commit_many"),
    call = function(e)
      return e.tm:commit_many({ { ops = { inc("A", -1), inc("B", 1) }, id = { ["$gt"] = "" } } })
    end },
  { "commit_many: items whose ops touch the marker or repeat a document", batch = true, code = "invalid",
    msg = "pendingTransactions", pending = lacks("commit_many"),
    call = function(e)
      return e.tm:commit_many({ { upd("A", { ["$unset"] = { pendingTransactions = true } }) },
                                { inc("B", 1), inc("B", 1) } })
    end },
  { "transfer_many: a list that is not a table", raises = "transfer_many takes a list",
    pending = lacks("transfer_many"), call = function(e) return e.tm:transfer_many(5) end },
  { "transfer_many: NaN and infinite amounts", batch = true, code = "invalid", msg = "finite",
    pending = lacks("transfer_many"),
    call = function(e)
      return e.tm:transfer_many({ { collection = "accounts", from = "A", to = "B", amount = NAN },
                                  { collection = "accounts", from = "B", to = "A", amount = INF } })
    end },
  { "transfer_many: a negative amount", batch = true, code = "invalid", msg = "positive",
    pending = lacks("transfer_many"),
    call = function(e)
      return e.tm:transfer_many({ { collection = "accounts", from = "A", to = "B", amount = -1 } })
    end },
  { "transfer_many: an unknown key", raises = "unknown option minimum", pending = lacks("transfer_many"),
    call = function(e)
      return e.tm:transfer_many({ { collection = "accounts", from = "A", to = "B", amount = 1,
                                    minimum = 0 } })
    end },
  { "transfer_many: an amount that is a string", raises = "amount must be a number",
    pending = lacks("transfer_many"),
    call = function(e)
      return e.tm:transfer_many({ { collection = "accounts", from = "A", to = "B", amount = "1" } })
    end },
  { "transfer_many: an account id that is a query operator", batch = true, code = "invalid", msg = "%$ne",
    pending = lacks("transfer_many"),
    call = function(e)
      return e.tm:transfer_many({ { collection = "accounts", from = { ["$ne"] = "" }, to = "B",
                                    amount = 1 } })
    end },
}

local function add(case) cases[#cases + 1] = case end

-- One document, two spellings: the server compares _id values in their
-- canonical form, so 1, 1.0 and Int64(1) are one id ------------------------
local Int64 = mongotx.Int64
for _, c in ipairs {
  { "1 and Int64(1)", 1, Int64(1) },
  { "1.0 and Int64(1)", 1.0, Int64(1) },
  { "Int64(7) and 7.0", Int64(7), 7.0 },
  { "{ a = 1 } and { a = Int64(1) }", { a = 1 }, { a = Int64(1) } },
  { "{ a = 1.0 } and { a = Int64(1) }", { a = 1.0 }, { a = Int64(1) } },
} do
  add { "begin: ops on " .. c[1] .. " (one document)", code = "invalid", msg = "one op per document",
        call = begin({ inc(c[2], -1), inc(c[3], 1) }) }
  add { "run: ops on " .. c[1] .. " (one document)", code = "invalid", msg = "one op per document",
        call = function(e) return e.tm:run({ inc(c[2], -1), inc(c[3], 1) }) end }
  add { "transfer: from " .. c[1]:gsub(" and ", " to "), code = "invalid", msg = "one op per document",
        call = transfer(c[2], c[3]) }
  add { "commit_many: an item with ops on " .. c[1], batch = true, code = "invalid",
        msg = "one op per document",
        call = function(e) return e.tm:commit_many({ { inc(c[2], -1), inc(c[3], 1) } }) end }
  add { "transfer_many: from " .. c[1]:gsub(" and ", " to "), batch = true, code = "invalid",
        msg = "one op per document",
        call = function(e)
          return e.tm:transfer_many({ { collection = "accounts", from = c[2], to = c[3], amount = 1 } })
        end }
end
add { "transfer: from 1 to 1.0", code = "invalid", msg = "one op per document", call = transfer(1, 1.0) }

-- Ids of types that match more than one value, or none reliably ------------
local refused_ids = {
  { "a Regex", function() return mongotx.Regex("^A") end },
  { "an array", function() return { "A" } end },
  { "an array built with mongotx.array", function() return mongotx.array({ "A", "B" }) end },
  { "an empty array", function() return mongotx.array() end },
  { "null", function() return mongotx.null end },
  { "a Decimal128", function() return mongotx.Decimal128("1") end },
  { "a Timestamp", function() return mongotx.Timestamp(1, 1) end },
  { "MinKey", function() return mongotx.MinKey end },
  { "MaxKey", function() return mongotx.MaxKey end },
  { "-inf", function() return -INF end },
  { "a document holding a Regex", function() return mongotx.doc("a", mongotx.Regex("x")) end },
  { "a document holding null", function() return { a = mongotx.null } end },
  { "a document holding an array", function() return { a = { 1, 2 } } end },
  { "a document holding a Decimal128", function() return { a = mongotx.Decimal128("1") } end },
  { "a document holding NaN", function() return { a = NAN } end },
  { "mongotx.doc with a $regex key", function() return mongotx.doc("$regex", "^A") end },
  { "a table with an $in key", function() return { ["$in"] = { "A", "B" } } end },
  { "a table with an $exists key", function() return { ["$exists"] = true } end },
}
for _, c in ipairs(refused_ids) do
  add { "begin: an op id that is " .. c[1], code = "invalid", msg = "id",
        call = function(e) return e.tm:begin({ inc(c[2](), 1) }) end }
  add { "begin: an insert whose id is " .. c[1], code = "invalid", msg = "id",
        call = function(e)
          return e.tm:begin({ { collection = "orders", id = c[2](), doc = { item = "x" } } })
        end }
  add { "begin: a transaction id that is " .. c[1], code = "invalid", msg = "id",
        call = function(e) return e.tm:begin({ inc("A", -1), inc("B", 1) }, { id = c[2]() }) end }
  add { "transfer: a from account that is " .. c[1], code = "invalid", msg = "id",
        call = function(e) return e.tm:transfer("accounts", c[2](), "B", 10) end }
  add { "run: an op id that is " .. c[1], code = "invalid", msg = "id",
        call = function(e) return e.tm:run({ inc(c[2](), 1) }) end }
end
add { "begin: a transaction id that is a function", code = "invalid", msg = "id", may_raise = true,
      call = begin({ inc("A", -1), inc("B", 1) }, { id = print }) }
add { "transfer: an account that is a function", code = "invalid", msg = "id", may_raise = true,
      call = transfer("A", print) }
add { "transfer: from a Regex matching both accounts", code = "invalid", msg = "id",
      call = transfer(mongotx.Regex("^[AB]$"), "o1") }
add { "transfer: to { $in = { A, B } }", code = "invalid", msg = "id",
      call = transfer("A", { ["$in"] = { "A", "B" } }) }
add { "transfer_many: from a Regex", batch = true, code = "invalid", msg = "id",
      call = function(e)
        return e.tm:transfer_many({ { collection = "accounts", from = mongotx.Regex("^[AB]$"), to = "B",
                                      amount = 1 } })
      end }

-- Ids that would act as queries where a transaction is looked up: each
-- must be refused, never find t-1 (which every setup makes) ----------------
local query_ids = {
  { "Regex(\"^t\")", function() return mongotx.Regex("^t") end },
  { "{ $gt = \"\" }", function() return { ["$gt"] = "" } end },
  { "{ $ne = 1 }", function() return { ["$ne"] = 1 } end },
  { "{ $in = { \"t-1\" } }", function() return { ["$in"] = { "t-1" } } end },
  { "doc(\"$regex\", \"^t\")", function() return mongotx.doc("$regex", "^t") end },
}
local lookups = {
  { "get", existing, function(e, id) return e.tm:get(id) end },
  { "commit", existing, function(e, id) return e.tm:commit({ _id = id }) end },
  { "rollback", PENDING, function(e, id) return e.tm:rollback({ _id = id }) end },
  { "compensate", committed, function(e, id) return e.tm:compensate({ _id = id }) end },
}
for _, s in ipairs {
  { "claim", existing }, { "apply", PENDING }, { "commit", PENDING_APPLIED }, { "cancel", PENDING },
  { "finish", APPLIED }, { "done", FINISHED }, { "undo", CANCELING }, { "cancelled", UNDONE },
} do
  lookups[#lookups + 1] = { "step " .. s[1], s[2], function(e, id) return e.tm:step(s[1], { _id = id }, 1) end }
end
for _, l in ipairs(lookups) do
  for _, q in ipairs(query_ids) do
    add { l[1] .. ": an id that is " .. q[1], code = "invalid", msg = "id", setup = l[2],
          call = function(e) return l[3](e, q[2]()) end }
  end
end

-- Validation sees what is sent: pairs() may lie (__pairs), __index and
-- __len may supply what the table does not hold; the encoder sends the
-- raw contents, so those are what must be checked ---------------------------
local function hidden_unset()
  return lying({ ["$inc"] = { balance = 1 }, ["$unset"] = { pendingTransactions = true } },
               { ["$inc"] = { balance = 1 } })
end
local function shown_inc_sends_set()
  return lying({ ["$set"] = { balance = 5 } }, { ["$inc"] = { balance = 1 } })
end
local function hidden_where()
  return lying({ balance = { ["$gte"] = 0 }, ["$where"] = "sleep(100) || true" },
               { balance = { ["$gte"] = 0 } })
end
for _, c in ipairs {
  { "an update whose pairs hides $unset of the marker", "pendingTransactions",
    function() return { { collection = "accounts", id = "A", update = hidden_unset() } } end },
  { "an update whose pairs shows $inc while it holds $set (no undo)", "",
    function() return { { collection = "accounts", id = "A", update = shown_inc_sends_set() } } end },
  { "an update whose pairs shows $inc while it holds nothing", "",
    function()
      return { { collection = "accounts", id = "A", update = lying({}, { ["$inc"] = { balance = 1 } }) } }
    end },
  { "a $set whose pairs hides the marker", "pendingTransactions",
    function()
      return { upd("A", { ["$set"] = lying({ status = "x", pendingTransactions = mongotx.array() },
                                          { status = "x" }) }) }
    end },
  { "an undo whose pairs hides $unset of the marker", "pendingTransactions",
    function() return { upd("A", { ["$set"] = { status = "x" } }, hidden_unset()) } end },
  { "a where whose pairs hides $where", "%$where",
    function() return { guarded(hidden_where()) } end },
  { "a where whose pairs hides a condition on the marker", "pendingTransactions",
    function() return { guarded(lying({ pendingTransactions = { ["$size"] = 0 } }, {})) } end },
  { "an op id whose pairs hides $gt", "%$gt",
    function() return { inc(lying({ ["$gt"] = "" }, {}), 1) } end },
  { "an op id holding a table whose pairs hides $ne", "%$ne",
    function() return { inc({ a = lying({ ["$ne"] = 1 }, {}) }, 1) } end },
  { "a doc whose pairs hides the marker", "pendingTransactions",
    function()
      return { { collection = "orders", id = "o2",
                 doc = lying({ item = "x", pendingTransactions = { "forged" } }, { item = "x" }) } }
    end },
  { "a doc whose pairs hides a $ key", "%$set",
    function()
      return { { collection = "orders", id = "o2", doc = lying({ item = "x", ["$set"] = 1 }, { item = "x" }) } }
    end },
  { "a doc whose pairs hides the version field", "txVersion",
    function()
      return { { collection = "orders", id = "o2", doc = lying({ item = "x", txVersion = 99 }, { item = "x" }) } }
    end },
  { "an op whose pairs hides an unknown key", "upsert",
    function()
      local shown = inc("A", 1)
      local raw = inc("A", 1)
      raw.upsert = true
      return { lying(raw, shown) }
    end },
  { "an ops list whose pairs hides a hole", "",
    function()
      return lying({ inc("A", -1), inc("B", 1), [5] = inc("o1", 1, "orders") }, { inc("A", -1), inc("B", 1) })
    end },
  { "an ops list whose __index and __len supply every op", "",
    function()
      return setmetatable({}, { __index = { inc("A", -1), inc("B", 1) }, __len = function() return 2 end })
    end },
  { "an op whose __index supplies its update", "",
    function()
      return { setmetatable({ collection = "accounts", id = "A" },
                            { __index = { update = { ["$inc"] = { balance = 1 } } } }) }
    end },
  { "a $set op whose __index supplies its undo", "",
    function()
      return { setmetatable({ collection = "orders", id = "o1", update = { ["$set"] = { status = "x" } } },
                            { __index = { undo = { ["$set"] = { status = "new" } } } }) }
    end },
  { "an op whose __index supplies its id", "",
    function()
      return { setmetatable({ collection = "accounts", update = { ["$inc"] = { balance = 1 } } },
                            { __index = { id = "A" } }) }
    end },
} do
  add { "begin: " .. c[1], code = "invalid", msg = c[2], call = function(e) return e.tm:begin(c[3]()) end }
  add { "run: " .. c[1], code = "invalid", msg = c[2], call = function(e) return e.tm:run(c[3]()) end }
  add { "commit_many: " .. c[1], batch = true, code = "invalid", msg = c[2],
        call = function(e) return e.tm:commit_many({ { ops = c[3]() } }) end }
end
add { "begin: a transaction id whose pairs hides $gt", code = "invalid", msg = "%$gt",
      call = function(e) return e.tm:begin({ inc("A", -1), inc("B", 1) }, { id = lying({ ["$gt"] = "" }, {}) }) end }
add { "get: an id whose pairs hides $gt", code = "invalid", msg = "%$gt", setup = existing,
      call = function(e) return e.tm:get(lying({ ["$gt"] = "" }, {})) end }
add { "commit: an _id whose pairs hides $ne", code = "invalid", msg = "%$ne", setup = existing,
      call = function(e) return e.tm:commit({ _id = lying({ ["$ne"] = 1 }, {}) }) end }
add { "rollback: an _id whose pairs hides $ne", code = "invalid", msg = "%$ne", setup = PENDING,
      call = function(e) return e.tm:rollback({ _id = lying({ ["$ne"] = 1 }, {}) }) end }
add { "step claim: an _id whose pairs hides $gt", code = "invalid", msg = "%$gt", setup = existing,
      call = function(e) return e.tm:step("claim", { _id = lying({ ["$gt"] = "" }, {}) }) end }
add { "transfer: an account whose pairs hides $ne", code = "invalid", msg = "%$ne",
      call = transfer(lying({ ["$ne"] = "nobody" }, {}), "B") }
add { "transfer: a transaction id whose pairs hides $gt", code = "invalid", msg = "%$gt",
      call = transfer("A", "B", { id = lying({ ["$gt"] = "" }, {}) }) }

-- where: only query operators, none that runs code or is unknown, and
-- nothing on the fields mongotx owns, however deep ---------------------------
for _, c in ipairs {
  { "an unknown operator on a field", "%$gtx", { balance = { ["$gtx"] = 1 } } },
  { "an unknown top-level operator", "%$foo", { ["$foo"] = 1 } },
  { "an unknown operator in $or", "%$gtx", { ["$or"] = { { balance = { ["$gtx"] = 1 } }, { balance = 1 } } } },
  { "an unknown operator in $and", "%$foo", { ["$and"] = { { ["$foo"] = 1 } } } },
  { "an unknown operator in $nor", "%$lol", { ["$nor"] = { { balance = { ["$lol"] = 1 } } } } },
  { "an unknown operator in $not", "%$gtx", { balance = { ["$not"] = { ["$gtx"] = 1 } } } },
  { "an unknown operator deep in $and of $or", "%$gtx",
    { ["$and"] = { { ["$or"] = { { balance = { ["$gtx"] = 1 } } } } } } },
  { "$expr", "%$expr", { ["$expr"] = { ["$gt"] = { "$balance", 0 } } } },
  { "$expr in $or", "%$expr", { ["$or"] = { { ["$expr"] = { ["$eq"] = { 1, 1 } } } } } },
  { "$where in $and", "%$where", { ["$and"] = { { ["$where"] = "true" } } } },
  { "$text", "%$text", { ["$text"] = { ["$search"] = "x" } } },
  { "$jsonSchema", "%$jsonSchema", { ["$jsonSchema"] = { required = { "balance" } } } },
  { "$near", "%$near", { loc = { ["$near"] = { 0, 0 } } } },
  { "$nearSphere", "%$nearSphere", { loc = { ["$nearSphere"] = { 0, 0 } } } },
  { "$geoWithin", "%$geoWithin", { loc = { ["$geoWithin"] = { ["$centerSphere"] = { { 0, 0 }, 1 } } } } },
  { "$geoIntersects", "%$geoIntersects",
    { loc = { ["$geoIntersects"] = { ["$geometry"] = { type = "Point", coordinates = { 0, 0 } } } } } },
  { "the marker in $or", "pendingTransactions",
    { ["$or"] = { { pendingTransactions = { ["$size"] = 0 } }, { balance = 1 } } } },
  { "a path under the marker in $or", "pendingTransactions",
    { ["$or"] = { { ["pendingTransactions.0"] = { ["$exists"] = false } } } } },
  { "the version field in $and", "txVersion", { ["$and"] = { { txVersion = 1 } } } },
  { "txRemoving in $nor", "txRemoving", { ["$nor"] = { { txRemoving = { ["$exists"] = true } } } } },
  { "_id in $or", "_id", { ["$or"] = { { _id = "B" }, { balance = 1 } } } },
  { "the version field deep in $and of $or", "txVersion",
    { ["$and"] = { { ["$or"] = { { txVersion = { ["$gt"] = 0 } } } } } } },
  { "txRemoving at the top", "txRemoving", { txRemoving = mongotx.null } },
} do
  add { "begin: a where with " .. c[1], code = "invalid", msg = c[2], call = begin({ guarded(c[3]) }) }
  add { "run: a where with " .. c[1], code = "invalid", msg = c[2],
        call = function(e) return e.tm:run({ guarded(c[3]) }) end }
end
add { "begin: a where with a configured marker in $or", code = "invalid", msg = "locks",
      setup = function(e) e.other = assert(e.db:manager{ application = "app-1", marker = "locks" }) end,
      call = function(e) return e.other:begin({ guarded({ ["$or"] = { { locks = { ["$size"] = 0 } } } }) }) end }
add { "begin: an assert whose where has an unknown operator", code = "invalid", msg = "%$gtx",
      call = begin({ { collection = "accounts", id = "A", kind = "assert", where = { balance = { ["$gtx"] = 1 } } } }) }

-- Options with values that cannot work, and content too big to store -------
add { "manager: the marker named txRemoving", code = "invalid", msg = "marker",
      call = function(e) return e.db:manager{ marker = "txRemoving" } end }
add { "manager: the version field named txPlaceholder", code = "invalid", msg = "version_field",
      call = function(e) return e.db:manager{ version_field = "txPlaceholder" } end }
add { "manager: the marker named txPlaceholder", code = "invalid", msg = "marker",
      call = function(e) return e.db:manager{ marker = "txPlaceholder" } end }
add { "manager: a NaN lease", code = "invalid", msg = "lease",
      call = function(e) return e.db:manager{ lease = NAN } end }
add { "manager: infinite retries", code = "invalid", msg = "retries",
      call = function(e) return e.db:manager{ retries = INF } end }
add { "manager: a negative stale_after", code = "invalid", msg = "stale_after",
      call = function(e) return e.db:manager{ stale_after = -1 } end }
add { "begin: a meta that contains itself", code = "invalid", msg = "meta",
      call = function(e) return e.tm:begin({ inc("A", -1), inc("B", 1) }, { meta = cyclic() }) end }
add { "run: a meta that contains itself", code = "invalid", msg = "meta",
      call = function(e) return e.tm:run({ inc("A", -1), inc("B", 1) }, { meta = cyclic() }) end }
add { "transfer: a meta that contains itself", code = "invalid", msg = "meta",
      call = transfer("A", "B", { meta = cyclic() }) }
add { "rollback: a reason over 16 MiB", code = "invalid", msg = "reason", setup = PENDING,
      call = function(e) return e.tm:rollback(e.t, ("x"):rep(16 * 1024 * 1024 + 1)) end }
add { "rollback: a reason over 16 MiB of an initial transaction", code = "invalid", msg = "reason",
      setup = existing, call = function(e) return e.tm:rollback(e.t, ("x"):rep(16 * 1024 * 1024 + 1)) end }
add { "connect: tls that is not a table", raises = "tls",
      call = function() return mongotx.connect(helpers.uri(), { tls = "yes" }) end }

-- Errors of the C core: a string code and a numeric server_code ------------
add { "C core: an insert whose _id is taken", check = core_error(11000), msg = ".",
      call = function(e) return e.db:collection("accounts"):insert_one({ _id = "A", balance = 1 }) end }
add { "C core: a find the server refuses (unknown operator)", check = core_error(), msg = ".", setup = existing,
      call = function(e) return e.db:collection("transactions"):find_all({ state = { ["$gtx"] = 1 } }) end }
add { "C core: a server that does not answer", check = core_error(), msg = ".",
      call = function()
        local db = assert(mongotx.connect("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300" ..
          "&connectTimeoutMS=300", { database = "mtx_nowhere" }))
        return db:manager{}
      end }

-- Cases the differential check of the C checks (csrc/checks.c) against
-- the Lua ones they replaced found unpinned: each fault where it hides
-- (the new name of a $rename, deep in an insert's doc, in an undo), and
-- the kinds of op that take neither update nor doc ---------------------------
local function insert(doc) return { collection = "orders", id = "o2", doc = doc } end
for _, c in ipairs {
  { "an $inc by the smallest integer (its undo overflows)", "cannot be undone", LUA54,
    { ["$inc"] = { balance = math.mininteger } } },
  { "a $mul by the smallest integer", "cannot be undone", LUA54,
    { ["$mul"] = { balance = math.mininteger } } },
  -- (LuaJIT's counterpart of math.mininteger: the same number, boxed)
  { "an $inc by the smallest Int64", "cannot be undone", true,
    { ["$inc"] = { balance = mongotx.Int64("-9223372036854775808") } } },
  { "a $mul by the smallest Int64", "cannot be undone", true,
    { ["$mul"] = { balance = mongotx.Int64("-9223372036854775808") } } },
  { "a $rename onto _id (the new name)", "%$rename may not touch _id", true,
    { ["$rename"] = { name = "_id.x" } } },
  { "a $rename onto the marker field (the new name)", "may not touch pendingTransactions", true,
    { ["$rename"] = { name = "pendingTransactions" } } },
  { "a $rename to a $ name", "needs a field name", true, { ["$rename"] = { name = "$x" } } },
  { "a $set holding NaN deep", "holds %-?nan", true, { ["$set"] = { a = { b = { c = NAN } } } } },
  { "an $inc of a string", "needs a number, not string", true, { ["$inc"] = { balance = "5" } } },
  { "an $inc of a table", "needs a number, not object", true, { ["$inc"] = { balance = {} } } },
  { "an operator holding a list of fields", "bad field name 1", true, { ["$set"] = { 1, 2 } } },
  { "a field name with two dots in a row", "bad field name a%.%.b", true,
    { ["$set"] = { ["a..b"] = 1 } } },
  { "a key that is not UTF-8", "cannot be stored", true, { ["$set"] = { ["\255"] = 1 } } },
  { "an $inc by a Decimal128 NaN", 'holds Decimal128%("NaN"%) %(under the key balance%)', true,
    { ["$inc"] = { balance = mongotx.Decimal128("NaN") } } },
  { "a $mul by a Decimal128 infinity", 'holds Decimal128%("Infinity"%)', true,
    { ["$mul"] = { balance = mongotx.Decimal128("Infinity") } } },
  { "a $set of a string that is not UTF-8", "holds a string that is not UTF%-8 %(under the key note%)",
    true, { ["$set"] = { note = "ok \192\175" } } },
  { "a $push of a Regex that is not UTF-8", "holds a regex that is not UTF%-8", true,
    { ["$push"] = { log = mongotx.Regex("\255") } } },
  { "a $rename to a name that is not UTF-8", "needs a field name", true,
    { ["$rename"] = { name = "n\255" } } },
  { "a path holding a NUL", "cannot be stored", true, { ["$inc"] = { ["bal\0ance"] = 1 } } },
} do
  add { "begin: " .. c[1], code = "invalid", msg = "^op 1: update.*" .. c[2],
        pending = not c[3] and function() return "LuaJIT has no integers to overflow" end or nil,
        call = begin({ upd("A", c[4]) }) }
end
for _, c in ipairs {
  { "an undo that unsets the marker", "undo: %$unset may not touch pendingTransactions",
    upd("A", { ["$set"] = { x = 1 } }, { ["$unset"] = { pendingTransactions = "" } }) },
  { "an undo that is no update", "undo: x is not an update operator",
    upd("A", { ["$set"] = { x = 1 } }, { x = 1 }) },
  { "a remove with an update", "only an update op takes update and undo",
    { collection = "accounts", id = "A", kind = "remove", update = { ["$inc"] = { balance = 1 } } } },
  { "an assert with a doc", "only an insert op takes a doc",
    { collection = "accounts", id = "A", kind = "assert", doc = { x = 1 } } },
  { "an insert of a list", "doc keys are strings", insert({ 1, 2 }) },
  { "an insert holding a $ key deep", "doc may not hold the key \"%$x\"",
    insert({ a = { b = { ["$x"] = 1 } } }) },
  { "an insert holding a dotted key deep", "dots are paths", insert({ a = { ["b.c"] = 1 } }) },
  { "an insert holding inf deep", "doc holds inf", insert({ a = { INF } }) },
  { "an insert holding a Decimal128 -Infinity deep", 'doc holds Decimal128%("%-Infinity"%)',
    insert({ a = { mongotx.Decimal128("-Infinity") } }) },
  { "an insert holding a surrogate (not UTF-8)", "doc holds a string that is not UTF%-8",
    insert({ a = { b = "\237\160\128" } }) },
  { "an insert setting the marker", "doc may not set pendingTransactions",
    insert({ pendingTransactions = {} }) },
  { "an insert setting _id (the op's id is its _id)", "doc may not set _id", insert({ _id = "o2" }) },
  { "a kind that is no string", "kind must be", { collection = "accounts", id = "A", kind = 1 } },
  { "an id whose table holds a dotted key deep", "may not hold dots",
    { collection = "accounts", id = mongotx.doc("a", { ["b.c"] = 1 }), kind = "assert" } },
  { "an id holding a plain table of two keys deep", "several keys %(a, b%)",
    { collection = "accounts", id = mongotx.doc("x", { a = 1, b = 2 }), kind = "assert" } },
} do
  add { "begin: " .. c[1], code = "invalid", msg = "^op 1: .*" .. c[2], call = begin({ c[3] }) }
end
add { "begin: the second op on the document of the first, as Int64 and as an insert",
      code = "invalid", msg = "op 2: document 7 of orders is also op 1",
      call = begin({ { collection = "orders", id = 7, kind = "assert" },
                     { collection = "orders", id = mongotx.Int64(7), doc = { item = "x" } } }) }
add { "begin: an update hidden behind __pairs is checked as sent", code = "invalid",
      msg = "op 1: update: %$unset may not touch pendingTransactions",
      call = begin({ upd("A", setmetatable({ ["$unset"] = { pendingTransactions = "" } },
                                           { __pairs = function() return next, {} end })) }) }

-- Values no reader can use, and names checked as an op's are (issue 20)
add { "begin: a where comparing with a Decimal128 NaN", code = "invalid",
      msg = 'op 1: where holds Decimal128%("NaN"%)',
      call = begin({ { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } },
                       where = { balance = { ["$gte"] = mongotx.Decimal128("NaN") } } } }) }
add { "begin: meta holding a string that is not UTF-8", code = "invalid",
      msg = "meta cannot be stored: it holds a string that is not UTF%-8",
      call = begin({ inc("A", 1) }, { meta = { note = "\255" } }) }
for what, field in pairs { ["not UTF-8"] = "bal\255", ["holding a NUL"] = "bal\0ance" } do
  add { "transfer: a field " .. what .. " (was a raise from the encoder)",
        code = "invalid", msg = "bad field name", call = function(e)
          return e.tm:transfer("accounts", "A", "B", 1, { field = field })
        end }
end
add { "manager: a transactions collection whose namespace is too long", code = "invalid",
      msg = "option collection of manager: collection name of", call = function(e)
        return e.db:manager{ collection = ("t"):rep(200) }
      end }
add { "manager: a transactions collection starting with a dot", code = "invalid",
      msg = "option collection of manager must be a collection name", call = function(e)
        return e.db:manager{ collection = ".tx" }
      end }

local function fixture()
  local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
  local tm = assert(db:manager{ application = "app-1" })
  assert(db:collection("accounts"):insert_many{
    { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
    { _id = "B", balance = 1000, pendingTransactions = mongotx.array() },
  })
  assert(db:collection("orders"):insert_one({ _id = "o1", status = "new" }, {}))
  return { db = db, tm = tm }
end

describe("#server hostile input", function()
  local e

  before_each(function() e = fixture() end)
  after_each(function() e.db:close() end)

  it("has a corpus of at least 60 cases", function()
    assert.is_true(#cases >= 60, #cases .. " cases")
  end)

  for _, case in ipairs(cases) do
    it(case[1], function()
      local why = case.pending and case.pending(e)
      if why then return pending(why) end
      if case.setup then case.setup(e) end
      local before = helpers.db_dump(e.db.client, e.db.name)
      if case.raises and not case.either then
        local ok, raised = pcall(case.call, e)
        assert.is_false(ok, "expected a raise, got " .. tostring(raised))
        assert.truthy(tostring(raised):find(case.raises), tostring(raised))
      elseif case.batch then
        local results, errs = case.call(e)
        assert.is_table(results)
        assert.is_true(#results > 0)
        for i = 1, #results do
          assert.is_false(results[i], "item " .. i)
          assert.are.equal(case.code, errs[i].code, tostring(errs[i]))
        end
        assert.truthy(errs[1].message:find(case.msg), errs[1].message)
      else
        local ok, res, err = pcall(case.call, e)
        if not ok then
          -- a raise is the answer only where the case allows one
          assert.truthy(case.either or case.may_raise, "raised: " .. tostring(res))
          if case.raises then assert.truthy(tostring(res):find(case.raises), tostring(res)) end
        else
          assert.is_nil(res)
          assert.is_table(err)
          if case.check then
            case.check(err)
          else
            assert.are.equal(case.code, err.code, tostring(err))
          end
          assert.are.equal("string", type(err.message))
          assert.truthy(err.message:find(case.msg), err.message)
          assert.are.equal("string", type(tostring(err)))
        end
      end
      helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
    end)
  end
end)

-- mongotx's bookkeeping on the documents it touched: nothing else may
-- differ once a transaction that could not apply is cancelled (txHeld is
-- left empty on a document an undone credit raised, txPending at 0 where
-- an undone escrowed credit waited).  Its collections are skipped where a
-- transaction runs: the transactions and the $$NOW probe's.
local BOOKKEEPING = { "txVersion", "txHeld", "txPending" }

-- What the corpus refuses must not cost what is allowed: every allowed id
-- type works, in whatever spelling the server takes as the same id;
-- every known query operator is accepted in a where; and a table whose
-- metatable supplies or hides content is refused or run exactly as its
-- raw contents say.
describe("#server what hostile-input checks still allow", function()
  local e, accounts

  before_each(function()
    e = fixture()
    accounts = e.db:collection("accounts")
  end)
  after_each(function() e.db:close() end)

  local allowed_ids = {
    { "a string", "s-1" },
    { "an integer", 42 },
    { "a negative integer", -7 },
    { "a double", 2.5 },
    { "an Int64", mongotx.Int64("1099511627776") },
    { "an ObjectId", mongotx.ObjectId("5f1d7a3b2c4e5f6a7b8c9d0e") },
    { "a Date", mongotx.Date(1234567) },
    { "a boolean", true },
    { "a Binary", mongotx.Binary("\0\1\2") },
    { "a mongotx.doc", mongotx.doc("a", 1, "b", "x") },
    { "a table with one key", { k = "v" } },
    { "a document holding a document", { k = mongotx.doc("x", 1, "y", mongotx.ObjectId("5f1d7a3b2c4e5f6a7b8c9d0f")) } },
    { "a document holding a Date", { at = mongotx.Date(5) } },
  }

  -- A document is an op id only: a transaction id goes into marker
  -- arrays, where $pull reads a document as a condition (pulling {a = 1}
  -- pulls {a = 1, b = 2} too), so it is refused there.
  for _, c in ipairs(allowed_ids) do
    local scalar = type(c[2]) ~= "table"
    it("an op id " .. (scalar and "and a transaction id " or "") .. "that are " .. c[1], function()
      local things = e.db:collection("things")
      local ops = { { collection = "things", id = c[2], doc = { item = c[1] } }, inc("A", -1) }
      if not scalar then
        local before = helpers.db_dump(e.db.client, e.db.name)
        local T, err = e.tm:begin(ops, { id = c[2] })
        assert.is_nil(T)
        assert.are.equal("invalid", err.code)
        assert.truthy(err.message:find("transaction id may not be a document"), err.message)
        local got
        got, err = e.tm:get(c[2])
        assert.is_nil(got)
        assert.are.equal("invalid", err.code)
        assert.are.same(before, helpers.db_dump(e.db.client, e.db.name))
      end
      local T = assert(e.tm:begin(ops, { id = scalar and c[2] or nil }))
      assert.are.equal("done", assert(e.tm:commit(T)).state)
      local got = assert(e.tm:get(T._id))
      assert.are.equal("done", got.state)
      if scalar then assert.are.equal(mongotx.encode({ x = c[2] }), mongotx.encode({ x = got._id })) end
      local docs = helpers.dump(things)
      assert.are.equal(1, #docs)
      assert.are.equal(c[1], docs[1].item)
      assert.are.same({}, docs[1].pendingTransactions)
      assert.are.equal(1, things:count({ _id = c[2] }))
      assert.are.equal(999, assert(accounts:find_one({ _id = "A" })).balance)
    end)
  end

  it("ids whose keys differ only in order are two documents, as on the server", function()
    local things = e.db:collection("things")
    local T = assert(e.tm:run({
      { collection = "things", id = mongotx.doc("a", 1, "b", 2), doc = { n = 1 } },
      { collection = "things", id = mongotx.doc("b", 2, "a", 1), doc = { n = 2 } },
    }))
    assert.are.equal("done", T.state)
    assert.are.equal(2, things:count({}))
  end)

  it("1, 1.0 and Int64(1) name one transaction", function()
    local function ops() return { inc("A", -1), inc("B", 1) } end
    assert(e.tm:begin(ops(), { id = 1 }))
    for _, id in ipairs { 1.0, mongotx.Int64(1) } do
      local T = assert(e.tm:get(id))
      assert.are.equal(1, T._id)
      assert.are.equal("initial", assert(e.tm:begin(ops(), { id = id })).state)
      local again, err = e.tm:begin({ inc("A", -2), inc("B", 2) }, { id = id })
      assert.is_nil(again)
      assert.are.equal("idempotency", err.code)
    end
    assert.are.equal(1, e.db:collection("transactions"):count({}))
    assert.are.equal("done", assert(e.tm:commit({ _id = mongotx.Int64(1) })).state)
    assert.are.equal("done", assert(e.tm:get(1.0)).state)
    local b = helpers.balances(accounts)
    assert.are.same({ 999, 1001 }, { b.A, b.B })
  end)

  it("a batch repeating an id in another spelling refuses the later items", function()
    local results, errs = e.tm:commit_many {
      { ops = { inc("A", -1) }, id = 1 },
      { ops = { inc("B", -1) }, id = mongotx.Int64(1) },
      { ops = { inc("A", -5) }, id = 1.0 },
    }
    assert.are.equal("done", results[1].state)
    for i = 2, 3 do
      assert.is_false(results[i])
      assert.are.equal("invalid", errs[i].code, tostring(errs[i]))
    end
    assert.are.equal(1, e.db:collection("transactions"):count({}))
    local b = helpers.balances(accounts)
    assert.are.same({ 999, 1000 }, { b.A, b.B })
  end)

  it("an account named 1 is reached as 1.0 and Int64(1), and its marker is pulled", function()
    assert(accounts:insert_one({ _id = 1, balance = 100, pendingTransactions = mongotx.array() }))
    assert.are.equal("done", assert(e.tm:transfer("accounts", mongotx.Int64(1), "B", 10, { min = 0 })).state)
    assert.are.equal("done", assert(e.tm:transfer("accounts", "A", 1.0, 5)).state)
    local one = assert(accounts:find_one({ _id = 1 }))
    assert.are.equal(95, one.balance)
    assert.are.same({}, one.pendingTransactions)
    local b = helpers.balances(accounts)
    assert.are.same({ 995, 1010 }, { b.A, b.B })
  end)

  it("takes a collection name as long as the namespace limit allows", function()
    local name = ("c"):rep(mongotx.core.MAX_NAMESPACE - #e.db.name - 1)
    assert(e.db:collection(name):insert_many({ { _id = "L", balance = 5 }, { _id = "M", balance = 5 } }))
    local T = assert(e.tm:transfer(name, "L", "M", 2))
    assert.are.equal("done", T.state)
    for id, want in pairs({ L = 3, M = 7 }) do
      local doc = assert(e.db:collection(name):find_one({ _id = id }))
      assert.are.equal(want, doc.balance)
      assert.are.equal(0, #doc.pendingTransactions)
    end
    local _, err = e.tm:transfer(name .. "c", "L", "M", 2)
    assert.are.equal("invalid", err.code)
    assert.are.equal(1, assert(e.db:collection("transactions"):count({})))
  end)

  it("takes the $-keys update operators define: $push's modifiers, $currentDate's $type", function()
    assert(accounts:update_one({ _id = "A" }, { ["$set"] = { list = mongotx.array { 1, 2, 9 } } }))
    local T = assert(e.tm:run({
      { collection = "accounts", id = "A",
        update = { ["$push"] = { list = { ["$each"] = { 7, 8 }, ["$slice"] = 10 } } },
        undo = { ["$set"] = { list = mongotx.array { 1, 2, 9 } } } },
      { collection = "accounts", id = "B",
        update = { ["$currentDate"] = { seen = { ["$type"] = "date" } } },
        undo = { ["$unset"] = { seen = "" } } },
    }))
    assert.are.equal("done", T.state)
    assert.are.same({ 1, 2, 9, 7, 8 }, assert(accounts:find_one({ _id = "A" })).list)
    assert.truthy(assert(accounts:find_one({ _id = "B" })).seen)
  end)

  it("takes the positional $[] in a path", function()
    local why = helpers.ferretdb_lacks("the all-positional operator $[]")
    if why then return pending(why) end
    assert(accounts:update_one({ _id = "A" }, { ["$set"] = { list = mongotx.array { 1, 2 } } }))
    local T = assert(e.tm:run({ { collection = "accounts", id = "A",
      update = { ["$inc"] = { ["list.$[]"] = 10 } } } }))
    assert.are.equal("done", T.state)
    assert.are.same({ 11, 12 }, assert(accounts:find_one({ _id = "A" })).list)
  end)

  it("takes $sort's paths among $push's modifiers and values $pullAll and $unset do not store", function()
    assert(accounts:update_one({ _id = "A" }, { ["$set"] = { list = mongotx.array { { s = { n = 2 } } } } }))
    local T = assert(e.tm:run({ { collection = "accounts", id = "A",
      update = { ["$push"] = { list = { ["$each"] = { { s = { n = 1 } } }, ["$sort"] = { ["s.n"] = 1 } } },
                 ["$unset"] = { gone = { ["$x"] = 1 } } },
      undo = { ["$pullAll"] = { list = { { s = { n = 1 } } } } } } }))
    assert.are.equal("done", T.state)
    local list = assert(accounts:find_one({ _id = "A" })).list
    assert.are.equal(2, #list)
    -- (sorted by s.n where the server implements $sort; FerretDB v1 appends)
    assert.are.same({ 1, 2 }, { math.min(list[1].s.n, list[2].s.n), math.max(list[1].s.n, list[2].s.n) })
  end)

  it("takes $pull's conditions, which are query operators", function()
    local why = helpers.ferretdb_lacks("$pull with a condition (it matches the condition as a value)")
    if why then return pending(why) end
    assert(accounts:update_one({ _id = "A" }, { ["$set"] = { list = mongotx.array { 1, 2, 9, 7, 8 } } }))
    local T = assert(e.tm:run({ { collection = "accounts", id = "A",
      update = { ["$pull"] = { list = { ["$gte"] = 7 } } },
      undo = { ["$set"] = { list = mongotx.array { 1, 2, 9, 7, 8 } } } } }))
    assert.are.equal("done", T.state)
    assert.are.same({ 1, 2 }, assert(accounts:find_one({ _id = "A" })).list)
  end)

  it("accepts every known query operator in a where", function()
    local wheres = {
      { balance = { ["$eq"] = 1000 } }, { balance = { ["$ne"] = 1 } },
      { balance = { ["$gt"] = 1 } }, { balance = { ["$gte"] = 1 } },
      { balance = { ["$lt"] = 5000 } }, { balance = { ["$lte"] = 5000 } },
      { balance = { ["$in"] = { 1000, 1 } } }, { balance = { ["$nin"] = { 1, 2 } } },
      { balance = { ["$exists"] = true } }, { balance = { ["$type"] = "number" } },
      { balance = { ["$mod"] = { 10, 0 } } },
      { name = { ["$regex"] = "^a", ["$options"] = "i" } }, { name = { ["$regex"] = mongotx.Regex("^a") } },
      { tags = { ["$all"] = { "x" } } }, { tags = { ["$elemMatch"] = { ["$eq"] = "x" } } },
      { tags = { ["$size"] = 0 } }, { balance = { ["$not"] = { ["$lt"] = 0 } } },
      { ["$and"] = { { balance = { ["$gte"] = 0 } }, { balance = { ["$lte"] = 5000 } } } },
      { ["$or"] = { { balance = 1000 }, { balance = { ["$exists"] = false } } } },
      { ["$nor"] = { { balance = { ["$lt"] = 0 } } } },
      { balance = { ["$bitsAllSet"] = 0 } }, { balance = { ["$bitsAnySet"] = 8 } },
      { balance = { ["$bitsAllClear"] = 1 } }, { balance = { ["$bitsAnyClear"] = 1 } },
      { ["$and"] = { { ["$or"] = { { balance = { ["$in"] = { 1000 } } } } }, { balance = { ["$not"] =
        { ["$type"] = "string" } } } } },
    }
    for i, where in ipairs(wheres) do
      local t, err = e.tm:begin({ guarded(where) }, { id = "w" .. i })
      assert(t, string.format("where %d refused: %s", i, tostring(err)))
    end
    assert.are.equal(#wheres, e.tm:stats().initial)
    -- and one that holds lets its transaction through
    local T = assert(e.tm:run({ guarded({ ["$and"] = { { balance = { ["$gte"] = 1 } },
      { ["$or"] = { { balance = { ["$in"] = { 1000, 2000 } } }, { balance = { ["$exists"] = false } } } },
      { balance = { ["$not"] = { ["$lt"] = 0 } } } } }) }))
    assert.are.equal("done", T.state)
    assert.are.equal(999, assert(accounts:find_one({ _id = "A" })).balance)
  end)

  -- Either refused (nothing written) or run exactly as the raw contents
  -- say; never the hidden content.
  local function refused_or(expected, res, err, before)
    if res == nil and err and err.code == "invalid" then
      helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
      return
    end
    assert(res, "neither refused nor run: " .. tostring(err))
    assert.are.equal("done", res.state)
    local b = helpers.balances(accounts)
    assert.are.same(expected, { b.A, b.B })
  end

  it("an op whose __index supplies a false where: refused or run without it", function()
    local before = helpers.db_dump(e.db.client, e.db.name)
    local debit = setmetatable(inc("A", -5), { __index = { where = { balance = { ["$gte"] = 1e9 } } } })
    local res, err = e.tm:run({ debit, inc("B", 5) })
    refused_or({ 995, 1005 }, res, err, before)
  end)

  it("an update whose __index supplies another operator: refused or run as it holds", function()
    local before = helpers.db_dump(e.db.client, e.db.name)
    local update = setmetatable({ ["$inc"] = { balance = -5 } },
      { __index = { ["$set"] = { balance = 0 } } })
    local res, err = e.tm:run({ { collection = "accounts", id = "A", update = update }, inc("B", 5) })
    refused_or({ 995, 1005 }, res, err, before)
  end)

  it("an op whose pairs hides the false where it holds: refused or cancelled by it", function()
    local opts = { skip = { "transactions", "transactions.probe" }, without = BOOKKEEPING }
    local before = helpers.db_dump(e.db.client, e.db.name, opts)
    local raw = inc("A", -5)
    raw.where = { balance = { ["$gte"] = 1e9 } }
    local res, err = e.tm:run({ lying(raw, inc("A", -5)), inc("B", 5) })
    assert.is_nil(res, "the hidden guard was skipped")
    assert.truthy(err.code == "invalid" or err.code == "guard", tostring(err))
    helpers.assert_dump_unchanged(before, e.db.client, e.db.name, opts)
  end)
end)

describe("#server hostile data mid-transaction ends cancelled", function()
  local e, accounts

  before_each(function()
    e = fixture()
    accounts = e.db:collection("accounts")
  end)
  after_each(function() e.db:close() end)

  -- Runs fn (which must end in a cancelled transaction) and checks that
  -- every collection but the transactions holds what it held before
  -- fn, apart from BOOKKEEPING; returns the transaction document.
  local function cancelled_as_before(fn, code, why, skip)
    local opts = { skip = { "transactions", "transactions.probe", skip }, without = BOOKKEEPING }
    local before = helpers.db_dump(e.db.client, e.db.name, opts)
    local t, res, err = fn()
    assert.is_nil(res)
    assert.are.equal(code, err.code, tostring(err))
    helpers.assert_dump_unchanged(before, e.db.client, e.db.name, opts)
    local T = assert(e.tm:get(t._id))
    assert.are.equal("cancelled", T.state)
    assert.truthy(tostring(T.reason):find(why, 1, true), tostring(T.reason))
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions, "a marker is left on " .. d._id)
    end
    return T
  end

  it("a document deleted between begin and commit", function()
    local t = assert(e.tm:begin({ inc("A", -100), inc("B", 100) }))
    assert(accounts:delete_one({ _id = "B" }, {}))
    cancelled_as_before(function() return t, e.tm:commit(t) end, "missing", "does not exist")
    local A = assert(accounts:find_one({ _id = "A" }, {}))
    assert.are.equal(1000, A.balance)
    assert.is_number(A.txVersion) -- applied, then undone
  end)

  it("a document deleted while the transaction is pending, before the op on it", function()
    local t = assert(e.tm:begin({ inc("A", -100), inc("B", 100) }))
    assert(e.tm:step("claim", t))
    assert(accounts:delete_one({ _id = "B" }, {}))
    cancelled_as_before(function()
      assert(e.tm:step("apply", t, 1))
      assert.are.equal(900, assert(accounts:find_one({ _id = "A" }, {})).balance)
      return t, e.tm:commit(t)
    end, "missing", "does not exist")
  end)

  it("a guard that is false", function()
    cancelled_as_before(function()
      local t = assert(e.tm:begin({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -5000 } },
          where = { balance = { ["$gte"] = 5000 } } },
        inc("B", 5000) }))
      return t, e.tm:commit(t)
    end, "guard", "where condition is false")
  end)

  it("a transfer beyond the minimum", function()
    local before = helpers.db_dump(e.db.client, e.db.name,
      { skip = { "transactions", "transactions.probe" }, without = BOOKKEEPING })
    local res, err = e.tm:transfer("accounts", "A", "B", 1001, { min = 0, id = "over" })
    assert.is_nil(res)
    assert.are.equal("guard", err.code, tostring(err))
    helpers.assert_dump_unchanged(before, e.db.client, e.db.name,
      { skip = { "transactions", "transactions.probe" }, without = BOOKKEEPING })
    assert.are.equal("cancelled", assert(e.tm:get("over")).state)
  end)

  it("an insert whose _id is taken", function()
    local T = cancelled_as_before(function()
      local t = assert(e.tm:begin({ inc("A", -10),
        { collection = "orders", id = "o1", doc = { status = "forged" } } }))
      return t, e.tm:commit(t)
    end, "conflict", "another document has its _id")
    assert.are.equal(2, #T.ops)
    assert.are.equal("new", assert(e.db:collection("orders"):find_one({ _id = "o1" }, {})).status)
  end)

  it("an op on a collection that does not exist", function()
    cancelled_as_before(function()
      local t = assert(e.tm:begin({ inc("A", -10), inc("B", 10, "no_such_collection") }))
      return t, e.tm:commit(t)
    end, "missing", "does not exist", "no_such_collection")
    -- mongo-java-server creates a collection for an update that matches
    -- nothing (MongoDB does not): what matters is that it stays empty
    assert.are.equal(0, assert(e.db:collection("no_such_collection"):count({}, {})))
  end)

  it("a remove of a document that does not exist", function()
    cancelled_as_before(function()
      local t = assert(e.tm:begin({ inc("A", -10),
        { collection = "orders", id = "o-missing", kind = "remove" } }))
      return t, e.tm:commit(t)
    end, "missing", "does not exist")
  end)

  it("an assert on a document that does not exist", function()
    cancelled_as_before(function()
      local t = assert(e.tm:begin({ inc("A", -10),
        { collection = "accounts", id = "Z", kind = "assert" } }))
      return t, e.tm:commit(t)
    end, "missing", "does not exist")
  end)
end)

-- Transaction documents recovery cannot drive: written by hand, by an old
-- or broken client, or damaged.  Each is inserted next to a well-formed
-- stale transaction; recovery must report it (report.malformed and an
-- error with code "malformed" naming its id and what is wrong), leave it
-- byte for byte as it was, and still recover the good one.
local function bin(t) return mongotx.Binary(mongotx.encode(t)) end

local function good_op(extra)
  local op = { collection = "accounts", id = "A", kind = "update",
               update = bin({ ["$inc"] = { balance = -1 } }), undo = bin({ ["$inc"] = { balance = 1 } }) }
  for k, v in pairs(extra or {}) do op[k] = v end
  return op
end

local function without(t, k)
  t[k] = nil
  return t
end

local malformed = {
  { "ops is a string", "ops is not a list", { ops = "x" } },
  { "ops is an empty list", "ops is not a list", { ops = mongotx.array() } },
  { "ops is a document", "ops is not a list", { ops = { first = good_op() } } },
  { "ops is raw garbage binary", "ops is not a list", { ops = mongotx.Binary("\1\2\3garbage") } },
  { "an op is a number", "op 1: not a document", { ops = { 7 } } },
  { "an op has no collection", "op 1: needs a collection name",
    { ops = { without(good_op(), "collection") } } },
  { "an op's collection is a number", "op 1: needs a collection name",
    { ops = { good_op{ collection = 7 } } } },
  { "an op's collection has a $", "op 1: bad collection name", { ops = { good_op{ collection = "a$b" } } } },
  { "an op targets the transactions collection", "op 1: may not touch the transactions",
    { ops = { good_op{ collection = "transactions" } } } },
  { "an op has no id", "op 1: needs an id", { ops = { without(good_op(), "id") } } },
  { "an op's id has a dotted key", "op 1: id holds the key", { ops = { good_op{ id = { ["a.b"] = 1 } } } },
    may_refuse = true },
  { "an op has an unknown kind", "op 1: unknown kind upsert", { ops = { good_op{ kind = "upsert" } } } },
  { "an op's kind is not a string", "op 1: unknown kind", { ops = { good_op{ kind = 1 } } } },
  { "an op's update is garbage binary", "op 1: update is not BSON",
    { ops = { good_op{ update = mongotx.Binary("\255\255garbage") } } } },
  { "an op's update is a string", "op 1: update is not a document", { ops = { good_op{ update = "x" } } } },
  { "an op's update has no operators", "op 1: update: balance is not an update operator",
    { ops = { good_op{ update = bin({ balance = 5 }) } } } },
  { "an op's update touches the marker", "may not touch pendingTransactions",
    { ops = { good_op{ update = bin({ ["$unset"] = { pendingTransactions = true } }) } } } },
  { "an update op has no undo", "op 1: undo must be a table", { ops = { without(good_op(), "undo") } } },
  { "an op's where runs $where", "where may not use %$where",
    { ops = { good_op{ where = bin({ ["$where"] = "sleep(1000)" }) } } } },
  { "an insert op has no doc", "op 1: insert without a doc",
    { ops = { { collection = "orders", id = "o9", kind = "insert" } } } },
  { "the second op is broken", "op 2: unknown kind", { ops = { good_op(), good_op{ id = "B", kind = "x" } } } },
  { "the state is a list", "state is not a state name", { state = { "pending" } } },
  { "lastModified is a string", "lastModified is not a date", { lastModified = "yesterday" } },
  { "attempts is a string", "attempts is not a number", { attempts = "many" } },
  { "epoch is a document", "epoch is not a number", { epoch = { n = 1 } } },
}

describe("#server recovery with malformed transaction documents", function()
  local e, txs, rec

  before_each(function()
    e = fixture()
    e.tm = assert(e.db:manager{ application = "app-1", lease = 0 })
    txs = e.db:collection("transactions")
    rec = assert(e.db:manager{ application = "recoverer", stale_after = 0, lease = 0 })
  end)
  after_each(function() e.db:close() end)

  -- A transaction document: a pending one on A by default, `fields`
  -- replacing (false: removing) its fields.
  local function tx_doc(id, fields)
    local d = { _id = id, state = "pending", ops = { good_op() }, epoch = 1, attempts = 0,
                application = "app-1", lease = 0, lastModified = mongotx.Date(0) }
    for k, v in pairs(fields) do
      if v == false then d[k] = nil else d[k] = v end
    end
    return d
  end

  -- The bytes of each named transaction document.
  local function bytes(ids)
    local out = {}
    for _, id in ipairs(ids) do out[id] = mongotx.encode(assert(txs:find_one({ _id = id }, {}))) end
    return out
  end

  local function good()
    local t = assert(e.tm:begin({ inc("A", -100), inc("B", 100) }))
    mongotx.core.sleep(0.01) -- lastModified strictly older than the server's clock
    return t
  end

  for _, case in ipairs(malformed) do
    it(case[1], function()
      local ok, err = txs:insert_one(tx_doc("bad", case[3]), {})
      if not ok and case.may_refuse then
        return pending("this server refuses to store such a document, so cannot hold one: " .. tostring(err))
      end
      assert(ok, err)
      local before = bytes({ "bad" })
      local t = good()
      local r = assert(rec:recover())
      assert.are.equal(1, r.malformed)
      assert.are.equal(1, r.examined)
      assert.are.equal(1, r.done)
      assert.are.equal(0, r.failed + r.parked)
      assert.are.equal(1, #r.errors)
      assert.are.equal("bad", r.errors[1].id)
      assert.are.equal("malformed", r.errors[1].error.code)
      assert.truthy(r.errors[1].error.message:find(case[2]), r.errors[1].error.message)
      assert.are.same(before, bytes({ "bad" }))
      assert.are.equal("done", assert(e.tm:get(t._id)).state)
      assert.are.equal(900, assert(e.db:collection("accounts"):find_one({ _id = "A" }, {})).balance)
      -- and again on the next pass: reported, never written
      r = assert(rec:recover())
      assert.are.equal(1, r.malformed)
      assert.are.same(before, bytes({ "bad" }))
    end)
  end

  it("a state that is not a state name is not active: recovery does not look at it", function()
    assert(txs:insert_one(tx_doc("odd", { state = 5 }), {}))
    local before = bytes({ "odd" })
    local r = assert(rec:recover())
    assert.are.equal(0, r.malformed + r.examined)
    assert.are.same(before, bytes({ "odd" }))
  end)

  -- (spec/54: another writer's documents, such as the tutorial's recipe's)
  it("ops missing is another writer's document: recovery does not look at it", function()
    assert(txs:insert_one(tx_doc("foreign", { ops = false }), {}))
    local before = bytes({ "foreign" })
    local t = good()
    local r = assert(rec:recover())
    assert.are.equal(0, r.malformed)
    assert.are.equal(1, r.examined)
    assert.are.equal(1, r.done)
    assert.are.equal("done", assert(e.tm:get(t._id)).state)
    assert.are.same(before, bytes({ "foreign" }))
    assert.are.equal(1, assert(rec:backlog()).foreign)
  end)

  it("many malformed documents older than a good one do not starve it", function()
    local ids = {}
    for i = 1, 30 do
      ids[i] = "bad-" .. i
      assert(txs:insert_one(tx_doc(ids[i], { ops = "x", lastModified = mongotx.Date(i) }), {}))
    end
    local before = bytes(ids)
    local t = good()
    local r = assert(rec:recover{ limit = 5 })
    assert.are.equal(30, r.malformed)
    assert.are.equal(5, #r.errors, "the report lists at most `limit` of them")
    assert.are.equal(1, r.examined)
    assert.are.equal(1, r.done)
    assert.are.equal("done", assert(e.tm:get(t._id)).state)
    assert.are.same(before, bytes(ids))
  end)

  it("get, find and stats read malformed documents without raising", function()
    assert(txs:insert_one(tx_doc("bad", { ops = { good_op{ update = mongotx.Binary("\255garbage") } } }), {}))
    assert(txs:insert_one(tx_doc("bad2", { ops = mongotx.Binary("\1\2\3") }), {}))
    local before = helpers.db_dump(e.db.client, e.db.name)
    assert.are.equal("bad", assert(e.tm:get("bad"))._id)
    assert.are.equal(2, #assert(e.tm:find({ state = "pending" })))
    assert.are.equal(2, assert(e.tm:stats()).pending)
    helpers.assert_dump_unchanged(before, e.db.client, e.db.name)
  end)
end)

-- Values whose walk could take the process down: a table holding itself
-- under two keys, or a chain of tables each holding the next twice, is
-- small to build but has 2^depth paths; a walk along every path hangs,
-- and an encoder that writes every path before it measures asks libbson
-- for more than 2 GiB and aborts.  A separate process runs them so a
-- hang or an abort fails this spec instead of the suite: each must end
-- in nil, err invalid soon, nothing written.
describe("#server hostile values that must not hang or abort the process", function()
  local WORKER = [[
    package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
    local cpath = os.getenv("MONGOTX_CPATH")
    if cpath then package.cpath = cpath .. ";" .. package.cpath end
    local mongotx = require "mongotx"
    local db = assert(mongotx.connect(arg[1], { database = arg[2] }))
    local tm = assert(db:manager{ application = "app-1" })
    local function shared(depth)   -- 2^depth paths, depth + 1 tables
      local t = { leaf = 1 }
      for _ = 1, depth do local c = t; t = mongotx.doc("a", c, "b", c) end
      return t
    end
    local twice = {}
    twice.a, twice.b = twice, twice
    local cases = {
      { "op id holding itself twice", { { collection = "accounts", id = twice, kind = "assert" } } },
      { "op id of shared tables 40 deep",
        { { collection = "accounts", id = shared(40), kind = "assert" } } },
      { "update value of shared tables 40 deep",
        { { collection = "accounts", id = "A", update = { ["$set"] = { x = shared(40) } },
            undo = { ["$unset"] = { x = "" } } } } },
      { "insert doc of shared tables 40 deep",
        { { collection = "orders", id = "o9", doc = { x = shared(40) } } } },
      { "transaction id holding itself twice", { { collection = "accounts", id = "A", kind = "assert" } },
        { id = twice } },
    }
    for _, c in ipairs(cases) do
      local t, err = tm:begin(c[2], c[3])
      print(c[1] .. ": " .. (t and "begun" or tostring(err and err.code)))
      io.stdout:flush()
    end
    print("exit")
  ]]

  it("ids, updates and docs of tables shared along 2^40 paths, or holding themselves twice", function()
    local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
    assert(db:manager{ application = "app-1" }) -- its collection and indexes made here
    assert(db:collection("accounts"):insert_one({ _id = "A", balance = 1 }, {}))
    local before = helpers.db_dump(db.client, db.name)
    local pid, out, script = helpers.spawn_script(WORKER, helpers.uri(), db.name)
    local ended = helpers.wait_exit(pid, 60)
    if not ended then helpers.signal(pid, "KILL") end
    local output = helpers.read_file(out)
    os.remove(out)
    os.remove(script)
    assert.is_true(ended, "the process still walks after 60 s:\n" .. output)
    for _, name in ipairs { "op id holding itself twice", "op id of shared tables 40 deep",
                            "update value of shared tables 40 deep",
                            "insert doc of shared tables 40 deep",
                            "transaction id holding itself twice" } do
      assert.matches(name:gsub("%p", "%%%0") .. ": invalid\n", output)
    end
    assert.matches("\nexit\n", output)
    helpers.assert_dump_unchanged(before, db.client, db.name)
    db:close()
  end)
end)

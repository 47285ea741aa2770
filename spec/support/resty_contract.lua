-- The README's error rule through mongotx.resty (issue 20), run inside
-- nginx by a handler of spec/40: the rows of spec/31's table for the
-- calls mongotx.resty has, each argument with values of a wrong Lua type
-- (the call must raise, in the handler) and bad values of the right type
-- (it must return nil and an `invalid` error), as require "mongotx"
-- answers them.  spec/40 compares the database before and after: none of
-- them may write.
local core = require "mongotx.core"
local resty = require "mongotx.resty"

local NAN, INF = 0 / 0, math.huge
local D = core.Decimal128

local M = {}

local function op(update)
  return { { collection = "accounts", id = "A", update = update,
             undo = { ["$set"] = { balance = 1000 } } } }
end
local good_ops = op { ["$inc"] = { balance = 1 } }
local evil_id = { ["$gt"] = "" }
local function first(results, errs) return results[1] or nil, errs[1] end

-- e: { uri, database, db (a resty database), tm (its manager) }; the
-- database holds accounts A and B and an initial transaction "r1".
M.rows = {
  { "resty.connect uri", function(e, v) return resty.connect(v, { database = e.database }) end,
    wrong = { 1, {} }, bad = { "", "http://x", "mongodb://u:p:q@127.0.0.1" } },
  { "resty.connect opts", function(e, v) return resty.connect(e.uri, v) end,
    wrong = { "o", { bogus = 1 }, { database = 1 }, { thread_pool = 1 }, { wait = "1" },
              { offload = "no" }, { write_concern = "majority" } },
    bad = { { database = "" }, { database = "a/b" }, { database = "a\255" },
            { appname = ("x"):rep(129) }, { write_concern = { w = -1 } },
            { read_preference = "primaryish" }, { wait = -1 }, { wait = NAN } } },
  { "resty db:manager opts", function(e, v) return e.db:manager(v) end,
    wrong = { "o", { lease = "1" }, { bogus = 1 }, { group = "yes" }, { policies = 1 },
              { may_recover = print } },
    bad = { { lease = -1 }, { lease = NAN }, { collection = "a$b" }, { application = "a\255" },
            { marker = "$m" }, { write_concern = { w = 0 } } } },
  { "resty tm:begin ops", function(e, v) return e.tm:begin(v) end,
    wrong = { "ops", 1, print }, bad = { {}, { 1 }, op { ["$set"] = { s = "\255" } },
                                         op { ["$inc"] = { balance = D("NaN") } } } },
  { "resty tm:begin id", function(e, v) return e.tm:begin(good_ops, { id = v }) end,
    wrong = {}, bad = { evil_id, NAN, "t\255" } },
  { "resty tm:begin meta", function(e, v) return e.tm:begin(good_ops, { meta = v }) end,
    wrong = { "m", 1 }, bad = { { ["$x"] = 1 }, { x = D("Infinity") }, { s = "\255" }, { f = print } } },
  { "resty tm:run ops", function(e, v) return e.tm:run(v) end,
    wrong = { "ops" }, bad = { {}, op { ["$set"] = { s = "\255" } } } },
  { "resty tm:transfer collection", function(e, v) return e.tm:transfer(v, "A", "B", 1) end,
    wrong = { print }, bad = { "", "a$b", "x\255", "transactions" } },
  { "resty tm:transfer from", function(e, v) return e.tm:transfer("accounts", v, "B", 1) end,
    wrong = { print }, bad = { evil_id, NAN, "A\255" } },
  { "resty tm:transfer amount", function(e, v) return e.tm:transfer("accounts", "A", "B", v) end,
    wrong = { "1", D("1") }, bad = { 0, -1, NAN, INF, 2 ^ 60 } },
  { "resty tm:transfer field", function(e, v)
      return e.tm:transfer("accounts", "A", "B", 1, { field = v })
    end, wrong = { 1 }, bad = { "", "$x", "a..b", "b\255", "pendingTransactions" } },
  { "resty tm:transfer min", function(e, v)
      return e.tm:transfer("accounts", "A", "B", 1, { min = v })
    end, wrong = { "0", D("0") }, bad = { NAN, INF, 2 ^ 60 } },
  { "resty tm:commit_many item", function(e, v) return first(e.tm:commit_many({ v })) end,
    wrong = {}, bad = { {}, op { ["$set"] = { s = "\255" } }, { ops = good_ops, meta = { s = "\255" } } } },
  { "resty tm:commit_many list", function(e, v) return e.tm:commit_many(v) end,
    wrong = { "list", 1, print }, bad = {} },
  { "resty tm:transfer_many item", function(e, v) return first(e.tm:transfer_many({ v })) end,
    wrong = {}, bad = { { collection = "accounts", from = "A", to = "B", amount = NAN },
                        { collection = "accounts", from = "A", to = "B", amount = 1, field = "b\255" },
                        { collection = "x\255", from = "A", to = "B", amount = 1 } } },
  { "resty tm:get id", function(e, v) return e.tm:get(v) end,
    wrong = { print }, bad = { evil_id, NAN } },
  { "resty tm:commit t", function(e, v) return e.tm:commit(v) end,
    wrong = { "t", 1 }, bad = { { _id = evil_id } } },
  { "resty tm:rollback t", function(e, v) return e.tm:rollback(v) end,
    wrong = { "t" }, bad = { { _id = evil_id } } },
  { "resty tm:rollback reason", function(e, v) return e.tm:rollback({ _id = "r1" }, v) end,
    wrong = { 1, {}, print }, bad = { "why \255" } },
  { "resty tm:compensate t", function(e, v) return e.tm:compensate(v) end,
    wrong = { "t" }, bad = { { _id = evil_id } } },
  { "resty tm:recover opts", function(e, v) return e.tm:recover(v) end,
    wrong = { "o", { limit = "1" }, { bogus = 1 } },
    bad = { { limit = 0 }, { limit = 1.5 }, { limit = NAN }, { batch = 0 }, { batch = 1e9 } } },
  { "resty tm:prune opts", function(e, v) return e.tm:prune(v) end,
    wrong = { "o", { older_than = "1" } }, bad = { { older_than = -1 }, { older_than = NAN }, { limit = 0 } } },
  { "resty tm:find filter", function(e, v) return e.tm:find(v) end,
    wrong = { "f", 1 }, bad = { { state = { ["$bogus"] = 1 } }, { ["$where"] = "true" }, { x = print } } },
  { "resty tm:find opts", function(e, v) return e.tm:find({}, v) end,
    wrong = { "o", { bogus = 1 }, { limit = "1" } },
    bad = { { limit = -1 }, { limit = NAN }, { limit = 1.5 }, { skip = -1 }, { batch_size = -1 },
            { limit = 100001 } } },
  { "resty db:find opts", function(e, v) return e.db:find("accounts", {}, v) end,
    wrong = { "o", { bogus = 1 } }, bad = { { limit = 0 }, { limit = 100001 } } },
  { "resty db:find collection", function(e, v) return e.db:find(v, {}) end,
    wrong = { 1, print }, bad = { "", "a$b", "x\255", "system.x" } },
  { "resty db:find filter", function(e, v) return e.db:find("accounts", v) end,
    wrong = { "f", 1 }, bad = { { balance = { ["$bogus"] = 1 } }, { ["$where"] = "true" } } },
  { "resty db:find opts", function(e, v) return e.db:find("accounts", {}, v) end,
    wrong = { "o", { bogus = 1 }, { limit = "1" } }, bad = { { limit = -1 }, { limit = NAN }, { skip = -1 } } },
  { "resty db:count collection", function(e, v) return e.db:count(v, {}) end,
    wrong = { 1 }, bad = { "", "a$b", "x\255" } },
  { "resty db:count filter", function(e, v) return e.db:count("accounts", v) end,
    wrong = { "f", 1 }, bad = { { balance = { ["$bogus"] = 1 } }, { ["$where"] = "true" } } },
}

-- Runs every row; returns the number of cases and a list of what broke
-- the rule (one line each).
function M.run(e)
  local n, broke = 0, {}
  local function say(row, kind, k, what)
    broke[#broke + 1] = string.format("%s: %s %d: %s", row[1], kind, k, what)
  end
  for _, row in ipairs(M.rows) do
    for k, v in ipairs(row.wrong) do
      n = n + 1
      local ok, res, err = pcall(row[2], e, v)
      if ok then say(row, "wrong type", k, "no raise: " .. tostring(res) .. ", " .. tostring(err)) end
    end
    for k, v in ipairs(row.bad) do
      n = n + 1
      local ok, res, err = pcall(row[2], e, v)
      if not ok then
        say(row, "bad value", k, "raised: " .. tostring(res))
      elseif res ~= nil or type(err) ~= "table" or err.code ~= "invalid" then
        say(row, "bad value", k, "answered " .. tostring(res) .. ", " .. tostring(err))
      end
    end
  end
  return n, broke
end

return M

-- mongotx.manager.checks: what the manager's calls check before they run,
-- as functions taking the manager: the batch spec of begin, check, run,
-- and commit_many (spec), of a transfer (transfer_spec), the whole
-- check of tm:run and tm:transfer (run_call, transfer_call) and of
-- tm:commit's transaction (tx_ref), which mongotx.group runs for each
-- call it groups, and the items of a batch
-- call (batch_specs).  Wrong argument types raise at `level`, or at
-- HELPER_CALLER, counted as in mongotx.manager.

local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local options = require "mongotx.options"
local engine = require "mongotx.engine"

local key = engine.key
local type = type
local format = string.format

local _M = {}

-- mongotx.manager's level for a helper of a public method.
local HELPER_CALLER = 3

local begin_options = { id = true, meta = true }

-- Checks what begin and run take: a batch spec { ops, stored, id, meta,
-- extra } (batch.lua), or nil, err.  Wrong argument types raise at
-- `level`.  `built`: ops made by mongotx from checked scalars
-- (validate.ops), and opts { id, meta } taken from options checked
-- already (transfer_spec's callers check them).
function _M.spec(self, ops, opts, extra, what, level, built)
  local err
  if not built then
    opts, err = validate.options(opts, begin_options, what, level + 1)
    if not opts then return nil, err end
  end
  local norm, stored_form = validate.ops(ops, self.engine.vctx, built)
  if not norm then return nil, stored_form end
  if opts.meta ~= nil then
    local ok
    ok, err = options.meta(opts.meta, stored_form, what)
    if not ok then return nil, err end
  end
  local id = opts.id
  if id ~= nil then
    local why
    id, why = validate.check_tid(id)
    if id == nil then return nil, why end
  end
  return { ops = norm, stored = stored_form, id = id, meta = opts.meta, extra = extra }
end

-- What tm:run checks before it runs (as transfer_call).
function _M.run_call(self, ops, opts, extra, level)
  local spec, err = _M.spec(self, ops, opts, extra, "run", level + 1)
  return spec, err
end

local transfer_options = { field = true, min = true, id = true, meta = true }
_M.transfer_options = transfer_options

-- The spec of a transfer (raises at `level` for wrong argument types).
function _M.transfer_spec(self, collection, from, to, amount, opts, level)
  local ok, err = validate.amount(amount)
  if not ok then return nil, err end
  local field = opts.field or "balance"
  if type(field) ~= "string" then error("field must be a string", level + 1) end
  local where
  if opts.min ~= nil then
    -- any finite floor (an overdraft limit may be negative), and a bound
    -- min + amount that is still exact
    ok, err = validate.bound(opts.min, "min")
    if ok then ok, err = validate.bound(opts.min + amount, "min + amount") end
    if not ok then return nil, err end
    where = { [field] = { ["$gte"] = opts.min + amount } }
  end
  return _M.spec(self, {
    { collection = collection, id = from, update = { ["$inc"] = { [field] = -amount } },
      where = where },
    { collection = collection, id = to, update = { ["$inc"] = { [field] = amount } } },
  }, { id = opts.id, meta = opts.meta }, { source = from, destination = to, value = amount },
    "transfer", level + 1, true)
end

-- What tm:transfer checks before it runs: the spec, or nil, err (raises
-- at `level` for wrong argument types).  mongotx.group checks each
-- grouped call with it.
function _M.transfer_call(self, collection, from, to, amount, opts, level)
  local spec, err
  opts, err = validate.options(opts, transfer_options, "transfer", level + 1)
  if not opts then return nil, err end
  spec, err = _M.transfer_spec(self, collection, from, to, amount, opts, level + 1)
  return spec, err
end

-- What tm:commit (and tm:step) checks of its transaction `t` before it
-- reads: a table with an _id that may go into a query (validate.check_tid:
-- {$gt = ""} must not find another one).  Returns the id as sent, or
-- nil, err (`invalid`); raises at `level` for a wrong Lua type.
-- mongotx.group checks each grouped commit with it.
function _M.tx_ref(t, step, level)
  if type(t) ~= "table" or t._id == nil then
    error("expected a transaction (a table with _id)", level + 1)
  end
  local kind = type(t._id)
  if kind == "function" or kind == "thread" then
    error(format("%s needs a transaction id, not a %s", step, kind), level + 1)
  end
  local sent, err = validate.check_tid(t._id)
  if sent == nil then return nil, errors.wrap(err, step, nil) end
  return sent
end

-- A batch of specs checked one by one: a bad one gets its error and is
-- left out, nothing written for it; so does a repeated id.
function _M.batch_specs(list, what, check)
  if type(list) ~= "table" then error(what .. " takes a list", HELPER_CALLER) end
  local specs, errs, seen = {}, {}, {}
  for i = 1, #list do
    if type(list[i]) ~= "table" then
      error(format("%s: item %d is not a table", what, i), HELPER_CALLER)
    end
    local spec, err = check(list[i], i)
    if spec and spec.id ~= nil then
      local k = key(spec.id)
      if seen[k] then
        spec, err = nil, errors.new("invalid", format("item %d repeats the id of item %d", i,
          seen[k]), { step = what, id = spec.id })
      end
      seen[k] = seen[k] or i
    end
    specs[i], errs[i] = spec or false, err or false
  end
  return specs, errs
end

return _M

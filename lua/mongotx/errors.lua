-- Error values of the Lua layer: tables with code, message, step and the
-- transaction id, sharing the C core's metatable (so tostring works the
-- same for both).  Every code is a string. Codes:
--   invalid      bad input, rejected before anything was written
--   missing      an op's document does not exist
--   guard        an op's `where` condition is false (mongotx.ledger: a change
--                would take an account below `min`)
--   conflict     an insert's _id is taken by another document
--   cancelled    the transaction ended cancelled (why as a code in .cause, the
--                one stored on it: docs/errors.md; in words in .reason)
--   owned        another application holds the transaction and its lease
--   in_progress  another call holds the transaction and did not finish it
--                within policy.holder_wait seconds (Engine:await)
--   idempotency  an id was reused with different ops
--   state        the transaction is not in a state that allows the call
--   malformed    recovery found a transaction document it cannot read (left as it is)
--   fenced       another owner took the transaction (or a queue's job) over while
--                this one worked on it
--   removing, contention, busy, refused  op failures (see policy.on_op_failure);
--                contention also when mongotx.ledger kept finding its seqIds taken
--   mismatch     mongotx.ledger's committer found a cached balance its entries contradict
--   unsupported  mongotx.ledger: the server does not enforce the unique index on
--                the entries' (account, seqId) pairs (FerretDB v1); nothing was posted
--   policy       a policy function raised (in a recover report; errors.guard_policy
--                tells it from other raises) or returned what it may not
--                (queue:fail's backoff)
--   propagation  mongotx.sync: the caller's propagate failed (the change
--                is made and stays flagged for repair)
--   plus the C core's codes, libmongoc's domain names (server, stream,
--   write_concern, ...), for database failures, with the server's number
--   in server_code (csrc/error.c)

local core = require "mongotx.core"

local _M = {}

function _M.new(code, message, fields)
  local err = { code = code, message = message }
  for k, v in pairs(fields or {}) do err[k] = v end
  return core.error(err)
end

-- A transaction that was there a read ago is not: `state` (of `step`).
function _M.disappeared(id, step)
  return _M.new("state", "the transaction disappeared", { id = id, step = step })
end

-- The raise of a policy function, told apart from any other (an
-- interrupt, out of memory, a bug of mongotx): recovery counts the first
-- as a failure of the transaction it drove, and lets the others through,
-- recording nothing (mongotx.recovery).  guard_policy(name, fn) is fn with
-- its raises turned into a "policy" error (raised); an interrupt of Lua's
-- standalone interpreter and a memory error are raised on as they came.
-- Is v, what a pcall caught, an interrupt of Lua's standalone interpreter
-- (its SIGINT hook raises "interrupted!" wherever the code is) or a memory
-- error?  Neither is a failure of the code it stopped.
function _M.is_interrupt(v)
  return v == "not enough memory" or (type(v) == "string" and v:find("interrupted!$") ~= nil)
end

local function raised_by(name, ok, ...)
  if ok then return ... end
  local raised = ...
  if _M.is_interrupt(raised) then error(raised, 0) end
  error(_M.new("policy", string.format("policy %s raised: %s", name, tostring(raised)),
    { policy = name }), 0)
end

function _M.guard_policy(name, fn)
  return function(...) return raised_by(name, pcall(fn, ...)) end
end

-- Is v (what a pcall caught) a policy's raise (guard_policy)?
function _M.is_policy(v)
  return type(v) == "table" and v.code == "policy" and v.policy ~= nil
end

-- Is err (a step's error) the server's refusal of that one write (a
-- write error: a type its update cannot apply to, a path it cannot
-- create, a document grown too large)?  A definite answer for the op, as
-- a false guard is; not a network error, a retryable one, nor a command
-- refused as a whole.
function _M.refused(err)
  local reply = err.reply
  local writes = err.code == "server" and not err.transient and type(reply) == "table"
    and reply.writeErrors
  return writes ~= nil and writes ~= false and writes[1] ~= nil
end

-- Adds the step and transaction id to an error from the C core.
function _M.wrap(err, step, id)
  err.step = err.step or step
  if err.id == nil then err.id = id end
  return err
end

return _M

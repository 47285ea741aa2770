-- The `mongotx` command (bin/mongotx; docs/operating.md):
-- argument parsing (Debian's lua-argparse), the connection, and exit
-- codes.  The subcommands are in mongotx.cli.commands; what they print in
-- mongotx.cli.output, the progress bar in mongotx.cli.progress, ids on the
-- command line in mongotx.cli.args and --policy files in
-- mongotx.cli.policy.
--
-- Exit codes: 0 ok, 1 something failed at run time (named on stderr),
-- 130 and 143 stopped by SIGINT and SIGTERM (recover and prune between
-- two passes, each pass whole; see mongotx.cli.commands),
-- 2 bad usage (unknown command or flag, a malformed id or value, a bad
-- policy file, no URI or a malformed one).  Everything a command takes
-- is checked before it connects, so bad usage writes nothing.

--- The operator's command, `mongotx` (docs/operating.md).
-- @module mongotx.cli

local argparse = require "argparse"
local mongotx = require "mongotx"
local core = require "mongotx.core"
local catalog = require "mongotx.catalog"
local options = require "mongotx.options"
local args = require "mongotx.cli.args"
local policy_file = require "mongotx.cli.policy"
local commands = require "mongotx.cli.commands"
local output = require "mongotx.cli.output"
local backlog_file = require "mongotx.metrics.backlog"
local metrics = require "mongotx.metrics"

local format = string.format
local unpack = table.unpack or unpack -- luacheck: ignore 143 (LuaJIT)
local tointeger = math.tointeger or function(n) -- LuaJIT: exact to 2^53
  if n == math.floor(n) and n > -2 ^ 53 and n < 2 ^ 53 then return n end
end

local _M = {}

local OK, FAILED, USAGE = 0, 1, 2
_M.OK, _M.FAILED, _M.USAGE = OK, FAILED, USAGE

-- How long a server that does not answer is waited for, unless the URI
-- says otherwise: the command fails in seconds instead of libmongoc's 30.
local TIMEOUT_MS = 5000
-- How long one reply is waited for, unless the URI says otherwise: a
-- server that stops answering mid-command (stopped, or a network that
-- drops packets) fails the command in a minute instead of libmongoc's
-- five, so that a recovery worker says so (and its last pass's time
-- stops moving).  A minute leaves room for status's aggregation over a
-- large collection.
local SOCKET_TIMEOUT_MS = 60000

local STATES = { "initial", "pending", "applied", "done", "canceling", "cancelled" }

-- Converters for argparse: a value, or nil and what it must be.
local function seconds(s)
  local n = tonumber(s)
  if not n or n ~= n or n < 0 or n > options.MAX_SECONDS then
    return nil, format("%q is not a number of seconds from 0 to %d", s, options.MAX_SECONDS)
  end
  return n
end

local function count(s)
  local n = tonumber(s) and tointeger(tonumber(s))
  if not n or n < 1 or n > 2147483647 then
    return nil, format("%q is not a whole number from 1 to 2147483647", s)
  end
  return n
end

local function parser()
  local p = argparse("mongotx", "Look at and steer mongotx transactions.")
    :epilog("Ids: a number, oid:<24 hex digits>, long:<digits>, str:<text> or other text;\n" ..
            "a negative number after --, as in: mongotx rollback -- -7.\n" ..
            "Exit codes: 0 ok, 1 something failed, 2 bad usage, 130/143 stopped by SIGINT/SIGTERM.")
    :command_target("command")
  p:option("--uri", "Server to connect to (default: $MONGOTX_URI).")
  p:option("--database", "Database (default: the URI's, else test).")
  p:option("--collection", "Transactions collection.", "transactions")
  p:option("--policy", "Lua file returning a table of policy overrides."):argname("<file>")
  p:flag("--json", "Print JSON lines instead of tables.")

  local status = p:command("status", "Counts by state, parked, stale, the oldest open one.")
  status:option("--stale-after", "Seconds after which a transaction counts as stale.")
    :argname("<sec>"):convert(seconds)
  status:flag("--prometheus", "Print the backlog as Prometheus gauges (textfile collector).")

  local list = p:command("list", "List transactions, oldest change first.")
  list:option("--state", "Only in this state."):choices(STATES):argname("<state>")
  list:option("--older-than", "Only last changed more than <sec> seconds ago.")
    :argname("<sec>"):convert(seconds)
  list:flag("--parked", "Only parked ones.")
  list:flag("--holds", "Only holds (tm:hold), their status beside the state.")
  list:option("--limit", "At most <n> transactions.", "50"):argname("<n>"):convert(count)

  p:command("show", "A transaction, its ops and its documents' markers and versions.")
    :argument("id", "Transaction id.")

  local recover = p:command("recover", "Drive stale transactions to done or cancelled.")
  recover:option("--limit", "Look at <n> transactions at most."):argname("<n>"):convert(count)
  recover:option("--loop", "Sweep again every <sec> seconds, until stopped; " ..
    "a sweep that did nothing prints nothing.")
    :argname("<sec>"):convert(seconds)
  recover:option("--stale-after", "Seconds after which this application's own " ..
    "transactions count as stale."):argname("<sec>"):convert(seconds)
  recover:option("--application", "Recover as this application.", "mongotx-cli")
    :argname("<name>")
  recover:option("--batch", "Transactions per recovery pass.", "200"):argname("<n>"):convert(count)
  recover:option("--metrics-file", "After every sweep, write the backlog gauges of " ..
    "status --prometheus and this worker's counters (mongotx.metrics) to <path> (atomically).")
    :argname("<path>")

  local rollback = p:command("rollback", "Cancel a transaction that has not committed.")
  rollback:argument("id", "Transaction id.")
  rollback:option("--reason", "Reason stored on it.", "rolled back by mongotx rollback")
    :argname("<text>")

  local compensate = p:command("compensate",
    "Undo a committed transaction with a compensating one (refused below a floor: run it again later).")
  compensate:argument("id", "Transaction id.")
  compensate:flag("--no-floors", "Debit even below the floors the transaction's debits had.")
  p:command("unpark", "Let recovery take a parked transaction up again.")
    :argument("id", "Transaction id.")

  local prune = p:command("prune", "Delete finished transactions past the retention.")
  prune:option("--older-than", "Seconds (default: the retention policy).")
    :argname("<sec>"):convert(seconds)
  prune:option("--batch", "Transactions deleted per step.", "1000"):argname("<n>"):convert(count)
  prune:flag("--dry-run", "Only count what would be deleted.")
  return p
end

-- Prints "mongotx: <message>" on stderr, one line (an error's tostring
-- already starts so; its id is written as the command line takes it) and
-- returns the exit code.  Input the library refuses (`invalid`: nothing
-- was written) is bad usage, whenever it is found.
local function fail(code, message)
  if code == FAILED and type(message) == "table" and message.code == "invalid" then code = USAGE end
  io.stderr:write("mongotx: ", output.visible(output.reason(message),
    code ~= USAGE), "\n")
  return code
end

-- Is this standard stream open?  A closed one's descriptor would be taken
-- by the connection's socket, and what the command prints would go to
-- the server.
local function is_open(file)
  local _, _, errno = file:seek("cur")
  return errno ~= 9 -- EBADF; a pipe or a terminal says ESPIPE
end

-- The URI with a password hidden, for messages.
local function shown(uri)
  return (uri:gsub("^(mongodb[^:]*://[^:@/]*:)[^@/]*@", "%1***@"))
end

-- The URI with the timeouts this command wants, unless it sets them.
local function with_timeouts(uri)
  for _, t in ipairs { { "serverSelectionTimeoutMS", TIMEOUT_MS },
                       { "connectTimeoutMS", TIMEOUT_MS }, { "socketTimeoutMS", SOCKET_TIMEOUT_MS } } do
    local name, ms = t[1], t[2]
    if not uri:lower():find("[?&]" .. name:lower() .. "=") then
      local sep = "&"
      if not uri:find("?", 1, true) then
        sep = uri:find("^mongodb[^:]*://[^/]*/") and "?" or "/?"
      end
      uri = uri .. sep .. name .. "=" .. ms
    end
  end
  return uri
end

-- Connects and checks that the transactions collection is there (a
-- mistyped database or collection is an error, not an empty answer, and
-- nothing is created for it); returns the database handle, or nil, code.
local function connect(o)
  local db, err = mongotx.connect(with_timeouts(o.uri), { database = o.database })
  if not db then
    -- libmongoc refuses a malformed URI with MONGOC_ERROR_COMMAND_INVALID_ARG
    -- (22; mongotx.connect says `invalid`): bad usage, like a bad --database
    if err.code == "invalid" and err.server_code == 22 then
      local message, password = err.message, o.uri:match("^mongodb[^:]*://[^:@/]*:([^@/]*)@")
      if password and password ~= "" then -- libmongoc's message may quote it
        local at = message:find(password, 1, true)
        while at do
          message = message:sub(1, at - 1) .. "***" .. message:sub(at + #password)
          at = message:find(password, at + 3, true)
        end
      end
      return nil, fail(USAGE, format("bad URI %s: %s", shown(o.uri), message))
    end
    return nil, fail(err.code == "invalid" and USAGE or FAILED, err.message or tostring(err))
  end
  local exists
  exists, err = catalog.has_collection(db.client, db.name, o.collection)
  if exists == nil then
    db:close()
    return nil, fail(FAILED, format("cannot reach %s: %s", shown(o.uri), err.message or
      tostring(err)))
  end
  if not exists then
    db:close()
    return nil, fail(FAILED, format("database %s has no collection %s (wrong --database or " ..
      "--collection?); nothing was created", db.name, o.collection))
  end
  return db
end

-- Runs the command line `argv` (a list of strings); returns the exit code.

--- The `mongotx` command: `bin/mongotx` calls this (docs/operating.md).
-- Commands: status, list, show, recover, rollback, compensate, unpark, prune;
-- `mongotx --help` and `mongotx <command> --help` list their options. `status --prometheus` prints the backlog
-- as Prometheus gauges; `recover --metrics-file PATH` writes them and its own counters after every sweep
-- (docs/metrics.md).
-- SIGINT and SIGTERM stop `recover` and `prune` after the pass in hand (exit 130, 143).
-- @syntax code = cli.main(argv); from a shell:
--   mongotx [--uri URI] [--database DB] [--collection C] [--policy FILE.lua] [--json] COMMAND ...
-- @tparam table argv the arguments (`arg`)
-- @treturn integer the exit code: 0 ok, 1 something failed at run time, 2 bad usage, 130/143 stopped by SIGINT/SIGTERM
-- @errors a message on stderr, and the exit code
-- @usage -- shell: MONGOTX_URI=mongodb://db1:27017 mongotx --database bank recover --loop 10
-- os.exit(require("mongotx.cli").main({ "--database", "bank", "status" }))
function _M.main(argv)
  if not is_open(io.stderr) then return FAILED end
  if not is_open(io.stdout) then
    return fail(FAILED, "cannot write the output: standard output is closed")
  end
  local p = parser()
  -- usage errors are raised to here instead of exiting inside argparse
  p.error = function(cmd, message) error({ usage = cmd:get_usage(), message = message }, 0) end
  local ok, o = pcall(p.parse, p, { unpack(argv or {}) })
  if not ok then
    if type(o) ~= "table" then error(o, 0) end
    io.stderr:write(o.usage, "\n\n")
    return fail(USAGE, (o.message:gsub("\n+", "; "))) -- argparse's hint on a line of its own
  end
  o.uri = o.uri or os.getenv("MONGOTX_URI")
  if not o.uri or o.uri == "" then
    return fail(USAGE, "no server: give --uri or set MONGOTX_URI")
  end
  if o.id then
    local id, why = args.id(o.id)
    if id == nil then return fail(USAGE, why) end
    o.id = id
  end
  local checked, bad = options.check({ collection = o.collection }, { collection = true },
    "mongotx", 1)
  if not checked then return fail(USAGE, (bad.message:gsub("option (%w+) of mongotx", "--%1"))) end
  local overrides = {}
  if o.policy then
    local why
    overrides, why = policy_file.load(o.policy)
    if not overrides then return fail(USAGE, why) end
  end
  if o.prometheus and o.json then return fail(USAGE, "--json and --prometheus: choose one") end
  if o.metrics_file then
    local writable, why = backlog_file.check(o.metrics_file)
    if not writable then return fail(USAGE, "--metrics-file: cannot write " .. why) end
  end
  if o.stale_after then overrides.stale_after = o.stale_after end
  overrides.collection, overrides.application = o.collection, o.application or "mongotx-cli"
  -- SIGINT and SIGTERM are noted from here on (core.catch_signals): recover
  -- and prune stop at their next pass, the others end what they do
  core.catch_signals()
  local db, code = connect(o)
  if not db then return code end
  o.database_name = db.name -- the gauges' label
  if o.metrics_file then
    -- the worker's own counters, for the life of the process, beside the
    -- backlog in the same file (a --policy file's on_event still runs)
    o.metrics = metrics.new { client = db.client }
    overrides = o.metrics:wrap(overrides)
  end
  local tm, err = db:manager(overrides)
  if not tm then
    db:close()
    return fail(FAILED, err)
  end
  local signal, number = core.signal_caught()
  if signal then
    db:close()
    return fail(128 + number, format("%s stopped by %s before it began: nothing was done",
      o.command, signal))
  end
  -- a raise (a policy's, say) is a failure named like the others
  ok, code = policy_file.pcall_no_exit(commands[o.command], tm, o, fail)
  db:close()
  if not ok then code = fail(FAILED, format("%s raised an error: %s", o.command, tostring(code))) end
  signal, number = core.signal_caught()
  if signal and not o.stopped then -- it came too late to stop anything: said so
    code = fail(128 + number, format("%s came while %s ran, which ended first (exit code %d)",
      signal, o.command, code))
  end
  err = output.stdout:flush().err
  if err and code == OK then
    return fail(FAILED, "cannot write the output: " .. tostring(err))
  end
  return code
end

return _M

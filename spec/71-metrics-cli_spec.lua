-- The backlog gauges of the `mongotx` command (README, "Metrics"):
-- `status --prometheus` and `recover --metrics-file PATH` (with the
-- worker's own counters, mongotx.metrics), read back with
-- Python's prometheus_client parser (spec/support/prometheus.lua) and
-- compared with what the database holds.  The file is replaced
-- atomically: a reader never sees half of one.  A path that cannot be
-- written is refused before the command connects.
local helpers = require "spec.helpers"
local server = require "spec.support.server"
local prom = require "spec.support.prometheus"
local mongotx = require "mongotx"

local q = server.quote
local CORE = "build/lua54/mongotx/core.so"
local no_build = not server.exists(CORE) and
  "bin/mongotx runs under Lua 5.4 and needs " .. CORE .. " (make)" or nil

local function command(args)
  local words = { "--uri", q(helpers.uri()) }
  for _, a in ipairs(args) do words[#words + 1] = q(a) end
  return string.format("env -u MONGOTX_URI MONGOTX_CPATH=%s lua5.4 bin/mongotx %s",
    q(os.getenv("PWD") .. "/build/lua54/?.so"), table.concat(words, " "))
end

local function run(args)
  local out, err = os.tmpname(), os.tmpname()
  local code = server.execute(command(args) .. " >" .. out .. " 2>" .. err)
  local o, e = helpers.read_file(out), helpers.read_file(err)
  os.remove(out)
  os.remove(err)
  return code, o, e
end

describe("#server mongotx status --prometheus and recover --metrics-file", function()
  local db, dbname, tm, txs, dir

  before_each(function()
    if no_build then return end
    dbname = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = dbname }))
    tm = assert(db:manager { application = "app", lease = 1, stale_after = 1 })
    txs = db:collection("transactions")
    assert(db:collection("accounts"):insert_many {
      { _id = "A", balance = 1000, pendingTransactions = mongotx.array() },
    })
    dir = server.capture("mktemp -d"):gsub("%s+$", "")
  end)

  after_each(function()
    if no_build then return end
    db:close()
    os.execute("rm -rf " .. q(dir))
  end)

  local function check_build()
    if no_build then pending(no_build) return false end
    return true
  end

  local ops = { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } } }

  -- two initial, one pending (claimed) and parked, all left a while
  local function backlog()
    assert(tm:begin(ops))
    assert(tm:begin(ops))
    local t = assert(tm:begin(ops))
    assert(tm:step("claim", t))
    assert(txs:update_one({ _id = t._id }, { ["$set"] = { parked = true } }))
    mongotx.core.sleep(1.2) -- past stale_after
  end

  local function labels(extra)
    local l = { database = dbname, collection = "transactions" }
    for k, v in pairs(extra or {}) do l[k] = v end
    return l
  end

  it("status --prometheus prints the backlog as the database holds it", function()
    if not check_build() then return end
    backlog()
    local code, out, err = run { "--database", dbname, "status", "--prometheus",
                                 "--stale-after", "1" }
    assert.are.equal(0, code, err)
    local families = assert(prom.parse(out))
    local function v(name, extra) return prom.value(families, name, labels(extra)) end
    assert.are.equal(2, v("mongotx_open_transactions", { state = "initial" }))
    assert.are.equal(1, v("mongotx_open_transactions", { state = "pending" }))
    assert.are.equal(0, v("mongotx_open_transactions", { state = "applied" }))
    assert.are.equal(assert(txs:count { parked = true }), v("mongotx_parked_transactions"))
    assert.are.equal(2, v("mongotx_active_transactions"))
    assert.are.equal(2, v("mongotx_stale_transactions"))
    assert.are.equal(1, v("mongotx_stale_after_seconds"))
    local oldest = v("mongotx_oldest_open_seconds")
    assert.truthy(oldest >= 1 and oldest < 60, tostring(oldest))
    for _, fam in ipairs(families) do assert.are.equal("gauge", fam.type) end
  end)

  it("recover --loop --metrics-file rewrites the file after every sweep, atomically", function()
    if not check_build() then return end
    backlog()
    local path = dir .. "/mongotx.prom"
    local out = os.tmpname()
    local p = assert(io.popen(command { "--database", dbname, "recover", "--loop", "0",
      "--stale-after", "1", "--application", "app", "--metrics-file", path } ..
      " >" .. out .. " 2>&1 & echo $!"))
    local pid = tonumber(p:read("*l"))
    p:close()
    assert.is_true(helpers.wait_file(path, 30), "no " .. path)
    -- read it as fast as possible while the worker rewrites it: every
    -- read is a whole file
    local reads, torn, last = 0, nil, nil
    local until_ = mongotx.core.monotonic_ms() + 1500
    while mongotx.core.monotonic_ms() < until_ do
      local f = io.open(path, "rb")
      if f then
        local s = f:read("a")
        f:close()
        reads = reads + 1
        if not (s:find("\nmongotx_stale_after_seconds{[^\n]*} 1\n")
                and s:find("\nmongotx_round_trips_total %d+\n$")) then torn = s end
        last = s
      end
    end
    helpers.signal(pid, "TERM")
    assert.is_true(helpers.wait_exit(pid, 10))
    local said = helpers.read_file(out)
    os.remove(out)
    assert.is_nil(torn, "a torn read:\n" .. tostring(torn))
    assert.truthy(reads > 10)
    local families = assert(prom.parse(last))
    -- the sweeps recovered the two initial ones; the parked one is left
    assert.are.equal(0, prom.value(families, "mongotx_open_transactions",
                                   labels { state = "initial" }), said)
    assert.are.equal(1, prom.value(families, "mongotx_parked_transactions", labels()))
    assert.are.equal(2, assert(txs:count { state = "done" }))
    -- and the worker's own counters, cumulative since it started: every
    -- transaction it moved to done, in as many passes as the file says it ran
    -- (counted recovered: done counts in the registry that began them)
    local app = { application = "app" }
    assert.are.equal(2, prom.value(families, "mongotx_recovered_total",
                                   { application = "app", outcome = "done" }))
    assert.is_nil(prom.value(families, "mongotx_transactions_done_total", app))
    local passes = prom.value(families, "mongotx_recovery_passes_total", app)
    assert.truthy(passes > 2, tostring(passes)) -- --loop 0: a sweep after another
    assert.are.equal(passes, prom.value(families, "mongotx_recovery_pass_seconds_count", app))
    assert.truthy(prom.value(families, "mongotx_round_trips_total", {}) > passes)
    -- no temporary file left beside it
    assert.are.equal("mongotx.prom", server.capture("ls " .. q(dir)):gsub("%s+$", ""))
  end)

  it("refuses a path it cannot write before connecting, and --json with --prometheus", function()
    if not check_build() then return end
    local before = helpers.db_dump(db.client, dbname)
    for _, path in ipairs { dir .. "/missing/x.prom", dir } do
      local code, _, err = run { "--database", dbname, "recover", "--metrics-file", path }
      assert.are.equal(2, code)
      assert.truthy(err:find("--metrics-file: cannot write", 1, true), err)
    end
    if server.execute("test $(id -u) = 0") ~= 0 then -- (root writes a read-only directory)
      os.execute("chmod 500 " .. q(dir))
      local code, _, err = run { "--database", dbname, "recover", "--metrics-file", dir .. "/x.prom" }
      os.execute("chmod 700 " .. q(dir))
      assert.are.equal(2, code)
      assert.truthy(err:find("Permission denied", 1, true), err)
    end
    local code, _, err = run { "--database", dbname, "--json", "status", "--prometheus" }
    assert.are.equal(2, code)
    assert.truthy(err:find("choose one", 1, true), err)
    helpers.assert_dump_unchanged(before, db.client, dbname)
    assert.are.equal("", server.capture("ls " .. q(dir)):gsub("%s+$", ""))
  end)
end)

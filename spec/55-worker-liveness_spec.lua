-- A recovery worker that stops getting anything done can be alerted on
-- (docs/metrics.md, "Alerts"): `recover --loop --metrics-file` writes the
-- time of its last finished pass
-- (mongotx_recovery_last_pass_timestamp_seconds).  While the server does
-- not answer, the worker says so on stderr and still rewrites the file
-- (without the backlog it cannot read), so the file's age tells a dead
-- worker and the last pass's time a worker that gets nothing done; when
-- the server answers again, the worker says so and the time moves on.
--
-- The spec starts a server of its own, to stop it (SIGSTOP).

local helpers = require "spec.helpers"
local server = require "spec.support.server"
local prom = require "spec.support.prometheus"
local cli = require "spec.support.cli"
local mongotx = require "mongotx"

local sleep = mongotx.core.sleep

describe("#server #slow the recovery worker's last pass", function()
  if cli.no_build then
    it("runs bin/mongotx", function() pending(cli.no_build) end)
    return
  end

  local srv, dir
  before_each(function()
    srv = assert(server.start { kind = "memory" })
    dir = server.capture("mktemp -d"):gsub("%s+$", "")
  end)
  after_each(function()
    srv:kill("CONT")
    srv:stop()
    os.execute("rm -rf " .. server.quote(dir))
  end)

  -- The file's families, and its last pass's time (nil: no file yet).
  local function read(path)
    local f = io.open(path, "rb")
    if not f then return nil end
    local text = f:read("a")
    f:close()
    local families = assert(prom.parse(text))
    return families, prom.value(families, "mongotx_recovery_last_pass_timestamp_seconds",
                                { database = "bank", collection = "transactions" })
  end

  local function wait_for(seconds, what, fn)
    local stop = mongotx.core.monotonic_ms() + seconds * 1000
    while mongotx.core.monotonic_ms() < stop do
      local v = fn()
      if v then return v end
      sleep(0.1)
    end
    error("waited " .. seconds .. " s for " .. what)
  end

  it("stops moving while the server does not answer, said on stderr, and moves on after", function()
    local db = assert(mongotx.connect(srv.uri, { database = "bank" }))
    local tm = assert(db:manager { application = "shop" })
    assert(db:collection("accounts"):insert_many { { _id = "A", balance = 10 }, { _id = "B", balance = 0 } })
    assert(tm:transfer("accounts", "A", "B", 1)) -- the transactions collection exists
    db:close()

    -- a reply is waited for 2 s (the command's own default is a minute)
    local uri = srv.uri .. "&socketTimeoutMS=2000"
    local path = dir .. "/mongotx.prom"
    local started = os.time()
    local w = cli.start({ "--database", "bank", "recover", "--loop", "0.2", "--metrics-file", path },
                        { uri = uri })
    finally(function() helpers.signal(w.pid, "KILL") end) -- (gone already when the spec passed)
    local first = wait_for(30, "the first file", function()
      local _, t = read(path)
      return t
    end)
    assert.truthy(first >= started and first <= os.time(), tostring(first))
    local families = read(path)
    assert.are.equal(0, prom.value(families, "mongotx_stale_transactions",
                                   { database = "bank", collection = "transactions" }))
    wait_for(10, "a later pass", function()
      local _, t = read(path)
      return t and t > first
    end)

    srv:kill("STOP")
    local stopped = os.time()
    -- the worker says so, and the file goes on being written without the
    -- backlog while the last pass's time stays where it was
    local said = wait_for(30, "a line on stderr", function()
      local e = helpers.read_file(w.files.err)
      return e:find("mongotx: ", 1, true) and e
    end)
    local mtime = function() return tonumber(server.capture("stat -c %Y " .. server.quote(path))) end
    local before = mtime()
    wait_for(30, "a rewrite while the server is stopped", function()
      sleep(1)
      return mtime() > before
    end)
    local frozen
    families, frozen = read(path)
    assert.truthy(frozen <= stopped, frozen .. " > " .. stopped .. "\n" .. said)
    assert.is_nil(prom.value(families, "mongotx_stale_transactions",
                             { database = "bank", collection = "transactions" }))
    assert.truthy(prom.value(families, "mongotx_recovery_passes_total", { application = "mongotx-cli" }) > 1)

    srv:kill("CONT")
    local resumed = os.time()
    wait_for(60, "a pass after the server answers again", function()
      local _, t = read(path)
      return t and t >= resumed
    end)
    local err = helpers.read_file(w.files.err)
    assert.truthy(err:find("the server answers again, after %d+ failed sweeps? in %d+ s\n"), err)
    -- said once when it stopped answering, not at every sweep (one more
    -- line if the server stopped between a sweep and its backlog's read)
    local lines = select(2, ("\n" .. err):gsub("\nmongotx: ", ""))
    assert.is_nil(err:find("mongotx: [^\n]*mongotx: "), err) -- one prefix a line
    assert.truthy(lines >= 2 and lines <= 3, err)
    helpers.signal(w.pid, "TERM")
    assert.are.equal(143, (w.wait(20)))
  end)
end)

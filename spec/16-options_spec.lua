-- Options of the public calls (lua/mongotx/options.lua): a wrong type or
-- an unknown name raises, naming the option; a value of the right type
-- that cannot work (NaN, infinite, out of range, a field that clashes, an
-- unknown mode) returns nil and an `invalid` error naming the option and
-- what it must be.  Either way nothing is written.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"

local nan, inf = 0 / 0, math.huge
local TEN_YEARS = 10 * 365 * 24 * 3600

describe("#server options", function()
  local db

  before_each(function()
    db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
  end)
  after_each(function() db:close() end)

  local function dump() return helpers.db_dump(db.client, db.name) end

  -- fn() must return nil and an invalid error whose message finds `msg`
  -- (plain text), and write nothing.
  local function invalid(fn, msg, step)
    local before = dump()
    local res, err = fn()
    assert.is_nil(res)
    assert.is_table(err, "expected an error table, got " .. tostring(err))
    assert.are.equal("invalid", err.code, tostring(err))
    assert.truthy(err.message:find(msg, 1, true), err.message)
    if step then assert.are.equal(step, err.step) end
    assert.matches("^mongotx: ", tostring(err))
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end

  -- fn() must raise with a message that finds `msg` (plain text), and
  -- write nothing.
  local function raises(fn, msg)
    local before = dump()
    local ok, raised = pcall(fn)
    assert.is_false(ok, "expected a raise")
    assert.truthy(tostring(raised):find(msg, 1, true), tostring(raised))
    helpers.assert_dump_unchanged(before, db.client, db.name)
  end

  -- Every writer reads the server's replies to fence and to tell what
  -- happened, so none takes an unacknowledged write concern; a
  -- connection's default may be w = 0 (the C core's own calls).
  it("every writer refuses w = 0, and writes nothing", function()
    local wc = { write_concern = { w = 0 } }
    local function with(extra)
      local o = { write_concern = { w = 0 } }
      for k, v in pairs(extra or {}) do o[k] = v end
      return o
    end
    local msg = "option write_concern.w of %s must be acknowledged (not 0)"
    invalid(function() return db:manager(wc) end, msg:format("manager"))
    invalid(function() return db:queue(wc) end, msg:format("queue"))
    invalid(function() return db:ledger(wc) end, msg:format("ledger"))
    invalid(function() return db:versioned(wc) end, msg:format("versioned"))
    invalid(function() return db:sync(with { propagate = function() return true end }) end,
      msg:format("sync"))
    local raw = assert(mongotx.connect(helpers.uri(), { database = db.name, write_concern = { w = 0 } }))
    raw:close()
  end)

  describe("db:manager", function()
    local function manager(opts) return function() return db:manager(opts) end end

    it("refuses NaN, infinite, negative and too large durations", function()
      for _, name in ipairs { "stale_after", "lease", "retention" } do
        for _, v in ipairs { nan, inf, -inf, -1, -0.5, TEN_YEARS + 1, 1e300 } do
          invalid(manager { [name] = v }, "option " .. name .. " of manager must be a number " ..
            "of seconds from 0 to " .. TEN_YEARS, "manager")
        end
      end
    end)

    it("refuses counts that are not whole numbers in range", function()
      local ranges = {
        retries = { "a whole number from 0 to 1000", { nan, inf, -1, 1.5, 1001 } },
        max_attempts = { "a whole number from 1 to 1000000", { nan, inf, 0, -1, 2.5, 1e6 + 1 } },
        finish_batch = { "a whole number from 1 to 100000", { nan, -inf, 0, 0.5, 100001 } },
      }
      for name, r in pairs(ranges) do
        for _, v in ipairs(r[2]) do
          invalid(manager { [name] = v }, "option " .. name .. " of manager must be " .. r[1])
        end
      end
    end)

    it("refuses a marker or version field that is another mongotx field", function()
      -- not UTF-8 ("\xff", a sequence cut short): the updates of finish,
      -- commit and done go out without libmongoc's validation (csrc/txn.c,
      -- "Built here"), so these names are checked here
      for _, f in ipairs { "_id", "txRemoving", "txPlaceholder", "", "a.b", "$set", "a\0b",
                           "\xff", "m\xc3" } do
        invalid(manager { marker = f }, "option marker of manager must be a top-level field name")
        invalid(manager { version_field = f },
          "option version_field of manager must be a top-level field name")
      end
      invalid(manager { marker = "v", version_field = "v" },
        "options marker and version_field must be different fields")
      invalid(manager { marker = "txVersion" }, "must be different fields")
      invalid(manager { version_field = "pendingTransactions" }, "must be different fields")
    end)

    it("core.steps itself refuses a field name that is empty or not UTF-8", function()
      local core = require "mongotx.core"
      local names = { marker = "m", version = "v", removing = "r", held = "h", placeholder = "p",
                      pending = "e", escrow = "s" }
      assert.is_not_nil(core.steps(names))
      for field in pairs(names) do
        for _, bad in ipairs { "", "\xff", "a\xe2\x82" } do
          local with = {}
          for k, v in pairs(names) do with[k] = v end
          with[field] = bad
          raises(function() return core.steps(with) end,
            "steps: " .. field .. " must be a non-empty UTF-8 field name")
        end
      end
    end)

    it("a marker and version field beyond ASCII work through every step", function()
      local tm = assert(db:manager { marker = "en_cours_é", version_field = "versión" })
      local accounts = db.client:collection(db.name, "accounts")
      assert(accounts:insert_many({ { _id = "a", balance = 10 }, { _id = "b", balance = 0 } }, {}))
      local t = assert(tm:transfer("accounts", "a", "b", 4))
      assert.are.equal("done", t.state)
      assert.are.same({ { _id = "a", balance = 6, ["versión"] = 2, ["en_cours_é"] = {} },
                        { _id = "b", balance = 4, ["versión"] = 2, ["en_cours_é"] = {},
                          txPending = { balance = 0 }, txEscrow = {} } }, helpers.dump(accounts))
      assert.are.equal("done", assert(tm:get(t._id)).state)
    end)

    -- A string id that is not UTF-8 is refused before anything is
    -- written: a server may store other bytes as another string
    -- (FerretDB does: the transaction was written under one id and not
    -- found again under it, left pending with its balances moved).  So
    -- finish and done, which go out unvalidated (csrc/txn.c, "Built
    -- here"), never carry such an id either.  On every server.
    it("refuses ids that are not UTF-8 and writes nothing", function()
      local tm = assert(db:manager {})
      local accounts = db.client:collection(db.name, "accounts")
      assert(accounts:insert_many({ { _id = "a", balance = 10 }, { _id = "b", balance = 0 } }, {}))
      local before = helpers.db_dump(db.client, db.name)
      for _, call in ipairs {
        function() return tm:transfer("accounts", "a", "b", 4, { id = "tx\xff" }) end,
        function() return tm:transfer("accounts", "a\xff", "b", 4) end,
        function() return tm:transfer("accounts", "a", mongotx.doc("k", "b\xc3"), 4) end,
        function()
          local results, errs = tm:commit_many { {
            { collection = "accounts", id = "a", update = { ["$inc"] = { balance = -1 } } },
            { collection = "accounts", id = "b\xe2\x82", update = { ["$inc"] = { balance = 1 } } } } }
          assert.is_false(results[1])
          return nil, errs[1]
        end,
      } do
        local ok, err = call()
        assert.is_nil(ok)
        assert.are.equal("invalid", err.code)
        assert.matches("valid UTF%-8", err.message)
      end
      helpers.assert_dump_unchanged(before, db.client, db.name)
    end)

    -- A NUL may stand inside a string value (BSON and libmongoc take it,
    -- docs/guards.md), so inside a string id too: one answer whether the
    -- rest of the id is ASCII or not (the check's ASCII shortcut and
    -- libbson's path used to differ).
    it("takes a NUL inside a string id, ASCII or not, and stores it as sent", function()
      local tm = assert(db:manager {})
      local accounts = db.client:collection(db.name, "accounts")
      local tx = db.client:collection(db.name, "transactions")
      for _, row in ipairs {
        { what = "ASCII", id = "ab\0cd", account = "a\0" },
        { what = "not ASCII", id = "\195\169\0", account = "\195\169\0b" },
      } do
        assert.are.equal("s" .. #row.id .. ":" .. row.id, mongotx.core.id_key(row.id), row.what)
        assert(accounts:insert_many({ { _id = row.account, balance = 10 }, { _id = "to", balance = 0 } }, {}))
        local t, err = tm:transfer("accounts", row.account, "to", 4, { id = row.id })
        assert.is_nil(err, row.what)
        assert.are.equal("done", t.state, row.what)
        local stored = assert(tx:find_all({ _id = row.id }, {}))
        assert.are.equal(1, #stored, row.what)
        assert.are.equal(row.id, stored[1]._id, row.what)
        assert.are.equal("done", stored[1].state, row.what)
        assert.are.equal(6, assert(accounts:find_one({ _id = row.account }, {})).balance, row.what)
        assert(accounts:delete_many({}, {}))
      end
      -- NUL's overlong form (C0 80) is no UTF-8, beside a NUL or not
      for _, bad in ipairs { "\195\169\192\128", "\195\169\0\192\128", "a\192\128" } do
        local t, err = tm:transfer("accounts", "x", "to", 4, { id = bad })
        assert.is_nil(t)
        assert.are.equal("invalid", err.code)
      end
      assert.are.equal(0, tx:count({ state = { ["$ne"] = "done" } }))
    end)

    it("refuses unknown modes and names", function()
      invalid(manager { finish = "later" }, 'option finish of manager must be "inline" or "deferred"')
      invalid(manager { fencing = "none" },
        'option fencing of manager must be "auto", "deadline" or "version"')
      invalid(manager { application = "" }, "option application of manager must be a non-empty")
      invalid(manager { collection = "system.tx" }, "option collection of manager must be a collection name")
      invalid(manager { write_concern = { w = -1 } }, "option write_concern.w of manager must be")
      invalid(manager { write_concern = { w = 1.5 } }, "option write_concern.w of manager must be")
      invalid(manager { write_concern = { w = "" } }, "option write_concern.w of manager must be")
      invalid(manager { write_concern = { wtimeout = nan } }, "option write_concern.wtimeout of manager")
      invalid(manager { write_concern = { w = 0, j = true } }, "option write_concern.j of manager")
      -- fencing reads the replies: unacknowledged writes would all look lost
      invalid(manager { write_concern = { w = 0 } },
        "option write_concern.w of manager must be acknowledged (not 0)")
    end)

    it("raises for wrong types and unknown names, naming the option", function()
      raises(manager { lease = "30" }, "option lease of manager must be a number, not string")
      raises(manager { retries = true }, "option retries of manager must be a number")
      raises(manager { finish = 1 }, "option finish of manager must be a string")
      raises(manager { marker = 5 }, "option marker of manager must be a string")
      raises(manager { on_op_failure = "cancel" }, "option on_op_failure of manager must be a function")
      raises(manager { backoff = 1 }, "option backoff of manager must be a function")
      raises(manager { write_concern = "majority" }, "option write_concern of manager must be a table")
      raises(manager { write_concern = { w = true } }, "option write_concern.w of manager must be a number or a string")
      raises(manager { write_concern = { j = "yes" } }, "option write_concern.j of manager must be a boolean")
      raises(manager { write_concern = { x = 1 } }, "unknown option write_concern.x for manager")
      raises(manager { stale = 5 }, "unknown option stale for manager")
      raises(manager("app"), "options of manager must be a table")
    end)

    it("a wrong type raises even next to a bad value", function()
      raises(manager { lease = nan, retries = "3" }, "option retries of manager must be a number")
    end)

    it("takes the bounds themselves", function()
      local ok = {
        { lease = 0, stale_after = 0, retention = 0 },
        { lease = TEN_YEARS, stale_after = TEN_YEARS, retention = TEN_YEARS },
        { retries = 0, max_attempts = 1, finish_batch = 1 },
        { retries = 1000, max_attempts = 1e6, finish_batch = 100000 },
        { retries = 3.0, lease = 0.5 },
        { marker = "locks", version_field = "v" },
        { marker = "txVersion", version_field = "v" },
        { finish = "deferred", fencing = "version" },
        { write_concern = { w = "majority", j = true, wtimeout = 1000 } },
      }
      for _, opts in ipairs(ok) do
        local tm, err = db:manager(opts)
        assert.is_table(tm, tostring(err))
      end
    end)
  end)

  describe("calls", function()
    local tm, accounts

    before_each(function()
      tm = assert(db:manager { application = "app-1" })
      accounts = db:collection("accounts")
      assert(accounts:insert_many {
        { _id = "A", balance = 100 }, { _id = "B", balance = 100 },
      })
    end)

    local ops = { { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } } }

    it("recover{limit} must be a whole number from 1 to 2^31-1", function()
      for _, v in ipairs { 0, -1, 1.5, nan, inf, 2 ^ 31 } do
        invalid(function() return tm:recover { limit = v } end,
          "option limit of recover must be a whole number from 1 to 2147483647", "recover")
      end
      raises(function() return tm:recover { limit = "10" } end,
        "option limit of recover must be a number")
      raises(function() return tm:recover { max = 1 } end, "unknown option max for recover")
      assert.is_table(assert(tm:recover { limit = 2 ^ 31 - 1 }))
    end)

    it("prune{older_than} must be a number of seconds from 0 to 10 years", function()
      for _, v in ipairs { -1, nan, inf, -inf, TEN_YEARS + 1 } do
        invalid(function() return tm:prune { older_than = v } end,
          "option older_than of prune must be a number of seconds", "prune")
      end
      raises(function() return tm:prune { older_than = "1h" } end,
        "option older_than of prune must be a number")
      assert.are.equal(0, assert(tm:prune { older_than = TEN_YEARS }))
    end)

    it("begin, run and transfer raise for option types and unknown names", function()
      raises(function() return tm:begin(ops, { meta = "x" }) end, "option meta of begin must be a table")
      raises(function() return tm:run(ops, { idempotency = 1 }) end, "unknown option idempotency for run")
      raises(function() return tm:transfer("accounts", "A", "B", 1, { min = "0" }) end,
        "option min of transfer must be a number")
      raises(function() return tm:transfer("accounts", "A", "B", 1, { field = 1 }) end,
        "option field of transfer must be a string")
    end)

    it("transfer_many: a bad value is that item's error, the others run", function()
      local before = helpers.dump(accounts)
      local results, errs = tm:transfer_many {
        { collection = "system.x", from = "A", to = "B", amount = 1 },
        { collection = "accounts", from = "A", to = "B", amount = 1 },
      }
      assert.is_false(results[1])
      assert.are.equal("invalid", errs[1].code)
      assert.truthy(errs[1].message:find("option collection of transfer_many item 1", 1, true))
      assert.are.equal("transfer_many", errs[1].step)
      assert.are.equal("done", results[2].state)
      assert.is_false(errs[2])
      assert.are.equal(1, db:collection("transactions"):count({}))
      assert.are_not.same(before, helpers.dump(accounts))
      raises(function()
        return tm:transfer_many { { collection = "accounts", from = "A", to = "B", amount = 1, x = 1 } }
      end, "unknown option x for transfer_many item 1")
      raises(function()
        return tm:commit_many { { ops = ops, meta = 1 } }
      end, "option meta of commit_many item 1 must be a table")
    end)
  end)

  describe("connect", function()
    local uri

    before_each(function() uri = helpers.uri() end)

    it("raises for wrong types, naming the option", function()
      raises(function() return mongotx.connect(uri, { tls = "yes" }) end,
        "option tls of connect must be a table, not string")
      raises(function() return mongotx.connect(uri, { tls = { ca_file = 5 } }) end,
        "option tls.ca_file of connect must be a string")
      raises(function() return mongotx.connect(uri, { tls = { verify = true } }) end,
        "unknown option tls.verify for connect")
      raises(function() return mongotx.connect(uri, { read_preference = 1 }) end,
        "option read_preference of connect must be a string")
      raises(function() return mongotx.connect(uri, { write_concern = { w = {} } }) end,
        "option write_concern.w of connect must be a number or a string")
      raises(function() return mongotx.connect(uri, { appname = 1 }) end,
        "option appname of connect must be a string")
      raises(function() return mongotx.connect(uri, { database = 5 }) end,
        "option database of connect must be a string")
    end)

    it("returns nil, invalid for bad values", function()
      invalid(function() return mongotx.connect(uri, { read_preference = "fastest" }) end,
        'option read_preference of connect must be "primary"', "connect")
      invalid(function() return mongotx.connect(uri, { write_concern = { w = -1 } }) end,
        "option write_concern.w of connect must be")
      invalid(function() return mongotx.connect(uri, { database = "a.b" }) end,
        "option database of connect must be a database name")
      invalid(function() return mongotx.connect(uri, { database = "" }) end,
        "option database of connect must be a database name")
      invalid(function() return mongotx.connect(uri, { appname = ("x"):rep(129) }) end,
        "option appname of connect must be at most 128 bytes")
    end)

    it("the core's connect raises naming the option, for types and values alike", function()
      local core = mongotx.core
      local cases = {
        { { tls = "yes" }, "option 'tls' must be a table" },
        { { tls = { pem_file = {} } }, "option 'tls.pem_file' must be a string" },
        { { tls = { allow_invalid_hostname = "yes" } }, "option 'tls.allow_invalid_hostname' must be a boolean" },
        { { tls = { bogus = true } }, "unknown option 'tls.bogus'" },
        { { appname = {} }, "option 'appname' must be a string" },
        { { write_concern = 1 }, "option 'write_concern' must be a table" },
        { { write_concern = { w = -1 } }, "option 'write_concern.w' must be a whole number" },
        { { write_concern = { w = nan } }, "option 'write_concern.w' must be a whole number" },
        { { write_concern = { wtimeout = -5 } }, "option 'write_concern.wtimeout' must be" },
        { { write_concern = { w = 0, j = true } }, "option 'write_concern.j'" },
        { { write_concern = { x = 1 } }, "unknown option 'write_concern.x'" },
        { { read_preference = "fastest" }, "option 'read_preference' must be \"primary\"" },
        { { read_preference = 1 }, "option 'read_preference' must be" },
      }
      for _, case in ipairs(cases) do
        local ok, raised = pcall(core.connect, uri, case[1])
        assert.is_false(ok)
        assert.truthy(raised:find(case[2], 1, true), raised)
        assert.is_nil(raised:find("bad argument", 1, true), raised)
      end
    end)
  end)

  -- A misuse is reported at the line that made the call (error levels
  -- through helpers and batch items, no tail call in between).
  it("misuse raises at the caller's line", function()
    local tm = assert(db:manager {})
    local calls = {
      function() local r = db:manager { bogus = 1 }; return r end,
      function() local r = tm:transfer("accounts", "A", "B", 1, { bogus = 1 }); return r end,
      function() local r = tm:begin({}, { bogus = 1 }); return r end,
      function() local r = tm:transfer_many { { collection = "accounts", from = "A", to = "B",
        amount = 1, bogus = 1 } }; return r end,
      function() local r = tm:transfer_many { { collection = "accounts", from = "A", to = "B",
        amount = 1, field = 5 } }; return r end,
      function() local r = tm:commit_many { { ops = {}, bogus = 1 } }; return r end,
      function() local r = tm:commit_many { { ops = {}, meta = 5 } }; return r end,
      function() local r = tm:commit_many(5); return r end,
      function() local r = tm:rollback({ _id = "x" }, 5); return r end,
      function() local r = tm:prune { bogus = 1 }; return r end,
      function() local r = tm:step("bogus", { _id = "x" }); return r end,
    }
    for i, call in ipairs(calls) do
      local ok, msg = pcall(call)
      assert.is_false(ok, "call " .. i .. " did not raise")
      assert.truthy(tostring(msg):find("16%-options_spec%.lua:%d+:"), "call " .. i .. ": " .. tostring(msg))
    end
  end)
end)

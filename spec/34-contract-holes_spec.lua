-- Contract holes, round 4 (issue 40): `done` only when every effect
-- landed (an escrowed credit the server would refuse at the finish is
-- refused at the apply), a write the server refuses at the apply cancels
-- the transaction with everything else undone, on every path; a txHeld
-- entry the tutorial's recipe left behind (PyMongo) is cleared by whoever
-- meets it; every later answer names the refused op; tm:each's
-- cancellations carry the cause.
local helpers = require "spec.helpers"
local mongotx = require "mongotx"
local server = require "spec.support.server"
local metrics = require "mongotx.metrics"
local group = require "mongotx.group"


describe("#server contract holes", function()
  local db, accounts, txs, name

  before_each(function()
    name = helpers.db_name()
    db = assert(mongotx.connect(helpers.uri(), { database = name }))
    accounts = db:collection("accounts")
    txs = db:collection("transactions")
  end)
  after_each(function() if db then db:close() end db = nil end)

  local function put(docs) assert(accounts:insert_many(docs)) end
  local function doc(id) return assert(accounts:find_one({ _id = id })) end
  local function stored(id) return assert(txs:find_one({ _id = id })) end
  local function credit(id, n, field)
    return { collection = "accounts", id = id, update = { ["$inc"] = { [field or "balance"] = n } } }
  end

  -- Nothing of mongotx left on any account: no marker, no txHeld entry,
  -- no escrowed credit.
  local function assert_clean()
    for _, d in ipairs(helpers.dump(accounts)) do
      assert.are.same({}, d.pendingTransactions or {}, "marker left on " .. tostring(d._id))
      assert.are.same({}, d.txHeld or {}, "txHeld left on " .. tostring(d._id))
      assert.are.same({}, d.txEscrow or {}, "txEscrow left on " .. tostring(d._id))
      local p = d.txPending
      if type(p) == "table" then
        for k, v in pairs(p) do
          if type(v) == "table" then for _, x in pairs(v) do assert.are.equal(0, x, k) end
          else assert.are.equal(0, v, "credit left in escrow on " .. tostring(d._id)) end
        end
      end
    end
  end

  -- The refusal of op `op` (document `id`) answered first and again.
  local function assert_refused(err, op, id, code)
    assert.are.equal(code or "refused", err.code)
    assert.are.equal("refused", err.cause)
    assert.are.equal(op, err.op)
    assert.are.equal("accounts", err.collection)
    assert.are.equal(id, err.document)
  end

  describe("an escrowed credit the finish could not move", function()
    it("is refused at the apply, one at a time: cancelled, nothing moved", function()
      put { { _id = "P", balance = 1000 }, { _id = "S", balance = "x" } }
      local tm = assert(db:manager {})
      local T, err = tm:transfer("accounts", "P", "S", 30, { id = "t1" })
      assert.is_nil(T)
      assert_refused(err, 2, "S")
      assert.are.equal(14, err.server_code)
      assert.are.same({ "cancelled", "refused", 2 }, { stored("t1").state, stored("t1").cause,
        stored("t1").failedOp })
      assert.are.equal(1000, doc("P").balance)
      assert.are.equal("x", doc("S").balance)
      assert_clean()
      -- a retried key, and a commit of it, answer the same refusal
      T, err = tm:transfer("accounts", "P", "S", 30, { id = "t1" })
      assert.is_nil(T)
      assert_refused(err, 2, "S", "cancelled")
      T, err = tm:commit({ _id = "t1" })
      assert.is_nil(T)
      assert_refused(err, 2, "S", "cancelled")
    end)

    it("is refused at the apply under a parent that is no document (field = wallet.usd)", function()
      put { { _id = "P", wallet = { usd = 100 } }, { _id = "W", wallet = "none" } }
      local tm = assert(db:manager {})
      local t = assert(tm:begin(
        { credit("P", -30, "wallet.usd"), credit("W", 30, "wallet.usd") }, { id = "t2" }))
      local T, err = tm:commit(t)
      assert.is_nil(T)
      assert_refused(err, 2, "W")
      assert.are.equal("cancelled", stored("t2").state)
      assert.are.same({ usd = 100 }, doc("P").wallet)
      assert.are.equal("none", doc("W").wallet)
      assert_clean()
    end)

    it("a batch: the refused one cancelled, the others done", function()
      put { { _id = "P", balance = 1000 }, { _id = "Q", balance = 0 }, { _id = "S", balance = "x" } }
      local tm = assert(db:manager {})
      local function item(to, n, id)
        return { collection = "accounts", from = "P", to = to, amount = n, id = id }
      end
      local results, errs = tm:transfer_many { item("Q", 10, "b1"), item("S", 20, "b2"),
                                               item("Q", 30, "b3") }
      assert.are.equal("done", results[1].state)
      assert.is_false(results[2])
      assert_refused(errs[2], 2, "S")
      assert.are.equal("done", results[3].state)
      assert.are.same({ 960, 40, "x" }, { doc("P").balance, doc("Q").balance, doc("S").balance })
      assert.are.same({ "done", "cancelled", "done" },
        { stored("b1").state, stored("b2").state, stored("b3").state })
      assert_clean()
    end)

    it("a finish the server refuses after the commit leaves it applied, never done", function()
      put { { _id = "P", balance = 1000 }, { _id = "Q", balance = 0 }, { _id = "S", balance = 0 } }
      local tm = assert(db:manager { finish = "deferred" })
      assert.are.equal("applied", assert(tm:transfer("accounts", "P", "S", 30, { id = "d1" })).state)
      assert.are.equal("applied", assert(tm:transfer("accounts", "P", "Q", 10, { id = "d2" })).state)
      -- another writer breaks S after the commit point
      assert(accounts:update_one({ _id = "S" }, { ["$set"] = { balance = "x" } }))
      local n, err = tm:finish()
      assert.are.equal(1, n)
      assert.are.equal("server", err.code)
      assert.are.same({ "applied", "done" }, { stored("d1").state, stored("d2").state })
      assert.are.same({ "d1" }, doc("S").pendingTransactions)
      assert.are.equal(30, doc("S").txPending.balance)
      assert.are.same({ 960, 10 }, { doc("P").balance, doc("Q").balance })
      assert.are.same({}, doc("Q").pendingTransactions)
      -- recovery cannot finish it either while S is broken: not done
      local back = assert(db:manager { stale_after = 0, lease = 1, max_attempts = 100 })
      helpers.age(txs, "d1", 60)
      back:recover { batch = 1 }
      back:recover()
      assert.are.equal("applied", stored("d1").state)
      -- once S is repaired, recovery finishes it
      assert(accounts:update_one({ _id = "S" }, { ["$set"] = { balance = 0 } }))
      helpers.age(txs, "d1", 60)
      assert.are.equal(1, assert(back:recover()).done)
      assert.are.equal("done", stored("d1").state)
      assert.are.equal(30, doc("S").balance)
      assert_clean()
    end)
  end)

  describe("a write the server refuses at the apply", function()
    -- P pays 30 to S, guarded (P's debit applies first), S refuses it
    local cases = {
      { "escrow off, a string balance", { escrow = false }, { _id = "S", balance = "x" } },
      { "escrow on, txPending not a subdocument", {},
        { _id = "S", balance = 0, txPending = "junk" } },
    }
    for _, case in ipairs(cases) do
      local what, opts, S = case[1], case[2], case[3]

      it("cancels, every other op undone (" .. what .. "): single, begin + commit, batch", function()
        put { { _id = "P", balance = 1000 }, { _id = "Q", balance = 0 }, S }
        local tm = assert(db:manager(opts))
        local T, err = tm:transfer("accounts", "P", "S", 30, { min = 0, id = "r1" })
        assert.is_nil(T)
        assert_refused(err, 2, "S")
        local t = assert(tm:begin({ credit("P", -30), credit("Q", 30), credit("S", 30) },
          { id = "r2" }))
        T, err = tm:commit(t)
        assert.is_nil(T)
        assert_refused(err, 3, "S")
        local results, errs = tm:commit_many {
          { ops = { credit("P", -5), credit("Q", 5) }, id = "r3" },
          { ops = { credit("Q", -5), credit("S", 5) }, id = "r4" },
        }
        assert.are.equal("done", results[1].state)
        assert_refused(errs[2], 2, "S")
        for _, id in ipairs { "r1", "r2", "r4" } do
          assert.are.same({ "cancelled", "refused" }, { stored(id).state, stored(id).cause })
        end
        assert.are.same({ 995, 5 }, { doc("P").balance, doc("Q").balance })
        assert.are.same(S.balance, doc("S").balance)
        assert_clean()
      end)

      it("cancels in a group-commit batch, transfers and begun commits (" .. what .. ")", function()
        put { { _id = "P", balance = 1000 }, { _id = "Q", balance = 0 },
              { _id = "R", balance = 1000 }, S }
        local tm = assert(db:manager(opts))
        -- (calls on disjoint documents: one batch each time)
        local out = group.run_calls(tm, {
          { method = "transfer", n = 5, "accounts", "P", "Q", 5, { id = "g1" } },
          { method = "transfer", n = 5, "accounts", "R", "S", 6, { min = 0, id = "g2" } },
        })
        assert.are.equal("done", out[1][1].state)
        assert_refused(out[2][2], 2, "S")
        local t3 = assert(tm:begin({ credit("R", -7), credit("S", 7) }, { id = "g3" }))
        local t4 = assert(tm:begin({ credit("P", -8), credit("Q", 8) }, { id = "g4" }))
        out = group.run_calls(tm, { { method = "commit", n = 1, t3 }, { method = "commit", n = 1, t4 } })
        assert_refused(out[1][2], 2, "S")
        assert.are.equal("done", out[2][1].state)
        for _, id in ipairs { "g2", "g3" } do
          assert.are.same({ "cancelled", "refused" }, { stored(id).state, stored(id).cause })
        end
        assert.are.same({ 987, 13, 1000 }, { doc("P").balance, doc("Q").balance, doc("R").balance })
        assert.are.same(S.balance, doc("S").balance)
        assert_clean()
      end)

      it("cancels on recovery's paths, batched and one at a time (" .. what .. ")", function()
        put { { _id = "P", balance = 1000 }, S }
        local gone = assert(db:manager(opts))
        for _, id in ipairs { "v1", "v2" } do
          local t = assert(gone:begin({ credit("P", -30), credit("S", 30) }, { id = id }))
          assert(gone:step("claim", t))
          assert(gone:step("apply", t, 1))
          helpers.age(txs, id, 3600)
        end
        local o = { stale_after = 1 }
        for k, v in pairs(opts) do o[k] = v end
        local back = assert(db:manager(o))
        local r = assert(back:recover { batch = 1, limit = 1 })
        assert.are.equal(1, r.cancelled)
        r = assert(back:recover())
        assert.are.equal(1, r.cancelled)
        for _, id in ipairs { "v1", "v2" } do
          assert.are.same({ "cancelled", "refused", 2 },
            { stored(id).state, stored(id).cause, stored(id).failedOp })
          local T, err = gone:commit({ _id = id })
          assert.is_nil(T)
          assert_refused(err, 2, "S", "cancelled")
        end
        assert.are.equal(1000, doc("P").balance)
        assert_clean()
      end)
    end

    it("tm:each: the cancellation carries the cause, the same on a re-run", function()
      put { { _id = "P", balance = 1000 }, { _id = "Q", balance = 0 }, { _id = "S", balance = "x" },
            { _id = "T", balance = 0 } }
      local tm = assert(db:manager {})
      local function job()
        return assert(tm:each({ "Q", "S", "T" }, function(to)
          return { credit("P", -10), credit(to, 10) }
        end, { id = "pay", key = function(to) return to end }))
      end
      local first, again = job(), job()
      assert.are.same({ 2, 1 }, { first.committed, first.cancelled })
      assert.are.same({ 2, 1 }, { again.skipped, again.cancelled })
      local c1, c2 = first.cancellations[1], again.cancellations[1]
      assert.are.same({ "S", "refused", false }, { c1.key, c1.cause, c1.earlier })
      assert.are.same({ "S", "refused", true }, { c2.key, c2.cause, c2.earlier })
      assert.are.equal(c1.reason, c2.reason)
      assert.are.same({ 980, 10, "x", 10 },
        { doc("P").balance, doc("Q").balance, doc("S").balance, doc("T").balance })
      assert_clean()
    end)
  end)

  it("a retried refusal names the op whose guard refused (stock or funds)", function()
    put { { _id = "A", balance = 100 } }
    assert(db:collection("stock"):insert_one({ _id = "widget", count = 5 }))
    local tm = assert(db:manager {})
    local function order(id, n, price)
      return tm:run({
        { collection = "stock", id = "widget", update = { ["$inc"] = { count = -n } },
          where = { count = { ["$gte"] = n } } },
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -price } },
          where = { balance = { ["$gte"] = price } } },
      }, { id = id })
    end
    for _, c in ipairs { { "o-stock", 9, 10, 1, "stock", "widget" },
                         { "o-funds", 1, 500, 2, "accounts", "A" } } do
      local _, err = order(c[1], c[2], c[3])
      assert.are.same({ "guard", "guard", c[4], c[5], c[6] },
        { err.code, err.cause, err.op, err.collection, err.document })
      _, err = order(c[1], c[2], c[3])
      assert.are.same({ "cancelled", "guard", c[4], c[5], c[6] },
        { err.code, err.cause, err.op, err.collection, err.document })
    end
    assert.are.equal(5, assert(db:collection("stock"):find_one({ _id = "widget" })).count)
    assert.are.equal(100, doc("A").balance)
  end)

  it("a floor reads another manager's committed escrowed credit", function()
    put { { _id = "A", balance = 100 }, { _id = "B", balance = 0 }, { _id = "C", balance = 0 } }
    local m1 = assert(db:manager { marker = "m1", finish = "deferred" })
    local T = assert(m1:transfer("accounts", "A", "B", 50, { min = 0, id = "m1-t" }))
    assert.are.equal("applied", T.state) -- committed, B's credit still in escrow
    assert.are.same({ 0, 50 }, { doc("B").balance, doc("B").txPending.balance })
    local m2 = assert(db:manager {})
    T = assert(m2:transfer("accounts", "B", "C", 50, { min = 0 }))
    assert.are.equal("done", T.state)
    assert.are.same({ 50, 0, 50 }, { doc("A").balance, doc("B").balance, doc("C").balance })
    assert.are.same({}, doc("B").m1)
    assert.are.equal(1, m1:finish())
    assert.are.equal("done", stored("m1-t").state)
    assert.are.same({}, doc("A").m1)
    assert_clean()
  end)

  describe("counters", function()
    -- begun, done, cancelled of application "app" as rendered
    local function figures(m)
      local text, out = m:render(), {}
      for _, what in ipairs { "begun", "done" } do
        out[#out + 1] = tonumber(text:match("mongotx_transactions_" .. what ..
          "_total{application=\"app\"} (%S+)")) or 0
      end
      local cancelled = 0
      for n in text:gmatch("mongotx_transactions_cancelled_total{[^}]*} (%S+)") do
        cancelled = cancelled + tonumber(n)
      end
      out[3] = cancelled
      return out
    end

    it("count a transaction in the registry that began it, whoever ends it", function()
      put { { _id = "A", balance = 100 }, { _id = "B", balance = 0 } }
      -- begun by one registry's manager, which stops before it ends them
      local m1 = metrics.new()
      local gone = assert(db:manager(m1:wrap { application = "app" }))
      for _, id in ipairs { "k1", "k2" } do
        local t = assert(gone:begin({ credit("A", -10), credit("B", 10) }, { id = id }))
        assert(gone:step("claim", t))
        helpers.age(txs, id, 3600)
      end
      assert.are.same({ 2, 0, 0 }, figures(m1))
      -- another registry's recovery ends them and counts none of them
      local m = metrics.new()
      local back = assert(db:manager(m:wrap { application = "app", stale_after = 1 }))
      assert.are.equal(1, assert(back:recover { batch = 1, limit = 1 }).done)
      assert.are.equal(1, assert(back:recover()).done)
      assert.are.same({ 0, 0, 0 }, figures(m))
      -- the first counts them done when it reconciles its marks
      assert.are.equal(2, assert(m1:reconcile(gone, { age = 0 })))
      assert.are.same({ 2, 2, 0 }, figures(m1))
      assert.are.equal(0, assert(m1:reconcile(gone, { age = 0 })))
      -- and one created in the second, refused: begun once, cancelled once
      local _, err = back:transfer("accounts", "A", "B", 500, { min = 0 })
      assert.are.equal("guard", err.code)
      assert.are.same({ 1, 0, 1 }, figures(m))
    end)

    it("count done once when two drivers finish the same transactions", function()
      put { { _id = "A", balance = 100 }, { _id = "B", balance = 0 } }
      local m = metrics.new()
      local tm = assert(db:manager(m:wrap { application = "app", finish = "deferred" }))
      for _, id in ipairs { "f1", "f2", "f3" } do
        assert.are.equal("applied", assert(tm:transfer("accounts", "A", "B", 10, { id = id })).state)
      end
      -- another caller of the same registry finishes one first
      local other = assert(db:manager(m:wrap { application = "app" }))
      assert.are.equal("done", assert(other:commit({ _id = "f2" })).state)
      assert.are.same({ 3, 1, 0 }, figures(m))
      assert.are.equal(3, tm:finish())
      assert.are.same({ 3, 3, 0 }, figures(m))
      for _, id in ipairs { "f1", "f2", "f3" } do assert.are.equal("done", stored(id).state) end
      assert.are.same({ 70, 30 }, { doc("A").balance, doc("B").balance })
      assert_clean()
    end)
  end)

  it("clears a txHeld entry the tutorial's recipe (PyMongo) left behind", function()
    local python = server.cache .. "/venv/bin/python"
    assert(server.exists(python), "no " .. python .. ": run spec/support/setup.sh prometheus")
    -- the tutorial's recovery of every unfinished transaction, in PyMongo
    -- (spec/support/recipe_writer.py, which reads the tutorial's source,
    -- destination and value from a transaction, as transfer() stores them)
    local function recipe()
      assert.are.equal(0, server.execute(string.format("%s spec/support/recipe_writer.py %s %s " ..
        "recover >/dev/null", server.quote(python), server.quote(helpers.uri()), server.quote(name))))
    end
    local tm_plain
    local function begun(id, n, ops)
      local t = assert(tm_plain:begin({ credit("A", -n), credit("B", n) }, { id = id }))
      assert(txs:update_one({ _id = id }, { ["$set"] = { source = "A", destination = "B", value = n } }))
      assert(tm_plain:step("claim", t))
      for _, i in ipairs(ops) do assert(tm_plain:step("apply", t, i)) end
    end
    put { { _id = "A", balance = 100, pendingTransactions = mongotx.array() },
          { _id = "B", balance = 0, pendingTransactions = mongotx.array() },
          { _id = "C", balance = 0, pendingTransactions = mongotx.array() } }
    tm_plain = assert(db:manager { escrow = false })
    begun("t1", 50, { 1, 2 })
    assert.are.same({ "t1" }, doc("B").txHeld)
    -- this process is gone; a writer that knows only the tutorial finishes it
    recipe()
    assert.are.equal("done", stored("t1").state)
    assert.are.same({ {}, { "t1" } }, { doc("B").pendingTransactions, doc("B").txHeld })
    -- a floor-guarded debit of B (any manager) is not held up by it
    local other = assert(db:manager {})
    local T = assert(other:transfer("accounts", "B", "C", 20, { min = 0 }))
    assert.are.equal("done", T.state)
    assert.are.same({ 50, 30, 20 }, { doc("A").balance, doc("B").balance, doc("C").balance })
    assert_clean()
    -- nor by an entry whose transaction was pruned since the recipe
    begun("t2", 10, { 2 })
    recipe() -- (applies A's debit, which mongotx had not)
    assert(txs:delete_one({ _id = "t2" }))
    assert.are.same({ "t2" }, doc("B").txHeld)
    T = assert(other:transfer("accounts", "B", "C", 40, { min = 0 }))
    assert.are.equal("done", T.state)
    assert.are.same({ 40, 0, 60 }, { doc("A").balance, doc("B").balance, doc("C").balance })
    assert_clean()
  end)
end)

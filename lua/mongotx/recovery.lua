-- Recovery: finds the transactions that processes left behind (crashed,
-- stalled, gone) and drives each to done or cancelled, under the
-- policies: which may be recovered (may_recover), a stale initial run or
-- expired (stale_initial), a stale pending rolled forward or back
-- (stale_pending), and after policy.max_attempts failed tries parked for
-- an operator.
--
-- Batched (the default, BATCH at a time): the policies are applied per
-- transaction as read, then for the whole batch one round trip per step:
--
--   versions  one find per collection (pending ones, and initial ones
--             where the server cannot fence by deadline: the versions
--             that fence their applies, read before the claim);
--   claim     one bulk write, each claim fenced as a single one is (state,
--             epoch, and for a pending one its owner's deadline passed);
--             a lost claim is not driven (Engine:claim_many says which);
--   forward   (initial, pending) apply as a batch does (mongotx.batch:
--             guarded ops first), one commit (each at its own epoch),
--             then with the applied ones finish and done (batch.finish);
--   back      (canceling, and pending rolled back) undo, fence (every one
--             was taken over) and cancelled, one bulk write each.
--
-- versions, claim and forward are mongotx.engine.forward's, which the
-- grouped tm:commit drives its batches with too.
--
-- Whatever cannot go that way (an op that cannot apply, a guard meeting
-- holders, a commit that did not match, a late apply the fence found)
-- goes on alone through the engine.  batch = 1: each alone (recover_one).

local batch = require "mongotx.batch"
local forward = require "mongotx.engine.forward"
local errors = require "mongotx.errors"
local validate = require "mongotx.validate"
local stored = require "mongotx.stored"
local holds = require "mongotx.holds"

local ipairs, tostring, pcall, type = ipairs, tostring, pcall, type
local Date = require("mongotx.core").Date
local live, has_marker, id_key = stored.live, stored.has_marker, validate.id_key

local _M = {}

local ACTIVE = { "initial", "pending", "applied", "canceling" }

local function park(eng, T, reason)
  local res, err = eng.tx:update_one({ _id = T._id },
    { ["$set"] = { parked = true, reason = reason } }, eng.wopts)
  if not res then return nil, errors.wrap(err, "park", T._id) end
  eng:event("park", { id = T._id, reason = reason })
  return "parked"
end

-- What the policies say of T before anything is claimed: "parked",
-- "skipped" or "cancelled" (settled here), or "claim"; nil, err.
local function triage(eng, T, now, me)
  if (T.attempts or 0) >= eng.policy.max_attempts then
    return park(eng, T, T.reason or "recovery failed too many times")
  end
  local age = T.lastModified and (now - T.lastModified:value()) / 1000 or math.huge
  -- a hold: by its expiry, and never forward (mongotx.holds)
  if type(T.hold) == "table" then return holds.triage(eng, T, now, age, me) end
  if not eng.policy.may_recover(T, age, me) then return "skipped" end
  -- the owner (this engine holds T at its epoch) drives it at once: a
  -- claim would wait for its own deadline (policy.may_recover)
  if eng:holds(T) then return "own" end
  if T.state == "initial" and eng.policy.stale_initial(T) == "expire" then
    local moved, err = eng:step("cancelled", T._id, eng.tx, T._id, "initial", T.epoch,
      "expired", "expired")
    if moved == nil then return nil, err end
    return moved and "cancelled" or "skipped"
  end
  return "claim"
end

-- How recovery ends the stale pending T it claimed: "forward" or "back"
-- (policy.stale_pending; a hold always back), and the reason and cause
-- of the cancel.
local function stale_way(eng, T)
  if type(T.hold) == "table" then return holds.stale_way(T) end
  return eng.policy.stale_pending(T), "rolled back by recovery", "recovery"
end

-- The expire event of a hold this recovery's cancel (at `epoch`, which a
-- cancel keeps and a decision moves on) expired.
local function expired(eng, T, epoch)
  if type(T.hold) == "table" and T.state == "canceling" and T.cause == "expired"
      and T.epoch == epoch then
    eng:event("expire", { id = T._id, amount = T.hold.amount })
  end
end

-- Why an op could not apply (Engine's op failures) and so T was cancelled.
local CANCELLING = { cancelled = true }
for code in pairs(require("mongotx.engine").failure_text) do CANCELLING[code] = true end

-- A failure of driving T that ended with T cancelled (an op that could
-- not apply): "cancelled"; nil, err otherwise.
local function failed_or_cancelled(eng, T, err)
  if CANCELLING[err.code] then
    local again = eng:get(T._id)
    if again and again.state == "cancelled" then return "cancelled" end
  end
  return nil, err
end

-- Recovers one stale transaction; returns what happened: "done",
-- "cancelled", "skipped" or "parked", or nil, err.
local function recover_one(eng, T, now, me)
  local route, err = triage(eng, T, now, me)
  if route == "own" then
    local final
    final, err = eng:drive(T, nil)
    if final then return "done" end
    return failed_or_cancelled(eng, T, err)
  end
  if route ~= "claim" then return route, err end
  local versions
  if T.state == "initial" or T.state == "pending" then
    versions, err = eng:versions(T)
    if not versions then return nil, err end
  end
  local was = T.state
  local claimed
  claimed, err = eng:claim(T, was == "initial" and { state = "pending" } or nil, now)
  if claimed == nil then return nil, err end
  if not claimed then return "skipped" end
  T = claimed
  -- a stale initial one was never started: stale_initial decided it
  if was == "pending" then
    local way, reason, cause = stale_way(eng, T)
    if way == "back" then
      local epoch = T.epoch
      T, err = eng:cancel(T, reason, cause)
      if not T then return nil, err end
      -- still pending: another claim came after ours (its owner drives
      -- it now); never forward (a hold would be captured)
      if T.state == "pending" then
        eng:hold(T._id, nil)
        return "skipped"
      end
      expired(eng, T, epoch)
      versions = nil
    end
  end
  local final
  final, err = eng:drive(T, versions)
  if final then return "done" end
  return failed_or_cancelled(eng, T, err)
end

-- Batches ------------------------------------------------------------------

-- Entries of a batch: { T = <the transaction>, was = <its state as read>,
-- outcome = "done" | "cancelled" | "skipped", err = <why it failed>,
-- slow = <goes on one at a time> } (the fields mongotx.batch reads too).

local fail, raised_in, guarded = batch.fail, batch.raised_in, batch.guarded

-- Drives entry e on alone, from where it stands now.
local function alone(eng, e)
  forward.again(eng, e)
  if e.err then
    e.outcome, e.err = failed_or_cancelled(eng, e.T, e.err)
  else
    e.outcome = "done"
  end
end

-- Groups items by the collection of their op: by_coll[name] = { ... },
-- names in the order first seen.
local function by_collection(entries, each)
  local by_coll, order = {}, {}
  for _, e in ipairs(entries) do
    for i, op in ipairs(e.T.ops) do
      local item = each(e, i, op)
      if item then
        local items = by_coll[op.collection]
        if not items then
          items = {}
          by_coll[op.collection], order[#order + 1] = items, op.collection
        end
        items[#items + 1] = item
      end
    end
  end
  return by_coll, order
end

-- The claimed initial and pending entries: forward (apply, commit, those
-- left behind one at a time); the committed ones are left `applied` for
-- finish, a failure that ended in a cancel is that outcome.
local function drive_forward(eng, entries, versions, deadline)
  forward.forward(eng, entries, versions, deadline)
  for _, e in ipairs(entries) do
    if e.err then e.outcome, e.err = failed_or_cancelled(eng, e.T, e.err) end
  end
end

-- Which entries' ops in collection `name` (items { tid, op, entry }) still
-- carry their marker: one read.  Returns a set of entries, or nil, err.
local function still_marked(eng, name, items)
  local ids = {}
  for k, item in ipairs(items) do ids[k] = item.op.id end
  local docs, err = eng:coll(name):find_all({ _id = { ["$in"] = ids } },
    { projection = { [eng.marker] = 1 }, sort = { _id = 1 } })
  if not docs then return nil, errors.wrap(err, "undo") end
  local by_id, marked = {}, {}
  for _, doc in ipairs(docs) do by_id[id_key(doc._id)] = doc end
  for _, item in ipairs(items) do
    if has_marker(by_id[id_key(item.op.id)], eng.marker, item.tid) then
      marked[item.entry] = true
    end
  end
  return marked
end

-- canceling (claimed, so taken over: epoch > 1) -> cancelled: undo every
-- op where it applied, fence every document (an apply a former owner
-- prepared can no longer match; Engine:undo_op), then cancelled.  An
-- entry whose marker is still there after the fence (a late apply landed
-- between the two) unwinds alone.
local function back(eng, entries)
  local function each(e, _, op)
    if not e.err and not e.slow then
      return { tid = stored.mark(e.T), op = op, entry = e, takeover = true }
    end
  end
  for _, step in ipairs { "undo", "fence" } do
    local by_coll, order = by_collection(entries, each)
    for _, name in ipairs(order) do
      local items = by_coll[name]
      local res, err = eng:many(step, eng:coll(name), items)
      if not res then
        for _, item in ipairs(items) do fail(item.entry, err) end
      elseif step == "fence" and not (res.ok and res.matched + res.upserted == #items) then
        -- a document missing (nothing to fence) or marked again
        local marked
        marked, err = still_marked(eng, name, items)
        for _, item in ipairs(items) do
          if not marked then fail(item.entry, err)
          elseif marked[item.entry] then item.entry.slow = "undo" end
        end
      end
    end
    for _, e in ipairs(entries) do
      if not e.err and not e.slow then eng:event(step, { id = e.T._id }) end
    end
  end
  local ids, list = {}, {}
  for _, e in ipairs(entries) do
    if not e.err and not e.slow then list[#list + 1], ids[#ids + 1] = e, e.T._id end
  end
  if #ids > 0 then
    local res, err = eng:many("cancelled", eng.tx, ids)
    for _, e in ipairs(list) do
      if not res then fail(e, err)
      elseif res.moved == #ids then
        e.outcome = "cancelled"
        eng:hold(e.T._id, nil)
        eng:event("cancelled", { id = e.T._id, reason = e.T.reason, cause = e.T.cause })
      else
        e.slow = "cancelled" -- somebody else moved some: look at each
      end
    end
  end
  for _, e in ipairs(entries) do
    if e.slow and not e.err then guarded(alone, eng, e) end
  end
end

-- Claims the entries (all triaged "claim") in one bulk write, after
-- reading the versions that fence them (forward.claim), and routes the
-- ones won by the state each is in: pending (forward, with its versions),
-- canceling (back), applied (finish), anything else alone.  A lost claim
-- is "skipped", as recover_one's is.
local function claim(eng, entries, now)
  local routes = { forward = {}, versions = {}, back = {}, applied = {}, alone = {} }
  local claimed, versions, deadline = forward.claim(eng, entries, now)
  if not claimed then
    for _, e in ipairs(entries) do fail(e, versions) end
    return routes
  end
  for i, e in ipairs(entries) do
    local vs = versions[i]
    if not claimed[i] then
      e.outcome = "skipped"
    else
      e.T = claimed[i]
      if e.was == "pending" then
        local ok, way, reason, cause = pcall(stale_way, eng, e.T)
        if not ok then
          raised_in(e, way)
        elseif way == "back" then
          local epoch = e.T.epoch
          local T, err = eng:cancel(e.T, reason, cause)
          if T then expired(eng, T, epoch) end
          if not T then
            fail(e, err)
          elseif T.state == "pending" then
            e.outcome = "skipped" -- as recover_one: another claim came after ours
          else
            e.T = T
          end
        end
      end
      local state = not e.err and not e.outcome and e.T.state -- (a failure is reported)
      if state == "pending" then
        local n = #routes.forward + 1
        routes.forward[n], routes.versions[n] = e, vs
      elseif state == "canceling" then
        routes.back[#routes.back + 1] = e
      elseif state == "applied" then
        routes.applied[#routes.applied + 1] = e
      elseif state then
        routes.alone[#routes.alone + 1] = e
      end
    end
  end
  return routes, deadline
end

-- Recovers one batch of stale transactions (as read, well-formed);
-- outcomes and failures go into the entries.
local function recover_batch(eng, entries, now, me)
  local claims = {}
  for _, e in ipairs(entries) do
    local ok, route, err = pcall(triage, eng, e.T, now, me)
    if not ok then
      raised_in(e, route)
    elseif route == "claim" then
      claims[#claims + 1] = e
    elseif route == "own" then
      guarded(alone, eng, e)
    elseif route then
      e.outcome = route
    else
      fail(e, err)
    end
  end
  if #claims == 0 then return end
  local routes, deadline = claim(eng, claims, now)
  if #routes.forward > 0 then drive_forward(eng, routes.forward, routes.versions, deadline) end
  if #routes.back > 0 then back(eng, routes.back) end
  for _, e in ipairs(routes.alone) do guarded(alone, eng, e) end
  -- finish the applied ones, claimed so or committed above, together
  local finish, list = {}, {}
  for _, e in ipairs(routes.applied) do finish[#finish + 1] = e end
  for _, e in ipairs(routes.forward) do
    if not e.err and not e.outcome then
      if e.T.state == "applied" then finish[#finish + 1] = e
      elseif e.T.state == "done" then e.outcome = "done" end
    end
  end
  for i, e in ipairs(finish) do list[i] = e.T end
  if #list > 0 then
    local _, err = batch.finish(eng, list)
    for _, e in ipairs(finish) do
      if e.T.state == "done" then e.outcome = "done" else fail(e, err) end
    end
  end
  for _, e in ipairs(claims) do
    if e.outcome then eng:hold(e.T._id, nil) end -- settled: nothing to fence
  end
end

-- How many documents a pass reads beyond its `limit`: room for the
-- malformed ones among the oldest (below).  The read is bounded, so a
-- pass costs what it drives whatever the backlog, on a server that sends
-- a whole result in one reply (mongo-java-server) as on one that sends
-- 101 documents, then 16 MiB at a time (MongoDB).
_M.MARGIN = 100

-- The most documents one reply brings: the client holds that many
-- undecoded and `size` decoded, whatever `limit` is.
_M.READ = 1000

-- The cursor over the active transactions a pass may take: mongotx's own
-- (stored.OWN: not another writer's), not parked,
-- not tried in the last stale_after seconds (`triedAt`, set when a try
-- fails: a failure is tried again no sooner than a stale transaction is
-- first, so passes in quick succession, as a `mongotx recover` sweep runs
-- them, cannot spend its max_attempts in seconds; stale_after = 0 waits
-- for nothing), not changed since the pass began (the pass's own writes
-- move lastModified on: on a server whose cursor reads on as it goes,
-- MongoDB, a transaction this pass claimed and failed must not come back
-- in a later chunk), oldest first; at most limit + MARGIN of them, READ
-- a reply.  SLACK_MS: a create stamps lastModified, and the pass takes
-- `now` (Engine:pass_now), from estimates of the server's clock, which may
-- be off; a write of the pass's own seen again is safely driven again.
local SLACK_MS = 1000
local function stale_cursor(eng, limit, size, now)
  local filter = { state = { ["$in"] = ACTIVE }, parked = { ["$ne"] = true }, ops = stored.OWN,
                   lastModified = { ["$not"] = { ["$gt"] = Date(now + SLACK_MS) } },
                   ["$nor"] = { holds.not_due(now) } }
  if eng.policy.stale_after > 0 then
    filter["$or"] = { { triedAt = { ["$exists"] = false } },
      { triedAt = { ["$lt"] = Date(math.floor(now - eng.policy.stale_after * 1000)) } } }
  end
  local most = limit + _M.MARGIN
  return eng.tx:find(filter, { sort = { lastModified = 1 }, limit = most,
                               batch_size = math.min(most, math.max(size, _M.READ)) })
end

-- The next up to `n` well-formed transactions of the cursor, and true
-- when the cursor has ended; nil, err.  A malformed one
-- (validate.malformed) is counted in report.malformed and listed in
-- report.errors (the first `limit` of them), never written: it is
-- evidence for an operator.  Malformed ones do not count against the
-- limit, only against the margin: up to MARGIN of them older than the
-- well-formed ones cannot starve these; more hold them back until someone
-- removes them (every pass reports the ones it reads).
local function next_chunk(eng, cursor, n, limit, report)
  local list = {}
  while #list < n do
    local T, err = cursor:next()
    if not T then
      if err then return nil, errors.wrap(err, "recover") end
      return list, true
    end
    local why = validate.malformed(T, eng.vctx)
    if not why then
      list[#list + 1] = T
    else
      report.malformed = report.malformed + 1
      if report.malformed <= limit then
        report.errors[#report.errors + 1] = { id = T._id, error = errors.new("malformed",
          "malformed transaction, left as it is: " .. why, { step = "recover", id = T._id }) }
      end
    end
  end
  return list
end

-- Counts a failure of T in the report and on T, so that a transaction
-- that keeps failing is parked (with this reason) instead of blocking
-- every pass, and notes when (triedAt, by the server's clock: stale_cursor
-- waits before the next try).
local function failed(eng, report, T, e)
  report.failed = report.failed + 1
  report.errors[#report.errors + 1] = { id = T._id, error = e }
  eng.tx:update_one({ _id = T._id }, { ["$inc"] = { attempts = 1 },
    ["$set"] = { reason = tostring(e) }, ["$currentDate"] = { triedAt = true } }, eng.wopts)
end

-- The list cut into batches of at most `size`; a transaction begun with
-- other marker or version fields than this manager's (mongotx.stored) is
-- a batch of its own: a batch's steps are bound to one form.
local function chunks(eng, list, size)
  local out, cur = {}, {}
  for _, T in ipairs(list) do
    if eng:form(T) ~= eng.own then
      out[#out + 1] = { T }
    else
      cur[#cur + 1] = T
      if #cur == size then out[#out + 1], cur = cur, {} end
    end
  end
  if #cur > 0 then out[#out + 1] = cur end
  return out
end

-- How many transactions a pass recovers together by default.
_M.BATCH = 100

-- Drives the transactions of `list` (a chunk of the pass, at most `size`)
-- together (alone when there is one; chunks() sets apart those of another
-- form); outcomes and failures go into the report.
local function drive(eng, list, report, now, me)
  for _, chunk in ipairs(chunks(eng, list, #list)) do
    local entries = {}
    for i, T in ipairs(chunk) do entries[i] = { T = live(T), was = T.state } end
    local ok, raised
    if #entries == 1 then
      local e = entries[1]
      ok, raised, e.err = pcall(recover_one, eng, e.T, now, me)
      e.outcome = ok and raised or nil
    else
      ok, raised = pcall(recover_batch, eng, entries, now, me)
    end
    for _, e in ipairs(entries) do
      if not ok and not e.outcome then raised_in(e, raised) end
      if e.outcome and not e.err then
        report[e.outcome] = report[e.outcome] + 1
      else
        failed(eng, report, e.T, e.err or errors.new("state", "not settled", { id = e.T._id }))
      end
    end
  end
end

-- Finds up to `limit` stale transactions and drives each to done or
-- cancelled under the policies, `size` at a time (1: each alone).  The
-- pass streams: it decodes `size` transactions, drives them and lets
-- them go before it reads on, so what it holds is bounded by the batch
-- (and the server's reply of at most READ), not by `limit`; what it reads
-- is bounded by limit + MARGIN.
-- Returns a report: { examined, done, cancelled, skipped, parked, failed,
-- malformed, errors = { {id, error}, ... } } (the shape callers and
-- specs compare whole; client:counters() tells the round trips), or nil,
-- err when the read fails (what was driven before stays driven).
function _M.recover(eng, limit, size)
  size = size or 1
  local now, err = eng:pass_now()
  if not now then return nil, err end
  local me = eng:me()
  local report = { examined = 0, done = 0, cancelled = 0, skipped = 0, parked = 0,
                   failed = 0, malformed = 0, errors = {} }
  -- the same table as the pass's `recover` event: a listener times the
  -- pass from one to the other (mongotx.metrics)
  eng:event("recovering", report)
  -- Oldest first; whether each one is stale enough is the policy's call
  -- (a holder may have declared a shorter lease than this manager's).
  local cursor = stale_cursor(eng, limit, size, now)
  local ended = false
  while not ended and report.examined < limit do
    local list
    list, ended = next_chunk(eng, cursor, math.min(size, limit - report.examined), limit, report)
    if not list then
      cursor:close()
      return nil, ended -- the read's error
    end
    report.examined = report.examined + #list
    if #list > 0 then drive(eng, list, report, now, me) end
  end
  cursor:close()
  eng:event("recover", report)
  -- then a listener that counts transactions (mongotx.metrics) reads
  -- back those it counted begun and saw no end of
  if eng:listening() then
    eng:event("reconcile", { age = eng.policy.stale_after,
                             find = function(ids) return eng:states(ids) end,
                             clock = function() return eng:clock() end })
  end
  return report
end

return _M

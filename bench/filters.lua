-- bench/filters.lua: what one single-document write costs the server by
-- the shape of its filter, on 10 and on 10 000 documents.  The protocol's
-- writes are conditioned (`_id` plus a marker or state condition) where a
-- raw $inc filters on `_id` alone; on a server that answers a conditioned
-- filter by scanning the collection instead of its `_id` index, the
-- protocol pays per document in the collection, which no batching on the
-- client removes.  bench/run.lua prints this next to its table.
--
--   lua5.4 bench/filters.lua [repeats]      (default 200 per shape)

package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end

local mongotx = require "mongotx"
local bank = require "bench.bank"
local stats = require "bench.stats"

local now = mongotx.core.monotonic_ms
local repeats = tonumber(arg[1]) or 200
local uri = assert(os.getenv("MONGOTX_TEST_URI"), "MONGOTX_TEST_URI is not set")
local inc = { ["$inc"] = { balance = 0 } }

-- Each shape: a write of document i, unchanged balance (so every run of it
-- matches the same documents).
local shapes = {
  { "update_one {_id}", function(c, i) return c:update_one({ _id = i }, inc, bank.WOPTS) end },
  { "update_one {_id, marker $ne}", function(c, i)
      return c:update_one({ _id = i, pendingTransactions = { ["$ne"] = "t" } }, inc, bank.WOPTS) end },
  -- every apply's isolation condition (docs/guards.md, "Isolation")
  { "update_one {_id, marker $ne, txHeld.0 absent}", function(c, i)
      return c:update_one({ _id = i, pendingTransactions = { ["$ne"] = "t" },
                            ["txHeld.0"] = { ["$exists"] = false } }, inc, bank.WOPTS) end },
  { "update_one {_id, balance $gte}", function(c, i)
      return c:update_one({ _id = i, balance = { ["$gte"] = 0 } }, inc, bank.WOPTS) end },
  { "find_and_modify {_id, marker $ne}", function(c, i)
      return c:find_and_modify({ _id = i, pendingTransactions = { ["$ne"] = "t" } },
        { update = inc, write_concern = bank.WRITE_CONCERN }) end },
  { "find {_id}", function(c, i) return c:find_all({ _id = i }, {}) end },
  { "find {_id, marker $ne}", function(c, i)
      return c:find_all({ _id = i, pendingTransactions = { ["$ne"] = "t" } }, {}) end },
}

local _M = {}

-- Median ms per call of each shape, by collection size:
-- { { shape, [10] = ms, [10000] = ms }, ... }
function _M.measure()
  local out = {}
  for k, s in ipairs(shapes) do out[k] = { shape = s[1] } end
  for _, size in ipairs { 10, 10000 } do
    local db = bank.open(uri, "filters", size)
    local coll = db:collection(bank.COLLECTION)
    for k, s in ipairs(shapes) do
      local lat = {}
      for r = 1, repeats do
        local i = r % size + 1
        local t = now()
        assert(s[2](coll, i))
        lat[r] = now() - t
      end
      out[k][size] = stats.median(lat)
    end
    bank.drop(db)
  end
  return out
end

function _M.markdown(rows)
  local lines = { "| write (one document) | ms on 10 documents | ms on 10 000 documents |", "|---|---|---|" }
  for _, r in ipairs(rows) do
    lines[#lines + 1] = ("| %s | %.3f | %.3f |"):format(r.shape, r[10], r[10000])
  end
  return table.concat(lines, "\n")
end

if arg and arg[0] and arg[0]:match("filters%.lua$") then
  print(_M.markdown(_M.measure()))
end

return _M

-- The child processes of torture/ledger.lua (mongotx.ledger):
--
--   ledger_worker.lua work <uri> <db> <accounts> <seed>   random transfers (min = 0),
--       single and batched, with a committer pass now and then, until killed
--   ledger_worker.lua scenario <uri> <db>   the crash matrix's run: a transfer, a
--       batch of two, a reversal, then the committer
--   ledger_worker.lua commit <uri> <db>     the committer until nothing is left
package.path = "./lua/?.lua;./lua/?/init.lua;./?.lua;" .. package.path
local cpath = os.getenv("MONGOTX_CPATH")
if cpath then package.cpath = cpath .. ";" .. package.cpath end
local mongotx = require "mongotx"

local mode, uri, name = arg[1], arg[2], arg[3]
local db = assert(mongotx.connect(uri, { database = name }))
local L = assert(db:ledger {})

if mode == "work" then
  local accounts = tonumber(arg[4])
  math.randomseed(tonumber(arg[5]))
  local function pick() return "acc" .. math.random(accounts) end
  while true do
    local r = math.random(10)
    if r <= 6 then
      local from, to = pick(), pick()
      if from ~= to then L:transfer(from, to, math.random(1, 30), { min = 0 }) end
    elseif r <= 9 then
      local list = {}
      for i = 1, 4 do
        local from, to = pick(), pick()
        if from ~= to then list[#list + 1] = { from = from, to = to, amount = math.random(1, 30) } end
        if i == 4 and #list > 0 then L:transfer_many(list, { min = 0 }) end
      end
    else
      assert(L:commit { limit = 50 })
    end
  end
elseif mode == "scenario" then
  assert(L:transfer("A", "B", 10, { min = 0 }))
  L:transfer_many({ { from = "B", to = "C", amount = 5 }, { from = "C", to = "A", amount = 1 } }, { min = 0 })
  local t = assert(L:transfer("A", "C", 20, { min = 0, id = "t" }))
  assert(L:reverse(t._id, { min = 0 }))
  assert(L:commit())
elseif mode == "commit" then
  repeat local r = assert(L:commit { limit = 10000 }) until r.uncommitted == 0
else
  error("unknown mode " .. tostring(mode))
end
io.stdout:write("ok\n")

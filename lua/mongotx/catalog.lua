-- Does a collection exist?  Asked with listCollections, which creates
-- nothing: a manager made for a mistyped name would create it (its index
-- does), so the `mongotx` command and resty.recovery ask first.  Names
-- are compared here, not only by the server: mongo-java-server ignores
-- listCollections' name filter and answers with every collection.

local core = require "mongotx.core"

local ipairs = ipairs

local _M = {}

-- Collections per batch of the answer (a server that ignores the filter
-- sends them all).
local BATCH = 100

-- A cursor id as the server wants it back: an Int64 (LuaJIT decodes one
-- past 2^53 to an Int64 already, anything else to a number).
local function long(id)
  if core.type(id) == "long" then return id end
  return core.Int64(id)
end

-- has_collection(client, database, name) -> true or false, or nil, err;
-- client is a core client.
function _M.has_collection(client, database, name)
  local reply, err = client:command(database, core.doc("listCollections", 1,
    "filter", { name = name }, "nameOnly", true, "cursor", { batchSize = BATCH }))
  while reply do
    local cursor = reply.cursor
    for _, c in ipairs(cursor.firstBatch or cursor.nextBatch) do
      if c.name == name then
        if cursor.id ~= 0 then -- not read to its end: the server may free it now
          client:command(database, core.doc("killCursors", "$cmd.listCollections",
            "cursors", core.array { long(cursor.id) }))
        end
        return true
      end
    end
    if cursor.id == 0 then return false end
    reply, err = client:command(database, core.doc("getMore", long(cursor.id),
      "collection", "$cmd.listCollections", "batchSize", BATCH))
  end
  return nil, err
end

return _M

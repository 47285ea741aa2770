-- How many update statements one write command of a batched step carries
-- (Engine:many).  Everywhere but on FerretDB v1, all of them: libmongoc
-- cuts a bulk write at the server's maxWriteBatchSize.
--
-- FerretDB v1 (checked on v1.24.0, SQLite backend) keeps the read of every
-- single-document update statement open until its whole `update` command
-- ends: internal/handler/msg_update.go defers closing each statement's
-- query inside its loop over the statements, and the limit of one
-- document stops reading without closing it.  Each open read holds one of
-- the database's SQLite connections, at most 100
-- (backends/sqlite/metadata/pool/opendb.go, SetMaxOpenConns(100)), and
-- each statement's write needs one more: the 100th statement that matches
-- waits for a connection forever, and its client for the reply.  There a
-- batched step sends FERRETDB_V1 statements a command, which leaves room
-- for three such commands at once.

local errors = require "mongotx.errors"

local ipairs, pairs, setmetatable, type = ipairs, pairs, setmetatable, type

local _M = {}

_M.FERRETDB_V1 = 25

-- The steps that send an update statement per item of their list (finish
-- one per op, in the collection its next argument names, of each
-- transaction of its list).
local ITEMS = { apply = true, claim = true, undo = true, fence = true }

-- client -> FerretDB v1's version, or false for another server (asked
-- once a client).
local known = setmetatable({}, { __mode = "k" })

-- The FerretDB v1 version `client`'s server is ("v1.24.0"), or false for
-- any other server; nil, err when it could not be asked.  buildInfo names
-- FerretDB (ferretdbVersion): one round trip a client, asked when a
-- manager is made (mongotx.manager: v1 does not isolate updates of one
-- document) or a step has more statements than FERRETDB_V1.
function _M.ferretdb_v1(client)
  local v = known[client]
  if v == nil then
    local reply, err = client:command("admin", { buildInfo = 1 })
    if not reply then return nil, err end
    v = reply.ferretdbVersion
    v = type(v) == "string" and v:match("^v?1%.") ~= nil and v
    known[client] = v
  end
  return v
end

-- The most statements a write command to `client`'s server may carry, or
-- false for no limit; nil, err when the server could not be asked.
local function cap_of(client)
  local v, err = _M.ferretdb_v1(client)
  if v == nil then return nil, err end
  return v and _M.FERRETDB_V1
end

-- The calls' lists, each of at most `cap` statements (for finish, pieces
-- of the transactions: { _id, mark, ops = <some of its ops in collection
-- `name`> }, a transaction's ops cut between two calls where it
-- straddles them: each op's finish stands alone); nil when `list` fits
-- in one.
local function cut(step, list, cap, name)
  local chunks, cur, n = {}, {}, 0
  for _, item in ipairs(list) do
    local piece
    for _, op in ipairs(step == "finish" and item.ops or { item }) do
      if step ~= "finish" or op.collection == name then
        if n == cap then chunks[#chunks + 1], cur, n, piece = cur, {}, 0, nil end
        if step ~= "finish" then
          cur[#cur + 1] = item
        else
          if not piece then
            piece = { _id = item._id, mark = item.mark, ops = {} }
            cur[#cur + 1] = piece
          end
          piece.ops[#piece.ops + 1] = op
        end
        n = n + 1
      end
    end
  end
  chunks[#chunks + 1] = cur
  return #chunks > 1 and chunks or nil
end

local COUNTS = { "inserted", "matched", "modified", "deleted", "upserted" }

-- Runs run(coll, list, ...) (a step's call with its retries) in as many
-- commands as `client`'s server needs (false: a server known not to be
-- FerretDB v1), and returns the bulk results merged as one (items at
-- their index in `list`'s statements), or nil, err at the first that
-- fails (the ones before stand: as when a server cuts a bulk).
function _M.run(client, step, run, coll, list, ...)
  if not client or not (ITEMS[step] or step == "finish") then return run(coll, list, ...) end
  local size = #list
  if step == "finish" then
    size = 0
    for _, T in ipairs(list) do
      for _, op in ipairs(T.ops) do
        if op.collection == ... then size = size + 1 end
      end
    end
  end
  if size <= _M.FERRETDB_V1 then return run(coll, list, ...) end
  local cap, err = cap_of(client)
  if cap == nil then return nil, errors.wrap(err, step) end
  local chunks = cap and cut(step, list, cap, ...)
  if not chunks then return run(coll, list, ...) end
  local total = { ok = true, items = {} }
  for _, k in ipairs(COUNTS) do total[k] = 0 end
  local offset = 0
  for _, chunk in ipairs(chunks) do
    local res
    res, err = run(coll, chunk, ...)
    if not res then return nil, err end
    for _, k in ipairs(COUNTS) do total[k] = total[k] + res[k] end
    total.ok = total.ok and res.ok
    for i, item in pairs(res.items) do total.items[offset + i] = item end
    if step == "finish" then
      for _, T in ipairs(chunk) do offset = offset + #T.ops end
    else
      offset = offset + #chunk
    end
  end
  return total
end

return _M

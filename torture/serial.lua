-- The serial-order check (docs/guards.md, "Isolation"), after Elle: the
-- transactions of the workload each push their id onto the `log` array of
-- a few shared documents (`serial`: s1..sN), an exclusive op undone by a
-- `$pop`, which erases another transaction's entry when two interleave.
-- Each document's log gives the order its writers took effect in: a
-- precedence graph over the transactions, with an edge from each entry to
-- the next on every document.  One serial order exists only when the
-- graph has no cycle.  At every poll (a read of the documents while the
-- workload runs) the graph must have no cycle and no log an entry twice;
-- at the end every done transaction must have its entry on each of its
-- documents (none lost), and no other transaction any.

local array = require("mongotx").array

local M = {}

M.COLLECTION = "serial"
M.DOCS = 4

function M.fixture()
  local docs = {}
  for i = 1, M.DOCS do docs[i] = { _id = "s" .. i, log = array() } end
  return docs
end

-- The op that pushes `name` onto the log of document `doc` ("s1"...).
function M.push(name, doc)
  return { collection = M.COLLECTION, id = doc, update = { ["$push"] = { log = name } },
           undo = { ["$pop"] = { log = 1 } } }
end

-- The ops of transaction `name`: its name pushed onto `n` (default 2) of
-- the documents, in a random order.
function M.ops(name, n)
  local picks, ops = {}, {}
  n = n or 2
  while #ops < n do
    local k = math.random(M.DOCS)
    if not picks[k] then
      picks[k] = true
      ops[#ops + 1] = M.push(name, "s" .. k)
    end
  end
  return ops
end

local function log_of(doc)
  return type(doc.log) == "table" and doc.log or {}
end

-- Violations (strings) in docs (the documents as read at one moment): an
-- entry twice in a log, or a cycle in the precedence graph.
function M.poll(docs)
  local out, edges = {}, {}
  for _, doc in ipairs(docs) do
    local seen = {}
    local log = log_of(doc)
    for i, x in ipairs(log) do
      x = tostring(x)
      if seen[x] then
        out[#out + 1] = ("serial/%s holds %s twice"):format(tostring(doc._id), x)
      end
      seen[x] = true
      if i > 1 then
        local a = tostring(log[i - 1])
        edges[a] = edges[a] or {}
        edges[a][x] = tostring(doc._id)
      end
    end
  end
  -- a cycle: depth first, colouring grey while on the path
  local colour, path = {}, {}
  local function visit(a)
    colour[a] = "grey"
    path[#path + 1] = a
    for b in pairs(edges[a] or {}) do
      if colour[b] == "grey" then
        local from = #path
        while path[from] ~= b do from = from - 1 end
        local cycle = {}
        for i = from, #path do cycle[#cycle + 1] = path[i] end
        cycle[#cycle + 1] = b
        out[#out + 1] = "no serial order: " .. table.concat(cycle, " -> ")
        return true
      elseif not colour[b] and visit(b) then
        return true
      end
    end
    path[#path] = nil
    colour[a] = "black"
  end
  local nodes = {}
  for a in pairs(edges) do nodes[#nodes + 1] = a end
  table.sort(nodes)
  for _, a in ipairs(nodes) do
    if not colour[a] and visit(a) then break end
  end
  return out
end

-- The final check: poll's, and each transaction of `txs` (stored, with
-- their ops; key(T) its name in the logs) whose ops push onto serial
-- documents has its entry on each of them when done, on none otherwise.
function M.final(docs, txs, key)
  local out = M.poll(docs)
  local logs = {}
  for _, doc in ipairs(docs) do
    local set = {}
    for _, x in ipairs(log_of(doc)) do set[tostring(x)] = true end
    logs[tostring(doc._id)] = set
  end
  for _, T in ipairs(txs) do
    for _, op in ipairs(T.ops or {}) do
      local push = op.collection == M.COLLECTION and type(op.update) == "table"
        and op.update["$push"]
      if push then
        local name, on = tostring(push.log), logs[tostring(op.id)] or {}
        if T.state == "done" and not on[name] then
          out[#out + 1] = ("serial/%s lost the entry of done %s"):format(tostring(op.id), key(T))
        elseif T.state ~= "done" and on[name] then
          out[#out + 1] = ("serial/%s holds the entry of %s %s"):format(tostring(op.id),
            tostring(T.state), key(T))
        end
      end
    end
  end
  return out
end

return M

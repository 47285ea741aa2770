-- bench/latency.lua: a network's round trip between the benchmark's client
-- and the server.  Starts toxiproxy (spec/support/setup.sh toxiproxy) on
-- loopback in front of the server, configures it through its HTTP API
-- (curl), and sets the latency toxics of each level.
--
--   local latency = require "bench.latency"
--   local proxy = assert(latency.start(uri))  -- proxy.uri goes through it
--   proxy:set(level)                           -- one of latency.LEVELS
--   latency.ping(proxy.uri, 200)               -- measured round trip, ms
--   proxy:stop()
--
-- toxiproxy's latency toxic counts whole milliseconds (latency and jitter
-- are integers) and delays the data of one direction by latency ± jitter,
-- a negative delay passing at once.  So:
--   1 ms:   1 ms on the requests (upstream), none on the replies: every
--           round trip takes 1 ms more.
--   0.2 ms: no constant delay below 1 ms exists; latency = -3, jitter = 5
--           in both directions delays one message in ten by 1 ms (-8 .. +1
--           ms, uniform): 0.2 ms a round trip on average (81 % of round
--           trips undelayed, 18 % +1 ms, 1 % +2 ms).  Sequential round
--           trips add up, so throughput sees the mean; p50/p99 see the
--           two peaks, not a 0.2 ms network.
-- Each level's measured round trip (ping, below) is printed with the table.

local mongotx = require "mongotx"
local server = require "spec.support.server"

local q, capture = server.quote, server.capture
local now = mongotx.core.monotonic_ms

local _M = {}

local function toxic(stream, latency, jitter)
  return { name = "latency_" .. stream, type = "latency", stream = stream,
           attributes = { latency = latency, jitter = jitter } }
end

-- key: the suffix of the rows' keys (raw@1ms); rtt: the round trip added
-- (ms, on average); toxics: what the proxy gets for it.
_M.LEVELS = {
  { key = "0.2ms", rtt = 0.2, label = "0.2 ms",
    toxics = { toxic("upstream", -3, 5), toxic("downstream", -3, 5) } },
  { key = "1ms", rtt = 1, label = "1 ms", toxics = { toxic("upstream", 1, 0) } },
}

local BIN = server.cache .. "/bin/toxiproxy-server"

-- A JSON object from a flat Lua table (strings, numbers, nested tables
-- with string keys): enough for toxiproxy's requests.
local function json(v)
  if type(v) == "table" then
    local parts = {}
    for k, x in pairs(v) do parts[#parts + 1] = ("%q:%s"):format(k, json(x)) end
    table.sort(parts)
    return "{" .. table.concat(parts, ",") .. "}"
  elseif type(v) == "string" then
    return ("%q"):format(v)
  end
  return tostring(v)
end

local Proxy = {}
Proxy.__index = Proxy

-- One request to the API; returns the body, or nil and why (curl -f fails
-- on an HTTP error, -S says which).
function Proxy:api(method, path, body)
  local cmd = ("curl -sS -f -X %s %s%s 2>&1"):format(method, q(self.api_url .. path),
    body and (" -H 'Content-Type: application/json' -d " .. q(json(body))) or "")
  local f = assert(io.popen(cmd, "r"))
  local out = f:read("*a")
  local ok = f:close()
  if not ok then return nil, ("toxiproxy: %s %s: %s"):format(method, path, out) end
  return out
end

-- Starts toxiproxy on a free port of 127.0.0.1 with one proxy in front of
-- the server of `uri` (mongodb://host:port/?options); the proxy's own
-- address replaces host:port in proxy.uri.  The server runs under a shell
-- that reads this process's pipe and kills it at EOF, so it dies with us.
function _M.start(uri)
  local f = io.open(BIN, "rb")
  if not f then return nil, "toxiproxy is not set up: run spec/support/setup.sh toxiproxy" end
  f:close()
  local upstream = uri:match("^mongodb://([^/?]+)")
  if not upstream or upstream:find(",", 1, true) or upstream:find("@", 1, true) then
    return nil, "toxiproxy: not one host:port without credentials in " .. uri
  end
  local port = server.free_port()
  if not port then return nil, "toxiproxy: cannot pick a free port (python3 missing?)" end
  local dir = capture("mktemp -d \"${TMPDIR:-/tmp}/mongotx-toxiproxy.XXXXXX\""):gsub("%s+$", "")
  local self = setmetatable({ api_url = ("http://127.0.0.1:%d"):format(port), dir = dir,
                              log = dir .. "/toxiproxy.log" }, Proxy)
  self.pipe = assert(io.popen(("%s -host 127.0.0.1 -port %d < /dev/null >> %s 2>&1 & " ..
    "echo $! > %s; cat > /dev/null; kill $! 2>/dev/null; wait")
    :format(q(BIN), port, q(self.log), q(dir .. "/pid")), "w"))
  local up
  for _ = 1, 200 do
    up = self:api("GET", "/version")
    if up then break end
    server.sleep(0.05)
  end
  if not up then
    self:stop()
    return nil, "toxiproxy did not answer on " .. self.api_url .. "\n" .. (server.readfile(self.log) or "")
  end
  self.version = up:match('"version"%s*:%s*"([^"]*)"') or up
  local created, err = self:api("POST", "/proxies",
    { name = "mongo", listen = "127.0.0.1:0", upstream = upstream, enabled = true })
  if not created then
    self:stop()
    return nil, err
  end
  local listen = created:match('"listen"%s*:%s*"([^"]+)"')
  self.uri = uri:gsub("^mongodb://[^/?]+", "mongodb://" .. listen, 1)
  return self
end

-- Replaces the toxics with those of `level` (nil: none, loopback).
function Proxy:set(level)
  assert(self:api("POST", "/reset"))
  for _, t in ipairs(level and level.toxics or {}) do
    assert(self:api("POST", "/proxies/mongo/toxics", t))
  end
end

-- The round trip to the server of uri (through the proxy as it is set):
-- n `ping` commands on a fresh connection (after one that connects), each
-- timed; returns the median and the mean in ms.
function _M.ping(uri, n)
  local db = assert(mongotx.connect(uri, { database = "admin" }))
  assert(db.client:command("admin", { ping = 1 }))
  local times, sum = {}, 0
  for i = 1, n do
    local t = now()
    assert(db.client:command("admin", { ping = 1 }))
    times[i] = now() - t
    sum = sum + times[i]
  end
  db:close()
  table.sort(times)
  return { median = times[math.ceil(n / 2)], mean = sum / n, n = n }
end

function Proxy:stop()
  if self.pipe then
    self.pipe:close() -- EOF: the wrapping shell kills toxiproxy and waits
    self.pipe = nil
  end
  server.execute("rm -rf " .. q(self.dir))
end

return _M

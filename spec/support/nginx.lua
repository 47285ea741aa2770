-- Starts and stops nginx (Debian's, with its Lua module) for the OpenResty
-- specs (spec/40-openresty_spec.lua) and the OpenResty benchmark: a
-- generated nginx.conf in a prefix of its own, on a free loopback port,
-- serving the handlers of examples/openresty/bank.lua.  Plain LuaJIT, io
-- and os only; HTTP through curl.
--
--   local nginx = require "spec.support.nginx"
--   local n = assert(nginx.start{ workers = 2, uri = uri, database = name })
--   local status, body, seconds = n:request("POST", "/transfer", '{"from":...}')
--   n:workers()   -- the worker pids
--   n:stop()
--
-- start{} options:
--   uri, database  what the handlers use (MONGOTX_URI, MONGOTX_DATABASE)
--   workers        worker_processes (1)
--   threads        threads of thread_pool mongotx (4)
--   vms            lua_worker_thread_vm_pool_size (8)
--   configure      Lua source of a table for bank.configure{...}, merged
--                  over uri and database ("{ manager = {...} }")
--   recovery       false: no recovery timer (default: bank's, with the
--                  configure's recovery table)
--   init_worker    more Lua run in init_worker_by_lua after bank's
--   locations      more location blocks (the spec's own endpoints)
--   http           more http-level directives
--   check_client_abort  lua_check_client_abort on (a client that goes
--                  away ends its request's handler)
--   metrics_dict   the size of lua_shared_dict mongotx_metrics ("1m"),
--                  served at /metrics
--   log_level      error_log's level ("notice")
--   reuseport      a listening socket per worker (the kernel spreads new
--                  connections evenly over the workers)
--   env            { NAME = value }: set in the workers' environment (such
--                  as MONGOTX_FAULT, a crash point: csrc/fault.c)
--
-- The nginx master runs in the foreground of a shell that also watches the
-- Lua process which started it: when that process is gone, nginx is
-- stopped, so a killed spec run leaves no nginx behind.

local M = {}

-- The shell and file helpers the test servers use (spec/support/server.lua).
local server = require "spec.support.server"
local q, execute, capture, readfile = server.quote, server.execute, server.capture, server.readfile
local sleep, free_port, alive = server.sleep, server.free_port, server.alive
M.execute, M.readfile, M.alive = execute, readfile, alive

local function writefile(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- This Lua process's pid (/proc/self is the reader itself).
local function my_pid()
  local stat = readfile("/proc/self/stat")
  return tonumber(stat and stat:match("^(%d+)"))
end

-- The repository's root: the specs and the benchmark run from it.
local ROOT = capture("pwd"):gsub("%s+$", "")
local CPATH = os.getenv("MONGOTX_CPATH") or (ROOT .. "/build/luajit/?.so")
if CPATH:sub(1, 1) ~= "/" then CPATH = ROOT .. "/" .. CPATH:gsub("^%./", "") end

M.MODULES = "/usr/lib/nginx/modules"

local function conf(o)
  local env = {}
  for k, v in pairs(o.env or {}) do env[#env + 1] = ("env %s=%s;\n"):format(k, v) end
  local paths = table.concat({ ROOT .. "/examples/openresty/?.lua", ROOT .. "/lua/?.lua",
                               ROOT .. "/lua/?/init.lua", ROOT .. "/?.lua" }, ";")
  local recovery = o.recovery == false and "" or "  bank.init_worker()\n"
  return ([[
load_module %s/ndk_http_module.so;
load_module %s/ngx_http_lua_module.so;
worker_processes %d;
daemon off;
master_process on;
pid logs/nginx.pid;
error_log logs/error.log %s;
worker_shutdown_timeout 5s;
%senv MONGOTX_URI;
env MONGOTX_DATABASE;
thread_pool mongotx threads=%d;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path logs/body;
  lua_package_path "%s;;";
  lua_package_cpath "%s;;";
  lua_worker_thread_vm_pool_size %d;
  lua_shared_dict mongotx 1m;
  lua_shared_dict mongotx_metrics %s;
  lua_check_client_abort %s;
  %s
  init_worker_by_lua_block {
    local bank = require "bank"
    local conf = %s
    conf.uri = os.getenv("MONGOTX_URI")
    conf.database = os.getenv("MONGOTX_DATABASE")
    bank.configure(conf)
%s    %s
  }
  server {
    listen 127.0.0.1:%d%s;
    client_max_body_size 8k;
    client_body_buffer_size 8k;
    error_page 413 @too_large;
    location @too_large {
      default_type application/json;
      return 413 '{"error":"too_large","message":"the body is larger than 8 KiB"}\n';
    }
    location = /transfer { content_by_lua_block { require("bank").transfer() } }
    location = /hold { content_by_lua_block { require("bank").hold() } }
    location = /capture { content_by_lua_block { require("bank").capture() } }
    location = /void { content_by_lua_block { require("bank").void() } }
    location = /direct/transfer { content_by_lua_block { require("bank").transfer{ offload = false } } }
    location ~ ^/tx/(?<txid>[^/]+)$ { content_by_lua_block { require("bank").get_tx(ngx.var.txid) } }
    location = /ping { content_by_lua_block { ngx.say("pong") } }
    location = /metrics { content_by_lua_block { require("bank").metrics() } }
    %s
  }
}
]]):format(M.MODULES, M.MODULES, o.workers or 1, o.log_level or "notice", table.concat(env),
           o.threads or 4, paths, CPATH, o.vms or 8,
           o.metrics_dict or "1m", o.check_client_abort and "on" or "off", o.http or "", o.configure or "{}",
           recovery, o.init_worker or "", o.port, o.reuseport and " reuseport" or "", o.locations or "")
end

local Nginx = {}
Nginx.__index = Nginx

function M.start(o)
  o = o or {}
  local self = setmetatable({}, Nginx)
  self.prefix = capture("mktemp -d \"${TMPDIR:-/tmp}/mongotx-nginx.XXXXXX\""):gsub("%s+$", "")
  if self.prefix == "" then return nil, "mktemp -d failed" end
  execute("mkdir -p " .. q(self.prefix .. "/logs") .. " " .. q(self.prefix .. "/conf"))
  o.port = o.port or free_port()
  if not o.port then return nil, "cannot pick a free port (python3 missing?)" end
  self.port, self.log = o.port, self.prefix .. "/logs/error.log"
  writefile(self.prefix .. "/conf/nginx.conf", conf(o))
  local watcher = my_pid()
  -- nginx in the foreground; the shell stops it once the watched process
  -- is gone (or when told to by stop(), through the pid file)
  local script = ([[
cd %s || exit 1
MONGOTX_URI=%s MONGOTX_DATABASE=%s nginx -p %s -c conf/nginx.conf -e logs/error.log > logs/stdout 2>&1 &
n=$!
echo $n > logs/master.pid
while kill -0 $n 2>/dev/null; do
  if ! kill -0 %d 2>/dev/null; then kill -QUIT $n; sleep 2; kill -KILL $n 2>/dev/null; break; fi
  sleep 0.5
done
]]):format(q(self.prefix), q(o.uri or ""), q(o.database or ""), q(self.prefix), watcher)
  writefile(self.prefix .. "/run.sh", script)
  execute("setsid bash " .. q(self.prefix .. "/run.sh") .. " > /dev/null 2>&1 < /dev/null &")
  for _ = 1, 200 do
    local pid = tonumber((readfile(self.prefix .. "/logs/master.pid") or ""):match("%d+"))
    if pid and not self.pid then self.pid = pid end
    if self.pid and not alive(self.pid) then
      return nil, "nginx exited: " .. (readfile(self.log) or "") .. (readfile(self.prefix ..
        "/logs/stdout") or "")
    end
    if self.pid and #self:workers() >= (o.workers or 1) and self:request("GET", "/ping") == 200 then
      return self
    end
    sleep(0.05)
  end
  self:stop()
  return nil, "nginx did not answer /ping within 10 s: " .. (readfile(self.log) or "")
end

function Nginx:url(path)
  return ("http://127.0.0.1:%d%s"):format(self.port, path)
end

-- The worker pids (children of the master), sorted.
function Nginx:workers()
  local out = {}
  if not self.pid then return out end
  for pid in capture("pgrep -P " .. self.pid .. " 2>/dev/null"):gmatch("%d+") do
    out[#out + 1] = tonumber(pid)
  end
  table.sort(out)
  return out
end

-- A new file name in the prefix (the files of every request apart).
local function scratch(self, what)
  self.files = (self.files or 0) + 1
  return ("%s/logs/%s-%d"):format(self.prefix, what, self.files)
end

local function curl_command(self, method, path, body, opts)
  opts = opts or {}
  local out = scratch(self, "response")
  local args = { "curl -s -o " .. q(out), "-w '%{http_code} %{time_total}'", "-X", method,
                 "--max-time", tostring(opts.timeout or 30) }
  if body then
    local file = scratch(self, "request")
    writefile(file, body)
    args[#args + 1] = "-H 'Content-Type: application/json' --data-binary @" .. q(file)
  end
  for k, v in pairs(opts.headers or {}) do args[#args + 1] = "-H " .. q(k .. ": " .. v) end
  args[#args + 1] = q(self:url(path))
  return table.concat(args, " "), out
end

local function parse(res, out)
  local code, t = res:match("(%d+) ([%d.]+)")
  local body = readfile(out) or ""
  os.remove(out)
  return tonumber(code), body, tonumber(t)
end

-- request(method, path [, body [, { headers, timeout }]]) -> status (0 when
-- the request failed), body, seconds (curl's time_total).
function Nginx:request(method, path, body, opts)
  local cmd, out = curl_command(self, method, path, body, opts)
  return parse(capture(cmd .. " 2>/dev/null"), out)
end

-- The same in the background: returns a handle whose :wait() gives what
-- request() would.
function Nginx:spawn(method, path, body, opts)
  local cmd, out = curl_command(self, method, path, body, opts)
  local res = scratch(self, "result") -- written when curl is done
  execute("(" .. cmd .. " > " .. q(res .. ".tmp") .. " 2>/dev/null; mv " .. q(res .. ".tmp") ..
          " " .. q(res) .. ") &")
  return {
    wait = function(_, seconds)
      for _ = 1, (seconds or 60) * 20 do
        local s = readfile(res)
        if s then
          os.remove(res)
          return parse(s, out)
        end
        sleep(0.05)
      end
      return nil, "still running"
    end,
  }
end

-- many(list [, { parallel = true, max_time = 30 }]) -> handle: list[i] =
-- { method, path, body, headers }, sent by one curl process, in order
-- one after another or all at once (--parallel); handle:wait(seconds) ->
-- results, results[i] = { status = <0 when it failed>, body = }, or nil,
-- "still running".
function Nginx:many(list, opts)
  opts = opts or {}
  local config, outs = {}, {}
  for i, r in ipairs(list) do
    local out = scratch(self, "response")
    outs[i] = out
    config[#config + 1] = ("url = %q\nrequest = %q\noutput = %q\nmax-time = %g\n" ..
      "write-out = \"%d %%{http_code}\\n\"\n"):format(self:url(r.path), r.method, out,
      opts.max_time or 30, i)
    if r.body then
      local file = scratch(self, "request")
      writefile(file, r.body)
      config[#config + 1] = ("header = \"Content-Type: application/json\"\ndata-binary = %q\n")
        :format("@" .. file)
    end
    for k, v in pairs(r.headers or {}) do
      config[#config + 1] = ("header = %q\n"):format(k .. ": " .. v)
    end
    if i < #list then config[#config + 1] = "next\n" end
  end
  local file, res = scratch(self, "curl-config"), scratch(self, "result")
  writefile(file, table.concat(config))
  local flags = opts.parallel and ("--parallel --parallel-immediate --parallel-max " .. #list) or ""
  execute(("(curl -s %s -K %s > %s.tmp 2>/dev/null; mv %s.tmp %s) &"):format(flags, q(file),
    q(res), q(res), q(res)))
  return {
    wait = function(_, seconds)
      for _ = 1, (seconds or 120) * 20 do
        local s = readfile(res)
        if s then
          os.remove(res)
          os.remove(file)
          local results = {}
          for i in ipairs(list) do results[i] = { status = 0, body = "" } end
          for i, code in s:gmatch("(%d+) (%d+)") do
            i = tonumber(i)
            results[i].status = tonumber(code)
            results[i].body = readfile(outs[i]) or ""
            os.remove(outs[i])
          end
          return results
        end
        sleep(0.05)
      end
      return nil, "still running"
    end,
  }
end

function Nginx:error_log()
  return readfile(self.log) or ""
end

function Nginx:stop()
  if self.pid and alive(self.pid) then
    local workers = self:workers()
    execute("kill -QUIT " .. self.pid)
    for _ = 1, 100 do
      if not alive(self.pid) then break end
      sleep(0.05)
    end
    if alive(self.pid) then execute("kill -KILL " .. self.pid) end
    for _, w in ipairs(workers) do
      if alive(w) then execute("kill -KILL " .. w .. " 2>/dev/null") end
    end
  end
  if not os.getenv("MONGOTX_KEEP_NGINX") then execute("rm -rf " .. q(self.prefix)) end
end

return M

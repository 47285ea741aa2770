-- mongotx.resty.thread: the module every call of mongotx.resty names to
-- ngx.run_worker_thread.  lua-nginx-module requires that module in the
-- nginx worker's event loop, not in the thread, the first time each
-- worker-thread VM runs a call; so this one loads nothing then, and the
-- VM's first call loads mongotx.resty and the engine (about 4 ms of CPU)
-- in its worker thread.  Requiring mongotx.resty itself there stalled
-- every request of the worker for that long at each new VM, up to
-- lua_worker_thread_vm_pool_size times after a start or reload.

local _M = {}

local thread

-- mongotx.resty's thread(kind, spec, method, args), loaded at the first call.
function _M.thread(kind, spec, method, args)
  thread = thread or require("mongotx.resty").thread
  return thread(kind, spec, method, args)
end

return _M

-- A minimal coroutine scheduler for mongotx.group's specs (what a
-- mongotx.pool user with its own scheduler would plug in): runnable
-- coroutines, and waiters on signals with deadlines.
local core = require "mongotx.core"

-- scheduler(): spawn(fn) adds a task; signal(), now(); loop() runs until
-- every task ended.
return function()
  local S = { runnable = {}, waiting = {} }
  local function now() return core.monotonic_ms() / 1000 end
  function S.spawn(fn)
    S.runnable[#S.runnable + 1] = coroutine.create(fn)
    return true
  end
  function S.signal()
    local sig = { posted = 0 }
    function sig.wait(self, seconds)
      if self.posted > 0 then
        self.posted = self.posted - 1
        return true
      end
      local w = { co = coroutine.running(), sig = self, at = now() + seconds }
      S.waiting[#S.waiting + 1] = w
      return coroutine.yield(w)
    end
    function sig.post(self)
      for i, w in ipairs(S.waiting) do
        if w.sig == self then
          table.remove(S.waiting, i)
          w.woken = true
          S.runnable[#S.runnable + 1] = w
          return
        end
      end
      self.posted = self.posted + 1
    end
    return sig
  end
  S.now = now
  function S.loop()
    while #S.runnable > 0 or #S.waiting > 0 do
      if #S.runnable == 0 then
        -- the earliest deadline times out
        local first, k = nil, nil
        for i, w in ipairs(S.waiting) do
          if not first or w.at < first.at then first, k = w, i end
        end
        local left = first.at - now()
        if left > 0 then core.sleep(left) end
        table.remove(S.waiting, k)
        first.woken = false
        S.runnable[#S.runnable + 1] = first
      end
      local item = table.remove(S.runnable, 1)
      local co, arg = item, nil
      if type(item) == "table" then co, arg = item.co, item.woken end
      local ok, err = coroutine.resume(co, arg)
      if not ok then error(debug.traceback(co, err), 0) end
    end
  end
  return S
end

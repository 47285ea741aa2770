-- A policies module (mongotx.resty's `policies`) for spec/73: an op that
-- fails (a false guard, ...) raises in on_op_failure, as a policy that
-- refuses to decide does.
return { on_op_failure = function() error("policy says no") end }

-- A policies module (mongotx.resty's `policies`) that asks for the
-- deferred finish: spec/44 checks that group commit refuses it from a
-- module as it does from the options.
return { finish = "deferred" }

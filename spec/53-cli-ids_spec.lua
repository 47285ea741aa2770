-- Every id type a transaction may have (validate.check_tid: string,
-- integer, Int64, double, ObjectId, Binary, Date, boolean) through every
-- subcommand of `mongotx` that prints or takes an id (issue 26), in its
-- tables, its --json lines and its messages: the command prints an id in
-- its own syntax, and that text pasted back finds the same transaction.
-- Run under the spec's Lua (spec/support/cli.lua): Lua 5.4 decodes an
-- Int64 to an integer, LuaJIT one past 2^53 to an Int64.

local helpers = require "spec.helpers"
local cli = require "spec.support.cli"
local mongotx = require "mongotx"

local core = mongotx.core
local big = core.Int64("9007199254740993") -- 2^53 + 1: no double holds it

-- { name, id, text = what the command prints (a list: either), json = its
-- id in the --json lines }
local IDS = {
  { "a plain string", "order-17", text = { "order-17" }, json = '"order-17"' },
  { "a string that reads as a number", "42", text = { "str:42" }, json = '"42"' },
  { "a string with a prefix of the syntax", "oid:x", text = { "str:oid:x" }, json = '"oid:x"' },
  { "the empty string", "", text = { "str:" }, json = '""' },
  { "an integer", 42, text = { "42" }, json = "42" },
  { "a negative integer", -7, text = { "-7" }, json = "-7" },
  { "a small Int64", core.Int64(5), text = { "5" }, json = "5" },
  { "an Int64 past 2^53", big, text = { "9007199254740993", "long:9007199254740993" },
    json = "9007199254740993" },
  { "a double", 1.5, text = { "1.5" }, json = "1.5" },
  { "an ObjectId", core.ObjectId("5f00000000000000000000aa"),
    text = { "oid:5f00000000000000000000aa" }, json = '{"$oid":"5f00000000000000000000aa"}' },
  { "a Binary", core.Binary("\0\1ab", 0), text = { "bin:00016162" },
    json = '{"$binary":{"base64":"AAFhYg==","subType":"00"}}' },
  { "a Binary of subtype 4", core.Binary(("\17"):rep(16), 4),
    text = { "bin:4:" .. ("11"):rep(16) },
    json = '{"$binary":{"base64":"EREREREREREREREREREREQ==","subType":"04"}}' },
  { "a Date", core.Date(1700000000123), text = { "date:1700000000123" },
    json = '{"$date":"2023-11-14T22:13:20.123Z"}' },
  { "a boolean", true, text = { "bool:true" }, json = "true" },
}

local function escape(s) return (s:gsub("%p", "%%%0")) end

describe("#server ids of every type through every subcommand", function()
  for _, case in ipairs(IDS) do
    it(case[1], function()
      if cli.no_build then pending(cli.no_build) return end
      local db = assert(mongotx.connect(helpers.uri(), { database = helpers.db_name() }))
      local tm = assert(db:manager{ application = "app-1" })
      assert(db:collection("accounts"):insert_many {
        { _id = "A", balance = 100 }, { _id = "B", balance = 100 } })
      assert(tm:begin({
        { collection = "accounts", id = "A", update = { ["$inc"] = { balance = -1 } } },
        { collection = "accounts", id = "B", update = { ["$inc"] = { balance = 1 } } },
      }, { id = case[2] }))
      -- { code, out, err, said = all of it, for messages }
      local function run(...)
        local code, out, err = cli.run({ "--database", db.name, ... })
        return { code = code, out = out, err = err,
                 said = table.concat({ ... }, " ") .. ":\n" .. out .. err }
      end

      -- the table of `list` gives the text; each text it may be is one
      local r = run("list")
      assert.are.equal(0, r.code, r.said)
      local text = r.out:match("\n(%S*)%s+initial ")
      assert.truthy(text, r.said)
      local known = false
      for _, t in ipairs(case.text) do known = known or t == text end
      assert.is_true(known, "printed as " .. text)
      r = run("--json", "list")
      assert.are.equal(0, r.code, r.said)
      assert.truthy(r.out:find('"_id":' .. case.json, 1, true), r.said)
      r = run("status")
      assert.are.equal(0, r.code, r.said)
      assert.truthy(r.out:find("oldest open:%s+[%d.]+ s %(" .. escape(text) .. "%)\n"), r.said)
      r = run("--json", "status")
      assert.truthy(r.out:find('"oldest_id":' .. case.json, 1, true), r.said)

      -- pasted back: show finds this transaction
      r = run("show", "--", text)
      assert.are.equal(0, r.code, r.said)
      assert.truthy(r.out:find("^id:%s+" .. escape(text) .. "\n"), r.said)
      r = run("--json", "show", "--", text)
      assert.are.equal(0, r.code, r.said)
      assert.truthy(r.out:find('"transaction":{"_id":' .. case.json, 1, true)
        or r.out:find('"_id":' .. case.json, 1, true), r.said)

      -- recover's table of failures and its failed events (a policy refuses it)
      local policy = os.tmpname()
      local f = assert(io.open(policy, "w"))
      f:write('return { may_recover = function() error("refused") end }\n')
      f:close()
      r = run("--policy", policy, "recover", "--stale-after", "0",
        "--application", "app-1")
      assert.are.equal(1, r.code, r.said)
      assert.truthy(r.out:find("\n" .. escape(text) .. "%s+policy%s"), r.said)
      local T = assert(tm:get(case[2]))
      assert.are.equal(1, T.attempts)
      r = run("--json", "--policy", policy, "recover", "--stale-after", "0",
        "--application", "app-1")
      os.remove(policy)
      assert.are.equal(1, r.code, r.said)
      assert.truthy(r.out:find('"event":"failed","id":' .. case.json, 1, true), r.said)

      -- a message names the id as the command takes it
      r = run("unpark", "--", text)
      assert.are.equal(1, r.code, r.said)
      assert.truthy(r.err:find("^mongotx: unpark of " .. escape(text) .. ": "), r.said)

      -- recovered, compensated; the answers name it so
      r = run("recover", "--stale-after", "0", "--application", "app-1")
      assert.are.equal(0, r.code, r.said)
      assert.are.equal("done", assert(tm:get(case[2])).state)
      r = run("compensate", "--", text)
      assert.are.equal(0, r.code, r.said)
      assert.truthy(r.out:find("^" .. escape(text) .. ": compensated by %S+ %(done%)\n"), r.said)
      r = run("--json", "compensate", "--", text) -- again: the same one
      assert.are.equal(0, r.code, r.said)
      assert.truthy(r.out:find('^{"id":' .. escape(case.json) .. ',"compensation":'), r.said)
      r = run("rollback", "--", text)
      assert.are.equal(1, r.code, r.said)
      assert.truthy(r.err:find("^mongotx: rollback of " .. escape(text) .. ": "), r.said)
      assert.are.same({ A = 100, B = 100 }, (helpers.balances(db:collection("accounts"))))
      db:close()
    end)
  end
end)

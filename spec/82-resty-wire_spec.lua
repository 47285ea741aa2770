-- mongotx.resty.wire: the values of a call as they cross to a worker
-- thread and back (pack, unpack_list), without nginx or a server.  The
-- calls that cross it against a server: spec/41 (offload = false) and
-- spec/40 (nginx).
local helpers = require "spec.helpers"
local core = helpers.core
local wire = require "mongotx.resty.wire"

local ERROR_MT = getmetatable(core.error({ code = "x" }))

describe("mongotx.resty.wire", function()
  it("gives errors their metatable back at any depth, and counts nils", function()
    local err = core.error({ code = "guard", message = "too little" })
    local out, n = wire.unpack_list(wire.pack(4, { list = { false, { err = err } } }, nil, err, "x"))
    assert.are.equal(4, n)
    assert.is_nil(out[2])
    assert.are.equal("x", out[4])
    assert.are.equal(ERROR_MT, getmetatable(out[3]))
    assert.are.equal("guard", out[3].code)
    assert.is_false(out[1].list[1])
    local inner = out[1].list[2].err
    assert.are.equal(ERROR_MT, getmetatable(inner))
    assert.are.same({ code = "guard", message = "too little" }, setmetatable(inner, nil))
  end)

  it("leaves the values it packs as they were", function()
    local err = core.error({ code = "guard", message = "too little" })
    local res = { err = err, again = err }
    wire.pack(2, res, err)
    assert.are.equal(ERROR_MT, getmetatable(err))
    assert.are.same({ code = "guard", message = "too little" }, setmetatable(err, nil))
    assert.are.same({ "again", "err" }, (function()
      local keys = {}
      for k in pairs(res) do keys[#keys + 1] = k end
      table.sort(keys)
      return keys
    end)())
  end)

  it("takes a string that holds the mark for data", function()
    local v = { s = "__mongotx_error", t = { __note = "__mongotx_error" } }
    local out = wire.unpack_list(wire.pack(1, v))
    assert.are.same(v, out[1])
    assert.are_not.equal(ERROR_MT, getmetatable(out[1]))
    assert.are_not.equal(ERROR_MT, getmetatable(out[1].t))
  end)

  it("answers a table without errors as decoded", function()
    local id = core.ObjectId()
    local out = wire.unpack_list(wire.pack(1, { _id = id, ops = { { id = "A" } } }))
    assert.are.equal(id, out[1]._id)
    assert.are.same({ { id = "A" } }, out[1].ops)
  end)
end)

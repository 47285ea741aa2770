-- The Lua <-> BSON bridge: core.encode/core.decode, the value
-- constructors and core.type.  No server needed.
local helpers = require "spec.helpers"
local core = helpers.core

local LUAJIT = type(jit) == "table"

-- Little-endian integers and a walker over the top-level elements of a
-- BSON document, so that specs can check the bytes themselves (the BSON
-- type of every field and the order of the keys), not only what decode
-- makes of them.  string.byte only: it must run on LuaJIT too.
local function int32(s, pos)
  local a, b, c, d = s:byte(pos, pos + 3)
  local n = a + b * 256 + c * 65536 + d * 16777216
  if n >= 2147483648 then n = n - 4294967296 end
  return n
end

local fixed = {
  [0x01] = 8, [0x07] = 12, [0x08] = 1, [0x09] = 8, [0x0A] = 0, [0x10] = 4,
  [0x11] = 8, [0x12] = 8, [0x13] = 16, [0x7F] = 0, [0xFF] = 0,
}

-- { {key = "a", type = 0x10, pos = <offset of the value>}, ... }
local function elements(bytes)
  assert(int32(bytes, 1) == #bytes, "document length prefix")
  local out, pos = {}, 5
  while bytes:byte(pos) ~= 0 do
    local t = bytes:byte(pos)
    local nul = bytes:find("\0", pos + 1, true)
    local e = { key = bytes:sub(pos + 1, nul - 1), type = t, pos = nul + 1 }
    out[#out + 1] = e
    pos = nul + 1
    if fixed[t] then
      pos = pos + fixed[t]
    elseif t == 0x02 then
      pos = pos + 4 + int32(bytes, pos)
    elseif t == 0x03 or t == 0x04 then
      pos = pos + int32(bytes, pos)
    elseif t == 0x05 then
      pos = pos + 5 + int32(bytes, pos)
    elseif t == 0x0B then
      pos = bytes:find("\0", bytes:find("\0", pos, true) + 1, true) + 1
    else
      error("unexpected BSON type " .. t)
    end
  end
  return out
end

local function keys_of(bytes)
  local keys = {}
  for i, e in ipairs(elements(bytes)) do keys[i] = e.key end
  return keys
end

-- The BSON type byte of field x of core.encode{ x = v }.
local function type_byte(v)
  return elements(core.encode { x = v })[1].type
end

local T = { double = 0x01, string = 0x02, object = 0x03, array = 0x04,
  binData = 0x05, objectId = 0x07, bool = 0x08, date = 0x09, null = 0x0A,
  regex = 0x0B, int = 0x10, timestamp = 0x11, long = 0x12, decimal = 0x13,
  minKey = 0xFF, maxKey = 0x7F }

local function roundtrip(v)
  local bytes = core.encode { x = v }
  local doc = assert(core.decode(bytes))
  return doc.x, bytes, doc
end

local NEG_ZERO = -1 * 0.0

describe("bson bridge", function()

  describe("round trips", function()
    -- every BSON type the bridge makes: value, its $type alias, and a
    -- check on what comes back
    local cases = {
      { "int32", 42, "int" },
      { "int64", 1099511627776, "long" },
      { "double", 1.5, "double" },
      { "string", "h\195\169llo\0world", "string" },
      { "empty string", "", "string" },
      { "true", true, "bool" },
      { "false", false, "bool" },
      { "null", core.null, "null" },
      { "ObjectId", core.ObjectId("5f2b8e1c9d3a4b5c6d7e8f90"), "objectId" },
      { "Date", core.Date(1600000000123), "date" },
      { "negative Date", core.Date(-86400000), "date" },
      { "Int64", core.Int64("1099511627776"), "long" },
      { "Decimal128", core.Decimal128("1234.5678"), "decimal" },
      { "Binary", core.Binary("\0\1\2\255", 0), "binData" },
      { "Binary with a user subtype", core.Binary("xyz", 0x80), "binData" },
      { "Regex", core.Regex("^a.*b$", "im"), "regex" },
      { "Timestamp", core.Timestamp(1600000000, 7), "timestamp" },
      { "MinKey", core.MinKey, "minKey" },
      { "MaxKey", core.MaxKey, "maxKey" },
    }
    for _, case in ipairs(cases) do
      local name, v, alias = case[1], case[2], case[3]
      it(name .. " encodes as " .. alias .. " and comes back equal", function()
        assert.are.equal(alias, core.type(v))
        assert.are.equal(T[alias], type_byte(v))
        local back, bytes, doc = roundtrip(v)
        assert.are.equal(alias, core.type(back))
        if type(back) == "userdata" and not rawequal(back, core.null) then
          assert.are.equal(tostring(v), tostring(back))
          assert.is_true(v == back)
        elseif type(v) == "userdata" and not rawequal(v, core.null) then
          assert.are.equal(v:value(), back) -- an Int64 comes back a number
        else
          assert.are.equal(v, back)
        end
        assert.are.equal(bytes, core.encode(doc))
      end)
    end

    it("nested documents and arrays", function()
      local v = { a = { b = { 1, "two", { c = true } } }, e = core.array() }
      local back, bytes, doc = roundtrip(v)
      assert.are.equal(1, back.a.b[1])
      assert.are.equal("two", back.a.b[2])
      assert.is_true(back.a.b[3].c)
      assert.are.equal("array", core.type(back.a.b))
      assert.are.equal("array", core.type(back.e))
      assert.are.equal(0, #back.e)
      assert.are.equal(bytes, core.encode(doc))
    end)

    it("null decodes to core.null (a NULL light userdata)", function()
      local back = roundtrip(core.null)
      assert.are.equal("userdata", type(back))
      assert.is_true(rawequal(core.null, back))
      local arr = roundtrip(core.array { 1, core.null, 3 })
      assert.are.equal(3, #arr)
      assert.is_true(rawequal(core.null, arr[2]))
    end)

    it("cjson.null is core.null", function()
      local ok, cjson = pcall(require, "cjson")
      if not ok then
        pending("lua-cjson is not installed for this Lua")
        return
      end
      assert.is_true(rawequal(cjson.null, core.null))
    end)

    it("a document with every type re-encodes to the same bytes", function()
      local doc = core.doc(
        "_id", core.ObjectId(), "i", 7, "l", core.Int64(7), "big", core.Int64("9223372036854775807"),
        "d", 7.0, "nz", NEG_ZERO, "s", "x", "b", false, "n", core.null,
        "o", core.doc("z", 1, "a", 2), "a", core.array { 1, 2.5, core.Int64(3) },
        "ea", core.array(), "eo", {}, "dt", core.Date(0), "dec", core.Decimal128("-0.00"),
        "bin", core.Binary("\0", 5), "re", core.Regex("x", ""), "ts", core.Timestamp(0, 0),
        "min", core.MinKey, "max", core.MaxKey)
      local bytes = core.encode(doc)
      local decoded = assert(core.decode(bytes))
      assert.are.equal(bytes, core.encode(decoded))
      -- and again: the decoded form of the decoded form is stable
      assert.are.equal(bytes, core.encode(assert(core.decode(core.encode(decoded)))))
      local types = {}
      for _, e in ipairs(elements(bytes)) do types[e.key] = e.type end
      assert.are.equal(T.int, types.i)
      assert.are.equal(T.long, types.l)
      assert.are.equal(LUAJIT and T.int or T.double, types.d) -- the literal 7.0
      assert.are.equal(T.array, types.ea)
      assert.are.equal(T.object, types.eo)
    end)
  end)

  describe("numbers", function()
    it("int32 limits stay int32, one beyond becomes int64", function()
      assert.are.equal(T.int, type_byte(2147483647))
      assert.are.equal(T.int, type_byte(-2147483648))
      assert.are.equal(T.long, type_byte(2147483648))
      assert.are.equal(T.long, type_byte(-2147483649))
      assert.are.equal(2147483647, (roundtrip(2147483647)))
      assert.are.equal(-2147483649, (roundtrip(-2147483649)))
    end)

    it("int64 limits round-trip exactly", function()
      local max, min = core.Int64("9223372036854775807"), core.Int64("-9223372036854775808")
      assert.are.equal("Int64(9223372036854775807)", tostring(max))
      assert.are.equal("Int64(-9223372036854775808)", tostring(min))
      for _, v in ipairs { max, min } do
        local back, bytes, doc = roundtrip(v)
        assert.are.equal(T.long, type_byte(v))
        assert.are.equal(bytes, core.encode(doc))
        if LUAJIT then
          -- beyond 2^53 a double cannot hold it: it stays an Int64 value
          assert.are.equal("userdata", type(back))
          assert.is_true(back == v)
        else
          assert.are.equal(v:value(), back)
          assert.are.equal("number", type(back))
        end
      end
      if not LUAJIT then
        assert.are.equal(math.maxinteger, (roundtrip(math.maxinteger)))
        assert.are.equal(math.mininteger, (roundtrip(math.mininteger)))
        assert.are.equal(T.long, type_byte(math.maxinteger))
        assert.are.equal(T.long, type_byte(math.mininteger))
      end
    end)

    it("Int64 refuses what is not a 64-bit integer", function()
      assert.has_error(function() core.Int64("9223372036854775808") end)
      assert.has_error(function() core.Int64("-9223372036854775809") end)
      assert.has_error(function() core.Int64("12abc") end)
      assert.has_error(function() core.Int64("") end)
      assert.has_error(function() core.Int64(1.5) end)
      assert.has_error(function() core.Int64({}) end)
    end)

    it("an int64 that fits in 32 bits still re-encodes as int64", function()
      local back, bytes, doc = roundtrip(core.Int64(5))
      assert.are.equal(5, back)
      assert.are.equal("number", type(back))
      assert.are.equal(bytes, core.encode(doc))
      assert.are.equal(T.long, elements(core.encode(doc))[1].type)
    end)

    it("an array holding an int64 that fits in 32 bits re-encodes", function()
      local bytes = core.encode { a = core.array { core.Int64(1), 2, core.Int64(3) } }
      local doc = assert(core.decode(bytes))
      assert.are.equal(1, doc.a[1])
      local ok, again = pcall(core.encode, doc)
      assert.is_true(ok, again)
      assert.are.equal(bytes, again)
    end)

    it("an array of integral doubles re-encodes as doubles", function()
      -- { a: [1.0, 2.0] } built by hand
      local arr = "\27\0\0\0" .. "\1" .. "0\0" .. "\0\0\0\0\0\0\240\63"
                  .. "\1" .. "1\0" .. "\0\0\0\0\0\0\0\64" .. "\0"
      local bytes = "\35\0\0\0" .. "\4a\0" .. arr .. "\0"
      local doc = assert(core.decode(bytes))
      assert.are.same({ 1, 2 }, { doc.a[1], doc.a[2] })
      local ok, again = pcall(core.encode, doc)
      assert.is_true(ok, again)
      assert.are.equal(bytes, again)
    end)

    it("integral doubles stay doubles once decoded", function()
      -- built from BSON (double 3.0), whatever Lua makes of the literal
      local bytes = "\16\0\0\0\1x\0" .. "\0\0\0\0\0\0\8\64" .. "\0"
      local doc = assert(core.decode(bytes))
      assert.are.equal(3, doc.x)
      assert.are.equal(bytes, core.encode(doc))
      if LUAJIT then
        -- every number is a double: integral ones up to 2^53 are integers
        assert.are.equal("int", core.type(3.0))
        assert.are.equal("long", core.type(2 ^ 53))
        assert.are.equal("double", core.type(2 ^ 53 + 2))
        assert.are.equal(T.long, type_byte(-(2 ^ 53)))
      else
        assert.are.equal("double", core.type(3.0))
        assert.are.equal(T.double, type_byte(3.0))
        assert.are.equal("long", core.type(9007199254740992))
      end
    end)

    it("on LuaJIT an int64 up to 2^53 decodes to a number", function()
      if not LUAJIT then
        pending("LuaJIT only: Lua 5.4 has 64-bit integers")
        return
      end
      local back, bytes, doc = roundtrip(core.Int64("9007199254740992"))
      assert.are.equal("number", type(back))
      assert.are.equal(2 ^ 53, back)
      assert.are.equal(bytes, core.encode(doc))
      local beyond = roundtrip(core.Int64("9007199254740993"))
      assert.are.equal("userdata", type(beyond))
      assert.are.equal("Int64(9007199254740993)", tostring(beyond))
    end)

    it("-0.0 keeps its sign", function()
      assert.are.equal("double", core.type(NEG_ZERO))
      local bytes = core.encode { x = NEG_ZERO }
      assert.are.equal("\0\0\0\0\0\0\0\128", bytes:sub(8, 15))
      local back = roundtrip(NEG_ZERO)
      assert.are.equal(-math.huge, 1 / back)
      assert.are.equal(bytes, core.encode(assert(core.decode(bytes))))
    end)

    it("NaN stays NaN, infinities stay infinite", function()
      local nan = roundtrip(0 / 0)
      assert.is_true(nan ~= nan)
      assert.are.equal(T.double, type_byte(0 / 0))
      assert.are.equal(math.huge, (roundtrip(math.huge)))
      assert.are.equal(-math.huge, (roundtrip(-math.huge)))
      assert.are.equal(T.double, type_byte(math.huge))
    end)
  end)

  describe("tables", function()
    it("an empty plain table is a document, core.array() an array", function()
      assert.are.equal("object", core.type({}))
      assert.are.equal("array", core.type(core.array()))
      assert.are.equal(T.object, type_byte({}))
      assert.are.equal(T.array, type_byte(core.array()))
      assert.are.equal("\5\0\0\0\0", core.encode({}))
      local t = { 1, 2 }
      assert.are.equal(t, core.array(t))
    end)

    it("an empty array decodes to an array and re-encodes as one", function()
      local back, bytes, doc = roundtrip(core.array())
      assert.are.equal("array", core.type(back))
      assert.are.equal(bytes, core.encode(doc))
      table.insert(back, "x")
      assert.are.equal("x", assert(core.decode(core.encode(doc))).x[1])
    end)

    it("a table with keys 1..n is an array", function()
      assert.are.equal("array", core.type({ 1, 2, 3 }))
      local bytes = core.encode { x = { "a", "b" } }
      local inner = bytes:sub(elements(bytes)[1].pos)
      assert.are.same({ "0", "1" }, keys_of(inner:sub(1, int32(inner, 1))))
    end)

    it("nesting 100 levels deep encodes, 101 raises", function()
      local function nest(levels) -- counting the top-level document
        local t = {}
        for _ = 2, levels do t = { a = t } end
        return t
      end
      local bytes = core.encode(nest(100))
      local doc = assert(core.decode(bytes))
      assert.are.equal(bytes, core.encode(doc))
      assert.has_error(function() core.encode(nest(101)) end)
      local ok, err = pcall(core.encode, nest(101))
      assert.is_false(ok)
      assert.matches("nested more than 100 levels", err)
      local arr = {}
      for _ = 2, 101 do arr = { arr } end
      assert.has_error(function() core.encode({ a = arr }) end)
    end)

    it("decoding allows deeper nesting than encoding (server replies)", function()
      local function nested_bytes(levels)
        local inner = "\5\0\0\0\0"
        for _ = 2, levels do
          local n = #inner + 8
          inner = string.char(n % 256, math.floor(n / 256) % 256, 0, 0)
                  .. "\3a\0" .. inner .. "\0"
        end
        return inner
      end
      local doc = assert(core.decode(nested_bytes(150)))
      local depth, t = 1, doc
      while t.a do depth, t = depth + 1, t.a end
      assert.are.equal(150, depth)
      -- far too deep: refused with a message, not a crash
      local ok, res, err = pcall(core.decode, nested_bytes(1000))
      if ok then
        assert.is_nil(res)
        assert.is_not_nil(err)
      else
        assert.matches("nested", res)
      end
    end)

    it("a document of exactly 16 MiB encodes, one byte more raises", function()
      -- 13 bytes of overhead: length, type, "s\0", string length, NULs
      local limit = 16 * 1024 * 1024
      local bytes = core.encode { s = ("x"):rep(limit - 13) }
      assert.are.equal(limit, #bytes)
      local ok, err = pcall(core.encode, { s = ("x"):rep(limit - 12) })
      assert.is_false(ok)
      assert.matches("exceeds the 16 MiB limit", err)
      ok, err = pcall(core.encode, { a = ("x"):rep(limit / 2), b = ("y"):rep(limit / 2) })
      assert.is_false(ok)
      assert.matches("exceeds the 16 MiB limit", err)
      assert.has_error(function() core.encode { s = ("x"):rep(limit + 1) } end)
    end)
  end)

  describe("key order", function()
    it("core.doc keeps the order of its keys", function()
      local d = core.doc("z", 1, "a", 2, "m", 3, "b", 4)
      assert.are.same({ "z", "a", "m", "b" }, keys_of(core.encode(d)))
      assert.are.equal(1, d.z)
      assert.are.equal("object", core.type(d))
    end)

    it("a repeated key in core.doc keeps its first place, last value", function()
      local d = core.doc("a", 1, "b", 2, "a", 3)
      assert.are.same({ "a", "b" }, keys_of(core.encode(d)))
      assert.are.equal(3, d.a)
    end)

    it("a key repeated after a nil value is written once (found by fuzz/)", function()
      local bytes = core.encode(core.doc("a", nil, "b", 2, "a", 1))
      assert.are.same({ "a", "b" }, keys_of(bytes))
      local doc = assert(core.decode(bytes))
      assert.are.equal(1, doc.a)
      assert.are.equal(2, doc.b)
      assert.are.same({ "b" }, keys_of(core.encode(core.doc("a", nil, "b", 2, "a", nil))))
    end)

    it("decoded documents keep their order through changes", function()
      local bytes = core.encode(core.doc("z", 1, "y", 2, "x", 3, "w", 4))
      local doc = assert(core.decode(bytes))
      assert.are.same({ "z", "y", "x", "w" }, keys_of(core.encode(doc)))
      doc.y = "changed"
      doc.x = nil
      doc.v = 5 -- a new key goes after the known ones
      assert.are.same({ "z", "y", "w", "v" }, keys_of(core.encode(doc)))
      local again = assert(core.decode(core.encode(doc)))
      assert.are.equal("changed", again.y)
      assert.is_nil(again.x)
      assert.are.equal(5, again.v)
    end)

    it("nested decoded documents keep their order", function()
      local bytes = core.encode { o = core.doc("b", 1, "a", 2, "c", core.doc("y", 1, "x", 2)) }
      local doc = assert(core.decode(bytes))
      assert.are.equal(bytes, core.encode(doc))
      assert.are.same({ "b", "a", "c" }, keys_of(core.encode(doc.o)))
      assert.are.same({ "y", "x" }, keys_of(core.encode(doc.o.c)))
    end)
  end)

  describe("encoding errors", function()
    local function fails(t, pattern)
      local ok, err = pcall(core.encode, t)
      assert.is_false(ok, "encoding should have raised")
      assert.matches(pattern, err, 1, true)
    end

    it("name the path of what cannot be encoded", function()
      fails({ a = { b = { 1, 2, { x = print } } } },
            "mongotx: cannot encode function at a.b[3].x")
      fails({ a = coroutine.create(print) }, "cannot encode thread at a")
      fails({ a = io.stdout }, "a userdata that is not a mongotx value at a")
    end)

    it("refuse cycles", function()
      local t = {}
      t.self = { t }
      fails(t, "a table that contains itself at self[1]")
      local a = {}
      a[1] = a
      fails({ x = a }, "contains itself")
    end)

    it("refuse a table mixing array and hash keys", function()
      fails({ a = { 1, 2, x = 3 } }, "a table mixing array and hash keys at a")
    end)

    it("refuse arrays with holes", function()
      fails({ a = { [1] = 1, [3] = 3 } }, "an array with holes at a")
      local arr = core.array { 1, 2 }
      arr[4] = 4
      fails({ a = arr }, "at a")
    end)

    it("refuse non-string keys", function()
      fails({ [true] = 1 }, "neither a string nor a positive integer at top level")
      fails({ a = { [1.5] = 1 } }, "neither a string nor a positive integer at a")
      fails({ a = { [0] = 1 } }, "at a")
      fails({ a = core.array { 1, x = 2 } }, "not 1..n")
    end)

    it("refuse keys containing NUL", function()
      fails({ ["a\0b"] = 1 }, "a key containing a NUL byte")
    end)

    it("refuse keys that are not UTF-8, which decode would refuse (found by fuzz/)", function()
      fails({ ["\218"] = {} }, "a key that is not valid UTF-8 at \218")
      fails({ a = { ["k\192\128"] = 1 } }, "a key that is not valid UTF-8 at a.k")
      -- values are not keys: a string that is not UTF-8 still round-trips
      local bytes = core.encode { ["h\195\169"] = "\218\192\128" }
      assert.are.equal("\218\192\128", assert(core.decode(bytes))["h\195\169"])
    end)

    it("refuse an array at the top level", function()
      assert.has_error(function() core.encode { 1, 2 } end)
      assert.has_error(function() core.encode(core.array()) end)
      assert.has_error(function() core.encode("x") end)
      assert.has_error(function() core.encode(nil) end)
    end)

    it("leave nothing behind: the next encode works", function()
      pcall(core.encode, { a = { b = print } })
      assert.are.equal(core.encode { a = 1 }, "\12\0\0\0\16a\0\1\0\0\0\0")
    end)
  end)

  describe("decode", function()
    it("returns nil, err for invalid BSON", function()
      for _, bad in ipairs { "", "abc", "\5\0\0\0\1", "\6\0\0\0\0\0",
                             "\12\0\0\0\16a\0\1\0\0\0\1" } do
        local doc, err = core.decode(bad)
        assert.is_nil(doc)
        assert.are.equal("table", type(err))
        assert.are.equal("bson", err.code)
        assert.matches("invalid BSON", tostring(err))
      end
    end)

    it("refuses a code with scope whose scope is cut short (found by fuzz/)", function()
      -- { c: Code("x + 1", <scope of 12 bytes whose last is "+", not NUL>) }:
      -- bson_validate passes it, and re-encoding used to drop the field
      local scope = "\12\0\0\0" .. "\16x\0\1\0\0\0" .. "+"
      local bytes = "\34\0\0\0" .. "\15c\0" .. "\26\0\0\0" .. "\6\0\0\0x + 1\0" .. scope .. "\0"
      local ok, err = pcall(core.decode, bytes)
      assert.is_false(ok)
      assert.matches("corrupt BSON", err)
      -- the same with its NUL decodes and comes back byte for byte
      local good = bytes:sub(1, 32) .. "\0\0"
      assert.are.equal(good, core.encode(assert(core.decode(good))))
      -- code "x +\0\255\255" makes bson_validate skip the scope, whose key
      -- "\201" is not UTF-8: decode took it and encode wrote it back
      local code = "\6\0\0\0x +\0\255\255"
      ok, err = pcall(core.decode, "\34\0\0\0\15c\0\26\0\0\0" .. code .. "\12\0\0\0\16\201\0\0\0\0\0\0\0")
      assert.is_false(ok)
      assert.matches("corrupt BSON", err)
      local doc = assert(core.decode("\34\0\0\0\15c\0\26\0\0\0" .. code .. "\12\0\0\0\16k\0\0\0\0\0\0\0"))
      assert.are.equal("javascriptWithScope", core.type(doc.c))
    end)

    it("refuses a nested array without its final NUL (found by fuzz/)", function()
      -- { a: [1.5, <"ab" where an element or the final NUL should be>] }:
      -- bson_validate passes it, decode used to return { a = { 1.5 } }
      local arr = "\17\0\0\0" .. "\1" .. "0\0" .. "\0\0\0\0\0\0\248\63" .. "ab"
      local ok, err = pcall(core.decode, "\25\0\0\0" .. "\4a\0" .. arr .. "\0")
      assert.is_false(ok)
      assert.matches("corrupt BSON", err)
      -- { e: [] } whose array ends in "@": decoded as [], re-encoded with a NUL
      ok, err = pcall(core.decode, "\13\0\0\0" .. "\4e\0" .. "\5\0\0\0@" .. "\0")
      assert.is_false(ok)
      assert.matches("corrupt BSON", err)
      local good = "\16\0\0\0" .. "\1" .. "0\0" .. "\0\0\0\0\0\0\248\63" .. "\0"
      local doc = assert(core.decode("\24\0\0\0" .. "\4a\0" .. good .. "\0"))
      assert.are.equal(1, #doc.a)
      assert.are.equal(1.5, doc.a[1])
    end)

    it("refuses a document that ends early instead of losing its tail (found by fuzz/)", function()
      -- { r: /x\255/i, <0 type byte>, b: 2 }: after a regex that is not
      -- UTF-8 bson_validate looks no further, and bson_iter takes the 0 for
      -- the end; decode used to return { r = Regex("x\255", "i") }
      local body = "\11r\0x\255\0i\0" .. "\0" .. "\16b\0\2\0\0\0"
      local ok, err = pcall(core.decode, "\21\0\0\0" .. body .. "\0")
      assert.is_false(ok)
      assert.matches("corrupt BSON", err)
      -- the same nested: { o: { r: /x\255/i, <0>, b: 2 } }
      ok, err = pcall(core.decode, "\29\0\0\0" .. "\3o\0" .. "\21\0\0\0" .. body .. "\0" .. "\0")
      assert.is_false(ok)
      assert.matches("corrupt BSON", err)
      -- without the 0 it decodes whole
      local doc = assert(core.decode("\20\0\0\0" .. body:sub(1, 8) .. body:sub(10) .. "\0"))
      assert.are.equal(2, doc.b)
      assert.are.equal("x\255", doc.r:value())
      -- nor does it see a key that is not UTF-8 after such a regex, which
      -- encode would then refuse
      ok, err = pcall(core.decode, "\22\0\0\0" .. body:sub(1, 8) .. "\16m\255n\0\2\0\0\0" .. "\0")
      assert.is_false(ok)
      assert.matches("corrupt BSON", err)
    end)

    it("raises for a non-string argument", function()
      assert.has_error(function() core.decode({}) end)
      assert.has_error(function() core.decode() end)
    end)
  end)

  describe("values", function()
    it("ObjectId", function()
      local hex = "5f2b8e1c9d3a4b5c6d7e8f90"
      local oid = core.ObjectId(hex)
      assert.are.equal(hex, oid:value())
      assert.are.equal('ObjectId("' .. hex .. '")', tostring(oid))
      assert.are.equal("objectId", oid:type())
      assert.are.equal(("ab"):rep(12), core.ObjectId(("AB"):rep(12)):value())
      local a, b = core.ObjectId(), core.ObjectId()
      assert.are.equal(24, #a:value())
      assert.is_false(a == b)
      assert.is_true(a < b)
      assert.is_true(a <= a)
      assert.is_true(core.ObjectId(hex) == oid)
      assert.has_error(function() core.ObjectId("xyz") end)
      assert.has_error(function() core.ObjectId(("g"):rep(24)) end)
      assert.has_error(function() core.ObjectId(hex .. "00") end)
    end)

    it("Date", function()
      local d = core.Date(1600000000123)
      assert.are.equal(1600000000123, d:value())
      assert.are.equal("Date(1600000000123)", tostring(d))
      assert.is_true(core.Date(1) < core.Date(2))
      assert.is_true(core.Date(2) <= core.Date(2))
      assert.is_false(core.Date(3) < core.Date(2))
      local now = core.Date():value()
      assert.is_true(math.abs(now - os.time() * 1000) < 5000)
      assert.has_error(function() core.Date(1.5) end)
    end)

    it("Int64", function()
      local i = core.Int64("-42")
      assert.are.equal(-42, i:value())
      assert.are.equal("long", i:type())
      assert.are.equal("Int64(-42)", tostring(i))
      assert.is_true(core.Int64(7) == core.Int64("7"))
      assert.is_true(core.Int64(-1) < core.Int64(0))
      assert.is_true(core.Int64("-9223372036854775808") < core.Int64("9223372036854775807"))
    end)

    it("Decimal128", function()
      local d = core.Decimal128("1.10")
      assert.are.equal("1.10", d:value())
      assert.are.equal('Decimal128("1.10")', tostring(d))
      assert.are.equal("decimal", d:type())
      assert.is_true(core.Decimal128("1.10") == core.Decimal128("1.10"))
      assert.is_false(core.Decimal128("1.1") == core.Decimal128("1.10"))
      assert.has_error(function() core.Decimal128("one") end)
      assert.has_error(function() return core.Decimal128("1") < core.Decimal128("2") end)
    end)

    it("Binary", function()
      local data, sub = core.Binary("a\0b", 0x80):value()
      assert.are.equal("a\0b", data)
      assert.are.equal(0x80, sub)
      assert.are.equal(0, select(2, core.Binary("x"):value()))
      assert.are.equal("Binary(5, 2 bytes)", tostring(core.Binary("ab", 5)))
      assert.is_false(core.Binary("ab", 0) == core.Binary("ab", 5))
      assert.has_error(function() core.Binary("a", 256) end)
      assert.has_error(function() core.Binary("a", -1) end)
      assert.has_error(function() core.Binary() end)
    end)

    it("Regex", function()
      local p, o = core.Regex("^a", "ix"):value()
      assert.are.equal("^a", p)
      assert.are.equal("ix", o)
      assert.are.equal("", select(2, core.Regex("b"):value()))
      assert.are.equal('Regex("^a", "ix")', tostring(core.Regex("^a", "ix")))
      assert.has_error(function() core.Regex("a", "z") end)
      assert.has_error(function() core.Regex("a\0b") end)
    end)

    it("Timestamp", function()
      local t, i = core.Timestamp(4294967295, 4294967295):value()
      assert.are.equal(4294967295, t)
      assert.are.equal(4294967295, i)
      assert.are.equal("Timestamp(5, 6)", tostring(core.Timestamp(5, 6)))
      assert.is_true(core.Timestamp(1, 9) < core.Timestamp(2, 0))
      assert.is_true(core.Timestamp(1, 1) < core.Timestamp(1, 2))
      assert.has_error(function() core.Timestamp(-1, 0) end)
      assert.has_error(function() core.Timestamp(2 ^ 32, 0) end)
      assert.has_error(function() core.Timestamp(1, 0.5) end)
      assert.has_error(function() core.Timestamp(1) end)
    end)

    it("MinKey and MaxKey", function()
      assert.are.equal("minKey", core.MinKey:type())
      assert.are.equal("maxKey", core.MaxKey:type())
      assert.are.equal("MinKey", tostring(core.MinKey))
      assert.are.equal("MaxKey", tostring(core.MaxKey))
      assert.is_false(core.MinKey == core.MaxKey)
    end)

    it("values of different types are never equal and do not compare", function()
      assert.is_false(core.Date(5) == core.Int64(5))
      assert.has_error(function() return core.Date(5) < core.Int64(6) end)
      assert.has_error(function() return core.MinKey < core.MaxKey end)
    end)
  end)

  describe("core.type", function()
    it("names the BSON type a Lua value encodes to", function()
      assert.are.equal("string", core.type("s"))
      assert.are.equal("bool", core.type(false))
      assert.are.equal("null", core.type(core.null))
      assert.are.equal("int", core.type(1))
      assert.are.equal("double", core.type(0.5))
      assert.are.equal("object", core.type({ a = 1 }))
      assert.are.equal("object", core.type(core.doc("a", 1, "b", 2)))
      assert.are.equal("array", core.type({ 1 }))
      assert.is_nil(core.type(print))
      assert.is_nil(core.type(nil))
    end)
  end)

  describe("core.doc", function()
    it("raises for an odd number of arguments or non-string keys", function()
      assert.has_error(function() core.doc("a") end)
      assert.has_error(function() core.doc(1, 2) end)
      assert.has_error(function() core.doc("a", 1, true, 2) end)
    end)
  end)

  it("has a version", function()
    assert.are.equal("string", type(core._VERSION))
    assert.matches("^%d+%.%d+%.%d+", core._VERSION)
  end)
end)

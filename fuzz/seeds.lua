-- Writes the seed corpus of the fuzz harnesses (fuzz/*.c):
--   fuzz/corpus/bson_roundtrip/<name>   BSON documents
--   fuzz/corpus/lua_encode/<name>       programs for lua_encode.c
-- The documents are the values spec/01-bson_spec.lua round-trips, encoded
-- by the bridge itself, plus by-hand BSON the bridge cannot make (the
-- deprecated types, repeated keys, renumbered arrays, unsorted regex
-- options, invalid bytes).  Run after `make` from the repository root:
--
--   MONGOTX_CPATH="$PWD/build/lua54/?.so" lua5.4 fuzz/seeds.lua
--
-- Lua 5.4 only (string.pack).
package.path = "./?.lua;" .. package.path
local core = require("spec.helpers").core

local function write(dir, name, bytes)
  local path = "fuzz/corpus/" .. dir .. "/" .. name
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

---------------------------------------------------------------------------
-- bson_roundtrip: documents

local docs = {
  int32 = { x = 42 },
  int32_limits = core.doc("max", 2147483647, "min", -2147483648),
  int64 = { x = 1099511627776 },
  int64_limits = core.doc("max", math.maxinteger, "min", math.mininteger),
  int64_small = { x = core.Int64(5) },
  double = { x = 1.5 },
  double_integral = { x = 3.0 },
  double_specials = core.doc("nan", 0 / 0, "inf", math.huge, "ninf", -math.huge, "nz", -1 * 0.0),
  string = { x = "h\195\169llo\0world" },
  string_invalid_utf8 = { k = "\192\128\255" },
  empty = {},
  bools = core.doc("t", true, "f", false),
  null = { x = core.null },
  objectid = { _id = core.ObjectId("5f2b8e1c9d3a4b5c6d7e8f90") },
  dates = core.doc("d", core.Date(1600000000123), "neg", core.Date(-86400000)),
  decimal = core.doc("a", core.Decimal128("1234.5678"), "b", core.Decimal128("-0.00"),
    "c", core.Decimal128("NaN"), "d", core.Decimal128("-Infinity")),
  binary = core.doc("b0", core.Binary("\0\1\2\255", 0), "b80", core.Binary("xyz", 0x80),
    "old", core.Binary("ab", 2), "uuid", core.Binary(("\17"):rep(16), 4)),
  regex = { r = core.Regex("^a.*b$", "im") },
  timestamp = { ts = core.Timestamp(4294967295, 7) },
  minmax = core.doc("min", core.MinKey, "max", core.MaxKey),
  nested = { a = { b = { 1, "two", { c = true } } }, e = core.array() },
  arrays = core.doc("ints", core.array { core.Int64(1), 2, core.Int64(3) },
    "doubles", core.array { 1.5, 2.5 }, "empty", core.array(), "mixed", core.array { "a", core.null, {} }),
  ordered = core.doc("z", 1, "a", 2, "m", 3, "b", 4),
  every_type = core.doc(
    "_id", core.ObjectId("5f2b8e1c9d3a4b5c6d7e8f91"), "i", 7, "l", core.Int64(7),
    "big", core.Int64("9223372036854775807"), "d", 7.0, "nz", -1 * 0.0, "s", "x", "b", false,
    "n", core.null, "o", core.doc("z", 1, "a", 2), "a", core.array { 1, 2.5, core.Int64(3) },
    "ea", core.array(), "eo", {}, "dt", core.Date(0), "dec", core.Decimal128("-0.00"),
    "bin", core.Binary("\0", 5), "re", core.Regex("x", ""), "ts", core.Timestamp(0, 0),
    "min", core.MinKey, "max", core.MaxKey),
  transaction = core.doc("_id", core.ObjectId("5f2b8e1c9d3a4b5c6d7e8f92"), "state", "pending",
    "ops", core.array { core.doc("collection", "accounts", "id", "A", "kind", "update",
      "update", core.doc("$inc", { balance = -100 })) },
    "lastModified", core.Date(1600000000000), "pendingTransactions", core.array { "t1" }),
}

local function nest(levels) -- counting the top-level document
  local t = {}
  for _ = 2, levels do t = { a = t } end
  return t
end
docs.nested_100 = nest(100)

for name, doc in pairs(docs) do write("bson_roundtrip", name, core.encode(doc)) end

-- By hand: a document from its elements (type byte, key, value bytes).
local function element(t, key, value) return string.char(t) .. key .. "\0" .. value end
local function document(...)
  local body = table.concat({ ... }) .. "\0"
  return string.pack("<i4", #body + 4) .. body
end
local function bstring(s) return string.pack("<i4", #s + 1) .. s .. "\0" end

local hand = {
  undefined = document(element(0x06, "u", "")),
  dbpointer = document(element(0x0C, "p", bstring("db.coll") .. ("\1"):rep(12))),
  symbol = document(element(0x0E, "s", bstring("sym"))),
  code = document(element(0x0D, "c", bstring("function () { return 1 }"))),
  code_w_scope = document(element(0x0F, "c", (function()
    local code, scope = bstring("x + 1"), document(element(0x10, "x", string.pack("<i4", 1)))
    return string.pack("<i4", 4 + #code + #scope) .. code .. scope
  end)())),
  repeated_key = document(element(0x10, "a", string.pack("<i4", 1)), element(0x10, "a", string.pack("<i4", 2))),
  array_renumbered = document(element(0x04, "a", document(
    element(0x10, "5", string.pack("<i4", 1)), element(0x02, "x", bstring("y"))))),
  regex_unsorted = document(element(0x0B, "r", "a\0xqiim\0")),
  too_deep_200 = (function()
    local d = document()
    for _ = 2, 201 do d = document(element(0x03, "a", d)) end
    return d
  end)(),
  -- what the fuzzer found (spec/01-bson_spec.lua has each): a scope without
  -- its final NUL, one bson_validate skips, an array without its final NUL,
  -- a 0 type byte after a regex that is not UTF-8
  found_scope_no_nul = "\34\0\0\0\15c\0\26\0\0\0\6\0\0\0x + 1\0\12\0\0\0\16x\0\1\0\0\0+\0",
  found_scope_bad_key = "\34\0\0\0\15c\0\26\0\0\0\6\0\0\0x +\0\255\255\12\0\0\0\16\201\0\0\0\0\0\0\0",
  found_array_no_nul = document(element(0x04, "a", "\17\0\0\0\1" .. "0\0" .. string.pack("<d", 1.5) .. "ab")),
  found_early_end = document(element(0x0B, "r", "x\255\0i\0"), "\0", element(0x10, "b", string.pack("<i4", 2))),
  -- invalid: decode must say so
  truncated = string.pack("<i4", 12) .. "\16a\0\1\0",
  bad_length = "\6\0\0\0\0\0",
  no_terminator = "\12\0\0\0\16a\0\1\0\0\0\1",
  bad_string_length = document(element(0x02, "s", string.pack("<i4", 100) .. "x\0")),
  empty_input = "",
}
for name, bytes in pairs(hand) do write("bson_roundtrip", name, bytes) end

---------------------------------------------------------------------------
-- lua_encode: programs.  The opcode numbers follow the enum in
-- fuzz/lua_encode.c, which says what each reads.

local OP = {}
for i, name in ipairs { "INT", "FLOAT", "STRING", "BOOL", "NULL", "NIL", "OTHER", "CTOR",
  "TABLE", "SET", "APPEND", "ARRAY", "DOC", "REF", "WRAP", "SETMETA", "DUP", "SWAP", "POP",
  "DECODED" } do
  OP[name] = i - 1
end
local CTOR = { ObjectId = 0, Date = 1, Int64 = 2, Decimal128 = 3, Binary = 4, Regex = 5, Timestamp = 6 }

-- asm{ "TABLE", "STRING", "x", ... }: opcodes by name, strings as their
-- length byte and bytes, numbers as one byte.
local function asm(code)
  local out, i = {}, 1
  while i <= #code do
    local op = code[i]
    out[#out + 1] = string.char(OP[op])
    if op == "STRING" then
      i = i + 1
      out[#out + 1] = string.char(#code[i]) .. code[i]
    elseif op == "INT" or op == "FLOAT" then
      i = i + 1
      out[#out + 1] = type(code[i]) == "string" and code[i] or string.char(code[i])
    elseif op == "BOOL" or op == "OTHER" or op == "DOC" or op == "REF" or op == "WRAP" then
      i = i + 1
      out[#out + 1] = string.char(code[i])
    elseif op == "CTOR" then
      out[#out + 1] = string.char(CTOR[code[i + 1]], code[i + 2])
      i = i + 2
    end
    i = i + 1
  end
  return table.concat(out)
end

-- { k = v } for a value program v
local function field(key, v)
  local code = { "TABLE", "STRING", key }
  for _, x in ipairs(v) do code[#code + 1] = x end
  code[#code + 1] = "SET"
  return code
end

-- an INT operand that is not one of the limits: raw int64 bytes
local function rawint(n) return string.char(12) .. string.pack(">i8", n) end
local raw_int = rawint(0x123456789)
local raw_float = string.char(255) .. string.pack(">d", 2.5)
local programs = {
  int_limits = { "TABLE", "STRING", "a", "INT", 3, "SET", "STRING", "b", "INT", 4, "SET",
    "STRING", "c", "INT", 7, "SET", "STRING", "d", "INT", 8, "SET", "STRING", "e", "INT", 5, "SET" },
  int_raw = field("x", { "INT", raw_int }),
  floats = { "TABLE", "STRING", "nan", "FLOAT", 0, "SET", "STRING", "inf", "FLOAT", 2, "SET",
    "STRING", "nz", "FLOAT", 4, "SET", "STRING", "raw", "FLOAT", raw_float, "SET" },
  strings = field("s", { "STRING", "a\0b\255\192\128" }),
  nul_key = field("a\0b", { "BOOL", 1 }),
  null_and_nil = { "TABLE", "STRING", "n", "NULL", "SET", "STRING", "m", "NIL", "SET" },
  specials = { "TABLE", "STRING", "min", "OTHER", 0, "SET", "STRING", "max", "OTHER", 1, "SET" },
  function_value = field("f", { "OTHER", 2 }),
  thread_value = field("t", { "OTHER", 3 }),
  foreign_userdata = field("u", { "OTHER", 4 }),
  lightuserdata = field("p", { "OTHER", 5 }),
  objectid = field("_id", { "STRING", "5f2b8e1c9d3a4b5c6d7e8f90", "CTOR", "ObjectId", 1 }),
  objectid_bad = field("_id", { "STRING", "xyz", "CTOR", "ObjectId", 1 }),
  date = field("d", { "INT", 4, "CTOR", "Date", 1 }),
  int64_string = field("l", { "STRING", "-9223372036854775808", "CTOR", "Int64", 1 }),
  decimal = field("m", { "STRING", "-1.10E+6144", "CTOR", "Decimal128", 1 }),
  binary = field("b", { "STRING", "\0\1", "INT", 1, "CTOR", "Binary", 2 }),
  regex = field("r", { "STRING", "^a", "STRING", "xi", "CTOR", "Regex", 2 }),
  timestamp = field("ts", { "INT", 3, "INT", 1, "CTOR", "Timestamp", 2 }),
  array = { "TABLE", "STRING", "a", "TABLE", "INT", 1, "APPEND", "STRING", "x", "APPEND", "ARRAY", "SET" },
  empty_array = field("a", { "TABLE", "ARRAY" }),
  array_hole = { "TABLE", "STRING", "a", "TABLE", "INT", 2, "NULL", "SET", "SET" },
  mixed_keys = { "TABLE", "STRING", "a", "TABLE", "INT", 1, "APPEND", "STRING", "k", "BOOL", 0, "SET", "SET" },
  bad_keys = { "TABLE", "BOOL", 1, "INT", 0, "SET", "FLOAT", 5, "INT", 0, "SET", "INT", 2, "INT", 0, "SET" },
  doc = { "STRING", "z", "INT", 1, "STRING", "a", "INT", 2, "DOC", 2 },
  doc_repeated = { "STRING", "a", "INT", 1, "STRING", "b", "INT", 2, "STRING", "a", "INT", 0, "DOC", 3 },
  cycle = { "TABLE", "STRING", "self", "REF", 0, "SET" },
  cycle_deep = { "TABLE", "STRING", "a", "TABLE", "STRING", "b", "REF", 0, "SET", "SET" },
  shared = { "TABLE", "STRING", "a", "TABLE", "SET", "STRING", "b", "REF", 1, "SET" },
  deep_99 = { "TABLE", "WRAP", 98, "STRING", "x", "SWAP", "SET" },
  deep_too = { "TABLE", "WRAP", 150 },
  decoded_changed = { "STRING", "z", "INT", 1, "STRING", "y", "INT", 7, "DOC", 2, "DECODED",
    "STRING", "z", "NIL", "SET", "STRING", "w", "FLOAT", 3, "SET" },
  decoded_int64 = { "TABLE", "STRING", "l", "INT", 1, "CTOR", "Int64", 1, "SET", "DECODED", "DUP" },
  handmade_meta = { "TABLE", "STRING", "a", "INT", 0, "SET", "TABLE", "STRING", "__mongotx",
    "STRING", "array", "SET", "SETMETA" },
  handmade_order = { "TABLE", "STRING", "a", "INT", 0, "SET", "TABLE", "INT", 1, "STRING", "a", "SET",
    "INT", rawint(2), "STRING", "a", "SET", "STRING", "__mongotx", "STRING", "document", "SET", "SETMETA" },
  handmade_types = { "TABLE", "STRING", "a", "FLOAT", 6, "SET", "TABLE", "STRING", "__mongotx",
    "STRING", "document", "SET", "STRING", "__types", "TABLE", "STRING", "a", "STRING", "int64", "SET",
    "SET", "SETMETA" },
  non_table = { "INT", 3, "STRING", "s", "NULL", "OTHER", 2 },
  -- what the fuzzer found: doc("a", nil, "a", 1), a key that is not UTF-8
  found_doc_nil_repeat = { "STRING", "a", "NIL", "STRING", "a", "INT", 1, "DOC", 2 },
  found_key_not_utf8 = { "TABLE", "STRING", "\218", "TABLE", "SET" },
}
for name, code in pairs(programs) do write("lua_encode", name, asm(code)) end

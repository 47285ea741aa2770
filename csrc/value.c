/* value.c: the mongotx.Value userdata and the constructors of core.
 *
 * Plain Lua values map to their natural BSON types (encode.c, decode.c);
 * every other BSON value is a mongotx.Value holding a bson_value_t:
 * ObjectId, Date, Int64, Decimal128, Binary, Regex, Timestamp,
 * MinKey/MaxKey, and what decoding finds without a constructor (code,
 * symbol, ...).  This file also makes the marked tables (core.array,
 * core.doc), names types (core.type) and opens the bridge's part of the
 * module (mtx_open_bson), so that each Lua-visible BSON type has one home. */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/time.h>

#include "mongotx.h"

mtx_value *
mtx_push_value(lua_State *L, const bson_value_t *src)
{
	mtx_value *ud = (mtx_value *)lua_newuserdata(L, sizeof *ud);

	bson_value_copy(src, &ud->v);
	luaL_getmetatable(L, MTX_VALUE_MT);
	lua_setmetatable(L, -2);
	return ud;
}

mtx_value *
mtx_test_value(lua_State *L, int idx)
{
	return (mtx_value *)luaL_testudata(L, idx, MTX_VALUE_MT);
}

static mtx_value *
check_value(lua_State *L, int idx)
{
	return (mtx_value *)luaL_checkudata(L, idx, MTX_VALUE_MT);
}

/* MongoDB's $type aliases. */
static const char *
type_alias(bson_type_t t)
{
	switch (t) {
	case BSON_TYPE_DOUBLE: return "double";
	case BSON_TYPE_UTF8: return "string";
	case BSON_TYPE_DOCUMENT: return "object";
	case BSON_TYPE_ARRAY: return "array";
	case BSON_TYPE_BINARY: return "binData";
	case BSON_TYPE_UNDEFINED: return "undefined";
	case BSON_TYPE_OID: return "objectId";
	case BSON_TYPE_BOOL: return "bool";
	case BSON_TYPE_DATE_TIME: return "date";
	case BSON_TYPE_NULL: return "null";
	case BSON_TYPE_REGEX: return "regex";
	case BSON_TYPE_DBPOINTER: return "dbPointer";
	case BSON_TYPE_CODE: return "javascript";
	case BSON_TYPE_SYMBOL: return "symbol";
	case BSON_TYPE_CODEWSCOPE: return "javascriptWithScope";
	case BSON_TYPE_INT32: return "int";
	case BSON_TYPE_TIMESTAMP: return "timestamp";
	case BSON_TYPE_INT64: return "long";
	case BSON_TYPE_DECIMAL128: return "decimal";
	case BSON_TYPE_MINKEY: return "minKey";
	case BSON_TYPE_MAXKEY: return "maxKey";
	default: return "unknown";
	}
}

void
mtx_push_int64(lua_State *L, int64_t i)
{
#if MTX_HAS_INTEGERS
	lua_pushinteger(L, (lua_Integer)i);
#else
	lua_pushnumber(L, (lua_Number)i);
#endif
}

static int
value_tostring(lua_State *L)
{
	const bson_value_t *v = &check_value(L, 1)->v;
	char buf[BSON_DECIMAL128_STRING > 25 ? BSON_DECIMAL128_STRING : 25];

	switch (v->value_type) {
	case BSON_TYPE_OID:
		bson_oid_to_string(&v->value.v_oid, buf);
		lua_pushfstring(L, "ObjectId(\"%s\")", buf);
		break;
	case BSON_TYPE_DATE_TIME:
		snprintf(buf, sizeof buf, "%" PRId64, v->value.v_datetime);
		lua_pushfstring(L, "Date(%s)", buf);
		break;
	case BSON_TYPE_INT64:
		snprintf(buf, sizeof buf, "%" PRId64, v->value.v_int64);
		lua_pushfstring(L, "Int64(%s)", buf);
		break;
	case BSON_TYPE_DECIMAL128:
		bson_decimal128_to_string(&v->value.v_decimal128, buf);
		lua_pushfstring(L, "Decimal128(\"%s\")", buf);
		break;
	case BSON_TYPE_BINARY:
		lua_pushfstring(L, "Binary(%d, %d bytes)",
				(int)v->value.v_binary.subtype,
				(int)v->value.v_binary.data_len);
		break;
	case BSON_TYPE_REGEX:
		lua_pushfstring(L, "Regex(\"%s\", \"%s\")",
				v->value.v_regex.regex, v->value.v_regex.options);
		break;
	case BSON_TYPE_TIMESTAMP:
		snprintf(buf, sizeof buf, "%u, %u",
			 (unsigned)v->value.v_timestamp.timestamp,
			 (unsigned)v->value.v_timestamp.increment);
		lua_pushfstring(L, "Timestamp(%s)", buf);
		break;
	case BSON_TYPE_MINKEY: lua_pushliteral(L, "MinKey"); break;
	case BSON_TYPE_MAXKEY: lua_pushliteral(L, "MaxKey"); break;
	default: lua_pushstring(L, type_alias(v->value_type)); break;
	}
	return 1;
}

static int
value_gc(lua_State *L)
{
	bson_value_destroy(&check_value(L, 1)->v);
	return 0;
}

/* Equal when they would encode to the same bytes. */
static int
value_eq(lua_State *L)
{
	mtx_value *a = mtx_test_value(L, 1), *b = mtx_test_value(L, 2);
	bson_t da, db;
	int eq;

	if (!a || !b || a->v.value_type != b->v.value_type) {
		lua_pushboolean(L, 0);
		return 1;
	}
	bson_init(&da);
	bson_init(&db);
	bson_append_value(&da, "", 0, &a->v);
	bson_append_value(&db, "", 0, &b->v);
	eq = bson_equal(&da, &db);
	bson_destroy(&da);
	bson_destroy(&db);
	lua_pushboolean(L, eq);
	return 1;
}

/* -1, 0, 1 for values of one ordered type; raises for anything else. */
static int
value_compare(lua_State *L)
{
	const bson_value_t *a = &check_value(L, 1)->v, *b = &check_value(L, 2)->v;

	if (a->value_type != b->value_type)
		return luaL_error(L, "attempt to compare %s with %s",
				  type_alias(a->value_type), type_alias(b->value_type));
	switch (a->value_type) {
	case BSON_TYPE_OID:
		return bson_oid_compare(&a->value.v_oid, &b->value.v_oid);
	case BSON_TYPE_DATE_TIME:
		return (a->value.v_datetime > b->value.v_datetime) -
		       (a->value.v_datetime < b->value.v_datetime);
	case BSON_TYPE_INT64:
		return (a->value.v_int64 > b->value.v_int64) -
		       (a->value.v_int64 < b->value.v_int64);
	case BSON_TYPE_TIMESTAMP: {
		uint64_t x = ((uint64_t)a->value.v_timestamp.timestamp << 32) |
			     a->value.v_timestamp.increment;
		uint64_t y = ((uint64_t)b->value.v_timestamp.timestamp << 32) |
			     b->value.v_timestamp.increment;
		return (x > y) - (x < y);
	}
	default:
		return luaL_error(L, "attempt to compare two %s values",
				  type_alias(a->value_type));
	}
}

static int
value_lt(lua_State *L)
{
	lua_pushboolean(L, value_compare(L) < 0);
	return 1;
}

static int
value_le(lua_State *L)
{
	lua_pushboolean(L, value_compare(L) <= 0);
	return 1;
}

static int
value_type(lua_State *L)
{
	lua_pushstring(L, type_alias(check_value(L, 1)->v.value_type));
	return 1;
}

/* The value as plain Lua: hex string, milliseconds, number, string, or the
 * parts of a binary, regex or timestamp. */
static int
value_value(lua_State *L)
{
	const bson_value_t *v = &check_value(L, 1)->v;
	char buf[BSON_DECIMAL128_STRING > 25 ? BSON_DECIMAL128_STRING : 25];

	switch (v->value_type) {
	case BSON_TYPE_OID:
		bson_oid_to_string(&v->value.v_oid, buf);
		lua_pushstring(L, buf);
		return 1;
	case BSON_TYPE_DATE_TIME: mtx_push_int64(L, v->value.v_datetime); return 1;
	case BSON_TYPE_INT64: mtx_push_int64(L, v->value.v_int64); return 1;
	case BSON_TYPE_DECIMAL128:
		bson_decimal128_to_string(&v->value.v_decimal128, buf);
		lua_pushstring(L, buf);
		return 1;
	case BSON_TYPE_BINARY:
		lua_pushlstring(L, (const char *)v->value.v_binary.data,
				v->value.v_binary.data_len);
		lua_pushinteger(L, v->value.v_binary.subtype);
		return 2;
	case BSON_TYPE_REGEX:
		lua_pushstring(L, v->value.v_regex.regex);
		lua_pushstring(L, v->value.v_regex.options);
		return 2;
	case BSON_TYPE_TIMESTAMP:
		lua_pushinteger(L, (lua_Integer)v->value.v_timestamp.timestamp);
		lua_pushinteger(L, (lua_Integer)v->value.v_timestamp.increment);
		return 2;
	case BSON_TYPE_CODE:
		lua_pushlstring(L, v->value.v_code.code, v->value.v_code.code_len);
		return 1;
	case BSON_TYPE_SYMBOL:
		lua_pushlstring(L, v->value.v_symbol.symbol,
				v->value.v_symbol.len);
		return 1;
	default:
		lua_pushnil(L);
		return 1;
	}
}

/* array([t]): marks t (or a new table) as a BSON array, so that an empty
 * table encodes as [] rather than {}. */
static int
l_array(lua_State *L)
{
	if (lua_isnoneornil(L, 1)) {
		lua_settop(L, 0);
		lua_newtable(L);
	} else {
		luaL_checktype(L, 1, LUA_TTABLE);
		lua_settop(L, 1);
	}
	luaL_getmetatable(L, MTX_ARRAY_MT);
	lua_setmetatable(L, 1);
	return 1;
}

/* doc(k1, v1, k2, v2, ...): a document whose keys encode in this order
 * (sort specifications, index keys, commands). */
static int
l_doc(lua_State *L)
{
	int i, n = lua_gettop(L), pos = 0;

	if (n % 2)
		return luaL_error(L, "mongotx.doc takes key, value pairs");
	lua_createtable(L, 0, n / 2);
	lua_createtable(L, n / 2, 1);
	lua_pushliteral(L, "document");
	lua_setfield(L, -2, "__mongotx");
	for (i = 1; i <= n; i += 2) {
		luaL_checktype(L, i, LUA_TSTRING);
		/* a repeated key keeps its place; asked of the order list, not
		 * the value, which is nil for doc("a", nil, "a", 1) and listed
		 * "a" twice: two "a" fields in the BSON (found by fuzz/) */
		if (!mtx_listed_in_order(L, n + 2, pos, i)) {
			lua_pushvalue(L, i);
			lua_rawseti(L, n + 2, ++pos);
		}
		lua_pushvalue(L, i);
		lua_pushvalue(L, i + 1);
		lua_rawset(L, n + 1);
	}
	lua_setmetatable(L, n + 1);
	return 1;
}

static int64_t
check_int64(lua_State *L, int idx)
{
	int64_t i;
	double d;

	if (lua_type(L, idx) == LUA_TSTRING) {
		const char *s = lua_tostring(L, idx);
		char *end;

		errno = 0;
		i = (int64_t)strtoll(s, &end, 10);
		if (errno || end == s || *end)
			luaL_argerror(L, idx, "not a 64-bit integer");
		return i;
	}
	luaL_checktype(L, idx, LUA_TNUMBER);
	if (mtx_number_kind(L, idx, &i, &d) == MTX_NUM_DOUBLE)
		luaL_argerror(L, idx, "not an integer");
	return i;
}

static int
l_objectid(lua_State *L)
{
	bson_value_t v;
	size_t len;
	const char *hex = luaL_optlstring(L, 1, NULL, &len);

	v.value_type = BSON_TYPE_OID;
	if (!hex)
		bson_oid_init(&v.value.v_oid, NULL);
	else if (bson_oid_is_valid(hex, len) && len == 24)
		bson_oid_init_from_string(&v.value.v_oid, hex);
	else
		return luaL_argerror(L, 1, "not 24 hexadecimal digits");
	mtx_push_value(L, &v);
	return 1;
}

static int
l_date(lua_State *L)
{
	bson_value_t v;
	struct timeval tv;

	v.value_type = BSON_TYPE_DATE_TIME;
	if (lua_isnoneornil(L, 1)) {
		gettimeofday(&tv, NULL);
		v.value.v_datetime = (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
	} else {
		v.value.v_datetime = check_int64(L, 1);
	}
	mtx_push_value(L, &v);
	return 1;
}

static int
l_int64(lua_State *L)
{
	bson_value_t v;

	v.value_type = BSON_TYPE_INT64;
	v.value.v_int64 = check_int64(L, 1);
	mtx_push_value(L, &v);
	return 1;
}

static int
l_decimal128(lua_State *L)
{
	bson_value_t v;
	const char *s = luaL_checkstring(L, 1);

	v.value_type = BSON_TYPE_DECIMAL128;
	if (!bson_decimal128_from_string(s, &v.value.v_decimal128))
		return luaL_argerror(L, 1, "not a decimal number");
	mtx_push_value(L, &v);
	return 1;
}

static int
l_binary(lua_State *L)
{
	bson_value_t v;
	size_t len;
	const char *data = luaL_checklstring(L, 1, &len);
	lua_Integer subtype = luaL_optinteger(L, 2, BSON_SUBTYPE_BINARY);

	luaL_argcheck(L, subtype >= 0 && subtype <= 255, 2, "not 0..255");
	v.value_type = BSON_TYPE_BINARY;
	v.value.v_binary.subtype = (bson_subtype_t)subtype;
	v.value.v_binary.data = (uint8_t *)data; /* copied by mtx_push_value */
	v.value.v_binary.data_len = (uint32_t)len;
	mtx_push_value(L, &v);
	return 1;
}

static int
l_regex(lua_State *L)
{
	bson_value_t v;
	size_t len;
	const char *pattern = luaL_checklstring(L, 1, &len);
	const char *options = luaL_optstring(L, 2, "");

	luaL_argcheck(L, strlen(pattern) == len, 1, "contains a NUL byte");
	luaL_argcheck(L, strspn(options, "ilmsux") == strlen(options), 2,
		      "options are among i, l, m, s, u, x");
	v.value_type = BSON_TYPE_REGEX;
	v.value.v_regex.regex = (char *)pattern;
	v.value.v_regex.options = (char *)options;
	mtx_push_value(L, &v);
	return 1;
}

static int
l_timestamp(lua_State *L)
{
	bson_value_t v;
	lua_Number t = luaL_checknumber(L, 1), i = luaL_checknumber(L, 2);

	luaL_argcheck(L, t >= 0 && t <= 4294967295.0 && t == floor(t), 1,
		      "not 0..2^32-1");
	luaL_argcheck(L, i >= 0 && i <= 4294967295.0 && i == floor(i), 2,
		      "not 0..2^32-1");
	v.value_type = BSON_TYPE_TIMESTAMP;
	v.value.v_timestamp.timestamp = (uint32_t)t;
	v.value.v_timestamp.increment = (uint32_t)i;
	mtx_push_value(L, &v);
	return 1;
}

/* type(v): the BSON type (as $type names it) v encodes to. */
int
mtx_l_type(lua_State *L)
{
	mtx_value *v;
	int64_t i;
	double d;
	static const char *const kinds[] = {"int", "long", "double"};

	switch (lua_type(L, 1)) {
	case LUA_TNUMBER:
		lua_pushstring(L, kinds[mtx_number_kind(L, 1, &i, &d)]);
		return 1;
	case LUA_TTABLE: {
		const char *kind = mtx_table_kind(L, 1);

		if (kind) {
			lua_pushstring(L, strcmp(kind, "array") ? "object" : "array");
			return 1;
		}
		lua_pushstring(L, mtx_plain_is_array(L, 1) ? "array" : "object");
		return 1;
	}
	case LUA_TUSERDATA:
		if ((v = mtx_test_value(L, 1))) {
			lua_pushstring(L, type_alias(v->v.value_type));
			return 1;
		}
		break;
	case LUA_TLIGHTUSERDATA:
		if (!lua_touserdata(L, 1)) {
			lua_pushliteral(L, "null");
			return 1;
		}
		break;
	case LUA_TSTRING: lua_pushliteral(L, "string"); return 1;
	case LUA_TBOOLEAN: lua_pushliteral(L, "bool"); return 1;
	default: break;
	}
	lua_pushnil(L);
	return 1;
}

static void
push_singleton(lua_State *L, bson_type_t t, const char *name)
{
	bson_value_t v;

	v.value_type = t;
	mtx_push_value(L, &v);
	lua_setfield(L, -2, name);
}

/***
 * The C core: the Lua <-> BSON bridge, the connection handles and the
 * protocol's steps. `require "mongotx"` re-exports the BSON constructors;
 * the type mapping is in docs/bson.md.
 * @module mongotx.core
 */

/***
 * An ObjectId, new or from its hex form.
 * @syntax v = core.ObjectId([hex])
 * @string[opt] hex 24 hex digits
 * @treturn userdata the value (`tostring`: `ObjectId("...")`)
 * @errors raises on a malformed hex string
 * @usage local id = core.ObjectId()
 * @function ObjectId
 */

/***
 * A BSON date.
 * @syntax v = core.Date([ms])
 * @int[opt] ms milliseconds since the epoch (default now)
 * @treturn userdata the value
 * @usage local d = core.Date(0)
 * @function Date
 */

/***
 * A BSON int64.
 * @syntax v = core.Int64(n)
 * @param n an integer, or a string of digits
 * @treturn userdata the value
 * @errors raises when n is not a whole number in range
 * @usage local big = core.Int64("9007199254740993")
 * @function Int64
 */

/***
 * A BSON decimal128.
 * @syntax v = core.Decimal128(s)
 * @string s the number's text
 * @treturn userdata the value
 * @errors raises on text that is not a decimal
 * @usage local price = core.Decimal128("9.99")
 * @function Decimal128
 */

/***
 * BSON binary data.
 * @syntax v = core.Binary(bytes [, subtype])
 * @string bytes the data
 * @int[opt=0] subtype the binary subtype
 * @treturn userdata the value
 * @usage local b = core.Binary("\0\1")
 * @function Binary
 */

/***
 * A BSON regular expression.
 * @syntax v = core.Regex(pattern [, options])
 * @string pattern the expression
 * @string[opt] options among `ilmsux`
 * @treturn userdata the value
 * @usage local r = core.Regex("^a", "i")
 * @function Regex
 */

/***
 * A BSON timestamp.
 * @syntax v = core.Timestamp(t, i)
 * @int t seconds
 * @int i the increment
 * @treturn userdata the value
 * @usage local ts = core.Timestamp(1, 0)
 * @function Timestamp
 */

/***
 * Marks a table as an array, so that an empty one encodes as `[]`.
 * @syntax t = core.array([t])
 * @tparam[opt] table t the elements (default a new table)
 * @treturn table t
 * @usage local tags = core.array()
 * @function array
 */

/***
 * A document whose keys keep this order (sort specs, index keys, commands).
 * @syntax d = core.doc(k1, v1, k2, v2, ...)
 * @param ... keys and values
 * @treturn table the document
 * @usage local sort = core.doc("state", 1, "lastModified", 1)
 * @function doc
 */

/***
 * Encodes a table as BSON bytes.
 * @syntax bytes = core.encode(t)
 * @tparam table t a document
 * @treturn string the BSON
 * @errors raises on a value BSON cannot hold (with its path)
 * @usage local bytes = core.encode({ a = 1 })
 * @function encode
 */

/***
 * Decodes BSON bytes into a table.
 * @syntax t, err = core.decode(bytes)
 * @string bytes BSON
 * @treturn table the document (its metatable keeps key order and types)
 * @errors `bson` for bytes that are not BSON
 * @usage local t = core.decode(core.encode({ a = 1 }))
 * @function decode
 */

/***
 * The BSON type a Lua value encodes to.
 * @syntax name = core.type(v)
 * @param v any value
 * @treturn string a `$type` name: "objectId", "date", "document", "array", ...
 * @usage assert(core.type(core.Date()) == "date")
 * @function type
 */

/***
 * The key mongotx compares ids by: equal for two ids exactly when the server matches them as one `_id`.
 * @syntax key, snapshot = core.id_key(v)
 * @param v an id
 * @treturn string the key
 * @return the id as it is sent
 * @errors nil, message for a value that is not an id; raises for one that cannot be encoded
 * @usage assert(core.id_key(1) == core.id_key(1.0))
 * @function id_key
 */

/***
 * Blocks the process (OpenResty passes `ngx.sleep` as the policy's sleep instead).
 * @syntax core.sleep(seconds)
 * @number seconds
 * @usage core.sleep(0.01)
 * @function sleep
 */

/***
 * A value's `$type` name.
 * @syntax name = v:type()
 * @treturn string
 * @usage assert(core.ObjectId():type() == "objectId")
 * @function Value:type
 */

/***
 * A value's content as plain Lua (a Date's milliseconds, an ObjectId's hex, ...).
 * @syntax x = v:value()
 * @return the content
 * @usage local ms = core.Date(5):value()
 * @function Value:value
 */

int
mtx_open_bson(lua_State *L)
{
	static const luaL_Reg value_methods[] = {
		{"type", value_type},
		{"value", value_value},
		{NULL, NULL},
	};
	static const luaL_Reg value_meta[] = {
		{"__eq", value_eq},
		{"__gc", value_gc},
		{"__le", value_le},
		{"__lt", value_lt},
		{"__tostring", value_tostring},
		{NULL, NULL},
	};
	static const luaL_Reg funcs[] = {
		{"Binary", l_binary},
		{"Date", l_date},
		{"Decimal128", l_decimal128},
		{"Int64", l_int64},
		{"ObjectId", l_objectid},
		{"Regex", l_regex},
		{"Timestamp", l_timestamp},
		{"array", l_array},
		{"decode", mtx_l_decode},
		{"doc", l_doc},
		{"encode", mtx_l_encode},
		{"type", mtx_l_type},
		{NULL, NULL},
	};

	luaL_newmetatable(L, MTX_VALUE_MT);
	luaL_setfuncs(L, value_meta, 0);
	lua_newtable(L);
	luaL_setfuncs(L, value_methods, 0);
	lua_setfield(L, -2, "__index");
	lua_pop(L, 1);

	luaL_newmetatable(L, MTX_ARRAY_MT);
	lua_pushliteral(L, "array");
	lua_setfield(L, -2, "__mongotx");
	lua_pop(L, 1);

	luaL_setfuncs(L, funcs, 0); /* into the module table on top */
	push_singleton(L, BSON_TYPE_MINKEY, "MinKey");
	push_singleton(L, BSON_TYPE_MAXKEY, "MaxKey");
	lua_pushlightuserdata(L, NULL);
	lua_setfield(L, -2, "null");
	return 0;
}

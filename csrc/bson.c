/* bson.c: the Lua <-> BSON bridge.
 *
 * Plain Lua values map to their natural BSON types; everything else is a
 * mongotx.Value userdata holding a bson_value_t.  Decoded tables remember
 * what plain Lua cannot: the order of their keys and, where a number would
 * re-encode as another type (an int64 that fits in 32 bits, an integral
 * double on LuaJIT), that type.  Both live in the table's metatable:
 *
 *   { __mongotx = "document", "k1", "k2", ..., __types = { k = "int64" } }
 *   { __mongotx = "array", __types = { [3] = "double" } }
 *
 * so decoding and re-encoding gives the same bytes, while the tables stay
 * ordinary tables to read and change. */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/time.h>

#include "mongotx.h"

/* Replies wrap stored documents (cursor.firstBatch[i]...), so decoding
 * allows deeper nesting than a stored document may have. */
#define MTX_MAX_DECODE_DEPTH (2 * MTX_MAX_DEPTH)

enum hint { HINT_NONE, HINT_INT64, HINT_DOUBLE };
static const char *const hint_names[] = {"", "int64", "double", NULL};

/* ------------------------------------------------------------------ */
/* mongotx.Value: ObjectId, Date, Int64, Decimal128, Binary, Regex, ...  */

typedef struct {
	bson_value_t v;
} mtx_value;

static mtx_value *
push_value(lua_State *L, const bson_value_t *src)
{
	mtx_value *ud = (mtx_value *)lua_newuserdata(L, sizeof *ud);

	bson_value_copy(src, &ud->v);
	luaL_getmetatable(L, MTX_VALUE_MT);
	lua_setmetatable(L, -2);
	return ud;
}

static mtx_value *
test_value(lua_State *L, int idx)
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

static void
push_int64(lua_State *L, int64_t i)
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
	mtx_value *a = test_value(L, 1), *b = test_value(L, 2);
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
	case BSON_TYPE_DATE_TIME: push_int64(L, v->value.v_datetime); return 1;
	case BSON_TYPE_INT64: push_int64(L, v->value.v_int64); return 1;
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

/* ------------------------------------------------------------------ */
/* Encoding                                                           */

typedef struct {
	lua_State *L;
	int depth; /* nesting level of the fields being encoded */
	struct {
		const char *key; /* NULL for an array index */
		lua_Integer index;
	} path[MTX_MAX_DEPTH + 1];
	const void *tables[MTX_MAX_DEPTH + 1]; /* open tables, for cycles */
} encoder;

static void encode_value(encoder *e, int idx, bson_t *b, const char *key,
			 int keylen, enum hint hint);

/* Raises "cannot encode <what> at a.b[3]". */
static int
encode_fail(encoder *e, const char *what)
{
	lua_State *L = e->L;
	luaL_Buffer buf;
	int i;

	luaL_buffinit(L, &buf);
	luaL_addstring(&buf, "mongotx: cannot encode ");
	luaL_addstring(&buf, what);
	luaL_addstring(&buf, " at ");
	for (i = 0; i <= e->depth; i++) {
		if (!e->path[i].key && e->path[i].index == 0)
			continue; /* a container whose fields have not begun */
		if (e->path[i].key) {
			if (i > 0)
				luaL_addchar(&buf, '.');
			luaL_addstring(&buf, e->path[i].key);
		} else {
			lua_pushfstring(L, "[%d]", (int)e->path[i].index);
			luaL_addvalue(&buf);
		}
	}
	luaL_pushresult(&buf);
	return lua_error(L);
}

enum numkind { NUM_INT32, NUM_INT64, NUM_DOUBLE };

/* How a Lua number encodes without a hint.  On LuaJIT every number is a
 * double: integral ones up to 2^53 (exact in a double) encode as integers. */
static enum numkind
number_kind(lua_State *L, int idx, int64_t *i, double *d)
{
#if MTX_HAS_INTEGERS
	if (lua_isinteger(L, idx)) {
		*i = (int64_t)lua_tointeger(L, idx);
		*d = (double)*i;
		return (*i >= INT32_MIN && *i <= INT32_MAX) ? NUM_INT32 : NUM_INT64;
	}
	*d = (double)lua_tonumber(L, idx);
	return NUM_DOUBLE;
#else
	*d = (double)lua_tonumber(L, idx);
	if (*d == floor(*d) && fabs(*d) <= 9007199254740992.0 &&
	    !(*d == 0 && signbit(*d))) {
		*i = (int64_t)*d;
		return (*i >= INT32_MIN && *i <= INT32_MAX) ? NUM_INT32 : NUM_INT64;
	}
	return NUM_DOUBLE;
#endif
}

static void
encode_number(lua_State *L, int idx, bson_t *b, const char *key, int keylen,
	      enum hint hint)
{
	int64_t i = 0;
	double d;
	enum numkind kind = number_kind(L, idx, &i, &d);

	if (hint == HINT_INT64 && kind == NUM_INT32)
		kind = NUM_INT64;
	else if (hint == HINT_DOUBLE && kind != NUM_DOUBLE)
		kind = NUM_DOUBLE;
	switch (kind) {
	case NUM_INT32: bson_append_int32(b, key, keylen, (int32_t)i); break;
	case NUM_INT64: bson_append_int64(b, key, keylen, i); break;
	case NUM_DOUBLE: bson_append_double(b, key, keylen, d); break;
	}
}

static int
is_integer_key(lua_State *L, int idx, lua_Integer *out)
{
#if MTX_HAS_INTEGERS
	if (!lua_isinteger(L, idx))
		return 0;
	*out = lua_tointeger(L, idx);
	return 1;
#else
	lua_Number n;

	if (lua_type(L, idx) != LUA_TNUMBER)
		return 0;
	n = lua_tonumber(L, idx);
	if (n != floor(n) || fabs(n) > 9007199254740992.0)
		return 0;
	*out = (lua_Integer)n;
	return 1;
#endif
}

/* The __mongotx kind ("document"/"array") of the table at idx, with its
 * metatable pushed (or nil pushed when it has none of ours). */
static const char *
table_kind(lua_State *L, int idx)
{
	const char *kind;

	if (!lua_getmetatable(L, idx)) {
		lua_pushnil(L);
		return NULL;
	}
	lua_getfield(L, -1, "__mongotx");
	/* a string held by the metatable stays valid after the pop; a number
	 * would be converted into a string only the stack slot holds */
	kind = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
	lua_pop(L, 1);
	if (!kind) {
		lua_pop(L, 1);
		lua_pushnil(L);
	}
	return kind;
}

/* For a table without our metatable: 1 with *n set when its keys are
 * exactly 1..n, 0 for a document; raises for anything else. */
static int
plain_is_array(encoder *e, int idx, lua_Integer *n)
{
	lua_State *L = e->L;
	lua_Integer count = 0, max = 0, k;
	int strings = 0, others = 0;

	lua_pushnil(L);
	while (lua_next(L, idx)) {
		lua_pop(L, 1);
		count++;
		if (lua_type(L, -1) == LUA_TSTRING)
			strings++;
		else if (is_integer_key(L, -1, &k) && k >= 1)
			max = k > max ? k : max;
		else
			others++;
	}
	if (others)
		encode_fail(e, "a table with a key that is neither a string nor a positive integer");
	if (strings == count)
		return 0;
	if (strings)
		encode_fail(e, "a table mixing array and hash keys");
	if (max != count)
		encode_fail(e, "an array with holes");
	*n = count;
	return 1;
}

static enum hint
type_hint(lua_State *L, int types)
{
	int i;
	const char *name;

	if (!types)
		return HINT_NONE;
	lua_rawget(L, types); /* key on top of the stack, replaced by hint */
	name = lua_tostring(L, -1);
	for (i = 1; name && hint_names[i]; i++)
		if (strcmp(name, hint_names[i]) == 0)
			break;
	lua_pop(L, 1);
	return name && hint_names[i] ? (enum hint)i : HINT_NONE;
}

static void
encode_array_items(encoder *e, int idx, bson_t *b, lua_Integer n, int types)
{
	lua_State *L = e->L;
	lua_Integer i;
	char numbuf[24];
	const char *key;
	size_t keylen;

	for (i = 1; i <= n; i++) {
		e->path[e->depth].key = NULL;
		e->path[e->depth].index = i;
		keylen = bson_uint32_to_string((uint32_t)(i - 1), &key, numbuf,
					       sizeof numbuf);
		enum hint hint = HINT_NONE;

		if (types) {
			lua_pushinteger(L, i);
			hint = type_hint(L, types);
		}
		lua_rawgeti(L, idx, (int)i);
		encode_value(e, lua_gettop(L), b, key, (int)keylen, hint);
		lua_pop(L, 1);
	}
}

/* Encodes the field whose key is at -2 and value at -1. */
static void
encode_field(encoder *e, bson_t *b, int types)
{
	lua_State *L = e->L;
	size_t len;
	const char *key;
	enum hint hint = HINT_NONE;

	if (lua_type(L, -2) != LUA_TSTRING)
		encode_fail(e, "a document key that is not a string");
	key = lua_tolstring(L, -2, &len);
	e->path[e->depth].key = key;
	if (strlen(key) != len)
		encode_fail(e, "a key containing a NUL byte");
	/* bson_validate refuses a key that is not UTF-8, so core.decode could
	 * not read back what this wrote (found by fuzz/lua_encode.c) */
	if (!bson_utf8_validate(key, len, false))
		encode_fail(e, "a key that is not valid UTF-8");
	if (types) {
		lua_pushvalue(L, -2);
		hint = type_hint(L, types);
	}
	encode_value(e, lua_gettop(L), b, key, (int)len, hint);
}

static int
listed_in_order(lua_State *L, int meta, lua_Integer n, int key)
{
	lua_Integer i;
	int found = 0;

	for (i = 1; i <= n && !found; i++) {
		lua_rawgeti(L, meta, (int)i);
		found = lua_rawequal(L, -1, key);
		lua_pop(L, 1);
	}
	return found;
}

/* Fields of a document: those its metatable orders first, in that order,
 * then any others (added after decoding) in table order. */
static void
encode_document_fields(encoder *e, int idx, bson_t *b, int meta, int types)
{
	lua_State *L = e->L;
	lua_Integer norder = meta ? (lua_Integer)mtx_rawlen(L, meta) : 0;
	lua_Integer i, emitted = 0, count = 0;

	for (i = 1; i <= norder; i++) {
		lua_rawgeti(L, meta, (int)i);
		lua_pushvalue(L, -1);
		lua_rawget(L, idx);
		if (lua_isnil(L, -1) || lua_type(L, -2) != LUA_TSTRING) {
			lua_pop(L, 2);
			continue;
		}
		encode_field(e, b, types);
		lua_pop(L, 2);
		emitted++;
	}
	if (norder) {
		lua_pushnil(L);
		while (lua_next(L, idx)) {
			lua_pop(L, 1);
			count++;
		}
		if (count == emitted)
			return;
	}
	lua_pushnil(L);
	while (lua_next(L, idx)) {
		if (norder && listed_in_order(L, meta, norder, lua_gettop(L) - 1)) {
			lua_pop(L, 1);
			continue;
		}
		encode_field(e, b, types);
		lua_pop(L, 1);
	}
}

/* Encodes the table at idx as a document or an array into b, which is
 * the (begun) child or the top-level document.  Returns 1 for an array. */
static int
encode_table_body(encoder *e, int idx, bson_t *b)
{
	lua_State *L = e->L;
	const char *kind;
	int meta = 0, types = 0, is_array = 0, top = lua_gettop(L);
	lua_Integer n = 0;

	luaL_checkstack(L, 8, "mongotx: document too deep");
	kind = table_kind(L, idx);
	if (kind) {
		meta = lua_gettop(L);
		lua_getfield(L, meta, "__types");
		types = lua_istable(L, -1) ? lua_gettop(L) : 0;
		is_array = strcmp(kind, "array") == 0;
		if (is_array) {
			lua_Integer count = 0, k;

			n = (lua_Integer)mtx_rawlen(L, idx);
			lua_pushnil(L);
			while (lua_next(L, idx)) {
				lua_pop(L, 1);
				count++;
				if (!is_integer_key(L, -1, &k) || k < 1 || k > n)
					encode_fail(e, "an array with a key that is not 1..n");
			}
			if (count != n)
				encode_fail(e, "an array with holes");
		}
	} else {
		is_array = plain_is_array(e, idx, &n);
	}
	if (is_array)
		encode_array_items(e, idx, b, n, types);
	else
		encode_document_fields(e, idx, b, meta, types);
	lua_settop(L, top);
	return is_array;
}

static void
encode_child(encoder *e, int idx, bson_t *b, const char *key, int keylen)
{
	lua_State *L = e->L;
	const void *p = lua_topointer(L, idx);
	const char *kind;
	bson_t child;
	int i, array;

	for (i = 0; i <= e->depth; i++)
		if (e->tables[i] == p)
			encode_fail(e, "a table that contains itself");
	if (e->depth + 1 >= MTX_MAX_DEPTH)
		encode_fail(e, "a table nested more than 100 levels deep");
	/* Whether it is an array must be known before the child is begun. */
	kind = table_kind(L, idx);
	lua_pop(L, 1);
	if (kind) {
		array = strcmp(kind, "array") == 0;
	} else {
		lua_Integer n;
		array = plain_is_array(e, idx, &n);
	}
	if (array)
		bson_append_array_begin(b, key, keylen, &child);
	else
		bson_append_document_begin(b, key, keylen, &child);
	e->depth++;
	e->tables[e->depth] = p;
	e->path[e->depth].key = NULL;
	e->path[e->depth].index = 0;
	encode_table_body(e, idx, &child);
	e->depth--;
	if (array)
		bson_append_array_end(b, &child);
	else
		bson_append_document_end(b, &child);
}

static void
encode_value(encoder *e, int idx, bson_t *b, const char *key, int keylen,
	     enum hint hint)
{
	lua_State *L = e->L;
	size_t len;
	const char *s;
	mtx_value *v;

	switch (lua_type(L, idx)) {
	case LUA_TNIL:
		bson_append_null(b, key, keylen);
		break;
	case LUA_TBOOLEAN:
		bson_append_bool(b, key, keylen, lua_toboolean(L, idx));
		break;
	case LUA_TNUMBER:
		encode_number(L, idx, b, key, keylen, hint);
		break;
	case LUA_TSTRING:
		s = lua_tolstring(L, idx, &len);
		if (len > MTX_MAX_BSON)
			encode_fail(e, "a string longer than 16 MiB");
		bson_append_utf8(b, key, keylen, s, (int)len);
		break;
	case LUA_TTABLE:
		encode_child(e, idx, b, key, keylen);
		break;
	case LUA_TLIGHTUSERDATA:
		/* mongotx.null, ngx.null and cjson.null are all NULL */
		if (lua_touserdata(L, idx) != NULL)
			encode_fail(e, "a light userdata other than null");
		bson_append_null(b, key, keylen);
		break;
	case LUA_TUSERDATA:
		if (!(v = test_value(L, idx)))
			encode_fail(e, "a userdata that is not a mongotx value");
		bson_append_value(b, key, keylen, &v->v);
		break;
	default:
		encode_fail(e, lua_typename(L, lua_type(L, idx)));
	}
}

static bson_t *
check_document(lua_State *L, int idx, int with_id)
{
	encoder e;
	bson_t *b;
	const char *kind;
	bson_oid_t oid;
	bson_value_t id;

	idx = mtx_absindex(L, idx);
	luaL_checktype(L, idx, LUA_TTABLE);
	kind = table_kind(L, idx);
	lua_pop(L, 1);
	if (kind && strcmp(kind, "array") == 0)
		luaL_argerror(L, idx, "a document, not an array");
	b = mtx_scratch(L);
	e.L = L;
	e.depth = 0;
	e.tables[0] = lua_topointer(L, idx);
	e.path[0].key = "top level";
	if (with_id) {
		lua_getfield(L, idx, "_id");
		if (lua_isnil(L, -1)) {
			lua_pop(L, 1);
			bson_oid_init(&oid, NULL);
			id.value_type = BSON_TYPE_OID;
			id.value.v_oid = oid;
			bson_append_oid(b, "_id", 3, &oid);
			push_value(L, &id);
			lua_insert(L, -2);
		} else {
			lua_insert(L, -2); /* _id below the document */
		}
	}
	if (encode_table_body(&e, idx, b))
		luaL_argerror(L, idx, "a document, not an array");
	if (b->len > MTX_MAX_BSON)
		luaL_error(L, "mongotx: document of %d bytes exceeds the 16 MiB limit",
			   (int)b->len);
	if (with_id)
		lua_insert(L, -2); /* ...document, _id */
	return b;
}

bson_t *
mtx_check_document(lua_State *L, int idx)
{
	return check_document(L, idx, 0);
}

bson_t *
mtx_check_insert(lua_State *L, int idx)
{
	return check_document(L, idx, 1);
}

bson_t *
mtx_check_ordered(lua_State *L, int idx)
{
	int n = 0;

	idx = mtx_absindex(L, idx);
	luaL_checktype(L, idx, LUA_TTABLE);
	if (!table_kind(L, idx)) {
		lua_pushnil(L);
		while (n < 2 && lua_next(L, idx)) {
			lua_pop(L, 1);
			n++;
		}
		if (n > 1) {
			lua_settop(L, idx);
			luaL_argerror(L, idx, "a document whose key order matters "
				      "needs mongotx.doc(k1, v1, k2, v2, ...)");
		}
	}
	lua_pop(L, 1);
	return check_document(L, idx, 0);
}

void
mtx_append_value(lua_State *L, int idx, bson_t *b, const char *key)
{
	encoder e;

	e.L = L;
	e.depth = 0;
	e.tables[0] = NULL;
	e.path[0].key = key;
	encode_value(&e, mtx_absindex(L, idx), b, key, -1, HINT_NONE);
}

/* ------------------------------------------------------------------ */
/* Decoding                                                           */

static void push_container(lua_State *L, bson_iter_t *it, int array,
			   int depth);

/* Pushes the current element; returns the type hint its container must
 * record for the element to re-encode as the same BSON type. */
static enum hint
push_element(lua_State *L, const bson_iter_t *it, int depth)
{
	bson_type_t t = bson_iter_type(it);
	int64_t i;
	double d;

	switch (t) {
	case BSON_TYPE_DOUBLE:
		lua_pushnumber(L, bson_iter_double(it));
#if MTX_HAS_INTEGERS
		return HINT_NONE;
#else
		return number_kind(L, -1, &i, &d) == NUM_DOUBLE ? HINT_NONE
								: HINT_DOUBLE;
#endif
	case BSON_TYPE_UTF8: {
		uint32_t len;
		const char *s = bson_iter_utf8(it, &len);
		lua_pushlstring(L, s, len);
		return HINT_NONE;
	}
	case BSON_TYPE_DOCUMENT:
	case BSON_TYPE_ARRAY: {
		bson_iter_t child;
		bson_t doc;
		const uint8_t *data;
		uint32_t len;

		/* bson_init_static checks the final NUL, which neither
		 * bson_iter_recurse nor bson_validate (libbson 1.23) does
		 * (found by fuzz/bson_roundtrip.c) */
		if (t == BSON_TYPE_ARRAY)
			bson_iter_array(it, &len, &data);
		else
			bson_iter_document(it, &len, &data);
		if (!bson_init_static(&doc, data, len) ||
		    !bson_iter_init(&child, &doc))
			luaL_error(L, "mongotx: corrupt BSON");
		push_container(L, &child, t == BSON_TYPE_ARRAY, depth + 1);
		return HINT_NONE;
	}
	case BSON_TYPE_CODEWSCOPE: {
		uint32_t code_len, scope_len;
		const uint8_t *scope;
		size_t offset;
		bson_t s;

		/* bson_validate (libbson 1.23) skips a scope that
		 * bson_init_static refuses (no final NUL), and bson_append_value
		 * then leaves the field out: it vanished on re-encoding; nor does
		 * it always look inside one, and a scope key that is not UTF-8
		 * was then written back as BSON it refuses (found by
		 * fuzz/bson_roundtrip.c) */
		bson_iter_codewscope(it, &code_len, &scope_len, &scope);
		if (!bson_init_static(&s, scope, scope_len) ||
		    !bson_validate(&s, BSON_VALIDATE_NONE, &offset))
			luaL_error(L, "mongotx: corrupt BSON");
		push_value(L, bson_iter_value((bson_iter_t *)it));
		return HINT_NONE;
	}
	case BSON_TYPE_BOOL:
		lua_pushboolean(L, bson_iter_bool(it));
		return HINT_NONE;
	case BSON_TYPE_NULL:
		lua_pushlightuserdata(L, NULL);
		return HINT_NONE;
	case BSON_TYPE_INT32:
		push_int64(L, bson_iter_int32(it));
		return HINT_NONE;
	case BSON_TYPE_INT64:
		i = bson_iter_int64(it);
#if !MTX_HAS_INTEGERS
		if (i > 9007199254740992LL || i < -9007199254740992LL) {
			push_value(L, bson_iter_value((bson_iter_t *)it));
			return HINT_NONE;
		}
#endif
		push_int64(L, i);
		(void)d;
		return (i >= INT32_MIN && i <= INT32_MAX) ? HINT_INT64 : HINT_NONE;
	default:
		push_value(L, bson_iter_value((bson_iter_t *)it));
		return HINT_NONE;
	}
}

/* Records a type hint for key (on top of the stack, popped) in the
 * metatable at meta, creating __types on first use. */
static void
set_hint(lua_State *L, int meta, enum hint hint)
{
	lua_getfield(L, meta, "__types");
	if (lua_isnil(L, -1)) {
		lua_pop(L, 1);
		lua_newtable(L);
		lua_pushvalue(L, -1);
		lua_setfield(L, meta, "__types");
	}
	lua_insert(L, -2);
	lua_pushstring(L, hint_names[hint]);
	lua_rawset(L, -3);
	lua_pop(L, 1);
}

/* Pushes the table for the container whose elements `it` walks. */
static void
push_container(lua_State *L, bson_iter_t *it, int array, int depth)
{
	lua_Integer n = 0;
	int t, meta;
	enum hint hint;
	uint32_t len = it->len; /* the walk's end clears it */

	if (depth > MTX_MAX_DECODE_DEPTH)
		luaL_error(L, "mongotx: document nested more than %d levels deep",
			   MTX_MAX_DECODE_DEPTH);
	luaL_checkstack(L, 8, "mongotx: document too deep");
	lua_newtable(L);
	t = lua_gettop(L);
	lua_newtable(L); /* metatable: kind, key order, type hints */
	meta = t + 1;
	lua_pushstring(L, array ? "array" : "document");
	lua_setfield(L, meta, "__mongotx");
	while (bson_iter_next(it)) {
		n++;
		/* what encode refuses (see encode_field), and bson_validate too,
		 * but not past a regex that is not UTF-8 (found by fuzz/) */
		if (!array && !bson_utf8_validate(bson_iter_key(it),
						  bson_iter_key_len(it), false))
			luaL_error(L, "mongotx: corrupt BSON (a key that is not UTF-8)");
		hint = push_element(L, it, depth);
		if (array) {
			lua_rawseti(L, t, (int)n);
		} else {
			lua_pushlstring(L, bson_iter_key(it), bson_iter_key_len(it));
			lua_pushvalue(L, -1);
			lua_rawseti(L, meta, (int)n);
			lua_insert(L, -2);
			lua_rawset(L, t);
		}
		if (hint != HINT_NONE) {
			if (array)
				lua_pushinteger(L, n);
			else
				lua_pushlstring(L, bson_iter_key(it),
						bson_iter_key_len(it));
			set_hint(L, meta, hint);
		}
	}
	/* bson_iter_next takes a 0 type byte before the final NUL for the end,
	 * and bson_validate (libbson 1.23) looks no further than a regex that
	 * is not UTF-8: unless the walk ended at the final NUL, the rest of the
	 * document vanished without a word (found by fuzz/bson_roundtrip.c) */
	if (bson_iter_offset(it) + 1 != len)
		luaL_error(L, "mongotx: corrupt BSON");
	lua_getfield(L, meta, "__types");
	if (array && lua_isnil(L, -1)) {
		/* no hints: share one metatable among all plain arrays */
		lua_pop(L, 2);
		luaL_getmetatable(L, MTX_ARRAY_MT);
	} else if (!array && n < 2 && lua_isnil(L, -1)) {
		/* a single key has no order to keep */
		lua_pop(L, 2);
		return;
	} else {
		lua_pop(L, 1);
	}
	lua_setmetatable(L, t);
}

void
mtx_push_document(lua_State *L, const bson_t *b)
{
	bson_iter_t it;

	if (!bson_iter_init(&it, b))
		luaL_error(L, "mongotx: corrupt BSON");
	push_container(L, &it, 0, 0);
}

void
mtx_push_iter(lua_State *L, const bson_iter_t *it)
{
	push_element(L, it, 0);
}

/* ------------------------------------------------------------------ */
/* Lua functions                                                      */

/* encode(t): the BSON bytes of a document. */
static int
l_encode(lua_State *L)
{
	bson_t *b = mtx_check_document(L, 1);

	lua_pushlstring(L, (const char *)bson_get_data(b), b->len);
	return 1;
}

/* decode(bytes): the document, or nil and an error for invalid BSON (a
 * raise for the rare BSON that bson_validate passes and the bridge cannot
 * give back, see push_element). */
static int
l_decode(lua_State *L)
{
	size_t len, offset;
	const char *s = luaL_checklstring(L, 1, &len);
	bson_t b;

	if (!bson_init_static(&b, (const uint8_t *)s, len) ||
	    !bson_validate(&b, BSON_VALIDATE_NONE, &offset))
		return mtx_push_error_msg(L, "bson", 0, "invalid BSON");
	mtx_push_document(L, &b);
	return 1;
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
		if (!listed_in_order(L, n + 2, pos, i)) {
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
	if (number_kind(L, idx, &i, &d) == NUM_DOUBLE)
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
	push_value(L, &v);
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
	push_value(L, &v);
	return 1;
}

static int
l_int64(lua_State *L)
{
	bson_value_t v;

	v.value_type = BSON_TYPE_INT64;
	v.value.v_int64 = check_int64(L, 1);
	push_value(L, &v);
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
	push_value(L, &v);
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
	v.value.v_binary.data = (uint8_t *)data; /* copied by push_value */
	v.value.v_binary.data_len = (uint32_t)len;
	push_value(L, &v);
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
	push_value(L, &v);
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
	push_value(L, &v);
	return 1;
}

/* type(v): the BSON type (as $type names it) v encodes to. */
static int
l_type(lua_State *L)
{
	mtx_value *v;
	int64_t i;
	double d;
	static const char *const kinds[] = {"int", "long", "double"};

	switch (lua_type(L, 1)) {
	case LUA_TNUMBER:
		lua_pushstring(L, kinds[number_kind(L, 1, &i, &d)]);
		return 1;
	case LUA_TTABLE: {
		const char *kind = table_kind(L, 1);
		lua_Integer n;
		encoder e;

		if (kind) {
			lua_pushstring(L, strcmp(kind, "array") ? "object" : "array");
			return 1;
		}
		e.L = L;
		e.depth = 0;
		e.path[0].key = "top level";
		lua_pushstring(L, plain_is_array(&e, 1, &n) ? "array" : "object");
		return 1;
	}
	case LUA_TUSERDATA:
		if ((v = test_value(L, 1))) {
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
	push_value(L, &v);
	lua_setfield(L, -2, name);
}

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
		{"decode", l_decode},
		{"doc", l_doc},
		{"encode", l_encode},
		{"type", l_type},
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

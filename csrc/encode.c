/* encode.c: Lua -> BSON (core.encode and what the other files send).
 *
 * Walks a Lua value into a bson_t: the tables' metatables give key order
 * and type hints (see mongotx.h), plain tables become arrays or documents
 * by their keys.  The checks MongoDB would make later (16 MiB, 100 levels,
 * UTF-8 keys) and the ones Lua needs (cycles, holes, mixed keys) raise
 * here, naming the path of the offending value. */
#include <math.h>
#include <string.h>

#include "mongotx.h"

const char *const mtx_hint_names[] = {"", "int64", "double", NULL};

typedef struct {
	lua_State *L;
	int depth; /* nesting level of the fields being encoded */
	struct {
		const char *key; /* NULL for an array index */
		lua_Integer index;
	} path[MTX_MAX_DEPTH + 1];
	const void *tables[MTX_MAX_DEPTH + 1]; /* open tables, for cycles */
	/* The bytes this encoder wrote outside the container being filled
	 * (its open parents, less what the top one held before): with its
	 * own length, what the value takes so far.  A table holding one
	 * child twice, that child the next twice and so on is small, but
	 * 2^depth bytes long: it must fail at 16 MiB, not ask libbson for
	 * more than 2 GiB (which aborts the process). */
	int64_t outer;
} encoder;

static void encode_value(encoder *e, int idx, bson_t *b, const char *key,
			 int keylen, enum mtx_hint hint);

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

/* How a Lua number encodes without a hint.  On LuaJIT every number is a
 * double: integral ones up to 2^53 (exact in a double) encode as integers. */
enum mtx_numkind
mtx_number_kind(lua_State *L, int idx, int64_t *i, double *d)
{
#if MTX_HAS_INTEGERS
	if (lua_isinteger(L, idx)) {
		*i = (int64_t)lua_tointeger(L, idx);
		*d = (double)*i;
		return (*i >= INT32_MIN && *i <= INT32_MAX) ? MTX_NUM_INT32 : MTX_NUM_INT64;
	}
	*d = (double)lua_tonumber(L, idx);
	return MTX_NUM_DOUBLE;
#else
	*d = (double)lua_tonumber(L, idx);
	if (*d == floor(*d) && fabs(*d) <= 9007199254740992.0 &&
	    !(*d == 0 && signbit(*d))) {
		*i = (int64_t)*d;
		return (*i >= INT32_MIN && *i <= INT32_MAX) ? MTX_NUM_INT32 : MTX_NUM_INT64;
	}
	return MTX_NUM_DOUBLE;
#endif
}

void
mtx_append_number(lua_State *L, int idx, bson_t *b, const char *key, int keylen,
		  enum mtx_hint hint)
{
	int64_t i = 0;
	double d;
	enum mtx_numkind kind = mtx_number_kind(L, idx, &i, &d);

	if (hint == MTX_HINT_INT64 && kind == MTX_NUM_INT32)
		kind = MTX_NUM_INT64;
	else if (hint == MTX_HINT_DOUBLE && kind != MTX_NUM_DOUBLE)
		kind = MTX_NUM_DOUBLE;
	switch (kind) {
	case MTX_NUM_INT32: bson_append_int32(b, key, keylen, (int32_t)i); break;
	case MTX_NUM_INT64: bson_append_int64(b, key, keylen, i); break;
	case MTX_NUM_DOUBLE: bson_append_double(b, key, keylen, d); break;
	}
}

int
mtx_is_integer_key(lua_State *L, int idx, lua_Integer *out)
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
const char *
mtx_table_kind(lua_State *L, int idx)
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
		else if (mtx_is_integer_key(L, -1, &k) && k >= 1)
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

static enum mtx_hint
type_hint(lua_State *L, int types)
{
	int i;
	const char *name;

	if (!types)
		return MTX_HINT_NONE;
	lua_rawget(L, types); /* key on top of the stack, replaced by hint */
	name = lua_tostring(L, -1);
	for (i = 1; name && mtx_hint_names[i]; i++)
		if (strcmp(name, mtx_hint_names[i]) == 0)
			break;
	lua_pop(L, 1);
	return name && mtx_hint_names[i] ? (enum mtx_hint)i : MTX_HINT_NONE;
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
		enum mtx_hint hint = MTX_HINT_NONE;

		if (types) {
			lua_pushinteger(L, i);
			hint = type_hint(L, types);
		}
		lua_rawgeti(L, idx, (int)i);
		encode_value(e, lua_gettop(L), b, key, (int)keylen, hint);
		lua_pop(L, 1);
	}
}

/* bson_utf8_validate, but plain ASCII (the common case) without asking
 * libbson: 4% of a batch's client instructions went there.  A NUL byte is
 * taken on both paths, as BSON and libmongoc take it in a string value; a
 * key holding one is refused by its caller's length check, before it
 * gets here.  The overlong form of NUL (C0 80), which libbson's
 * ALLOW_NULL takes too, is not UTF-8 and no other driver decodes it: the
 * parts between NUL bytes are validated without it. */
int
mtx_utf8_valid(const char *s, size_t len)
{
	size_t i;

	for (i = 0; i < len; i++)
		if ((unsigned char)s[i] & 0x80)
			break;
	if (i == len)
		return 1;
	for (;;) {
		const char *nul = memchr(s, '\0', len);
		size_t n = nul ? (size_t)(nul - s) : len;

		if (!bson_utf8_validate(s, n, false))
			return 0;
		if (!nul)
			return 1;
		s = nul + 1;
		len -= n + 1;
	}
}

/* Encodes the field whose key is at -2 and value at -1. */
static void
encode_field(encoder *e, bson_t *b, int types)
{
	lua_State *L = e->L;
	size_t len;
	const char *key;
	enum mtx_hint hint = MTX_HINT_NONE;

	if (lua_type(L, -2) != LUA_TSTRING)
		encode_fail(e, "a document key that is not a string");
	key = lua_tolstring(L, -2, &len);
	e->path[e->depth].key = key;
	if (strlen(key) != len)
		encode_fail(e, "a key containing a NUL byte");
	/* bson_validate refuses a key that is not UTF-8, so core.decode could
	 * not read back what this wrote (found by fuzz/lua_encode.c) */
	if (!mtx_utf8_valid(key, len))
		encode_fail(e, "a key that is not valid UTF-8");
	if (types) {
		lua_pushvalue(L, -2);
		hint = type_hint(L, types);
	}
	encode_value(e, lua_gettop(L), b, key, (int)len, hint);
}

int
mtx_listed_in_order(lua_State *L, int meta, lua_Integer n, int key)
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
		if (norder && mtx_listed_in_order(L, meta, norder, lua_gettop(L) - 1)) {
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
	kind = mtx_table_kind(L, idx);
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
				if (!mtx_is_integer_key(L, -1, &k) || k < 1 || k > n)
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
	int64_t outer = e->outer;

	for (i = 0; i <= e->depth; i++)
		if (e->tables[i] == p)
			encode_fail(e, "a table that contains itself");
	if (e->depth + 1 >= MTX_MAX_DEPTH)
		encode_fail(e, "a table nested more than 100 levels deep");
	/* Whether it is an array must be known before the child is begun. */
	kind = mtx_table_kind(L, idx);
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
	/* b's length holds the child's empty form (its 5 bytes), which the
	 * child's own length counts: without them, a value exactly at the
	 * limit fits, one byte over does not */
	e->outer = outer + b->len - child.len;
	encode_table_body(e, idx, &child);
	e->outer = outer;
	e->depth--;
	if (array)
		bson_append_array_end(b, &child);
	else
		bson_append_document_end(b, &child);
}

static void
encode_value(encoder *e, int idx, bson_t *b, const char *key, int keylen,
	     enum mtx_hint hint)
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
		mtx_append_number(L, idx, b, key, keylen, hint);
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
		if (!(v = mtx_test_value(L, idx)))
			encode_fail(e, "a userdata that is not a mongotx value");
		bson_append_value(b, key, keylen, &v->v);
		break;
	default:
		encode_fail(e, lua_typename(L, lua_type(L, idx)));
	}
	if (e->outer + b->len > MTX_MAX_BSON)
		encode_fail(e, "a document that exceeds the 16 MiB limit");
}

static bson_t *
check_document(lua_State *L, int idx, int with_id, int reused)
{
	encoder e;
	bson_t *b;
	const char *kind;
	bson_oid_t oid;
	bson_value_t id;

	idx = mtx_absindex(L, idx);
	luaL_checktype(L, idx, LUA_TTABLE);
	kind = mtx_table_kind(L, idx);
	lua_pop(L, 1);
	if (kind && strcmp(kind, "array") == 0)
		luaL_argerror(L, idx, "a document, not an array");
	b = reused ? mtx_scratch_take(L) : mtx_scratch(L);
	e.L = L;
	e.depth = 0;
	e.tables[0] = lua_topointer(L, idx);
	e.path[0].key = "top level";
	e.outer = 0;
	if (with_id) {
		lua_getfield(L, idx, "_id");
		if (lua_isnil(L, -1)) {
			lua_pop(L, 1);
			bson_oid_init(&oid, NULL);
			id.value_type = BSON_TYPE_OID;
			id.value.v_oid = oid;
			bson_append_oid(b, "_id", 3, &oid);
			mtx_push_value(L, &id);
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
	return check_document(L, idx, 0, 0);
}

bson_t *
mtx_check_document_reused(lua_State *L, int idx)
{
	return check_document(L, idx, 0, 1);
}

bson_t *
mtx_check_insert(lua_State *L, int idx)
{
	return check_document(L, idx, 1, 0);
}

bson_t *
mtx_check_ordered(lua_State *L, int idx)
{
	int n = 0;

	idx = mtx_absindex(L, idx);
	luaL_checktype(L, idx, LUA_TTABLE);
	if (!mtx_table_kind(L, idx)) {
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
	return check_document(L, idx, 0, 0);
}

void
mtx_append_value(lua_State *L, int idx, bson_t *b, const char *key)
{
	encoder e;

	e.L = L;
	e.depth = 0;
	e.tables[0] = NULL;
	e.path[0].key = key;
	e.outer = -(int64_t)b->len; /* what b held before is not the value's */
	encode_value(&e, mtx_absindex(L, idx), b, key, -1, MTX_HINT_NONE);
}

int
mtx_plain_is_array(lua_State *L, int idx)
{
	lua_Integer n;
	encoder e;

	e.L = L;
	e.depth = 0;
	e.path[0].key = "top level";
	e.outer = 0;
	return plain_is_array(&e, idx, &n);
}

/* encode(t): the BSON bytes of a document. */
int
mtx_l_encode(lua_State *L)
{
	bson_t *b = mtx_check_document_reused(L, 1);

	lua_pushlstring(L, (const char *)bson_get_data(b), b->len);
	mtx_scratch_give(L, -2);
	return 1;
}

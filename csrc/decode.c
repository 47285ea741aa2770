/* decode.c: BSON -> Lua (core.decode, replies, cursor documents).
 *
 * Builds plain Lua tables whose metatables remember what Lua cannot (key
 * order, int64 and double hints; see mongotx.h), so that encode.c gives
 * back the same bytes.  BSON that libbson's own checks let through but
 * that would lose data on the way (found by fuzz/bson_roundtrip.c) is
 * refused here. */
#include "mongotx.h"

/* Replies wrap stored documents (cursor.firstBatch[i]...), so decoding
 * allows deeper nesting than a stored document may have. */
#define MTX_MAX_DECODE_DEPTH (2 * MTX_MAX_DEPTH)

static void push_container(lua_State *L, bson_iter_t *it, int array,
			   int depth);

/* Pushes the current element; returns the type hint its container must
 * record for the element to re-encode as the same BSON type. */
static enum mtx_hint
push_element(lua_State *L, const bson_iter_t *it, int depth)
{
	bson_type_t t = bson_iter_type(it);
	int64_t i;
	double d;

	switch (t) {
	case BSON_TYPE_DOUBLE:
		lua_pushnumber(L, bson_iter_double(it));
#if MTX_HAS_INTEGERS
		return MTX_HINT_NONE;
#else
		return mtx_number_kind(L, -1, &i, &d) == MTX_NUM_DOUBLE ? MTX_HINT_NONE
								: MTX_HINT_DOUBLE;
#endif
	case BSON_TYPE_UTF8: {
		uint32_t len;
		const char *s = bson_iter_utf8(it, &len);
		lua_pushlstring(L, s, len);
		return MTX_HINT_NONE;
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
		return MTX_HINT_NONE;
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
		mtx_push_value(L, bson_iter_value((bson_iter_t *)it));
		return MTX_HINT_NONE;
	}
	case BSON_TYPE_BOOL:
		lua_pushboolean(L, bson_iter_bool(it));
		return MTX_HINT_NONE;
	case BSON_TYPE_NULL:
		lua_pushlightuserdata(L, NULL);
		return MTX_HINT_NONE;
	case BSON_TYPE_INT32:
		mtx_push_int64(L, bson_iter_int32(it));
		return MTX_HINT_NONE;
	case BSON_TYPE_INT64:
		i = bson_iter_int64(it);
#if !MTX_HAS_INTEGERS
		if (i > 9007199254740992LL || i < -9007199254740992LL) {
			mtx_push_value(L, bson_iter_value((bson_iter_t *)it));
			return MTX_HINT_NONE;
		}
#endif
		mtx_push_int64(L, i);
		(void)d;
		return (i >= INT32_MIN && i <= INT32_MAX) ? MTX_HINT_INT64 : MTX_HINT_NONE;
	default:
		mtx_push_value(L, bson_iter_value((bson_iter_t *)it));
		return MTX_HINT_NONE;
	}
}

/* Records a type hint for key (on top of the stack, popped) in the
 * metatable at meta, creating __types on first use. */
static void
set_hint(lua_State *L, int meta, enum mtx_hint hint)
{
	lua_getfield(L, meta, "__types");
	if (lua_isnil(L, -1)) {
		lua_pop(L, 1);
		lua_newtable(L);
		lua_pushvalue(L, -1);
		lua_setfield(L, meta, "__types");
	}
	lua_insert(L, -2);
	lua_pushstring(L, mtx_hint_names[hint]);
	lua_rawset(L, -3);
	lua_pop(L, 1);
}

/* Pushes the metatable of the container at t (on top of the stack), with
 * `first` as its first key when given; returns its index, t + 1. */
static int
new_meta(lua_State *L, int t, int array, const char *first, uint32_t first_len)
{
	lua_newtable(L); /* metatable: kind, key order, type hints */
	lua_pushstring(L, array ? "array" : "document");
	lua_setfield(L, t + 1, "__mongotx");
	if (first) {
		lua_pushlstring(L, first, first_len);
		lua_rawseti(L, t + 1, 1);
	}
	return t + 1;
}

/* Pushes the table for the container whose elements `it` walks.  Its
 * metatable is made only when there is something to keep: a second key's
 * order, or a type hint (most documents a batch decodes have one key). */
static void
push_container(lua_State *L, bson_iter_t *it, int array, int depth)
{
	lua_Integer n = 0;
	int t, meta = 0;
	enum mtx_hint hint;
	uint32_t len = it->len; /* the walk's end clears it */
	const char *key, *first = NULL;
	uint32_t keylen, first_len = 0;

	if (depth > MTX_MAX_DECODE_DEPTH)
		luaL_error(L, "mongotx: document nested more than %d levels deep",
			   MTX_MAX_DECODE_DEPTH);
	luaL_checkstack(L, 8, "mongotx: document too deep");
	lua_newtable(L);
	t = lua_gettop(L);
	while (bson_iter_next(it)) {
		n++;
		key = bson_iter_key(it);
		keylen = bson_iter_key_len(it);
		/* what encode refuses (see encode_field), and bson_validate too,
		 * but not past a regex that is not UTF-8 (found by fuzz/) */
		if (!array && !mtx_utf8_valid(key, keylen))
			luaL_error(L, "mongotx: corrupt BSON (a key that is not UTF-8)");
		if (!array && n == 1)
			first = key, first_len = keylen;
		else if (!array && !meta)
			meta = new_meta(L, t, array, first, first_len);
		hint = push_element(L, it, depth);
		if (array) {
			lua_rawseti(L, t, (int)n);
		} else {
			lua_pushlstring(L, key, keylen);
			if (meta) {
				lua_pushvalue(L, -1);
				lua_rawseti(L, meta, (int)n);
			}
			lua_insert(L, -2);
			lua_rawset(L, t);
		}
		if (hint != MTX_HINT_NONE) {
			if (!meta)
				meta = new_meta(L, t, array, array ? NULL : first, first_len);
			if (array)
				lua_pushinteger(L, n);
			else
				lua_pushlstring(L, key, keylen);
			set_hint(L, meta, hint);
		}
	}
	/* bson_iter_next takes a 0 type byte before the final NUL for the end,
	 * and bson_validate (libbson 1.23) looks no further than a regex that
	 * is not UTF-8: unless the walk ended at the final NUL, the rest of the
	 * document vanished without a word (found by fuzz/bson_roundtrip.c) */
	if (bson_iter_offset(it) + 1 != len)
		luaL_error(L, "mongotx: corrupt BSON");
	if (!meta) {
		if (!array)
			return; /* at most one key: no order to keep */
		/* no hints: share one metatable among all plain arrays */
		luaL_getmetatable(L, MTX_ARRAY_MT);
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

/* decode(bytes): the document, or nil and an error for invalid BSON (a
 * raise for the rare BSON that bson_validate passes and the bridge cannot
 * give back, see push_element). */
int
mtx_l_decode(lua_State *L)
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

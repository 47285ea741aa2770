/* storable.c: the values no stored document should hold, whoever
 * stores them (an op's update, undo, doc or where, meta, a module's
 * values: csrc/checks.c calls it for all of them).
 *
 * Numbers that are not numbers: NaN and infinities, as Lua numbers, boxed
 * doubles or Decimal128s (a balance that became NaN stays NaN).  Strings
 * that are not UTF-8, as Lua strings or inside a regex, code, a symbol, a
 * DBPointer or code with scope: other drivers (PyMongo by default) cannot
 * decode a document holding one, and libmongoc's validation, which the
 * steps switch off (csrc/txn.c, "Checked here"), refuses them from
 * libbson 1.25 on (1.23 lets them pass).  A NUL inside a string value is
 * allowed, as libmongoc allows it (BSON_VALIDATE_UTF8_ALLOW_NULL). */
#include <math.h>
#include <string.h>

#include "mongotx.h"

/* core.type(v) for the boxed value at idx, pushed. */
static const char *
push_type_name(lua_State *L, int idx)
{
	idx = mtx_absindex(L, idx);
	lua_pushcfunction(L, mtx_l_type);
	lua_pushvalue(L, idx);
	lua_call(L, 1, 1);
	return lua_tostring(L, -1);
}

/* Is the Decimal128 NaN or infinite?  (Its combination field, the five
 * bits after the sign, is 11110 for an infinity and 11111 for a NaN.) */
static int
decimal_non_finite(const bson_decimal128_t *d)
{
	return ((d->high >> 58) & 0x1e) == 0x1e;
}

static int bson_strings_utf8(const bson_t *b);

/* Are the strings a boxed value holds (a regex's pattern and options,
 * code, a symbol, a DBPointer's collection, code with its scope) UTF-8? */
static int
value_strings_utf8(const bson_value_t *v)
{
	bson_t scope;

	switch (v->value_type) {
	case BSON_TYPE_REGEX:
		return bson_utf8_validate(v->value.v_regex.regex, strlen(v->value.v_regex.regex),
					  false) &&
		       bson_utf8_validate(v->value.v_regex.options,
					  strlen(v->value.v_regex.options), false);
	case BSON_TYPE_CODE:
		return mtx_utf8_valid(v->value.v_code.code, v->value.v_code.code_len);
	case BSON_TYPE_SYMBOL:
		return mtx_utf8_valid(v->value.v_symbol.symbol, v->value.v_symbol.len);
	case BSON_TYPE_DBPOINTER:
		return mtx_utf8_valid(v->value.v_dbpointer.collection,
				      v->value.v_dbpointer.collection_len);
	case BSON_TYPE_CODEWSCOPE:
		return mtx_utf8_valid(v->value.v_codewscope.code, v->value.v_codewscope.code_len) &&
		       bson_init_static(&scope, v->value.v_codewscope.scope_data,
					v->value.v_codewscope.scope_len) &&
		       bson_strings_utf8(&scope);
	default:
		return 1;
	}
}

/* Are the keys and strings of the document b (a code's scope) UTF-8? */
static int
bson_strings_utf8(const bson_t *b)
{
	bson_iter_t it;
	bson_t sub;
	const uint8_t *data;
	uint32_t len;

	if (!bson_iter_init(&it, b))
		return 0;
	while (bson_iter_next(&it)) {
		if (!bson_utf8_validate(bson_iter_key(&it), bson_iter_key_len(&it), false))
			return 0;
		if (BSON_ITER_HOLDS_DOCUMENT(&it) || BSON_ITER_HOLDS_ARRAY(&it)) {
			if (BSON_ITER_HOLDS_DOCUMENT(&it))
				bson_iter_document(&it, &len, &data);
			else
				bson_iter_array(&it, &len, &data);
			if (!bson_init_static(&sub, data, len) || !bson_strings_utf8(&sub))
				return 0;
		} else if (BSON_ITER_HOLDS_UTF8(&it)) {
			const char *s = bson_iter_utf8(&it, &len);

			if (!mtx_utf8_valid(s, len))
				return 0;
		} else if (!value_strings_utf8(bson_iter_value(&it))) {
			return 0;
		}
	}
	return 1;
}

/* What is wrong with the scalar at idx for a stored document or a guard:
 * a NaN or infinite number (a Lua number, a boxed double, a Decimal128),
 * or a string that is not UTF-8 (a Lua string, or one a boxed value
 * holds: other drivers cannot decode such a document).  Pushes it and
 * returns 1; else 0. */
static int
bad_scalar(lua_State *L, int idx)
{
	const mtx_value *v;
	const char *s;
	size_t n;

	switch (lua_type(L, idx)) {
	case LUA_TNUMBER:
		if (isfinite((double)lua_tonumber(L, idx)))
			return 0;
		mtx_tolstring(L, idx, NULL);
		return 1;
	case LUA_TSTRING:
		s = lua_tolstring(L, idx, &n);
		if (mtx_utf8_valid(s, n))
			return 0;
		lua_pushliteral(L, "a string that is not UTF-8");
		return 1;
	case LUA_TUSERDATA:
		if ((v = mtx_test_value(L, idx)) == NULL)
			return 0;
		if ((v->v.value_type == BSON_TYPE_DOUBLE && !isfinite(v->v.value.v_double)) ||
		    (v->v.value_type == BSON_TYPE_DECIMAL128 &&
		     decimal_non_finite(&v->v.value.v_decimal128))) {
			mtx_tolstring(L, idx, NULL);
			return 1;
		}
		if (value_strings_utf8(&v->v))
			return 0;
		lua_pushfstring(L, "a %s that is not UTF-8", push_type_name(L, idx));
		lua_remove(L, -2);
		return 1;
	default:
		return 0;
	}
}

/* The first value anywhere in the value at idx that bad_scalar refuses:
 * what is wrong with it (and under which key) pushed, and 1; else 0. */
int
mtx_find_bad_scalar(lua_State *L, int idx, int depth)
{
	if (lua_type(L, idx) != LUA_TTABLE)
		return bad_scalar(L, idx);
	if (depth > MTX_MAX_DEPTH)
		return 0;
	idx = mtx_absindex(L, idx);
	luaL_checkstack(L, 6, "mongotx: a value nested too deep");
	lua_pushnil(L);
	while (lua_next(L, idx)) {
		if (lua_type(L, -1) != LUA_TTABLE && bad_scalar(L, -1)) {
			const char *key = mtx_tolstring(L, -3, NULL);

			lua_pushfstring(L, "%s (under the key %s)", lua_tostring(L, -2), key);
			lua_insert(L, -5);
			lua_pop(L, 4);
			return 1;
		}
		if (mtx_find_bad_scalar(L, -1, depth + 1)) {
			lua_insert(L, -3);
			lua_pop(L, 2);
			return 1;
		}
		lua_pop(L, 1);
	}
	return 0;
}

/* ids.c: what may be an id, and when two ids are the same document.
 *
 * Transaction ids and op document ids go into filters as {_id: id} and
 * {marker: id}, so an id must match exactly one value there: a Regex
 * would match many _ids, null matches documents without the field, an
 * array matches by element, MinKey/MaxKey and Timestamp are not values a
 * caller means.  Those are refused.
 *
 * The server compares numbers by value, so 1, 1.0 and Int64(1) are one
 * _id; a Lua comparison would see three.  id_key gives every id a string
 * that is equal exactly when the server would match the two ids: numbers
 * by value (an integral double reads as the integer), documents field by
 * field in their order (as the server compares them), other types by
 * type and content.  Decimal128 is refused rather than compared: its
 * equal spellings (1, 1.0, 1E0) have no cheap canonical form here.
 *
 * An id takes at most MAX_ID_BYTES: the _id index of MongoDB before 4.2
 * refuses longer keys, and a transaction's id is written into its
 * document and into every marker (an apply sends it twice), so a large
 * one would fail in the middle of a transaction instead of at begin.
 *
 * The walk reads the BSON the encoder made of the value, so what is
 * checked is exactly what would be sent, whatever metatables the Lua
 * value carries (__pairs, __index). */
#include <inttypes.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mongotx.h"

#define MAX_ID_BYTES 1024

/* A growing byte buffer whose memory a guard on the Lua stack owns. */
typedef struct {
	void **slot;
	size_t len, cap;
} keybuf;

static void
kb_add(keybuf *kb, const char *s, size_t n)
{
	if (kb->len + n > kb->cap) {
		size_t cap = (kb->len + n) * 2 + 64;
		char *p = realloc(*kb->slot, cap);

		if (!p)
			abort(); /* as libbson does when it cannot allocate */
		*kb->slot = p, kb->cap = cap;
	}
	memcpy((char *)*kb->slot + kb->len, s, n);
	kb->len += n;
}

static void
kb_printf(keybuf *kb, const char *fmt, ...)
{
	char tmp[64];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(tmp, sizeof tmp, fmt, ap);
	va_end(ap);
	kb_add(kb, tmp, (size_t)n); /* every use fits in 64 bytes */
}

static const char hex_digits[] = "0123456789abcdef";

static void
kb_hex(keybuf *kb, const uint8_t *p, uint32_t n)
{
	char pair[2];
	uint32_t i;

	for (i = 0; i < n; i++) {
		pair[0] = hex_digits[p[i] >> 4], pair[1] = hex_digits[p[i] & 15];
		kb_add(kb, pair, 2);
	}
}

/* An integral double within int64's range reads as that integer, as the
 * server compares it with int32 and int64 values. */
static int
double_as_integer(double d, int64_t *out)
{
	if (d != floor(d) || d < -9223372036854775808.0 || d >= 9223372036854775808.0)
		return 0;
	*out = (int64_t)d;
	return 1;
}

static const char *walk_document(keybuf *kb, bson_iter_t *it);

/* Appends the key of the value at it, or returns why it cannot be an id. */
static const char *
walk_value(keybuf *kb, bson_iter_t *it)
{
	bson_iter_t child;
	const uint8_t *data;
	uint32_t len;
	bson_subtype_t subtype;
	const char *s;
	int64_t i;
	double d;

	switch (bson_iter_type(it)) {
	case BSON_TYPE_INT32:
		kb_printf(kb, "i%" PRId32, bson_iter_int32(it));
		return NULL;
	case BSON_TYPE_INT64:
		kb_printf(kb, "i%" PRId64, bson_iter_int64(it));
		return NULL;
	case BSON_TYPE_DOUBLE:
		d = bson_iter_double(it);
		if (isnan(d) || isinf(d))
			return "an id may not be NaN or infinite";
		if (double_as_integer(d, &i))
			kb_printf(kb, "i%" PRId64, i);
		else
			kb_printf(kb, "n%.17g", d);
		return NULL;
	case BSON_TYPE_UTF8:
		s = bson_iter_utf8(it, &len);
		/* a server may store other bytes as another string (FerretDB
		 * does): the id written would not be the id looked up */
		if (!mtx_utf8_valid(s, len))
			return "an id string must be valid UTF-8 (a server may store other "
			       "bytes as another string)";
		kb_printf(kb, "s%" PRIu32 ":", len);
		kb_add(kb, s, len);
		return NULL;
	case BSON_TYPE_BOOL:
		kb_printf(kb, "%s", bson_iter_bool(it) ? "true" : "false");
		return NULL;
	case BSON_TYPE_OID:
		kb_add(kb, "o", 1);
		kb_hex(kb, bson_iter_oid(it)->bytes, 12);
		return NULL;
	case BSON_TYPE_DATE_TIME:
		kb_printf(kb, "t%" PRId64, bson_iter_date_time(it));
		return NULL;
	case BSON_TYPE_BINARY:
		bson_iter_binary(it, &subtype, &len, &data);
		kb_printf(kb, "b%d:", (int)subtype);
		kb_hex(kb, data, len);
		return NULL;
	case BSON_TYPE_DOCUMENT:
		if (!bson_iter_recurse(it, &child))
			return "an id holds corrupt BSON";
		return walk_document(kb, &child);
	case BSON_TYPE_REGEX:
		return "an id may not be a Regex (a filter would match every _id it matches)";
	case BSON_TYPE_ARRAY:
		return "an id may not be an array (a filter would match by element)";
	case BSON_TYPE_NULL:
	case BSON_TYPE_UNDEFINED:
		return "an id may not be null (a filter would match documents without one)";
	case BSON_TYPE_DECIMAL128:
		return "an id may not be a Decimal128 (use an integer or a string)";
	default:
		return "an id must be a string, number, Int64, ObjectId, Date, boolean, "
		       "Binary or a document of those";
	}
}

static const char *
walk_document(keybuf *kb, bson_iter_t *it)
{
	const char *why;

	kb_add(kb, "{", 1);
	while (bson_iter_next(it)) {
		const char *key = bson_iter_key(it);
		size_t n = strlen(key);

		if (key[0] == '$')
			return "an id may not hold a key starting with $ (it would read as an operator)";
		if (strchr(key, '.'))
			return "keys of an id may not hold dots (they read as paths)";
		kb_printf(kb, "s%zu:", n);
		kb_add(kb, key, n);
		kb_add(kb, "=", 1);
		if ((why = walk_value(kb, it)))
			return why;
		kb_add(kb, ",", 1);
	}
	kb_add(kb, "}", 1);
	return NULL;
}

/* The key and snapshot of the ids most calls pass, made without the
 * encoder: an integer (how the encoder sends it: mtx_number_kind), a
 * string that fits and an ObjectId (sent as they are; an ObjectId's key
 * was 7 000 instructions the general way, twice a batched transfer).  Pushes both and returns 1, or 0 for
 * the general way. */
static int
quick_key(lua_State *L)
{
	int64_t i;
	double d;
	size_t len;
	const char *s;
	char key[32];
	luaL_Buffer buf;

	switch (lua_type(L, 1)) {
	case LUA_TNUMBER:
		if (mtx_number_kind(L, 1, &i, &d) == MTX_NUM_DOUBLE)
			return 0;
		snprintf(key, sizeof key, "i%" PRId64, i);
		lua_pushstring(L, key);
		break;
	case LUA_TSTRING:
		s = lua_tolstring(L, 1, &len);
		/* its bytes: length, the string and its NUL; the general way
		 * refuses one that is not UTF-8 */
		if (len + 5 > MAX_ID_BYTES || !mtx_utf8_valid(s, len))
			return 0;
		luaL_buffinit(L, &buf);
		snprintf(key, sizeof key, "s%zu:", len);
		luaL_addstring(&buf, key);
		luaL_addlstring(&buf, s, len);
		luaL_pushresult(&buf);
		break;
	case LUA_TUSERDATA: {
		/* an ObjectId (every transaction id mongotx makes) */
		const mtx_value *v = mtx_test_value(L, 1);
		int k;

		if (!v || v->v.value_type != BSON_TYPE_OID)
			return 0;
		key[0] = 'o';
		for (k = 0; k < 12; k++) {
			key[1 + 2 * k] = hex_digits[v->v.value.v_oid.bytes[k] >> 4];
			key[2 + 2 * k] = hex_digits[v->v.value.v_oid.bytes[k] & 15];
		}
		lua_pushlstring(L, key, 25);
		break;
	}
	default:
		return 0;
	}
	lua_pushvalue(L, 1);
	return 1;
}

/* id_key(v) -> key, snapshot | nil, message
 * key: a string equal for two ids exactly when the server matches them as
 * one _id; snapshot: the id as it is sent (decoded from what the encoder
 * made of v).  Raises, like the encoder, for values that cannot be encoded
 * at all (functions, tables holding themselves, ...). */
int
mtx_l_id_key(lua_State *L)
{
	bson_t *holder;
	bson_iter_t it;
	keybuf kb = {NULL, 0, 0};
	const char *why;
	int at;

	luaL_checkany(L, 1);
	if (lua_isnil(L, 1)) {
		lua_pushnil(L);
		lua_pushliteral(L, "an id is needed");
		return 2;
	}
	if (quick_key(L))
		return 2;
	holder = mtx_scratch_take(L);
	at = lua_gettop(L);
	mtx_append_value(L, 1, holder, "v");
	/* the value's bytes: the holder less its length, type, "v" and end */
	if (holder->len - 8 > MAX_ID_BYTES) {
		lua_pushnil(L);
		lua_pushfstring(L, "an id may take at most %d bytes, not %d", MAX_ID_BYTES,
				(int)(holder->len - 8));
		return 2;
	}
	kb.slot = mtx_guard(L, free);
	bson_iter_init_find(&it, holder, "v");
	if ((why = walk_value(&kb, &it))) {
		lua_pushnil(L);
		lua_pushstring(L, why);
		return 2;
	}
	lua_pushlstring(L, (const char *)*kb.slot, kb.len);
	mtx_push_iter(L, &it);
	mtx_scratch_give(L, at);
	return 2;
}

int
mtx_open_ids(lua_State *L)
{
	lua_pushcfunction(L, mtx_l_id_key);
	lua_setfield(L, -2, "id_key");
	return 0;
}

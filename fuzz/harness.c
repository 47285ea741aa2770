/* harness.c: the state, checks and walkers both fuzz harnesses share.
 *
 * The fuzzers link only the bridge's files (value.c, encode.c, decode.c,
 * scratch.c, error.c): the engine's files change under other hands, and
 * leaving the client code out keeps the coverage map about the bridge. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

lua_State *
fz_open(void)
{
	lua_State *L = luaL_newstate();

	fz_require(L != NULL, "luaL_newstate failed");
	/* the same calls luaopen_mongotx_core makes for the bridge's part */
	lua_newtable(L);
	mtx_open_scratch(L);
	mtx_open_error(L);
	mtx_open_bson(L);
	mtx_open_ids(L);
	fz_require(lua_gettop(L) == FZ_CORE, "opening the core left %d values",
		   lua_gettop(L));
	return L;
}

void
fz_require(int cond, const char *fmt, ...)
{
	va_list ap;

	if (cond)
		return;
	fputs("fuzz: broken promise: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	abort();
}

int
fz_call(lua_State *L, const char *name, int nargs, int nres)
{
	int status;

	lua_getfield(L, FZ_CORE, name);
	lua_insert(L, -(nargs + 1));
	status = lua_pcall(L, nargs, nres, 0);
	fz_require(status == LUA_OK || lua_type(L, -1) == LUA_TSTRING,
		   "core.%s raised a %s, not a message", name,
		   luaL_typename(L, -1));
	return status;
}

static int
depth_of(bson_iter_t *it)
{
	bson_iter_t child;
	int max = 0, d;

	while (bson_iter_next(it)) {
		if ((BSON_ITER_HOLDS_DOCUMENT(it) || BSON_ITER_HOLDS_ARRAY(it)) &&
		    bson_iter_recurse(it, &child)) {
			d = depth_of(&child);
			max = d > max ? d : max;
		}
	}
	return max + 1;
}

int
fz_depth(const bson_t *b)
{
	bson_iter_t it;

	return bson_iter_init(&it, b) ? depth_of(&it) : 0;
}

static int
walks(bson_iter_t *it, int array)
{
	bson_iter_t child;
	uint32_t code_len, scope_len, len = it->len, child_len;
	const uint8_t *scope, *data;
	size_t offset;
	bson_t b;

	while (bson_iter_next(it)) {
		if (!array && !bson_utf8_validate(bson_iter_key(it),
						  bson_iter_key_len(it), false))
			return 0;
		if (BSON_ITER_HOLDS_DOCUMENT(it) || BSON_ITER_HOLDS_ARRAY(it)) {
			/* bson_init_static, unlike bson_iter_recurse, checks the
			 * final NUL */
			if (BSON_ITER_HOLDS_ARRAY(it))
				bson_iter_array(it, &child_len, &data);
			else
				bson_iter_document(it, &child_len, &data);
			if (!bson_init_static(&b, data, child_len) ||
			    !bson_iter_init(&child, &b) ||
			    !walks(&child, BSON_ITER_HOLDS_ARRAY(it)))
				return 0;
		}
		if (BSON_ITER_HOLDS_CODEWSCOPE(it)) {
			bson_iter_codewscope(it, &code_len, &scope_len, &scope);
			if (!bson_init_static(&b, scope, scope_len) ||
			    !bson_validate(&b, BSON_VALIDATE_NONE, &offset))
				return 0;
		}
	}
	/* bson_iter_next also stops, with err_off 0, at a 0 type byte before
	 * the final NUL: only ending at the final NUL is the end */
	return bson_iter_offset(it) + 1 == len;
}

int
fz_walks(const bson_t *b)
{
	bson_iter_t it;

	return bson_iter_init(&it, b) && walks(&it, 0);
}

/* 1 when an element before the current one of `it` (walked from `first`,
 * a copy of the iterator before its first element) has the same key. */
static int
repeated_key(const bson_iter_t *first, bson_iter_t *it)
{
	bson_iter_t prev = *first;

	while (bson_iter_next(&prev) && bson_iter_offset(&prev) < bson_iter_offset(it))
		if (strcmp(bson_iter_key(&prev), bson_iter_key(it)) == 0)
			return 1;
	return 0;
}

/* libbson writes regex options as a sorted set of "ilmsux" (checked
 * against libbson 1.23 with bson_append_regex("xqiim") -> "imx"). */
static int
canonical_regex_options(const char *options)
{
	const char *p;

	for (p = options; *p; p++)
		if (!strchr("ilmsux", *p) || (p > options && p[-1] >= *p))
			return 0;
	return 1;
}

/* libbson's bson_append_value appends code, code with scope and the
 * namespace of a DBPointer as C strings (bson_append_code(), ...), so the
 * part of one after a NUL byte is lost: found by fuzz/bson_roundtrip.c
 * with code "x X\0\0" in a code with scope. */
static int
c_string_cut(const bson_iter_t *it)
{
	uint32_t len = 0, scope_len;
	const char *s = NULL;
	const uint8_t *scope;
	const bson_oid_t *oid;

	if (BSON_ITER_HOLDS_CODE(it))
		s = bson_iter_code(it, &len);
	else if (BSON_ITER_HOLDS_CODEWSCOPE(it))
		s = bson_iter_codewscope(it, &len, &scope_len, &scope);
	else if (BSON_ITER_HOLDS_DBPOINTER(it))
		bson_iter_dbpointer(it, &len, &s, &oid);
	return s && strlen(s) != len;
}

static const char *
inexact(bson_iter_t *it, int array)
{
	bson_iter_t first = *it, child;
	uint32_t n = 0;
	char index[16];
	const char *why, *options;

	while (bson_iter_next(it)) {
		if (array) {
			snprintf(index, sizeof index, "%u", (unsigned)n);
			if (strcmp(bson_iter_key(it), index) != 0)
				return "an array key that is not its index";
		} else if (repeated_key(&first, it)) {
			return "a repeated key";
		}
		n++;
		if ((BSON_ITER_HOLDS_DOCUMENT(it) || BSON_ITER_HOLDS_ARRAY(it)) &&
		    bson_iter_recurse(it, &child) &&
		    (why = inexact(&child, BSON_ITER_HOLDS_ARRAY(it))))
			return why;
		if (BSON_ITER_HOLDS_REGEX(it)) {
			bson_iter_regex(it, &options);
			if (!canonical_regex_options(options))
				return "regex options libbson rewrites";
		}
		if (c_string_cut(it))
			return "code or a DBPointer namespace with a NUL byte";
	}
	return NULL;
}

const char *
fz_not_exact(const bson_t *b)
{
	bson_iter_t it;

	return bson_iter_init(&it, b) ? inexact(&it, 0) : "not a document";
}

void
fz_check_reencode(lua_State *L, const char *bytes, size_t len)
{
	bson_t b;
	size_t offset, again_len;
	const char *again;
	int top = lua_gettop(L);

	fz_require(len <= MTX_MAX_BSON, "encode made %zu bytes", len);
	fz_require(bson_init_static(&b, (const uint8_t *)bytes, len) &&
		   bson_validate(&b, BSON_VALIDATE_NONE, &offset),
		   "encode made invalid BSON (%zu bytes)", len);
	lua_pushlstring(L, bytes, len);
	fz_require(fz_call(L, "decode", 1, 2) == LUA_OK && lua_istable(L, -2),
		   "decode refused what encode made: %s",
		   luaL_typename(L, -1));
	lua_pop(L, 1);
	fz_require(fz_call(L, "encode", 1, 1) == LUA_OK,
		   "a decoded document does not re-encode: %s",
		   lua_tostring(L, -1));
	again = lua_tolstring(L, -1, &again_len);
	fz_require(again_len == len && memcmp(again, bytes, len) == 0,
		   "re-encoding changed %zu bytes into %zu different ones",
		   len, again_len);
	lua_settop(L, top);
}

static int
compare_self(lua_State *L)
{
	lua_pushboolean(L, lua_compare(L, 1, 1, LUA_OPLT));
	return 1;
}

static void
touch_value(lua_State *L, int idx)
{
	int top = lua_gettop(L), status;

	luaL_tolstring(L, idx, NULL);
	lua_pushvalue(L, idx);
	fz_call(L, "type", 1, 1);
	lua_getfield(L, idx, "value");
	lua_pushvalue(L, idx);
	fz_require(lua_pcall(L, 1, LUA_MULTRET, 0) == LUA_OK,
		   "value:value() raised: %s", lua_tostring(L, -1));
	lua_settop(L, top);
	/* ordered types compare, the others raise a message */
	lua_pushcfunction(L, compare_self);
	lua_pushvalue(L, idx);
	status = lua_pcall(L, 1, 1, 0);
	fz_require(status == LUA_OK ? !lua_toboolean(L, -1)
				    : lua_type(L, -1) == LUA_TSTRING,
		   "a value compared less than itself, or raised a non-message");
	lua_settop(L, top);
}

void
fz_touch(lua_State *L, int idx, int depth)
{
	idx = lua_absindex(L, idx);
	luaL_checkstack(L, 8, "fuzz: too deep");
	lua_pushnil(L);
	while (lua_next(L, idx)) {
		if (lua_istable(L, -1) && depth < 2 * MTX_MAX_DEPTH)
			fz_touch(L, -1, depth + 1);
		else if (lua_type(L, -1) == LUA_TUSERDATA)
			touch_value(L, lua_gettop(L));
		lua_pop(L, 1);
	}
}

/* bson_roundtrip.c: libFuzzer harness, BSON -> Lua -> BSON.
 *
 * The input is taken as a BSON document and given to core.decode exactly
 * as a user (or a server reply) would.
 *
 * - Not a valid document (bson_init_static + bson_validate say so): decode
 *   must return nil and an error table, never raise or crash.
 * - Valid: decode must succeed unless the nesting is deeper than decoding
 *   allows (2 * MTX_MAX_DEPTH, raised as a message) or holds a part
 *   bson_validate did not look at (fz_walks: "corrupt BSON" raised, not a
 *   table that lost that part); every decoded value is
 *   read back through its methods; core.encode of the result must succeed
 *   unless deeper than MTX_MAX_DEPTH (raised as a message); and
 *   - when the document is one the bridge can give back exactly (see
 *     fz_not_exact), the bytes must be identical to the input;
 *   - otherwise the re-encoded bytes are the normal form, which must
 *     itself round-trip exactly.
 *
 * Valid BSON the bridge does not give back byte for byte, by design:
 *   - a document with a repeated key: it becomes one Lua table field, which
 *     keeps the last value (encoded at each place the key had);
 *   - an array whose keys are not "0", "1", ...: Lua arrays are positional,
 *     so the keys are renumbered (MongoDB itself never writes such arrays);
 *   - regex options that are not a sorted set of "ilmsux": libbson's
 *     bson_append_regex sorts them and drops the others;
 *   - code, code with scope or a DBPointer namespace holding a NUL byte:
 *     libbson appends those as C strings, cut at the NUL (found by this
 *     harness; they are deprecated types, the bridge leaves them to libbson).
 * Otherwise the deprecated types (undefined, DBPointer, symbol, code, code
 * with scope) are kept as opaque values and do come back byte for byte.
 *
 *   make fuzz-ci / make fuzz (Makefile); corpus: fuzz/corpus/bson_roundtrip */
#include <string.h>

#include "harness.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void
check_valid(lua_State *L, const bson_t *b, const uint8_t *data, size_t size)
{
	int depth = fz_depth(b);
	const char *why = fz_not_exact(b), *bytes;
	size_t len;

	int walks = fz_walks(b);

	if (fz_call(L, "decode", 1, 2) != LUA_OK) {
		fz_require(depth > 2 * MTX_MAX_DEPTH ||
			   (!walks && strstr(lua_tostring(L, -1), "corrupt BSON")),
			   "decode raised on valid BSON %d deep: %s", depth,
			   lua_tostring(L, -1));
		return;
	}
	fz_require(walks, "decode took BSON it cannot walk (a part lost)");
	fz_require(lua_istable(L, -2), "decode returned a %s for valid BSON",
		   luaL_typename(L, -2));
	lua_pop(L, 1);
	fz_touch(L, -1, 1);
	if (fz_call(L, "encode", 1, 1) != LUA_OK) {
		fz_require(depth > MTX_MAX_DEPTH &&
			   strstr(lua_tostring(L, -1), "nested more than"),
			   "a decoded document %d deep does not re-encode: %s",
			   depth, lua_tostring(L, -1));
		return;
	}
	bytes = lua_tolstring(L, -1, &len);
	if (!why)
		fz_require(len == size && memcmp(bytes, data, size) == 0,
			   "valid BSON of %zu bytes came back as %zu other bytes",
			   size, len);
	fz_check_reencode(L, bytes, len);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	lua_State *L = fz_open();
	bson_t b;
	size_t offset;
	int valid = bson_init_static(&b, data, size) &&
		    bson_validate(&b, BSON_VALIDATE_NONE, &offset);

	lua_pushlstring(L, (const char *)data, size);
	if (valid) {
		check_valid(L, &b, data, size);
	} else {
		fz_require(fz_call(L, "decode", 1, 2) == LUA_OK &&
			   lua_isnil(L, -2) && lua_istable(L, -1),
			   "decode of invalid BSON did not return nil, err");
		lua_getfield(L, -1, "code");
		fz_require(lua_isstring(L, -1) &&
			   strcmp(lua_tostring(L, -1), "bson") == 0,
			   "decode's error for invalid BSON is not code bson");
	}
	lua_close(L);
	return 0;
}

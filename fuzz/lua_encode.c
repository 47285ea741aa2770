/* lua_encode.c: libFuzzer harness, Lua values -> BSON.
 *
 * The input is a small program (one opcode byte, then its operands) that
 * builds Lua values on a stack: integers at the int32/int64 limits or from
 * raw bytes, floats (NaN, infinities, -0.0, raw bits), strings with NULs and
 * invalid UTF-8, booleans, nil, core.null, MinKey/MaxKey, the value
 * constructors called with fuzzed arguments, tables filled with any keys,
 * core.array, core.doc, shared and cyclic references to earlier tables,
 * nesting hundreds deep, functions, threads, foreign userdata, decoded
 * documents (with the bridge's metatables) changed afterwards, and
 * metatables made by hand.
 *
 * Every value left on the stack is given to core.encode (wrapped as { x = v }
 * when it is not a table) under lua_pcall.  It must either raise a message
 * (a string) or return BSON that is valid, no bigger than 16 MiB, decodes,
 * and re-encodes to the same bytes.  core.id_key is given the value too: it
 * must raise a message, refuse with one, or return a key and the id as
 * sent, whose own key is the same.  Without hand-made metatables the BSON
 * must also be exact as fz_not_exact defines it (in particular no repeated
 * key: MongoDB would refuse it); a hand-made metatable may list a key twice
 * and is allowed to.  ASan/UBSan/LSan catch the rest.
 *
 *   make fuzz-ci / make fuzz (Makefile); corpus: fuzz/corpus/lua_encode */
#include <math.h>
#include <string.h>

#include "harness.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Opcodes, in the order of the byte values (the byte modulo OP_COUNT). */
enum {
	OP_INT,	   /* sel [8 bytes]: a limit, or raw int64 when sel >= count */
	OP_FLOAT,  /* sel [8 bytes]: a special, or raw double bits */
	OP_STRING, /* len bytes...: a string of up to 255 bytes */
	OP_BOOL,   /* b */
	OP_NULL,   /* core.null */
	OP_NIL,
	OP_OTHER,  /* sel: MinKey, MaxKey, a function, a thread, a foreign
		    * userdata, a non-NULL light userdata */
	OP_CTOR,   /* sel nargs: core.<constructor>(top nargs values) */
	OP_TABLE,  /* a new table, remembered for OP_REF */
	OP_SET,	   /* t k v -> t  (t[k] = v) */
	OP_APPEND, /* t v -> t  (t[#t + 1] = v) */
	OP_ARRAY,  /* t -> core.array(t) */
	OP_DOC,	   /* n: 2n values -> core.doc(...) */
	OP_REF,	   /* sel: an earlier table again (sharing, cycles) */
	OP_WRAP,   /* n: v -> { a = v } (or { v }) n times over */
	OP_SETMETA, /* t m -> t  (setmetatable(t, m): hand-made metatable) */
	OP_DUP,
	OP_SWAP,
	OP_POP,
	OP_DECODED, /* t -> decode(encode(t)) when t encodes */
	OP_COUNT
};

/* Values a program may leave on the stack, tables it may refer back to,
 * and levels one OP_WRAP may add (beyond MTX_MAX_DEPTH either way). */
#define MAX_STACK 64
#define MAX_TABLES 64
#define MAX_WRAP 160

static const char *const ctors[] = {"ObjectId", "Date", "Int64",
				    "Decimal128", "Binary", "Regex",
				    "Timestamp"};

typedef struct {
	const uint8_t *p, *end;
	int base;     /* stack index below the program's values */
	int tables;   /* stack index of the list of tables made */
	int ntables;
	int handmade; /* a hand-made metatable was set */
} program;

static int
byte(program *pr)
{
	return pr->p < pr->end ? *pr->p++ : 0;
}

static uint64_t
u64(program *pr)
{
	uint64_t v = 0;
	int i;

	for (i = 0; i < 8; i++)
		v = v << 8 | (uint64_t)byte(pr);
	return v;
}

static int
depth(program *pr, lua_State *L)
{
	return lua_gettop(L) - pr->base;
}

static void
push_int(program *pr, lua_State *L)
{
	static const lua_Integer limits[] = {
		0, 1, -1, INT32_MAX, INT32_MIN, (lua_Integer)INT32_MAX + 1,
		(lua_Integer)INT32_MIN - 1, INT64_MAX, INT64_MIN,
		9007199254740992LL, 9007199254740993LL, -9007199254740992LL,
	};
	unsigned sel = (unsigned)byte(pr);
	uint64_t raw;

	if (sel < sizeof limits / sizeof *limits) {
		lua_pushinteger(L, limits[sel]);
		return;
	}
	raw = u64(pr);
	lua_pushinteger(L, (lua_Integer)raw);
}

static void
push_float(program *pr, lua_State *L)
{
	static const double specials[] = {
		0.0, 1.5, 3.0, 1e300, 2.2250738585072014e-308, 5e-324,
		9223372036854775808.0, 4294967296.0,
	};
	unsigned sel = (unsigned)byte(pr);
	uint64_t raw;
	double d;

	switch (sel) {
	case 0: lua_pushnumber(L, NAN); return;
	case 1: lua_pushnumber(L, -NAN); return;
	case 2: lua_pushnumber(L, INFINITY); return;
	case 3: lua_pushnumber(L, -INFINITY); return;
	case 4: lua_pushnumber(L, -0.0); return;
	default: break;
	}
	sel -= 5;
	if (sel < sizeof specials / sizeof *specials) {
		lua_pushnumber(L, specials[sel]);
		return;
	}
	raw = u64(pr);
	memcpy(&d, &raw, sizeof d);
	lua_pushnumber(L, d);
}

static void
push_string(program *pr, lua_State *L)
{
	size_t len = (size_t)byte(pr), left = (size_t)(pr->end - pr->p);

	len = len < left ? len : left;
	lua_pushlstring(L, (const char *)pr->p, len);
	pr->p += len;
}

static int
a_function(lua_State *L)
{
	lua_pushinteger(L, lua_gettop(L));
	return 1;
}

static void
push_other(program *pr, lua_State *L)
{
	static char somewhere;

	switch (byte(pr) % 6) {
	case 0: lua_getfield(L, FZ_CORE, "MinKey"); break;
	case 1: lua_getfield(L, FZ_CORE, "MaxKey"); break;
	case 2: lua_pushcfunction(L, a_function); break;
	case 3: lua_newthread(L); break;
	case 4: lua_newuserdatauv(L, 8, 0); break;
	default: lua_pushlightuserdata(L, &somewhere); break;
	}
}

/* core.<ctor>(the top nargs values): the value, or nil when it refused
 * its arguments (with a message: fz_call checks). */
static void
call_ctor(program *pr, lua_State *L)
{
	const char *name = ctors[byte(pr) % (sizeof ctors / sizeof *ctors)];
	int nargs = byte(pr) % 3;

	if (nargs > depth(pr, L))
		nargs = depth(pr, L);
	if (fz_call(L, name, nargs, 1) != LUA_OK) {
		lua_pop(L, 1);
		lua_pushnil(L);
	}
}

static void
new_table(program *pr, lua_State *L)
{
	lua_newtable(L);
	if (pr->ntables < MAX_TABLES) {
		lua_pushvalue(L, -1);
		lua_rawseti(L, pr->tables, ++pr->ntables);
	}
}

/* A key lua_rawset accepts (it raises for nil and NaN). */
static int
settable_key(lua_State *L, int idx)
{
	lua_Number n;

	if (lua_isnil(L, idx))
		return 0;
	if (lua_type(L, idx) == LUA_TNUMBER && !lua_isinteger(L, idx)) {
		n = lua_tonumber(L, idx);
		return n == n;
	}
	return 1;
}

static void
set_field(program *pr, lua_State *L)
{
	if (depth(pr, L) < 3 || !lua_istable(L, -3) || !settable_key(L, -2)) {
		lua_pop(L, depth(pr, L) < 2 ? depth(pr, L) : 2);
		return;
	}
	lua_rawset(L, -3);
}

static void
append(program *pr, lua_State *L)
{
	if (depth(pr, L) < 2 || !lua_istable(L, -2)) {
		if (depth(pr, L))
			lua_pop(L, 1);
		return;
	}
	lua_rawseti(L, -2, (lua_Integer)lua_rawlen(L, -2) + 1);
}

static void
make_array(program *pr, lua_State *L)
{
	if (depth(pr, L) < 1 || !lua_istable(L, -1))
		return;
	fz_require(fz_call(L, "array", 1, 1) == LUA_OK,
		   "core.array refused a table: %s", lua_tostring(L, -1));
}

static void
make_doc(program *pr, lua_State *L)
{
	int n = 2 * (byte(pr) % 8);

	if (n > depth(pr, L))
		n = depth(pr, L) & ~1;
	if (fz_call(L, "doc", n, 1) != LUA_OK) {
		lua_pop(L, 1);
		lua_pushnil(L);
	}
}

static void
push_ref(program *pr, lua_State *L)
{
	int sel = byte(pr);

	if (pr->ntables == 0)
		new_table(pr, L);
	else
		lua_rawgeti(L, pr->tables, 1 + sel % pr->ntables);
}

static void
wrap(program *pr, lua_State *L)
{
	int n = byte(pr) % MAX_WRAP, array = n & 1, i;

	if (depth(pr, L) < 1)
		return;
	for (i = 0; i < n; i++) {
		lua_createtable(L, array, !array);
		lua_insert(L, -2);
		if (array)
			lua_rawseti(L, -2, 1);
		else
			lua_setfield(L, -2, "a");
	}
}

static void
set_meta(program *pr, lua_State *L)
{
	if (depth(pr, L) < 2 || !lua_istable(L, -2) || !lua_istable(L, -1)) {
		if (depth(pr, L))
			lua_pop(L, 1);
		return;
	}
	lua_setmetatable(L, -2);
	pr->handmade = 1;
}

/* Replaces the table on top with its decoded form: a document with the
 * bridge's own metatables, which later ops may change. */
static void
decoded(program *pr, lua_State *L)
{
	if (depth(pr, L) < 1 || !lua_istable(L, -1))
		return;
	if (fz_call(L, "encode", 1, 1) != LUA_OK) {
		lua_pop(L, 1);
		lua_pushnil(L);
		return;
	}
	fz_require(fz_call(L, "decode", 1, 2) == LUA_OK && lua_istable(L, -2),
		   "decode refused what encode made");
	lua_pop(L, 1);
}

static void
step(program *pr, lua_State *L, int op)
{
	switch (op) {
	case OP_INT: push_int(pr, L); break;
	case OP_FLOAT: push_float(pr, L); break;
	case OP_STRING: push_string(pr, L); break;
	case OP_BOOL: lua_pushboolean(L, byte(pr) & 1); break;
	case OP_NULL: lua_getfield(L, FZ_CORE, "null"); break;
	case OP_NIL: lua_pushnil(L); break;
	case OP_OTHER: push_other(pr, L); break;
	case OP_CTOR: call_ctor(pr, L); break;
	case OP_TABLE: new_table(pr, L); break;
	case OP_SET: set_field(pr, L); break;
	case OP_APPEND: append(pr, L); break;
	case OP_ARRAY: make_array(pr, L); break;
	case OP_DOC: make_doc(pr, L); break;
	case OP_REF: push_ref(pr, L); break;
	case OP_WRAP: wrap(pr, L); break;
	case OP_SETMETA: set_meta(pr, L); break;
	case OP_DUP:
		if (depth(pr, L))
			lua_pushvalue(L, -1);
		break;
	case OP_SWAP:
		if (depth(pr, L) >= 2)
			lua_insert(L, -2);
		break;
	case OP_POP:
		if (depth(pr, L))
			lua_pop(L, 1);
		break;
	case OP_DECODED: decoded(pr, L); break;
	}
}

/* core.id_key of the value at idx: a message, a refusal with one, or a
 * key and the id as sent, which keys the same. */
static void
check_id_key(lua_State *L, int idx)
{
	const char *key, *again;

	lua_pushvalue(L, idx);
	if (fz_call(L, "id_key", 1, 2) != LUA_OK) {
		lua_pop(L, 1);
		return;
	}
	if (lua_isnil(L, -2)) {
		fz_require(lua_type(L, -1) == LUA_TSTRING, "id_key refused without a message");
		lua_pop(L, 2);
		return;
	}
	key = lua_tostring(L, -2);
	fz_require(key != NULL, "id_key returned a %s", luaL_typename(L, -2));
	fz_require(fz_call(L, "id_key", 1, 2) == LUA_OK, "id_key of its own id raised");
	again = lua_tostring(L, -2);
	fz_require(again != NULL && strcmp(again, key) == 0,
		   "the id as sent keys differently");
	lua_pop(L, 3);
}

/* core.encode of the value at idx must raise a message or round-trip. */
static void
check_encode(program *pr, lua_State *L, int idx)
{
	const char *bytes, *why;
	size_t len;
	bson_t b;

	if (lua_istable(L, idx)) {
		lua_pushvalue(L, idx);
	} else {
		lua_createtable(L, 0, 1);
		lua_pushvalue(L, idx);
		lua_setfield(L, -2, "x");
	}
	lua_pushvalue(L, -1);
	fz_call(L, "type", 1, 1); /* may raise, as encode may */
	lua_pop(L, 1);
	check_id_key(L, idx);
	if (fz_call(L, "encode", 1, 1) != LUA_OK) {
		lua_pop(L, 1);
		return;
	}
	bytes = lua_tolstring(L, -1, &len);
	fz_check_reencode(L, bytes, len);
	if (!pr->handmade) {
		fz_require(bson_init_static(&b, (const uint8_t *)bytes, len),
			   "encode made a bad length");
		why = fz_not_exact(&b);
		fz_require(!why, "encode made BSON with %s", why);
	}
	lua_pop(L, 1);
}

static int
run(lua_State *L)
{
	program *pr = (program *)lua_touserdata(L, 2);
	int i, top;

	lua_settop(L, FZ_CORE);
	luaL_checkstack(L, MAX_STACK + 32, "fuzz: program stack");
	lua_newtable(L);
	pr->tables = lua_gettop(L);
	pr->base = pr->tables;
	while (pr->p < pr->end) {
		step(pr, L, byte(pr) % OP_COUNT);
		if (depth(pr, L) > MAX_STACK)
			lua_settop(L, pr->base + MAX_STACK);
	}
	top = lua_gettop(L);
	for (i = pr->base + 1; i <= top; i++)
		check_encode(pr, L, i);
	return 0;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	lua_State *L = fz_open();
	program pr = {data, data + size, 0, 0, 0, 0};

	/* the program runs protected: a bug in it is a Lua error, reported */
	lua_pushcfunction(L, run);
	lua_insert(L, FZ_CORE);
	lua_pushlightuserdata(L, &pr);
	fz_require(lua_pcall(L, 2, 0, 0) == LUA_OK, "the program failed: %s",
		   lua_tostring(L, -1));
	lua_close(L);
	return 0;
}

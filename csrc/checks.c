/* checks.c: the checks of what callers pass as a transaction's ops
 * (lua/mongotx/validate.lua, DESIGN.md §8), and their normal form.  This
 * file holds the messages, the rules on the keys and numbers of a stored
 * value, ids and collections and the core.check_* bindings; an update's
 * operators and modifiers are checks_update.c, one op and the op walk
 * (core.check_ops) checks_ops.c, what they share checks.h.
 *
 * In Lua these checks were more than half of the client CPU of a batched
 * transfer (issue 13): every line of them ran in the interpreter.  Here
 * they read the same tables the same way: the caller's op and op list raw
 * (lua_next, lua_rawget, lua_rawlen: a metatable's __pairs, __index or
 * __len cannot show a check anything else than what is sent), and every
 * value kept as the snapshot core.snapshot makes of it, so that the
 * caller changing its tables after begin changes nothing.  The walks go
 * over the tables in next() order, so the first fault found, and so the
 * message, is the one the Lua checks named.
 *
 * The steps send the caller's content with libmongoc's validation off
 * (csrc/txn.c, "Checked here"), so whatever that validation refuses is
 * refused here, before anything is written: an empty key, a string that
 * is not UTF-8 (which libmongoc 1.23 lets through, later ones do not), and
 * more (csrc/storable.c, check_path, find_unstorable); spec/31 runs
 * the same values through both.
 *
 * A fault returns nil and the message (validate.lua makes the `invalid`
 * error with `op <i>: ` before it); misuse raises.  Only a `where`'s
 * filter grammar stays in Lua: check_ops calls back for it. */
#include <math.h>
#include <string.h>

#include "checks.h"

/* The walks stop looking deeper than this (as the Lua walks did), and the
 * encoder refuses deeper values anyway (MTX_MAX_DEPTH). */
#define WALK_DEPTH 100

/* The upvalues of every function here: string.format (%q as Lua writes
 * it, for LuaJIT and 5.4 alike), table.sort, table.concat. */
#define UP_FORMAT lua_upvalueindex(1)
#define UP_SORT lua_upvalueindex(2)
#define UP_CONCAT lua_upvalueindex(3)

/* Pushes string.format(fmt, <the value at idx>). */
const char *
push_format(lua_State *L, const char *fmt, int idx)
{
	idx = mtx_absindex(L, idx);
	lua_pushvalue(L, UP_FORMAT);
	lua_pushstring(L, fmt);
	lua_pushvalue(L, idx);
	lua_call(L, 2, 1);
	return lua_tostring(L, -1);
}

/* tostring(v) for the value at idx, pushed. */
const char *
push_tostring(lua_State *L, int idx)
{
	return mtx_tolstring(L, idx, NULL);
}

/* core.type(v) or type(v) for the value at idx, pushed. */
const char *
push_type_name(lua_State *L, int idx)
{
	idx = mtx_absindex(L, idx);
	lua_pushcfunction(L, mtx_l_type);
	lua_pushvalue(L, idx);
	lua_call(L, 1, 1);
	if (lua_isnil(L, -1)) {
		lua_pop(L, 1);
		lua_pushstring(L, luaL_typename(L, idx));
	}
	return lua_tostring(L, -1);
}

/* The error's message without the bridge's "mongotx: " (a raise caught by
 * lua_pcall on top of the stack, replaced). */
const char *
strip_prefix(lua_State *L)
{
	const char *msg = push_tostring(L, -1);

	if (strncmp(msg, "mongotx: ", 9) == 0)
		lua_pushstring(L, msg + 9);
	else
		lua_pushvalue(L, -1);
	lua_replace(L, -3);
	lua_pop(L, 1);
	return lua_tostring(L, -1);
}

/* Is s one of the NULL-ended list (none when list is NULL)? */
int
is_listed(const char *s, const char *const *list)
{
	for (; list && *list; list++)
		if (strcmp(s, *list) == 0)
			return 1;
	return 0;
}

/* ---- walks of a value's tables ---- */

int
starts_with_dollar(const char *s, size_t n)
{
	return n > 0 && s[0] == '$';
}

int
holds_dot(const char *s, size_t n)
{
	return memchr(s, '.', n) != NULL;
}

/* An empty key: libmongoc refuses it in an update or an inserted document
 * when the write is already under way (after the transaction is stored),
 * so it is refused here, before anything is written. */
int
is_empty(const char *s, size_t n)
{
	(void)s;
	return n == 0;
}

/* The first string key anywhere in the value at idx for which bad()
 * holds: pushed, and 1; else 0. */
int
find_key(lua_State *L, int idx, int depth, int (*bad)(const char *, size_t))
{
	size_t n;
	const char *s;

	if (lua_type(L, idx) != LUA_TTABLE || depth > WALK_DEPTH)
		return 0;
	idx = mtx_absindex(L, idx);
	luaL_checkstack(L, 4, "mongotx: a value nested too deep");
	lua_pushnil(L);
	while (lua_next(L, idx)) {
		if (lua_type(L, -2) == LUA_TSTRING) {
			s = lua_tolstring(L, -2, &n);
			if (bad(s, n)) {
				lua_pop(L, 1);
				return 1;
			}
		}
		if (find_key(L, -1, depth + 1, bad)) {
			lua_insert(L, -3);
			lua_pop(L, 2);
			return 1;
		}
		lua_pop(L, 1);
	}
	return 0;
}

/* Has the table at idx a metatable of the bridge (core.doc, decoding),
 * which keeps its key order? */
static int
keeps_order(lua_State *L, int idx)
{
	int keeps;

	if (!lua_getmetatable(L, idx))
		return 0;
	lua_pushliteral(L, "__mongotx");
	lua_rawget(L, -2);
	keeps = lua_toboolean(L, -1);
	lua_pop(L, 2);
	return keeps;
}

/* A plain table with several string keys anywhere in the value at idx
 * (its keys would encode in whatever order next() gives): its keys,
 * sorted and joined, pushed, and 1; else 0. */
static int
find_unordered(lua_State *L, int idx, int depth)
{
	int keys = 0;

	if (lua_type(L, idx) != LUA_TTABLE || depth > WALK_DEPTH)
		return 0;
	idx = mtx_absindex(L, idx);
	luaL_checkstack(L, 6, "mongotx: a value nested too deep");
	lua_pushnil(L);
	while (lua_next(L, idx)) {
		keys += lua_type(L, -2) == LUA_TSTRING;
		if (find_unordered(L, -1, depth + 1)) {
			lua_insert(L, -3);
			lua_pop(L, 2);
			return 1;
		}
		lua_pop(L, 1);
	}
	if (keys < 2 || keeps_order(L, idx))
		return 0;
	lua_pushvalue(L, UP_CONCAT);
	lua_newtable(L);
	keys = 0;
	lua_pushnil(L);
	while (lua_next(L, idx)) {
		lua_pop(L, 1);
		if (lua_type(L, -1) == LUA_TSTRING) {
			lua_pushvalue(L, -1);
			lua_rawseti(L, -3, ++keys);
		}
	}
	lua_pushvalue(L, UP_SORT);
	lua_pushvalue(L, -2);
	lua_call(L, 1, 0);
	lua_pushliteral(L, ", ");
	lua_call(L, 2, 1);
	return 1;
}

/* ---- ids and collections ---- */

/* What is wrong with the keys of the table id at idx (a key would make
 * the filter an operator, a path or an order the server reads another
 * way): the message pushed and 1; else 0. */
static int
bad_id_keys(lua_State *L, int idx)
{
	if (find_key(L, idx, 0, starts_with_dollar)) {
		push_format(L, "id holds the key %q: an id may not look like a "
			       "query operator", -1);
		return 1;
	}
	if (find_unordered(L, idx, 0)) {
		lua_pushfstring(L, "id holds a table with several keys (%s): the key "
				   "order of an _id matters, so build it with mongotx.doc",
				lua_tostring(L, -1));
		return 1;
	}
	if (find_key(L, idx, 0, holds_dot)) {
		push_format(L, "id holds the key %q: keys of an id may not hold dots", -1);
		return 1;
	}
	if (find_key(L, idx, 0, is_empty)) {
		lua_pushliteral(L, "id holds an empty key");
		return 1;
	}
	return 0;
}

/* Checks the id at idx for use in a filter (it must match exactly one
 * value there; ids.c says which may): pushes the id as sent and its key
 * (equal for ids the server takes for one _id) and returns 1, or pushes
 * what is wrong and returns 0. */
int
check_id(lua_State *L, int idx)
{
	int t = lua_type(L, idx), top;

	idx = mtx_absindex(L, idx);
	switch (t) {
	case LUA_TNIL:
		lua_pushliteral(L, "needs an id");
		return 0;
	case LUA_TFUNCTION:
	case LUA_TTHREAD:
		lua_pushfstring(L, "id may not be a %s", lua_typename(L, t));
		return 0;
	case LUA_TNUMBER:
		if (!isfinite((double)lua_tonumber(L, idx))) {
			lua_pushfstring(L, "id may not be %s", push_tostring(L, idx));
			return 0;
		}
		break;
	default:
		break;
	}
	top = lua_gettop(L);
	lua_pushcfunction(L, mtx_l_id_key);
	lua_pushvalue(L, idx);
	/* (the encoder raises only for tables and foreign userdata) */
	if (t == LUA_TNUMBER || t == LUA_TSTRING || t == LUA_TBOOLEAN || mtx_test_value(L, idx))
		lua_call(L, 1, 2);
	else if (lua_pcall(L, 1, 2, 0) != 0) {
		lua_pushfstring(L, "id cannot be encoded: %s", strip_prefix(L));
		return 0;
	}
	/* A table's keys are walked only now: the walks follow every path,
	 * and a table holding itself, or one child twice and that child the
	 * next twice, has 2^depth of them; the encoder (cycles, 100 levels,
	 * 16 MiB) has bounded them by what it wrote. */
	if (t == LUA_TTABLE && bad_id_keys(L, idx)) {
		lua_replace(L, top + 1);
		lua_settop(L, top + 1);
		return 0;
	}
	if (lua_isnil(L, -2))
		return 0; /* the message on top */
	lua_insert(L, -2); /* sent, key */
	return 1;
}

/* Checks the collection name at idx (txcoll: the transactions
 * collection's name; name_max: the most bytes it may have, or -1 for no
 * limit): 1, or the message pushed and 0. */
int
check_collection(lua_State *L, int idx, int txcoll, lua_Integer name_max)
{
	size_t n;
	const char *name;

	if (lua_type(L, idx) != LUA_TSTRING || mtx_rawlen(L, idx) == 0) {
		lua_pushliteral(L, "needs a collection name");
		return 0;
	}
	name = lua_tolstring(L, idx, &n);
	/* (a name a server would refuse only at the first write of the
	 * transaction, once it is stored: not UTF-8, or db..name) */
	if (memchr(name, '$', n) || memchr(name, '\0', n) || strncmp(name, "system.", 7) == 0 ||
	    name[0] == '.' || !mtx_utf8_valid(name, n)) {
		push_format(L, "bad collection name %q", idx);
		return 0;
	}
	if (name_max >= 0 && (lua_Integer)n > name_max) {
		lua_pushfstring(L, "collection name of %d bytes: at most %d here (its namespace, "
				   "<database>.<collection>, is limited to %d bytes)",
				(int)n, (int)name_max, MTX_MAX_NAMESPACE);
		return 0;
	}
	if (lua_rawequal(L, idx, txcoll)) {
		lua_pushliteral(L, "may not touch the transactions collection");
		return 0;
	}
	return 1;
}

/* core.check_id(id) -> sent, key | nil, message: an id (a transaction's,
 * or a module's document) checked as an op's is. */
static int
l_check_id(lua_State *L)
{
	lua_settop(L, 1);
	if (check_id(L, 1))
		return 2;
	lua_pushnil(L);
	lua_insert(L, -2);
	return 2;
}

/* What the core.check_* functions return for a check's result: true,
 * or nil and the message the check pushed. */
static int
verdict(lua_State *L, int ok)
{
	if (ok) {
		lua_pushboolean(L, 1);
		return 1;
	}
	lua_pushnil(L);
	lua_insert(L, -2);
	return 2;
}

/* core.check_collection(name, txcoll[, name_max]) -> true | nil, message */
static int
l_check_collection(lua_State *L)
{
	lua_settop(L, 3);
	return verdict(L, check_collection(L, 1, 2, luaL_optinteger(L, 3, -1)));
}

/* core.check_update(u, owned, what) -> true | nil, message: an update
 * (a snapshot, or one decoded from a stored transaction) checked as an
 * op's is; what names it in the message ("update", "undo"). */
static int
l_check_update(lua_State *L)
{
	const char *what = luaL_checkstring(L, 3);

	luaL_checktype(L, 2, LUA_TTABLE);
	lua_settop(L, 3);
	return verdict(L, check_update(L, 1, 2, what));
}

/* core.escrowable(u) -> whether the update u (a table) may be escrowed:
 * what an op stored with effect "escrow" must hold (validate.malformed). */
static int
l_escrowable(lua_State *L)
{
	luaL_checktype(L, 1, LUA_TTABLE);
	lua_settop(L, 1);
	lua_pushboolean(L, inc_escrow(L, 1));
	return 1;
}

/* core.check_value(snapshot) -> nil | message: what is wrong with a
 * caller's value (snapshotted) to be stored in a document: a `$` key or a
 * dotted key (servers read both as operators or paths), an empty key
 * (libmongoc refuses it), or a NaN or infinite number. */
static int
l_check_value(lua_State *L)
{
	lua_settop(L, 1);
	if (find_key(L, 1, 0, starts_with_dollar)) {
		push_format(L, "it holds the key %q, which looks like an operator", -1);
		return 1;
	}
	if (find_key(L, 1, 0, holds_dot)) {
		push_format(L, "it holds the key %q (dots are paths)", -1);
		return 1;
	}
	if (find_key(L, 1, 0, is_empty)) {
		lua_pushliteral(L, "it holds an empty key");
		return 1;
	}
	if (mtx_find_bad_scalar(L, 1, 0)) {
		lua_pushfstring(L, "it holds %s", lua_tostring(L, -1));
		return 1;
	}
	return 0;
}

/* core.operator_key(v) -> the first key starting with `$` anywhere in v,
 * or nil (a where's values). */
static int
l_operator_key(lua_State *L)
{
	lua_settop(L, 1);
	return find_key(L, 1, 0, starts_with_dollar);
}

/* core.touched(path, owned) -> the first field of owned that path
 * reaches (or a part of it), or nil (a where's field names). */
static int
l_touched(lua_State *L)
{
	size_t n;
	const char *path = luaL_checklstring(L, 1, &n);

	luaL_checktype(L, 2, LUA_TTABLE);
	lua_settop(L, 2);
	return touched(L, 2, path, n, NULL, 0);
}

int
mtx_open_checks(lua_State *L)
{
	static const luaL_Reg funcs[] = {
		{"check_collection", l_check_collection},
		{"check_id", l_check_id},
		{"check_ops", l_check_ops},
		{"check_update", l_check_update},
		{"check_value", l_check_value},
		{"escrowable", l_escrowable},
		{"operator_key", l_operator_key},
		{"touched", l_touched},
		{NULL, NULL},
	};
	const luaL_Reg *r;
	int k;

	lua_newtable(L); /* core.op_kinds: { update = true, ... } */
	for (k = 0; kinds[k]; k++) {
		lua_pushboolean(L, 1);
		lua_setfield(L, -2, kinds[k]);
	}
	lua_setfield(L, -2, "op_kinds");
	for (r = funcs; r->name; r++) {
		lua_getglobal(L, "string");
		lua_getfield(L, -1, "format");
		lua_remove(L, -2);
		lua_getglobal(L, "table");
		lua_getfield(L, -1, "sort");
		lua_getfield(L, -2, "concat");
		lua_remove(L, -3);
		lua_pushcclosure(L, r->func, 3);
		lua_setfield(L, -2, r->name);
	}
	return 0;
}

/* checks.c: the checks of what callers pass as a transaction's ops
 * (lua/mongotx/validate.lua, DESIGN.md §8), and their normal form.
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

#include "mongotx.h"

/* The walks stop looking deeper than this (as the Lua walks did), and the
 * encoder refuses deeper values anyway (MTX_MAX_DEPTH). */
#define WALK_DEPTH 100

/* The most the quick snapshots and the derived undo make without the
 * encoder: the bytes are copied out and the bson_t freed before anything
 * can raise (a child document moves even a small bson_t to the heap). */
#define QUICK_BYTES 120

/* The upvalues of every function here: string.format (%q as Lua writes
 * it, for LuaJIT and 5.4 alike), table.sort, table.concat. */
#define UP_FORMAT lua_upvalueindex(1)
#define UP_SORT lua_upvalueindex(2)
#define UP_CONCAT lua_upvalueindex(3)

/* Pushes string.format(fmt, <the value at idx>). */
static const char *
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
static const char *
push_tostring(lua_State *L, int idx)
{
	return mtx_tolstring(L, idx, NULL);
}

/* core.type(v) or type(v) for the value at idx, pushed. */
static const char *
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
static const char *
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
static int
is_listed(const char *s, const char *const *list)
{
	for (; list && *list; list++)
		if (strcmp(s, *list) == 0)
			return 1;
	return 0;
}

/* ---- walks of a value's tables ---- */

static int
starts_with_dollar(const char *s, size_t n)
{
	return n > 0 && s[0] == '$';
}

static int
holds_dot(const char *s, size_t n)
{
	return memchr(s, '.', n) != NULL;
}

/* An empty key: libmongoc refuses it in an update or an inserted document
 * when the write is already under way (after the transaction is stored),
 * so it is refused here, before anything is written. */
static int
is_empty(const char *s, size_t n)
{
	(void)s;
	return n == 0;
}

/* The first string key anywhere in the value at idx for which bad()
 * holds: pushed, and 1; else 0. */
static int
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
static int
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
static int
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

/* ---- updates ---- */

/* Does path reach field, or a part of it (a.b touches a, and a touches
 * a.b)? */
static int
touches(const char *path, size_t np, const char *field, size_t nf)
{
	if (np == nf)
		return memcmp(path, field, np) == 0;
	if (np > nf)
		return path[nf] == '.' && memcmp(path, field, nf) == 0;
	return field[np] == '.' && memcmp(path, field, np) == 0;
}

/* The first field of the list at owned that path (or, for $rename, its
 * new name `to`) touches: pushed, and 1; else 0. */
static int
touched(lua_State *L, int owned, const char *path, size_t np, const char *to, size_t nt)
{
	const char *f;
	size_t nf;
	int k;

	for (k = 1;; k++) {
		lua_rawgeti(L, owned, k);
		if (lua_isnil(L, -1)) {
			lua_pop(L, 1);
			return 0;
		}
		f = lua_tolstring(L, -1, &nf);
		if (f && (touches(path, np, f, nf) || (to && touches(to, nt, f, nf))))
			return 1;
		lua_pop(L, 1);
	}
}

static const char *const update_operators[] = {
	"$inc", "$set", "$unset", "$push", "$pull", "$addToSet", "$pop", "$min",
	"$max", "$mul", "$rename", "$currentDate", "$pullAll", "$bit", NULL};

/* A number as $inc and $mul take it: a Lua number, or a boxed one. */
static int
is_number(lua_State *L, int idx)
{
	const mtx_value *v;

	if (lua_type(L, idx) == LUA_TNUMBER)
		return 1;
	v = mtx_test_value(L, idx);
	return v && (v->v.value_type == BSON_TYPE_INT32 || v->v.value_type == BSON_TYPE_INT64 ||
		     v->v.value_type == BSON_TYPE_DOUBLE ||
		     v->v.value_type == BSON_TYPE_DECIMAL128);
}

/* Is the number at idx the smallest integer, whose negation (the
 * automatic undo of an $inc, or the inverse of $mul) overflows?  A Lua
 * integer, a float of that value (5.4), or a boxed Int64: LuaJIT has no
 * integers, so its only way to send it, which 5.4 decodes to an integer,
 * is the box; both runtimes refuse it alike. */
static int
is_min_integer(lua_State *L, int idx)
{
	const mtx_value *v = mtx_test_value(L, idx);

	if (v)
		return v->v.value_type == BSON_TYPE_INT64 && v->v.value.v_int64 == INT64_MIN;
#if MTX_HAS_INTEGERS
	if (lua_type(L, idx) != LUA_TNUMBER)
		return 0;
	if (lua_isinteger(L, idx))
		return lua_tointeger(L, idx) == LUA_MININTEGER;
	return lua_tonumber(L, idx) == -9223372036854775808.0;
#else
	return 0;
#endif
}

/* Has the path a part after a dot that starts with $ and is not the
 * all-positional "$[]" (when all_positional: $rename takes none)?  "a.$x"
 * would be stored as the field name "$x", which FerretDB refuses at the
 * apply, once the transaction is stored; "$[<id>]" needs arrayFilters,
 * which no op sends; and the positional "$" names the element the
 * filter's array condition matched, which for an undo or a finish (their
 * filters match the marker array) is the marker's index, not the element
 * the apply changed. */
static int
has_dollar_part(const char *path, size_t n, int all_positional)
{
	const char *p = path, *end = path + n, *dot;
	size_t len;

	while ((dot = memchr(p, '.', (size_t)(end - p))) != NULL) {
		p = dot + 1;
		dot = memchr(p, '.', (size_t)(end - p));
		len = (size_t)((dot ? dot : end) - p);
		if (len > 0 && p[0] == '$' &&
		    !(all_positional && len == 3 && memcmp(p, "$[]", 3) == 0))
			return 1;
	}
	return 0;
}

/* Can s be a key: UTF-8 without a NUL (the encoder's rule for keys)? */
static int
is_key(const char *s, size_t n)
{
	return strlen(s) == n && mtx_utf8_valid(s, n);
}

/* One path of an operator's fields (key at -2, value at -1): 1, or the
 * message pushed and 0. */
static int
check_path(lua_State *L, int owned, const char *what, const char *opname)
{
	int numeric = strcmp(opname, "$inc") == 0 || strcmp(opname, "$mul") == 0;
	int rename = strcmp(opname, "$rename") == 0;
	const char *path = "", *to = NULL;
	size_t np = 0, nt = 0;

	if (lua_type(L, -2) == LUA_TSTRING)
		path = lua_tolstring(L, -2, &np);
	/* (no dot first or last, no two dots in a row; UTF-8 without a NUL,
	 * as the encoder takes keys: a built op's path reaches the encoder
	 * only after this check) */
	if (lua_type(L, -2) != LUA_TSTRING || np == 0 || path[0] == '$' || path[0] == '.' ||
	    path[np - 1] == '.' || strstr(path, "..") || has_dollar_part(path, np, !rename) ||
	    !is_key(path, np)) {
		lua_pushfstring(L, "%s: %s has a bad field name %s", what, opname,
				push_tostring(L, -2));
		return 0;
	}
	if (numeric && !is_number(L, -1)) {
		lua_pushfstring(L, "%s: %s of %s needs a number, not %s", what, opname, path,
				push_type_name(L, -1));
		return 0;
	}
	if (numeric && is_min_integer(L, -1)) {
		lua_pushfstring(L, "%s: %s of %s by -9223372036854775808 cannot be undone (its "
				   "negation overflows)", what, opname, path);
		return 0;
	}
	if (rename) {
		if (lua_type(L, -1) == LUA_TSTRING)
			to = lua_tolstring(L, -1, &nt);
		if (!to || nt == 0 || to[0] == '$' || has_dollar_part(to, nt, 0) || !is_key(to, nt)) {
			lua_pushfstring(L, "%s: $rename of %s needs a field name", what, path);
			return 0;
		}
	}
	if (touched(L, owned, path, np, to, nt)) {
		lua_pushfstring(L, "%s: %s may not touch %s", what, opname, lua_tostring(L, -1));
		return 0;
	}
	return 1;
}

/* The $-keys an operator's value may start with ($push's modifiers and
 * the like); the other keys of an update's values are stored as field
 * names, which FerretDB and MongoDB before 5.0 refuse when they start with
 * $ -- at the apply, once the transaction is stored. */
static const char *const push_modifiers[] = {"$each", "$slice", "$sort", "$position", NULL};
static const char *const add_to_set_modifiers[] = {"$each", NULL};
static const char *const current_date_modifiers[] = {"$type", NULL};
/* The operators whose values are not stored (see find_unstorable). */
static const char *const unstored_operators[] = {"$pull", "$pullAll", "$unset", NULL};

/* Does the value at idx encode as an array? */
static int
is_array(lua_State *L, int idx)
{
	const char *kind;

	if (lua_type(L, idx) != LUA_TTABLE)
		return 0;
	idx = mtx_absindex(L, idx);
	kind = mtx_table_kind(L, idx);
	lua_pop(L, 1);
	return kind ? strcmp(kind, "array") == 0 : mtx_plain_is_array(L, idx);
}

/* Is the modifier (key at -2, value at -1) given what the server takes? */
static int
modifier_value_ok(lua_State *L, const char *k)
{
	const char *t;

	if (strcmp(k, "$each") == 0)
		return is_array(L, -1);
	if (strcmp(k, "$slice") == 0 || strcmp(k, "$position") == 0)
		return is_number(L, -1);
	if (strcmp(k, "$sort") == 0)
		return is_number(L, -1) || lua_type(L, -1) == LUA_TTABLE;
	if (strcmp(k, "$type") == 0) {
		t = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "";
		return strcmp(t, "date") == 0 || strcmp(t, "timestamp") == 0;
	}
	return 1;
}

/* What is wrong with the value at value of an operator taking modifiers
 * (the list at modifiers), or NULL: the server refuses at the apply a
 * value mixing modifiers with fields, modifiers without $each, a modifier
 * of the wrong type, and a $currentDate other than a boolean or $type. */
static const char *
bad_modifiers(lua_State *L, int value, const char *const *modifiers)
{
	static const char current_date_shape[] =
		"takes true, false or { $type = \"date\" | \"timestamp\" }";
	int current_date = modifiers == current_date_modifiers, dollar = 0, plain = 0, each = 0;
	const char *k;

	if (current_date && lua_type(L, value) == LUA_TBOOLEAN)
		return NULL;
	if (lua_type(L, value) != LUA_TTABLE)
		return current_date ? current_date_shape : NULL;
	lua_pushnil(L);
	while (lua_next(L, value)) {
		k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "";
		if (k[0] == '$') {
			dollar = 1;
			each |= strcmp(k, "$each") == 0;
			if (!modifier_value_ok(L, k)) {
				lua_pop(L, 2);
				return current_date ? current_date_shape
						    : "has a modifier of the wrong type ($each an "
						      "array, $slice and $position numbers)";
			}
		} else {
			plain = 1;
		}
		lua_pop(L, 1);
	}
	if (current_date && (plain || !dollar))
		return current_date_shape;
	if (dollar && (plain || !(each || current_date)))
		return "mixes fields with modifiers, or has modifiers without $each";
	return NULL;
}

/* A field name FerretDB and MongoDB before 5.0 refuse to store. */
static int
is_unstorable(const char *s, size_t n)
{
	return starts_with_dollar(s, n) || holds_dot(s, n);
}

/* Would the update at u store a key starting with $ or holding a dot, or
 * give an operator taking modifiers a value the server refuses?  1 with
 * the message (naming it as what) pushed; else 0.  The values of $pull
 * (conditions: query operators are its grammar), $pullAll (values to
 * match) and $unset (ignored) are not stored, so they are left alone. */
static int
find_unstorable(lua_State *L, int u, const char *what)
{
	const char *const *modifiers;
	const char *name, *k, *bad;
	size_t n;
	int top = lua_gettop(L), fieldset, value;

	u = mtx_absindex(L, u);
	luaL_checkstack(L, 12, "mongotx: no room to check an update");
	lua_pushnil(L);
	while (lua_next(L, u)) {
		fieldset = lua_gettop(L);
		name = lua_tostring(L, -2);
		if (is_listed(name, unstored_operators)) {
			lua_pop(L, 1);
			continue;
		}
		modifiers = strcmp(name, "$push") == 0		  ? push_modifiers
			    : strcmp(name, "$addToSet") == 0	  ? add_to_set_modifiers
			    : strcmp(name, "$currentDate") == 0 ? current_date_modifiers
								  : NULL;
		lua_pushnil(L);
		while (lua_next(L, fieldset)) {
			value = lua_gettop(L);
			if (lua_type(L, value) == LUA_TTABLE) {
				lua_pushnil(L);
				while (lua_next(L, value)) {
					k = NULL;
					if (lua_type(L, -2) == LUA_TSTRING) {
						k = lua_tolstring(L, -2, &n);
						if (!is_listed(k, modifiers) && is_unstorable(k, n)) {
							lua_pushvalue(L, -2);
							goto found_key;
						}
					}
					/* ($sort's keys are the elements' paths) */
					if (!(k && strcmp(k, "$sort") == 0 && is_listed(k, modifiers)) &&
					    find_key(L, -1, 2, is_unstorable))
						goto found_key;
					lua_pop(L, 1);
				}
			}
			if (modifiers && (bad = bad_modifiers(L, value, modifiers)) != NULL) {
				lua_pushfstring(L, "%s: %s of %s %s", what, lua_tostring(L, fieldset - 1),
						lua_tostring(L, value - 1), bad);
				goto found;
			}
			lua_pop(L, 1);
		}
		lua_pop(L, 1);
	}
	return 0;
found_key:
	lua_pushfstring(L, "%s: %s may not store the field name %s (a server refuses a stored "
			   "field name starting with $ or holding a dot)",
			what, lua_tostring(L, fieldset - 1), push_format(L, "%q", -1));
found:
	lua_replace(L, top + 1);
	lua_settop(L, top + 1);
	return 1;
}

/* An update document (the table at u): operators only, none touching _id
 * or the fields mongotx keeps on documents (the list at owned).  what:
 * "update" or "undo".  1, or the message pushed and 0. */
static int
check_update(lua_State *L, int u, int owned, const char *what)
{
	int n = 0, fieldset;
	const char *opname;

	u = mtx_absindex(L, u);
	if (lua_type(L, u) != LUA_TTABLE) {
		lua_pushfstring(L, "%s must be a table", what);
		return 0;
	}
	luaL_checkstack(L, 12, "mongotx: no room to check an update");
	lua_pushnil(L);
	while (lua_next(L, u)) {
		n++;
		fieldset = lua_gettop(L);
		if (lua_type(L, -2) != LUA_TSTRING || !is_listed(lua_tostring(L, -2), update_operators)) {
			lua_pushfstring(L, "%s: %s is not an update operator (an update needs "
					   "operators such as $inc or $set)", what,
					push_tostring(L, -2));
			return 0;
		}
		opname = lua_tostring(L, -2);
		lua_pushnil(L);
		if (lua_type(L, fieldset) != LUA_TTABLE || !lua_next(L, fieldset)) {
			lua_pushfstring(L, "%s: %s needs a table of fields", what, opname);
			return 0;
		}
		lua_pop(L, 2);
		lua_pushnil(L);
		while (lua_next(L, fieldset)) {
			if (!check_path(L, owned, what, opname))
				return 0;
			lua_pop(L, 1);
		}
		lua_pop(L, 1);
	}
	if (n == 0) {
		lua_pushfstring(L, "%s is empty", what);
		return 0;
	}
	if (mtx_find_bad_scalar(L, u, 0)) {
		lua_pushfstring(L, "%s holds %s", what, lua_tostring(L, -1));
		return 0;
	}
	if (find_key(L, u, 0, is_empty)) {
		lua_pushfstring(L, "%s holds an empty key", what);
		return 0;
	}
	if (find_unstorable(L, u, what))
		return 0;
	return 1;
}

/* The sign of the update at u if made only of $inc of Lua numbers of one
 * sign (1 or -1), else 0. */
static int
inc_sign(lua_State *L, int u)
{
	int sign = 0, s, top = lua_gettop(L);
	lua_Number x;

	lua_pushnil(L);
	if (!lua_next(L, u) || lua_type(L, -2) != LUA_TSTRING ||
	    strcmp(lua_tostring(L, -2), "$inc") != 0 || lua_type(L, -1) != LUA_TTABLE)
		goto none;
	lua_pop(L, 1);
	if (lua_next(L, u)) /* a second operator */
		goto none;
	lua_pushliteral(L, "$inc");
	lua_rawget(L, u);
	lua_pushnil(L);
	while (lua_next(L, -2)) {
		if (lua_type(L, -1) != LUA_TNUMBER || (x = lua_tonumber(L, -1)) == 0)
			goto none;
		s = x > 0 ? 1 : -1;
		if (sign && s != sign)
			goto none;
		sign = s;
		lua_pop(L, 1);
	}
	lua_settop(L, top);
	return sign;
none:
	lua_settop(L, top);
	return 0;
}

/* Pushes the automatic undo of the checked update at u when it is made
 * only of $inc of Lua numbers (the same $inc negated), as a table and as
 * its BSON, and returns 1; else 0 (nothing pushed). */
static int
push_inverse_inc(lua_State *L, int u)
{
	int top = lua_gettop(L), inc, src;
	bson_t doc, fields, *b;
	uint8_t bytes[QUICK_BYTES];
	uint32_t len;
	const char *field;
	size_t n;

	lua_pushnil(L);
	while (lua_next(L, u)) {
		if (lua_type(L, -2) != LUA_TSTRING || strcmp(lua_tostring(L, -2), "$inc") != 0) {
			lua_settop(L, top);
			return 0;
		}
		lua_pop(L, 1);
	}
	lua_createtable(L, 0, 1); /* the undo */
	lua_createtable(L, 0, 1); /* its $inc */
	inc = lua_gettop(L);
	lua_pushliteral(L, "$inc");
	lua_pushvalue(L, inc);
	lua_rawset(L, top + 1);
	lua_pushliteral(L, "$inc");
	lua_rawget(L, u);
	src = lua_gettop(L);
	lua_pushnil(L);
	while (lua_next(L, src)) {
		if (lua_type(L, -1) != LUA_TNUMBER) {
			lua_settop(L, top);
			return 0;
		}
#if MTX_HAS_INTEGERS
		if (lua_isinteger(L, -1)) /* not the smallest: check_update refused it */
			lua_pushinteger(L, (lua_Integer)(0u - (lua_Unsigned)lua_tointeger(L, -1)));
		else
#endif
			lua_pushnumber(L, -lua_tonumber(L, -1));
		lua_pushvalue(L, -3);
		lua_insert(L, -2);
		lua_rawset(L, inc);
		lua_pop(L, 1);
	}
	/* its BSON, from the table just made (no raise until it is freed) */
	bson_init(&doc);
	bson_append_document_begin(&doc, "$inc", 4, &fields);
	lua_pushnil(L);
	while (lua_next(L, inc)) {
		field = lua_tolstring(L, -2, &n);
		mtx_append_number(L, -1, &fields, field, (int)n, MTX_HINT_NONE);
		lua_pop(L, 1);
	}
	bson_append_document_end(&doc, &fields);
	lua_settop(L, top + 1);
	len = doc.len;
	if (len <= QUICK_BYTES)
		memcpy(bytes, bson_get_data(&doc), len);
	bson_destroy(&doc);
	if (len <= QUICK_BYTES) {
		lua_pushlstring(L, (const char *)bytes, len);
		return 1;
	}
	/* a larger one through the encoder, which owns its buffer */
	b = mtx_check_document_reused(L, top + 1);
	lua_pushlstring(L, (const char *)bson_get_data(b), b->len);
	mtx_scratch_give(L, -2);
	lua_remove(L, -2);
	return 1;
}

/* ---- one op ---- */

/* The fields of an op, in the order the Lua checks snapshotted them. */
enum { F_UPDATE, F_UNDO, F_DOC, F_WHERE, N_FIELDS };
static const char *const snapshot_fields[] = {"update", "undo", "doc", "where"};

static int
is_op_key(lua_State *L, int idx)
{
	static const char *const keys[] = {"collection", "id", "kind", "update",
					   "doc", "undo", "where", NULL};

	return lua_type(L, idx) == LUA_TSTRING && is_listed(lua_tostring(L, idx), keys);
}

/* Where check_op keeps what it works with: stack slots. */
typedef struct {
	int op, txcoll, owned, built, where_check, index;
	int collection, id, key;
	int value[N_FIELDS], bytes[N_FIELDS];
	int kind, out, doc, effect, floor;
	lua_Integer name_max;
} op_slots;

static void
push_slot(lua_State *L, int *slot)
{
	lua_pushnil(L);
	*slot = lua_gettop(L);
}

/* ---- snapshots ---- */

/* How deep quick_snapshot goes before it leaves a value to the encoder. */
#define QUICK_DEPTH 8

static int quick_fields(lua_State *L, int idx, bson_t *b, int depth);

/* Appends the value at idx to b when it has the quick shape: a boolean, a
 * number, a string, or a table without a metatable of at most one string
 * key whose value has the quick shape.  0 when it has not (b is then
 * left half made). */
static int
quick_append(lua_State *L, int idx, bson_t *b, const char *key, int keylen, int depth)
{
	bson_t child;
	size_t len;
	const char *s;

	switch (lua_type(L, idx)) {
	case LUA_TBOOLEAN:
		return bson_append_bool(b, key, keylen, lua_toboolean(L, idx));
	case LUA_TNUMBER:
		mtx_append_number(L, idx, b, key, keylen, MTX_HINT_NONE);
		return 1;
	case LUA_TSTRING:
		s = lua_tolstring(L, idx, &len);
		return len < 64 && bson_append_utf8(b, key, keylen, s, (int)len);
	case LUA_TTABLE:
		if (depth >= QUICK_DEPTH)
			return 0;
		if (lua_getmetatable(L, idx)) {
			lua_pop(L, 1);
			return 0;
		}
		return bson_append_document_begin(b, key, keylen, &child) &&
		       quick_fields(L, idx, &child, depth + 1) &&
		       bson_append_document_end(b, &child);
	default:
		return 0;
	}
}

/* The fields of the table at idx (no metatable) into b: at most one, a
 * key the encoder takes (no NUL, UTF-8) with a value of the quick shape. */
static int
quick_fields(lua_State *L, int idx, bson_t *b, int depth)
{
	const char *key;
	size_t len;
	int ok, top = lua_gettop(L);

	idx = mtx_absindex(L, idx);
	lua_pushnil(L);
	if (!lua_next(L, idx))
		return 1; /* an empty table is an empty document */
	if (lua_type(L, -2) != LUA_TSTRING) {
		lua_settop(L, top);
		return 0;
	}
	key = lua_tolstring(L, -2, &len);
	ok = strlen(key) == len && mtx_utf8_valid(key, len) &&
	     quick_append(L, lua_gettop(L), b, key, (int)len, depth);
	lua_pop(L, 1);
	if (!ok || lua_next(L, idx)) {
		lua_settop(L, top);
		return 0;
	}
	return 1;
}

/* Pushes a copy of the value at idx, of the quick shape: what decoding
 * its BSON gives (a table of one key has no metatable to keep an order). */
static void
quick_copy(lua_State *L, int idx)
{
	idx = mtx_absindex(L, idx);
	if (lua_type(L, idx) != LUA_TTABLE) {
		lua_pushvalue(L, idx);
		return;
	}
	lua_createtable(L, 0, 1);
	lua_pushnil(L);
	if (lua_next(L, idx)) {
		quick_copy(L, -1);
		lua_remove(L, -2);
		lua_rawset(L, -3);
	}
}

/* core.snapshot without the general encoder and decoder for the small
 * tables most ops hold ({ ["$inc"] = { balance = -5 } }): pushes the copy
 * and its BSON and returns 1, or 0 (nothing pushed) for any other value. */
static int
quick_snapshot(lua_State *L, int idx)
{
	bson_t b;
	uint8_t bytes[QUICK_BYTES];
	uint32_t len;
	int top = lua_gettop(L), ok;

	idx = mtx_absindex(L, idx);
	if (lua_getmetatable(L, idx)) {
		lua_pop(L, 1);
		return 0;
	}
	bson_init(&b);
	ok = quick_fields(L, idx, &b, 1) && b.len <= QUICK_BYTES;
	len = b.len;
	if (ok)
		memcpy(bytes, bson_get_data(&b), len);
	bson_destroy(&b);
	lua_settop(L, top);
	if (!ok)
		return 0;
	quick_copy(L, idx);
	lua_pushlstring(L, (const char *)bytes, len);
	return 1;
}

/* Snapshots op[f] into its slots (a table as the copy and its BSON, any
 * other value as it is): 1, or the message pushed and 0. */
static int
snapshot_field(lua_State *L, const op_slots *s, int f)
{
	lua_pushstring(L, snapshot_fields[f]);
	lua_rawget(L, s->op);
	if (lua_type(L, -1) != LUA_TTABLE || s->built) {
		lua_replace(L, s->value[f]);
		return 1;
	}
	if (quick_snapshot(L, -1)) {
		lua_replace(L, s->bytes[f]);
		lua_replace(L, s->value[f]);
		lua_pop(L, 1);
		return 1;
	}
	lua_pushcfunction(L, mtx_l_snapshot);
	lua_insert(L, -2);
	if (lua_pcall(L, 1, 2, 0) != 0) {
		lua_pushfstring(L, "%s cannot be stored: %s", snapshot_fields[f],
				strip_prefix(L));
		return 0;
	}
	lua_replace(L, s->bytes[f]);
	lua_replace(L, s->value[f]);
	return 1;
}

/* The kind: op.kind, else insert for an op with a doc, update for one
 * with an update.  1, or the message pushed and 0. */
static const char *const kinds[] = {"update", "insert", "remove", "assert", NULL};

static int
check_kind(lua_State *L, const op_slots *s)
{
	const char *k;

	lua_pushliteral(L, "kind");
	lua_rawget(L, s->op);
	if (!lua_toboolean(L, -1)) {
		lua_pop(L, 1);
		if (!lua_isnil(L, s->value[F_DOC]))
			lua_pushliteral(L, "insert");
		else if (!lua_isnil(L, s->value[F_UPDATE]))
			lua_pushliteral(L, "update");
		else
			lua_pushnil(L);
	}
	lua_replace(L, s->kind);
	k = lua_type(L, s->kind) == LUA_TSTRING ? lua_tostring(L, s->kind) : "";
	if (is_listed(k, kinds))
		return 1;
	lua_pushliteral(L, "kind must be update, insert, remove or assert");
	return 0;
}

static int
kind_is(lua_State *L, const op_slots *s, const char *kind)
{
	return strcmp(lua_tostring(L, s->kind), kind) == 0;
}

/* The update and undo of an update op, into out (undo derived for an
 * update of $inc only), with its effect.  1, or the message pushed and 0. */
static int
check_update_op(lua_State *L, const op_slots *s)
{
	int top = lua_gettop(L), derived = lua_isnil(L, s->value[F_UNDO]);

	if (!check_update(L, s->value[F_UPDATE], s->owned, "update"))
		return 0;
	if (derived) {
		/* the checked update's paths, its numbers negated: nothing
		 * more to check */
		if (!push_inverse_inc(L, s->value[F_UPDATE])) {
			lua_pushliteral(L, "an update other than $inc needs an explicit undo");
			return 0;
		}
		lua_replace(L, s->bytes[F_UNDO]);
		lua_replace(L, s->value[F_UNDO]);
	} else if (!check_update(L, s->value[F_UNDO], s->owned, "undo")) {
		return 0;
	}
	lua_pushvalue(L, s->value[F_UPDATE]);
	lua_setfield(L, s->out, "update");
	lua_pushvalue(L, s->value[F_UNDO]);
	lua_setfield(L, s->out, "undo");
	/* a debit (only $inc of negative numbers, undone by an $inc of
	 * positive ones) lowers what a guard reads (csrc/txn.c, "Guards");
	 * a derived undo negates the update's numbers, none 0 there */
	if (inc_sign(L, s->value[F_UPDATE]) == -1 &&
	    (derived || inc_sign(L, s->value[F_UNDO]) == 1)) {
		lua_pushliteral(L, "lowers");
		lua_pushvalue(L, -1);
		lua_replace(L, s->effect);
		lua_setfield(L, s->out, "effect");
	}
	lua_settop(L, top);
	return 1;
}

/* Is the key at idx one of the fields of the list at owned? */
static int
touched_exactly(lua_State *L, int owned, int idx)
{
	int k, same;

	idx = mtx_absindex(L, idx);
	for (k = 1;; k++) {
		lua_rawgeti(L, owned, k);
		if (lua_isnil(L, -1)) {
			lua_pop(L, 1);
			return 0;
		}
		same = lua_rawequal(L, -1, idx);
		lua_pop(L, 1);
		if (same)
			return 1;
	}
}

/* The doc of an insert op: a copy of its snapshot with the op's id as
 * _id, into out.  1, or the message pushed and 0. */
static int
check_insert_doc(lua_State *L, const op_slots *s)
{
	int src = s->value[F_DOC], doc, top = lua_gettop(L);

	if (lua_type(L, src) != LUA_TTABLE) {
		lua_pushliteral(L, "insert needs a doc");
		return 0;
	}
	lua_newtable(L);
	doc = lua_gettop(L);
	lua_pushnil(L);
	while (lua_next(L, src)) {
		if (lua_type(L, -2) != LUA_TSTRING) {
			lua_pushliteral(L, "doc keys are strings");
			return 0;
		}
		if (lua_tostring(L, -2)[0] == '$') {
			push_format(L, "doc may not hold the key %q", -2);
			return 0;
		}
		if (touched_exactly(L, s->owned, -2)) {
			lua_pushfstring(L, "doc may not set %s", lua_tostring(L, -2));
			return 0;
		}
		lua_pushvalue(L, -2);
		lua_insert(L, -2);
		lua_rawset(L, doc);
	}
	/* (_id is one of the owned fields: the op's id becomes it, below) */
	if (find_key(L, doc, 0, starts_with_dollar)) {
		push_format(L, "doc may not hold the key %q", -1);
		return 0;
	}
	if (find_key(L, doc, 0, holds_dot)) {
		push_format(L, "doc may not hold the key %q (dots are paths)", -1);
		return 0;
	}
	if (find_key(L, doc, 0, is_empty)) {
		lua_pushliteral(L, "doc may not hold an empty key");
		return 0;
	}
	if (mtx_find_bad_scalar(L, doc, 0)) {
		lua_pushfstring(L, "doc holds %s", lua_tostring(L, -1));
		return 0;
	}
	lua_pushvalue(L, s->id);
	lua_setfield(L, doc, "_id");
	lua_pushvalue(L, doc);
	lua_replace(L, s->doc);
	lua_setfield(L, s->out, "doc");
	lua_settop(L, top);
	return 1;
}

/* The where of an op: checked by validate.lua's filter grammar (the
 * function at where_check: where, owned, i -> true, floor | nil, err).
 * 1, or 0 with the error table pushed. */
static int
check_where(lua_State *L, const op_slots *s)
{
	if (lua_isnil(L, s->value[F_WHERE]))
		return 1;
	lua_pushvalue(L, s->where_check);
	lua_pushvalue(L, s->value[F_WHERE]);
	lua_pushvalue(L, s->owned);
	lua_pushvalue(L, s->index);
	lua_call(L, 3, 2);
	if (!lua_toboolean(L, -2))
		return 0;
	lua_replace(L, s->floor);
	lua_pop(L, 1);
	return 1;
}

/* Checks the op at s->op (the caller's table, read raw) and fills s->out
 * with its normal form { collection, id, kind, where, update, undo, doc,
 * effect, floor }, s->key with its document's key and s->bytes with the
 * BSON of its update, undo and where, which the stored form reuses.
 * Returns 1; 0 with the message pushed; -1 with an error table pushed. */
static int
check_op(lua_State *L, op_slots *s)
{
	if (lua_type(L, s->op) != LUA_TTABLE) {
		lua_pushliteral(L, "must be a table");
		return 0;
	}
	lua_pushnil(L);
	while (lua_next(L, s->op)) {
		lua_pop(L, 1);
		if (!is_op_key(L, -1)) {
			lua_pushfstring(L, "unknown key %s", push_tostring(L, -1));
			return 0;
		}
	}
	lua_pushliteral(L, "collection");
	lua_rawget(L, s->op);
	lua_replace(L, s->collection);
	if (!check_collection(L, s->collection, s->txcoll, s->name_max))
		return 0;
	lua_pushliteral(L, "id");
	lua_rawget(L, s->op);
	if (!check_id(L, -1))
		return 0;
	lua_replace(L, s->key);
	lua_replace(L, s->id);
	lua_pop(L, 1);
	if (!snapshot_field(L, s, F_UPDATE) || !snapshot_field(L, s, F_UNDO) ||
	    !snapshot_field(L, s, F_DOC) || !snapshot_field(L, s, F_WHERE))
		return 0;
	if (!check_kind(L, s))
		return 0;
	if (!check_where(L, s))
		return -1;
	if (mtx_find_bad_scalar(L, s->value[F_WHERE], 0)) {
		lua_pushfstring(L, "where holds %s", lua_tostring(L, -1));
		return 0;
	}
	lua_createtable(L, 0, 8);
	lua_replace(L, s->out);
	lua_pushvalue(L, s->collection);
	lua_setfield(L, s->out, "collection");
	lua_pushvalue(L, s->id);
	lua_setfield(L, s->out, "id");
	lua_pushvalue(L, s->kind);
	lua_setfield(L, s->out, "kind");
	lua_pushvalue(L, s->value[F_WHERE]);
	lua_setfield(L, s->out, "where");
	if (kind_is(L, s, "update")) {
		if (!check_update_op(L, s))
			return 0;
	} else if (!lua_isnil(L, s->value[F_UPDATE]) || !lua_isnil(L, s->value[F_UNDO])) {
		lua_pushliteral(L, "only an update op takes update and undo");
		return 0;
	}
	if (kind_is(L, s, "insert")) {
		if (!check_insert_doc(L, s))
			return 0;
	} else if (!lua_isnil(L, s->value[F_DOC])) {
		lua_pushliteral(L, "only an insert op takes a doc");
		return 0;
	}
	if (lua_toboolean(L, s->floor)) {
		lua_pushvalue(L, s->floor);
		lua_setfield(L, s->out, "floor");
	}
	return 1;
}

/* Refuses an op of the same document as an earlier one (by the key
 * check_id made, as the server reads ids): seen[collection][key] is the
 * op that took it.  1, or the message pushed and 0. */
static int
check_unique(lua_State *L, const op_slots *s, int seen, int i)
{
	lua_pushvalue(L, s->collection);
	lua_rawget(L, seen);
	if (lua_isnil(L, -1)) {
		lua_pop(L, 1);
		lua_newtable(L);
		lua_pushvalue(L, s->collection);
		lua_pushvalue(L, -2);
		lua_rawset(L, seen);
	}
	lua_pushvalue(L, s->key);
	lua_pushvalue(L, -1);
	lua_rawget(L, -3);
	if (!lua_isnil(L, -1)) {
		int first = (int)lua_tointeger(L, -1);

		lua_pushfstring(L, "document %s of %s is also op %d: one op per document (the "
				   "server reads these ids as one)",
				push_tostring(L, s->id), lua_tostring(L, s->collection), first);
		return 0;
	}
	lua_pop(L, 1);
	lua_pushinteger(L, i);
	lua_rawset(L, -3);
	lua_pop(L, 1);
	return 1;
}

/* Appends op i, checked, to the stored array arr (csrc/stored.c). */
static void
append_stored(lua_State *L, const op_slots *s, bson_t *arr, lua_Integer i)
{
	int parts[MTX_SO_N];
	int f, k;
	static const int part[N_FIELDS] = {MTX_SO_UPDATE, MTX_SO_UNDO, MTX_SO_DOC, MTX_SO_WHERE};

	parts[MTX_SO_COLLECTION] = s->collection;
	parts[MTX_SO_ID] = s->id;
	parts[MTX_SO_KIND] = s->kind;
	parts[MTX_SO_EFFECT] = s->effect;
	for (f = 0; f < N_FIELDS; f++) {
		k = part[f];
		/* the bytes the snapshot made, else (built) the table */
		parts[k] = lua_isnil(L, s->bytes[f]) ? s->value[f] : s->bytes[f];
	}
	parts[MTX_SO_DOC] = s->doc;
	mtx_append_stored_op(L, parts, arr, (uint32_t)(i - 1));
}

/* core.check_ops(ops, txcoll, owned, built, where_check, name_max) -> out,
 * stored, size | nil, message, i | nil, err.  ops: the caller's list (a
 * table), read raw; txcoll: the transactions collection's name; owned: the
 * fields mongotx keeps on documents ({ "_id", marker, version }); built:
 * the ops are mongotx's own, made from checked scalars (nothing to
 * snapshot); where_check: see check_where; name_max: the most bytes a
 * collection name may have (nil: no limit).  out[i]: op i's normal form;
 * stored: the ops as the transaction stores them (what core.stored_ops
 * makes of out, built here from the snapshots' bytes) and its size.  A
 * bad op gives its message and index (none for a fault of the whole
 * list), a bad where the error table its check made. */
static int
l_check_ops(lua_State *L)
{
	op_slots s;
	lua_Integer n, i, k;
	int f, outs, seen, held, base, r, too_big = 0;
	bson_t *arr;

	lua_settop(L, 6);
	luaL_checktype(L, 1, LUA_TTABLE);
	luaL_checktype(L, 3, LUA_TTABLE);
	s.name_max = luaL_optinteger(L, 6, -1);
	/* A C function may push LUA_MINSTACK (20) values unasked; the list,
	 * the scratch and the slots below take 21, and check_op pushes up to
	 * ~35 more (a quick snapshot 3 a level, 8 levels) before anything
	 * grows the stack: room for them all, asked once. */
	luaL_checkstack(L, 64, "mongotx: no room to check the ops");
	s.txcoll = 2, s.owned = 3, s.built = lua_toboolean(L, 4), s.where_check = 5;
	n = (lua_Integer)mtx_rawlen(L, 1);
	if (n == 0) {
		lua_pushnil(L);
		lua_pushliteral(L, "a transaction needs at least one op");
		return 2;
	}
	lua_pushnil(L);
	while (lua_next(L, 1)) {
		lua_pop(L, 1);
		if (!mtx_is_integer_key(L, -1, &k) || k < 1 || k > n) {
			lua_pushnil(L);
			lua_pushliteral(L, "ops must be a list");
			return 2;
		}
	}
	lua_createtable(L, (int)n, 0);
	outs = lua_gettop(L);
	lua_newtable(L);
	seen = lua_gettop(L);
	arr = mtx_scratch_take(L);
	held = lua_gettop(L);
	push_slot(L, &s.op);
	push_slot(L, &s.index);
	push_slot(L, &s.collection);
	push_slot(L, &s.id);
	push_slot(L, &s.key);
	for (f = 0; f < N_FIELDS; f++) {
		push_slot(L, &s.value[f]);
		push_slot(L, &s.bytes[f]);
	}
	push_slot(L, &s.kind);
	push_slot(L, &s.out);
	push_slot(L, &s.doc);
	push_slot(L, &s.effect);
	push_slot(L, &s.floor);
	base = lua_gettop(L);
	for (i = 1; i <= n; i++) {
		for (f = s.op; f <= base; f++) {
			lua_pushnil(L);
			lua_replace(L, f);
		}
		lua_rawgeti(L, 1, (int)i);
		lua_replace(L, s.op);
		lua_pushinteger(L, i);
		lua_replace(L, s.index);
		r = check_op(L, &s);
		if (r == 1 && !check_unique(L, &s, seen, (int)i))
			r = 0;
		if (r != 1)
			mtx_scratch_give(L, held);
		if (r == -1)
			return 2; /* nil, err: the where's check made it */
		if (r == 0) {
			lua_pushnil(L);
			lua_insert(L, -2);
			lua_pushinteger(L, i);
			return 3;
		}
		lua_settop(L, base);
		lua_pushvalue(L, s.out);
		lua_rawseti(L, outs, (int)i);
		/* too big for one document is bad content, told once every op
		 * is checked, as core.stored_ops would raise it */
		if (!too_big) {
			append_stored(L, &s, arr, i);
			too_big = arr->len > MTX_MAX_BSON;
		}
	}
	mtx_scratch_give(L, held);
	if (too_big) {
		lua_pushnil(L);
		lua_pushliteral(L, "the ops cannot be stored: the ops take more than 16 MiB");
		return 2;
	}
	lua_pushvalue(L, outs);
	mtx_push_stored_ops(L, arr);
	return 3;
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

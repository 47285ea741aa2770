/* checks_update.c: the checks of an update or undo (core.check_update,
 * and check_ops's for each op): its operators, the paths they name (none
 * reaching a field mongotx keeps), the modifiers of $push, $addToSet and
 * $currentDate, the values no operator may store; and the undo derived
 * from an $inc.  The rest of the checks is in checks.c (checks.h). */
#include <string.h>

#include "checks.h"

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
int
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
int
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
int
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
int
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
int
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

/* May the update at u be escrowed (csrc/txn.h, "Guards")?  Only when it
 * is made of $inc of Lua numbers, none 0, at least one positive, and no
 * positive path has a `$` part: the escrow subdocument holds no array for
 * an all-positional `$[]` to name. */
int
inc_escrow(lua_State *L, int u)
{
	int credit = 0, top = lua_gettop(L);
	lua_Number x;

	if (inc_sign(L, u) == -1) /* a debit: nothing to escrow */
		return 0;
	lua_pushnil(L);
	while (lua_next(L, u)) {
		if (lua_type(L, -2) != LUA_TSTRING || strcmp(lua_tostring(L, -2), "$inc") != 0 ||
		    lua_type(L, -1) != LUA_TTABLE)
			goto none;
		lua_pushnil(L);
		while (lua_next(L, -2)) {
			if (lua_type(L, -1) != LUA_TNUMBER || (x = lua_tonumber(L, -1)) == 0 ||
			    lua_type(L, -2) != LUA_TSTRING)
				goto none;
			if (x > 0) {
				if (strchr(lua_tostring(L, -2), '$'))
					goto none;
				credit = 1;
			}
			lua_pop(L, 1);
		}
		lua_pop(L, 1);
	}
	lua_settop(L, top);
	return credit;
none:
	lua_settop(L, top);
	return 0;
}

/* Pushes the automatic undo of the checked update at u when it is made
 * only of $inc of Lua numbers (the same $inc negated), as a table and as
 * its BSON, and returns 1; else 0 (nothing pushed). */
int
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

/* options.c: option tables passed from Lua.  Unknown keys, values of the
 * wrong type and values the driver cannot take are programming errors and
 * raise, with a message that names the option ("option 'tls' must be a
 * table, got string"); nothing here allocates before it has checked
 * everything, so raising never leaks. */
#include <stdio.h>
#include <string.h>

#include "mongotx.h"

/* Keys of the table at idx (an absolute index) must be strings in names;
 * `prefix` names the table they belong to ("write_concern."), or "". */
static void
check_keys(lua_State *L, int idx, const char *prefix, const char *const names[])
{
	int i;

	lua_pushnil(L);
	while (lua_next(L, idx)) {
		lua_pop(L, 1);
		if (lua_type(L, -1) != LUA_TSTRING)
			luaL_error(L, "mongotx: option names%s%s are strings, got %s",
				   *prefix ? " of " : "", prefix, luaL_typename(L, -1));
		for (i = 0; names[i]; i++)
			if (strcmp(lua_tostring(L, -1), names[i]) == 0)
				break;
		if (!names[i])
			luaL_error(L, "mongotx: unknown option '%s%s'", prefix,
				   lua_tostring(L, -1));
	}
}

void
mtx_check_options(lua_State *L, int idx, const char *const names[])
{
	if (lua_isnoneornil(L, idx))
		return;
	luaL_checktype(L, idx, LUA_TTABLE);
	check_keys(L, mtx_absindex(L, idx), "", names);
}

void
mtx_check_suboptions(lua_State *L, int idx, const char *name,
		     const char *const names[])
{
	char prefix[64];

	idx = mtx_absindex(L, idx);
	if (!lua_istable(L, idx))
		mtx_option_error(L, idx, name, "a table");
	snprintf(prefix, sizeof prefix, "%s.", name);
	check_keys(L, idx, prefix, names);
}

void
mtx_option_error(lua_State *L, int idx, const char *name, const char *expected)
{
	idx = mtx_absindex(L, idx);
	if (lua_type(L, idx) == LUA_TSTRING)
		luaL_error(L, "mongotx: option '%s' must be %s, got \"%s\"", name,
			   expected, lua_tostring(L, idx));
	if (lua_type(L, idx) == LUA_TNUMBER) {
		lua_pushvalue(L, idx); /* lua_tostring converts in place */
		luaL_error(L, "mongotx: option '%s' must be %s, got %s", name,
			   expected, lua_tostring(L, -1));
	}
	luaL_error(L, "mongotx: option '%s' must be %s, got %s", name, expected,
		   luaL_typename(L, idx));
}

/* A whole number from 0 to max, or -1 (NaN fails every comparison). */
static int64_t
whole_number(lua_State *L, int idx, lua_Number max)
{
	lua_Number n;

	if (lua_type(L, idx) != LUA_TNUMBER)
		return -1;
	n = lua_tonumber(L, idx);
	if (!(n >= 0 && n <= max) || n != (lua_Number)(int64_t)n)
		return -1;
	return (int64_t)n;
}

/* Pushes field `name` of the option table at idx (nil when there is no
 * table) and returns its Lua type. */
static int
get_option(lua_State *L, int idx, const char *name)
{
	if (lua_isnoneornil(L, idx)) {
		lua_pushnil(L);
		return LUA_TNIL;
	}
	lua_getfield(L, idx, name);
	return lua_type(L, -1);
}

void
mtx_opt_bool(lua_State *L, int idx, const char *name, bson_t *opts,
	     const char *bson_key)
{
	int t = get_option(L, idx, name);

	if (t != LUA_TNIL && t != LUA_TBOOLEAN)
		mtx_option_error(L, -1, name, "a boolean");
	if (t == LUA_TBOOLEAN)
		BSON_APPEND_BOOL(opts, bson_key, lua_toboolean(L, -1));
	lua_pop(L, 1);
}

void
mtx_opt_int(lua_State *L, int idx, const char *name, bson_t *opts,
	    const char *bson_key)
{
	int t = get_option(L, idx, name);
	int64_t n;

	if (t != LUA_TNIL && t != LUA_TNUMBER)
		mtx_option_error(L, -1, name, "a number");
	if (t == LUA_TNUMBER) {
		n = whole_number(L, -1, 9007199254740992.0); /* 2^53 */
		if (n < 0)
			mtx_option_error(L, -1, name, "a whole number >= 0");
		BSON_APPEND_INT64(opts, bson_key, n);
	}
	lua_pop(L, 1);
}

void
mtx_opt_doc(lua_State *L, int idx, const char *name, bson_t *opts,
	    const char *bson_key)
{
	int t = get_option(L, idx, name);
	bson_t *doc;

	if (t != LUA_TNIL && t != LUA_TTABLE)
		mtx_option_error(L, -1, name, "a table");
	if (t == LUA_TTABLE) {
		doc = strcmp(name, "sort") == 0 ? mtx_check_ordered(L, -1)
						: mtx_check_document(L, -1);
		BSON_APPEND_DOCUMENT(opts, bson_key, doc);
		lua_pop(L, 1); /* the scratch document */
	}
	lua_pop(L, 1);
}

/* A write concern table: { w = n | "majority" | tag, j = bool,
 * wtimeout = ms }.  Leaves the table's fields checked; returns 0 when idx
 * holds nil. */
static int
check_wc_table(lua_State *L, int idx, int *w, const char **wtag, int *j,
	       int64_t *wtimeout)
{
	static const char *const names[] = {"w", "j", "wtimeout", NULL};

	*w = MONGOC_WRITE_CONCERN_W_DEFAULT;
	*wtag = NULL;
	*j = -1;
	*wtimeout = -1;
	if (lua_isnil(L, idx))
		return 0;
	mtx_check_suboptions(L, idx, "write_concern", names);
	lua_getfield(L, idx, "w");
	if (lua_type(L, -1) == LUA_TNUMBER) {
		*w = (int)whole_number(L, -1, 2147483647.0);
		if (*w < 0)
			mtx_option_error(L, -1, "write_concern.w",
					 "a whole number >= 0 or a tag such as \"majority\"");
	} else if (lua_type(L, -1) == LUA_TSTRING && mtx_rawlen(L, -1) > 0)
		*wtag = lua_tostring(L, -1); /* kept alive by the table */
	else if (!lua_isnil(L, -1))
		mtx_option_error(L, -1, "write_concern.w",
				 "a whole number >= 0 or a tag such as \"majority\"");
	lua_pop(L, 1);
	lua_getfield(L, idx, "j");
	if (lua_isboolean(L, -1))
		*j = lua_toboolean(L, -1);
	else if (!lua_isnil(L, -1))
		mtx_option_error(L, -1, "write_concern.j", "a boolean");
	if (*j == 1 && *w == 0)
		luaL_error(L, "mongotx: option 'write_concern.j' cannot be true with w = 0");
	lua_pop(L, 1);
	lua_getfield(L, idx, "wtimeout");
	if (!lua_isnil(L, -1) &&
	    (*wtimeout = whole_number(L, -1, 2147483647.0)) < 0)
		mtx_option_error(L, -1, "write_concern.wtimeout",
				 "a whole number of milliseconds >= 0");
	lua_pop(L, 1);
	return 1;
}

mongoc_write_concern_t *
mtx_check_write_concern(lua_State *L, int idx)
{
	mongoc_write_concern_t *wc;
	int w, j;
	const char *wtag;
	int64_t wtimeout;

	if (!check_wc_table(L, mtx_absindex(L, idx), &w, &wtag, &j, &wtimeout))
		return NULL;
	wc = mongoc_write_concern_new();
	if (wtag && strcmp(wtag, "majority") == 0)
		mongoc_write_concern_set_w(wc, MONGOC_WRITE_CONCERN_W_MAJORITY);
	else if (wtag)
		mongoc_write_concern_set_wtag(wc, wtag);
	else if (w != MONGOC_WRITE_CONCERN_W_DEFAULT)
		mongoc_write_concern_set_w(wc, w);
	if (j >= 0)
		mongoc_write_concern_set_journal(wc, j);
	if (wtimeout >= 0)
		mongoc_write_concern_set_wtimeout_int64(wc, wtimeout);
	return wc;
}

/* Appends opts.write_concern (if any) as "writeConcern". */
void
mtx_opt_write_concern(lua_State *L, int idx, bson_t *opts)
{
	mongoc_write_concern_t *wc;

	get_option(L, idx, "write_concern");
	wc = mtx_check_write_concern(L, -1);
	lua_pop(L, 1);
	if (wc) {
		mongoc_write_concern_append(wc, opts);
		mongoc_write_concern_destroy(wc);
	}
}

/* A read preference mode: "primary" ... "nearest". */
mongoc_read_prefs_t *
mtx_check_read_prefs(lua_State *L, int idx)
{
	static const char *const modes[] = {"primary", "secondary",
		"primaryPreferred", "secondaryPreferred", "nearest", NULL};
	static const mongoc_read_mode_t values[] = {MONGOC_READ_PRIMARY,
		MONGOC_READ_SECONDARY, MONGOC_READ_PRIMARY_PREFERRED,
		MONGOC_READ_SECONDARY_PREFERRED, MONGOC_READ_NEAREST};

	int i;

	if (lua_isnoneornil(L, idx))
		return NULL;
	for (i = 0; lua_type(L, idx) == LUA_TSTRING && modes[i]; i++)
		if (strcmp(lua_tostring(L, idx), modes[i]) == 0)
			return mongoc_read_prefs_new(values[i]);
	mtx_option_error(L, idx, "read_preference", "\"primary\", \"secondary\", "
			 "\"primaryPreferred\", \"secondaryPreferred\" or \"nearest\"");
	return NULL;
}

/* Creates the read preference named by opts.read_preference, owned by a
 * guard pushed on the stack; NULL (and nothing pushed) when absent. */
mongoc_read_prefs_t *
mtx_opt_read_prefs(lua_State *L, int idx)
{
	void **slot;

	if (get_option(L, idx, "read_preference") == LUA_TNIL) {
		lua_pop(L, 1);
		return NULL;
	}
	if (lua_type(L, -1) != LUA_TSTRING)
		mtx_option_error(L, -1, "read_preference", "a string");
	slot = mtx_guard(L, (void (*)(void *))mongoc_read_prefs_destroy);
	*slot = mtx_check_read_prefs(L, -2);
	return (mongoc_read_prefs_t *)*slot;
}

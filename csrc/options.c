/* options.c: option tables passed from Lua.  Unknown keys and values of
 * the wrong type are programming errors and raise; nothing here allocates
 * before it has checked everything, so raising never leaks. */
#include <string.h>

#include "mongotx.h"

void
mtx_check_options(lua_State *L, int idx, const char *const names[])
{
	int i;

	if (lua_isnoneornil(L, idx))
		return;
	luaL_checktype(L, idx, LUA_TTABLE);
	lua_pushnil(L);
	while (lua_next(L, idx)) {
		lua_pop(L, 1);
		if (lua_type(L, -1) != LUA_TSTRING)
			luaL_argerror(L, idx, "option names are strings");
		for (i = 0; names[i]; i++)
			if (strcmp(lua_tostring(L, -1), names[i]) == 0)
				break;
		if (!names[i])
			luaL_error(L, "mongotx: unknown option '%s'", lua_tostring(L, -1));
	}
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

static void
option_type_error(lua_State *L, const char *name, const char *expected)
{
	luaL_error(L, "mongotx: option '%s' must be %s, got %s", name, expected,
		   luaL_typename(L, -1));
}

void
mtx_opt_bool(lua_State *L, int idx, const char *name, bson_t *opts,
	     const char *bson_key)
{
	int t = get_option(L, idx, name);

	if (t != LUA_TNIL && t != LUA_TBOOLEAN)
		option_type_error(L, name, "a boolean");
	if (t == LUA_TBOOLEAN)
		BSON_APPEND_BOOL(opts, bson_key, lua_toboolean(L, -1));
	lua_pop(L, 1);
}

void
mtx_opt_int(lua_State *L, int idx, const char *name, bson_t *opts,
	    const char *bson_key)
{
	int t = get_option(L, idx, name);
	lua_Number n;

	if (t != LUA_TNIL && t != LUA_TNUMBER)
		option_type_error(L, name, "a number");
	if (t == LUA_TNUMBER) {
		n = lua_tonumber(L, -1);
		if (n != (lua_Number)(int64_t)n || n < 0)
			option_type_error(L, name, "a non-negative integer");
		BSON_APPEND_INT64(opts, bson_key, (int64_t)n);
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
		option_type_error(L, name, "a table");
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
	if (!lua_istable(L, idx))
		option_type_error(L, "write_concern", "a table");
	mtx_check_options(L, idx, names);
	lua_getfield(L, idx, "w");
	if (lua_type(L, -1) == LUA_TNUMBER)
		*w = (int)lua_tointeger(L, -1);
	else if (lua_type(L, -1) == LUA_TSTRING)
		*wtag = lua_tostring(L, -1); /* kept alive by the table */
	else if (!lua_isnil(L, -1))
		option_type_error(L, "write_concern.w", "a number or a string");
	lua_pop(L, 1);
	lua_getfield(L, idx, "j");
	if (lua_isboolean(L, -1))
		*j = lua_toboolean(L, -1);
	else if (!lua_isnil(L, -1))
		option_type_error(L, "write_concern.j", "a boolean");
	lua_pop(L, 1);
	lua_getfield(L, idx, "wtimeout");
	if (lua_type(L, -1) == LUA_TNUMBER)
		*wtimeout = (int64_t)lua_tonumber(L, -1);
	else if (!lua_isnil(L, -1))
		option_type_error(L, "write_concern.wtimeout", "a number");
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

	if (lua_isnoneornil(L, idx))
		return NULL;
	return mongoc_read_prefs_new(values[luaL_checkoption(L, idx, NULL, modes)]);
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
		option_type_error(L, "read_preference", "a string");
	slot = mtx_guard(L, (void (*)(void *))mongoc_read_prefs_destroy);
	*slot = mtx_check_read_prefs(L, -2);
	return (mongoc_read_prefs_t *)*slot;
}

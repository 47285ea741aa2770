/* cursor.c: mongotx.Cursor over the documents of a query.  A cursor keeps
 * its collection (and so its client) alive, and sits in its client's list
 * so that closing the client destroys it first. */
#include "mongotx.h"

static mtx_cursor *
check_cursor(lua_State *L, int idx)
{
	return (mtx_cursor *)luaL_checkudata(L, idx, MTX_CURSOR_MT);
}

mtx_cursor *
mtx_new_cursor(lua_State *L, int parent_idx, mtx_client *owner)
{
	mtx_cursor *c;

	parent_idx = mtx_absindex(L, parent_idx);
	c = (mtx_cursor *)mtx_newuserdata(L, sizeof *c);
	c->cursor = NULL;
	c->owner = owner;
	c->prev = c->next = NULL;
	luaL_getmetatable(L, MTX_CURSOR_MT);
	lua_setmetatable(L, -2);
	lua_pushvalue(L, parent_idx);
	mtx_setparent(L, -2);
	return c;
}

void
mtx_cursor_attach(mtx_cursor *c, mongoc_cursor_t *cur)
{
	c->cursor = cur;
	c->next = c->owner->cursors;
	if (c->next)
		c->next->prev = c;
	c->owner->cursors = c;
}

void
mtx_cursor_release(mtx_cursor *c)
{
	if (!c->cursor)
		return;
	mongoc_cursor_destroy(c->cursor);
	c->cursor = NULL;
	if (c->prev)
		c->prev->next = c->next;
	else
		c->owner->cursors = c->next;
	if (c->next)
		c->next->prev = c->prev;
	c->prev = c->next = NULL;
}

static int
cursor_close(lua_State *L)
{
	mtx_cursor_release(check_cursor(L, 1));
	return 0;
}

/* cursor:next(): the next document, nil at the end, or nil, err. */
static int
cursor_next(lua_State *L)
{
	mtx_cursor *c = check_cursor(L, 1);
	const bson_t *doc;
	const bson_t *reply;
	bson_error_t err;

	if (!c->cursor)
		return luaL_error(L, "attempt to use a closed cursor");
	if (mongoc_cursor_next(c->cursor, &doc)) {
		mtx_push_document(L, doc);
		return 1;
	}
	if (mongoc_cursor_error_document(c->cursor, &err, &reply))
		return mtx_push_error(L, &err, reply);
	lua_pushnil(L);
	return 1;
}

static int
cursor_tostring(lua_State *L)
{
	mtx_cursor *c = check_cursor(L, 1);

	if (c->cursor)
		lua_pushfstring(L, "mongotx.Cursor (%p)", (void *)c);
	else
		lua_pushliteral(L, "mongotx.Cursor (closed)");
	return 1;
}

/***
 * The core's cursor handles.
 * @module mongotx.core
 */

/***
 * The next document.
 * @syntax doc, err = cursor:next()
 * @treturn ?table the document, or nil at the end
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage local doc = cursor:next()
 * @function Cursor:next
 */

/***
 * Releases the cursor.
 * @syntax cursor:close()
 * @usage cursor:close()
 * @function Cursor:close
 */

int
mtx_open_cursor(lua_State *L)
{
	static const luaL_Reg methods[] = {
		{"close", cursor_close},
		{"next", cursor_next},
		{NULL, NULL},
	};
	static const luaL_Reg meta[] = {
		{"__close", cursor_close},
		{"__gc", cursor_close},
		{"__tostring", cursor_tostring},
		{NULL, NULL},
	};

	luaL_newmetatable(L, MTX_CURSOR_MT);
	luaL_setfuncs(L, meta, 0);
	lua_newtable(L);
	luaL_setfuncs(L, methods, 0);
	lua_setfield(L, -2, "__index");
	lua_pop(L, 1);
	return 0;
}

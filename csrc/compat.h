/* compat.h: the few Lua C API differences between Lua 5.4 and LuaJIT 2.1
 * (Lua 5.1 API plus some 5.2 extensions).  Shims use a mtx_ prefix so they
 * never clash with names LuaJIT or lua-compat-5.3 may already define. */
#ifndef MONGOTX_COMPAT_H
#define MONGOTX_COMPAT_H

#include <lua.h>
#include <lauxlib.h>

#if LUA_VERSION_NUM >= 503
#define MTX_HAS_INTEGERS 1
#else
#define MTX_HAS_INTEGERS 0
#endif

#if LUA_VERSION_NUM >= 502
#define mtx_absindex(L, i) lua_absindex((L), (i))
#define mtx_rawlen(L, i) lua_rawlen((L), (i))
#else
#define mtx_absindex(L, i) \
	((i) > 0 || (i) <= LUA_REGISTRYINDEX ? (i) : lua_gettop(L) + (i) + 1)
#define mtx_rawlen(L, i) lua_objlen((L), (i))
#endif

#if LUA_VERSION_NUM >= 502
#define mtx_tolstring(L, i, len) luaL_tolstring((L), (i), (len))
#else
static inline const char *
mtx_tolstring(lua_State *L, int idx, size_t *len)
{
	idx = mtx_absindex(L, idx);
	if (!luaL_callmeta(L, idx, "__tostring")) {
		switch (lua_type(L, idx)) {
		case LUA_TNUMBER:
		case LUA_TSTRING:
			lua_pushvalue(L, idx);
			break;
		case LUA_TBOOLEAN:
			lua_pushstring(L, lua_toboolean(L, idx) ? "true" : "false");
			break;
		case LUA_TNIL:
			lua_pushliteral(L, "nil");
			break;
		default:
			lua_pushfstring(L, "%s: %p", luaL_typename(L, idx),
					lua_topointer(L, idx));
		}
	}
	return lua_tolstring(L, -1, len);
}
#endif

/* A userdata with room for one Lua value that keeps its parent alive.
 * LuaJIT stores it in the userdata's environment table instead. */
#if LUA_VERSION_NUM >= 504
#define mtx_newuserdata(L, size) lua_newuserdatauv((L), (size), 1)

static inline void
mtx_setparent(lua_State *L, int ud)
{
	lua_setiuservalue(L, ud, 1);
}
#else
#define mtx_newuserdata(L, size) lua_newuserdata((L), (size))

static inline void
mtx_setparent(lua_State *L, int ud)
{
	ud = mtx_absindex(L, ud);
	lua_createtable(L, 1, 0);
	lua_insert(L, -2);
	lua_rawseti(L, -2, 1);
	lua_setfenv(L, ud);
}
#endif

#endif

/* core.c: luaopen_mongotx_core, the only symbol the module exports. */
#define _GNU_SOURCE /* dladdr, RTLD_NODELETE */
#include <dlfcn.h>

#include "mongotx.h"

__attribute__((visibility("default"))) int luaopen_mongotx_core(lua_State *L);

/* Makes this module (and so libmongoc, whose only user it may be) stay
 * mapped until the process ends.  lua_close unloads the C modules it
 * loaded (the __gc of package's _CLIBS calls dlclose), but the pools of
 * client.c outlive every Lua state: their monitoring threads would wake
 * from a heartbeat wait in unmapped code and the process would die with
 * SIGSEGV after the state was closed (spec/42-exit_spec.lua).  Done here
 * rather than with -z nodelete so that any build (make, luarocks,
 * OpenResty) gets it.  A failure leaves the module as it was. */
static void
pin_module(void)
{
	Dl_info info;

	if (dladdr((void *)luaopen_mongotx_core, &info) && info.dli_fname)
		dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
}

int
luaopen_mongotx_core(lua_State *L)
{
	mongoc_init(); /* idempotent: libmongoc guards it with a once */
	pin_module();
	lua_newtable(L);
	lua_pushliteral(L, MONGOTX_VERSION);
	lua_setfield(L, -2, "_VERSION");
	lua_pushinteger(L, MTX_MAX_NAMESPACE);
	lua_setfield(L, -2, "MAX_NAMESPACE");
	lua_pushinteger(L, (lua_Integer)MTX_VERSION_BAND);
	lua_setfield(L, -2, "VERSION_BAND");
	lua_pushnumber(L, MTX_ROOM);
	lua_setfield(L, -2, "ROOM");
	lua_pushnumber(L, MTX_ROOM_FIELD);
	lua_setfield(L, -2, "ROOM_FIELD");
	mtx_open_scratch(L);
	mtx_open_error(L);
	mtx_open_bson(L);
	mtx_open_client(L);
	mtx_open_collection(L);
	mtx_open_cursor(L);
	mtx_open_ids(L);
	mtx_open_stored(L);
	mtx_open_checks(L);
	mtx_open_txn(L);
	mtx_open_fault(L);
	mtx_open_signals(L);
	return 1;
}

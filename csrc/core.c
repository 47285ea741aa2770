/* core.c: luaopen_mongotx_core, the only symbol the module exports. */
#include "mongotx.h"

__attribute__((visibility("default"))) int luaopen_mongotx_core(lua_State *L);

int
luaopen_mongotx_core(lua_State *L)
{
	mongoc_init(); /* idempotent: libmongoc guards it with a once */
	lua_newtable(L);
	lua_pushliteral(L, MONGOTX_VERSION);
	lua_setfield(L, -2, "_VERSION");
	mtx_open_scratch(L);
	mtx_open_error(L);
	mtx_open_bson(L);
	mtx_open_client(L);
	mtx_open_collection(L);
	mtx_open_cursor(L);
	mtx_open_ids(L);
	mtx_open_txn(L);
	mtx_open_fault(L);
	return 1;
}

/* txn.c: the two-phase-commit steps (placeholder until the engine lands). */
#include "mongotx.h"

int
mtx_open_txn(lua_State *L)
{
	(void)L;
	return 0;
}

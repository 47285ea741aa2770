/* scratch.c: C resources owned by Lua userdata for the length of one call,
 * so that raising from anywhere inside the call never leaks them. */
#include <stdint.h>

#include "mongotx.h"

#define MTX_SCRATCH_MT "mongotx.scratch"
#define MTX_GUARD_MT "mongotx.guard"

typedef struct {
	void *obj;
	void (*destroy)(void *);
} guard;

/* bson_t asks for 128-byte alignment, more than a userdata's: the
 * documents sit from the first aligned address inside a larger block,
 * after their count. */
static bson_t *
aligned(void *raw)
{
	return (bson_t *)(((uintptr_t)raw + sizeof(int) + 127) & ~(uintptr_t)127);
}

static int
scratch_gc(lua_State *L)
{
	void *raw = lua_touserdata(L, 1);
	bson_t *docs = aligned(raw);
	int k;

	for (k = 0; k < *(int *)raw; k++)
		bson_destroy(&docs[k]);
	return 0;
}

void
mtx_scratches(lua_State *L, int n, bson_t **out)
{
	void *raw = lua_newuserdata(L, sizeof(int) + 127 + (size_t)n * sizeof(bson_t));
	bson_t *docs = aligned(raw);
	int k;

	*(int *)raw = n;
	for (k = 0; k < n; k++) {
		bson_init(&docs[k]);
		out[k] = &docs[k];
	}
	luaL_getmetatable(L, MTX_SCRATCH_MT);
	lua_setmetatable(L, -2);
}

bson_t *
mtx_scratch(lua_State *L)
{
	bson_t *b;

	mtx_scratches(L, 1, &b);
	return b;
}

/* The registry key of the scratch document kept between calls. */
static const char kept_key = 0;

/* Setting up a scratch (a userdata with a finaliser, a bson_t, its buffer)
 * cost a batch about 3 000 instructions each, ten times a transfer, and
 * more when the garbage collector finalised it. */
bson_t *
mtx_scratch_take(lua_State *L)
{
	bson_t *b;

	lua_pushlightuserdata(L, (void *)&kept_key);
	lua_rawget(L, LUA_REGISTRYINDEX);
	if (lua_isnil(L, -1)) {
		lua_pop(L, 1);
		return mtx_scratch(L);
	}
	lua_pushlightuserdata(L, (void *)&kept_key);
	lua_pushnil(L);
	lua_rawset(L, LUA_REGISTRYINDEX);
	b = aligned(lua_touserdata(L, -1));
	bson_reinit(b);
	return b;
}

/* A document that grew beyond this is not kept: its buffer would stay. */
#define MTX_KEPT_MAX (64 * 1024)

void
mtx_scratch_give(lua_State *L, int idx)
{
	idx = mtx_absindex(L, idx);
	if (aligned(lua_touserdata(L, idx))->len > MTX_KEPT_MAX)
		return;
	lua_pushlightuserdata(L, (void *)&kept_key);
	lua_pushvalue(L, idx);
	lua_rawset(L, LUA_REGISTRYINDEX);
}

static int
guard_gc(lua_State *L)
{
	mtx_guard_free((void **)lua_touserdata(L, 1));
	return 0;
}

void **
mtx_guard(lua_State *L, void (*destroy)(void *))
{
	guard *g = (guard *)lua_newuserdata(L, sizeof *g);

	g->obj = NULL;
	g->destroy = destroy;
	luaL_getmetatable(L, MTX_GUARD_MT);
	lua_setmetatable(L, -2);
	return &g->obj;
}

void
mtx_guard_free(void **slot)
{
	guard *g = (guard *)slot; /* obj is the first member */

	if (g->obj) {
		g->destroy(g->obj);
		g->obj = NULL;
	}
}

int
mtx_open_scratch(lua_State *L)
{
	luaL_newmetatable(L, MTX_SCRATCH_MT);
	lua_pushcfunction(L, scratch_gc);
	lua_setfield(L, -2, "__gc");
	luaL_newmetatable(L, MTX_GUARD_MT);
	lua_pushcfunction(L, guard_gc);
	lua_setfield(L, -2, "__gc");
	lua_pop(L, 2);
	return 0;
}

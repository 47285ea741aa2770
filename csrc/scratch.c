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

/* The scratches the hot paths take and give back (mtx_scratches_take):
 * each holds MTX_POOL_DOCS documents; at most MTX_KEPT_N of them are kept
 * between calls, in a list under this registry key.  Setting up a
 * scratch (a userdata with a finaliser, a bson_t, its buffer) and
 * finalising it cost a step more than the rest of its own work, and
 * the scratches were a third of what a transfer left to the garbage
 * collector. */
static const char kept_key = 0;
#define MTX_POOL_DOCS 3
#define MTX_KEPT_N 4

/* Pushes the list of kept scratches (made on first use); returns its
 * index. */
static int
kept_list(lua_State *L)
{
	lua_pushlightuserdata(L, (void *)&kept_key);
	lua_rawget(L, LUA_REGISTRYINDEX);
	if (lua_isnil(L, -1)) {
		lua_pop(L, 1);
		lua_createtable(L, MTX_KEPT_N, 0);
		lua_pushlightuserdata(L, (void *)&kept_key);
		lua_pushvalue(L, -2);
		lua_rawset(L, LUA_REGISTRYINDEX);
	}
	return lua_gettop(L);
}

void
mtx_scratches_take(lua_State *L, int n, bson_t **out)
{
	bson_t *docs[MTX_POOL_DOCS], *d;
	int list = kept_list(L), kept = (int)mtx_rawlen(L, list), k;

	if (n > MTX_POOL_DOCS)
		luaL_error(L, "mongotx: %d scratch documents asked of a pool of %d", n,
			   MTX_POOL_DOCS);
	if (kept == 0) {
		lua_pop(L, 1);
		mtx_scratches(L, MTX_POOL_DOCS, docs);
		for (k = 0; k < n; k++)
			out[k] = docs[k];
		return;
	}
	lua_rawgeti(L, list, kept);
	lua_pushnil(L);
	lua_rawseti(L, list, kept);
	lua_remove(L, list);
	d = aligned(lua_touserdata(L, -1));
	for (k = 0; k < n; k++) {
		bson_reinit(&d[k]);
		out[k] = &d[k];
	}
}

bson_t *
mtx_scratch_take(lua_State *L)
{
	bson_t *b;

	mtx_scratches_take(L, 1, &b);
	return b;
}

/* A document that grew beyond this is not kept: its buffer would stay. */
#define MTX_KEPT_MAX (64 * 1024)

void
mtx_scratch_give(lua_State *L, int idx)
{
	void *raw;
	bson_t *d;
	int list, kept, k;

	idx = mtx_absindex(L, idx);
	raw = lua_touserdata(L, idx);
	if (*(int *)raw != MTX_POOL_DOCS)
		return; /* not one of the pool's */
	d = aligned(raw);
	for (k = 0; k < MTX_POOL_DOCS; k++)
		if (d[k].len > MTX_KEPT_MAX)
			return;
	list = kept_list(L);
	kept = (int)mtx_rawlen(L, list);
	for (k = 1; k <= kept && kept < MTX_KEPT_N; k++) {
		lua_rawgeti(L, list, k);
		if (lua_touserdata(L, -1) == raw)
			kept = MTX_KEPT_N; /* given already: kept once */
		lua_pop(L, 1);
	}
	if (kept < MTX_KEPT_N) {
		lua_pushvalue(L, idx);
		lua_rawseti(L, list, kept + 1);
	}
	lua_pop(L, 1);
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

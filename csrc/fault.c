/* fault.c: crash points for the torture suite (TESTING.md).
 *
 * Every write a protocol step makes passes a named point twice, "before"
 * and "after" the command.  Nothing happens unless the environment asks:
 *
 *   MONGOTX_FAULT=<point>:<when>:<n>   the nth time this process reaches
 *       <point> <when>, end it at once with _exit(MTX_FAULT_EXIT): no
 *       clean-up, no buffered output, like a kill -9 at that instant;
 *       <when> "drop": the nth write at <point> (the protocol steps'
 *       single updates and bulk writes) is not sent and fails as a
 *       network error does (transient), as if its reply were lost on the
 *       way: a test then sends the same write itself, later, as the copy
 *       still on its way;
 *   MONGOTX_FAULT_TRACE=<file>         append "<point> <when>" per point
 *       reached, so a test can list the points a scenario passes.
 *
 * core.fault(spec) sets the same thing from Lua (nil turns it off), for
 * tests that start no child process.  The environment is read once.
 *
 * core.refuse_now(true) makes this process's single writes (update,
 * findAndModify: of the collection handles and of the steps) whose filter
 * holds "$$NOW" fail without being sent, code 9, as DocumentDB (FerretDB
 * v2) refuses them unless documentdb.enableVariablesSupportForWriteCommands
 * is on, though it evaluates $$NOW in reads: the specs' stand-in for that
 * server.  The batched steps' bulk writes are not covered. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mongotx.h"

static struct {
	int loaded;
	char point[32], when[8];
	long target, seen;
	int trace_fd;
	int refuse_now;
} fault = {0, "", "", 0, 0, -1, 0};

/* Parses "<point>:<when>:<n>" into the crash target; 0 when malformed. */
static int
parse_spec(const char *spec)
{
	char point[32], when[8];
	long n;

	if (sscanf(spec, "%31[^:]:%7[^:]:%ld", point, when, &n) != 3 || n < 1 ||
	    (strcmp(when, "before") != 0 && strcmp(when, "after") != 0 &&
	     strcmp(when, "drop") != 0))
		return 0;
	memcpy(fault.point, point, sizeof point);
	memcpy(fault.when, when, sizeof when);
	fault.target = n;
	fault.seen = 0;
	return 1;
}

static void
load_env(void)
{
	const char *spec = getenv("MONGOTX_FAULT");
	const char *trace = getenv("MONGOTX_FAULT_TRACE");

	fault.loaded = 1;
	if (spec && *spec && !parse_spec(spec)) {
		fprintf(stderr, "mongotx: ignoring MONGOTX_FAULT=%s "
				"(want <point>:<before|after|drop>:<n>)\n", spec);
	}
	if (trace && *trace)
		fault.trace_fd = open(trace, O_WRONLY | O_CREAT | O_APPEND |
					  O_CLOEXEC, 0644);
}

void
mtx_fault(const char *point, const char *when)
{
	if (!fault.loaded)
		load_env();
	if (fault.trace_fd >= 0) {
		char line[64];
		int n = snprintf(line, sizeof line, "%s %s\n", point, when);

		if (n > 0 && write(fault.trace_fd, line, (size_t)n) < 0)
			fault.trace_fd = -1; /* tracing is best effort */
	}
	if (fault.target > 0 && strcmp(point, fault.point) == 0 &&
	    strcmp(when, fault.when) == 0 && ++fault.seen == fault.target) {
		static const char msg[] = "mongotx: fault injected, exiting\n";
		ssize_t r = write(STDERR_FILENO, msg, sizeof msg - 1);

		(void)r; /* exiting either way */
		_exit(MTX_FAULT_EXIT);
	}
}

int
mtx_fault_drops(const char *point, bson_error_t *err)
{
	if (!fault.loaded)
		load_env();
	if (fault.target <= 0 || strcmp(point, fault.point) != 0 ||
	    strcmp(fault.when, "drop") != 0 || ++fault.seen != fault.target)
		return 0;
	bson_set_error(err, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET,
		       "the reply was lost (core.fault drop at %s)", point);
	return 1;
}

/* Does what the iterator walks hold the string "$$NOW" at any depth? */
static int
holds_now(bson_iter_t *it)
{
	bson_iter_t child;

	while (bson_iter_next(it)) {
		if (BSON_ITER_HOLDS_UTF8(it) &&
		    strcmp(bson_iter_utf8(it, NULL), "$$NOW") == 0)
			return 1;
		if ((BSON_ITER_HOLDS_DOCUMENT(it) || BSON_ITER_HOLDS_ARRAY(it)) &&
		    bson_iter_recurse(it, &child) && holds_now(&child))
			return 1;
	}
	return 0;
}

int
mtx_fault_refuses(const bson_t *filter, bson_error_t *err)
{
	bson_iter_t it;

	if (!fault.refuse_now || !bson_iter_init(&it, filter) || !holds_now(&it))
		return 0;
	bson_set_error(err, MONGOC_ERROR_SERVER, 9,
		       "$$NOW is not supported in this context (core.refuse_now)");
	return 1;
}

/* core.refuse_now(on): see the top of this file. */
static int
l_refuse_now(lua_State *L)
{
	luaL_checktype(L, 1, LUA_TBOOLEAN);
	fault.refuse_now = lua_toboolean(L, 1);
	return 0;
}

/* core.fault("<point>:<when>:<n>" | nil): arm (or disarm) a crash point
 * from Lua; raises on a malformed spec. */
static int
l_fault(lua_State *L)
{
	lua_settop(L, 1);
	if (!fault.loaded)
		load_env();
	if (lua_isnil(L, 1)) {
		fault.target = 0;
		return 0;
	}
	luaL_argcheck(L, parse_spec(luaL_checkstring(L, 1)), 1,
		      "want \"<point>:<before|after|drop>:<n>\"");
	return 0;
}

/* core.crash_point(point, "before" | "after"): pass a named point from
 * Lua, for the modules whose writes are issued from Lua (mongotx.queue,
 * mongotx.ledger, ...), so the torture suite can crash them the same way. */
static int
l_crash_point(lua_State *L)
{
	const char *point = luaL_checkstring(L, 1);
	const char *when = luaL_checkstring(L, 2);

	luaL_argcheck(L, strlen(point) < sizeof fault.point, 1, "name too long");
	luaL_argcheck(L, strcmp(when, "before") == 0 || strcmp(when, "after") == 0,
		      2, "want \"before\" or \"after\"");
	mtx_fault(point, when);
	return 0;
}

int
mtx_open_fault(lua_State *L)
{
	lua_pushcfunction(L, l_fault);
	lua_setfield(L, -2, "fault");
	lua_pushcfunction(L, l_crash_point);
	lua_setfield(L, -2, "crash_point");
	lua_pushcfunction(L, l_refuse_now);
	lua_setfield(L, -2, "refuse_now");
	return 0;
}

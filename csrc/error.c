/* error.c: the error tables every runtime failure returns as nil, err.
 * Fields: code (a name: libmongoc's error domain, "server", "stream", ...),
 * server_code (the number libmongoc or the server gave, when not 0),
 * message, transient (a retry may succeed), reply (the server's reply).
 * The Lua layer's errors share the metatable, with codes of their own
 * ("invalid", "guard", ...): every code is a string. */
#include <string.h>

#include "mongotx.h"

static const char *
domain_name(uint32_t domain)
{
	switch (domain) {
	case MONGOC_ERROR_CLIENT: return "client";
	case MONGOC_ERROR_STREAM: return "stream";
	case MONGOC_ERROR_PROTOCOL: return "protocol";
	case MONGOC_ERROR_CURSOR: return "cursor";
	case MONGOC_ERROR_QUERY: return "query";
	case MONGOC_ERROR_INSERT: return "insert";
	case MONGOC_ERROR_SASL: return "auth";
	case MONGOC_ERROR_BSON: return "bson";
	case MONGOC_ERROR_NAMESPACE: return "namespace";
	case MONGOC_ERROR_COMMAND: return "command";
	case MONGOC_ERROR_COLLECTION: return "collection";
	case MONGOC_ERROR_SCRAM: return "auth";
	case MONGOC_ERROR_SERVER_SELECTION: return "server_selection";
	case MONGOC_ERROR_WRITE_CONCERN: return "write_concern";
	case MONGOC_ERROR_SERVER: return "server";
	case MONGOC_ERROR_TRANSACTION: return "transaction";
	default: return "driver";
	}
}

/* PostgreSQL's SQLSTATEs 40P01 (deadlock_detected) and 40001
 * (serialization_failure) as DocumentDB (FerretDB v2) passes them on, the
 * five characters packed six bits each (PostgreSQL's MAKE_SQLSTATE): the
 * server aborted this write so that another writer's could go on. */
#define PG_DEADLOCK_DETECTED 16908292
#define PG_SERIALIZATION_FAILURE 16777220

/* Network trouble, a write PostgreSQL aborted for another's sake (every
 * step is idempotent: trying it again is safe), or a server that says so
 * in its error labels. */
static int
is_transient(const bson_error_t *err, const bson_t *reply)
{
	bson_iter_t it, label;

	if (err->domain == MONGOC_ERROR_STREAM ||
	    err->domain == MONGOC_ERROR_SERVER_SELECTION)
		return 1;
	if (err->code == PG_DEADLOCK_DETECTED || err->code == PG_SERIALIZATION_FAILURE)
		return 1;
	if (!reply || !bson_iter_init_find(&it, reply, "errorLabels") ||
	    !BSON_ITER_HOLDS_ARRAY(&it) || !bson_iter_recurse(&it, &label))
		return 0;
	while (bson_iter_next(&label))
		if (BSON_ITER_HOLDS_UTF8(&label) &&
		    (strcmp(bson_iter_utf8(&label, NULL), "RetryableWriteError") == 0 ||
		     strcmp(bson_iter_utf8(&label, NULL), "TransientTransactionError") == 0))
			return 1;
	return 0;
}

static void
new_error_table(lua_State *L, const char *code, int server_code, const char *msg)
{
	lua_pushnil(L);
	lua_createtable(L, 0, 6);
	lua_pushstring(L, code);
	lua_setfield(L, -2, "code");
	if (server_code != 0) {
		lua_pushinteger(L, server_code);
		lua_setfield(L, -2, "server_code");
	}
	lua_pushstring(L, msg);
	lua_setfield(L, -2, "message");
	luaL_getmetatable(L, MTX_ERROR_MT);
	lua_setmetatable(L, -2);
}

int
mtx_push_error(lua_State *L, const bson_error_t *err, const bson_t *reply)
{
	new_error_table(L, domain_name(err->domain), (int)err->code, err->message);
	lua_pushboolean(L, is_transient(err, reply));
	lua_setfield(L, -2, "transient");
	if (reply && !bson_empty(reply)) {
		mtx_push_document(L, reply);
		lua_setfield(L, -2, "reply");
	}
	return 2;
}

int
mtx_push_error_msg(lua_State *L, const char *code, int server_code, const char *msg)
{
	new_error_table(L, code, server_code, msg);
	return 2;
}

/* "mongotx: <step> of <id>: <message> (<code>[ <server_code>])" */
static int
error_tostring(lua_State *L)
{
	luaL_Buffer b;

	luaL_checktype(L, 1, LUA_TTABLE);
	luaL_buffinit(L, &b);
	luaL_addstring(&b, "mongotx: ");
	lua_getfield(L, 1, "step");
	if (lua_isstring(L, -1)) {
		luaL_addvalue(&b);
		lua_getfield(L, 1, "id");
		if (!lua_isnil(L, -1)) {
			luaL_addstring(&b, " of ");
			mtx_tolstring(L, -1, NULL);
			luaL_addvalue(&b);
		}
		lua_pop(L, 1);
		luaL_addstring(&b, ": ");
	} else {
		lua_pop(L, 1);
	}
	lua_getfield(L, 1, "message");
	mtx_tolstring(L, -1, NULL);
	lua_remove(L, -2);
	luaL_addvalue(&b);
	/* " (server 11000)" with a server_code, " (guard)" without */
	lua_getfield(L, 1, "code");
	lua_getfield(L, 1, "server_code");
	if (lua_isstring(L, -1))
		lua_pushfstring(L, " (%s %s)",
				lua_isstring(L, -2) ? lua_tostring(L, -2) : "?",
				lua_tostring(L, -1));
	else
		lua_pushfstring(L, " (%s)", lua_isstring(L, -2) ? lua_tostring(L, -2) : "?");
	lua_remove(L, -2);
	lua_remove(L, -2);
	luaL_addvalue(&b);
	luaL_pushresult(&b);
	return 1;
}

/* error(t): gives a Lua-made error table the same metatable. */
static int
l_error(lua_State *L)
{
	luaL_checktype(L, 1, LUA_TTABLE);
	lua_settop(L, 1);
	luaL_getmetatable(L, MTX_ERROR_MT);
	lua_setmetatable(L, 1);
	return 1;
}

int
mtx_open_error(lua_State *L)
{
	luaL_newmetatable(L, MTX_ERROR_MT);
	lua_pushcfunction(L, error_tostring);
	lua_setfield(L, -2, "__tostring");
	lua_pop(L, 1);
	lua_pushcfunction(L, l_error);
	lua_setfield(L, -2, "error");
	return 0;
}

/* bulk.c: bulk writes, coll:bulk_write (registered by collection.c) and
 * mtx_bulk_execute, which the transaction steps share for their batched
 * writes.  Results are plain tables; failures are nil, err (error.c);
 * misuse raises. */
#include <string.h>

#include "mongotx.h"

static const char *const bulk_kinds[] = {"insert", "update_one",
	"update_many", "replace_one", "delete_one", "delete_many", NULL};

/* Adds request i (the table on top of the stack) to the bulk. */
static void
add_request(lua_State *L, mongoc_bulk_operation_t *bulk, int i)
{
	static const char *const names[] = {"doc", "filter", "op", "update",
		"upsert", NULL};
	int req = lua_gettop(L), kind;
	bson_t *filter = NULL, *doc = NULL, *opts;
	bson_error_t err;
	bool ok = true;

	if (!lua_istable(L, req))
		luaL_error(L, "mongotx: bulk request %d is not a table", i);
	mtx_check_options(L, req, names);
	lua_getfield(L, req, "op");
	kind = luaL_checkoption(L, -1, NULL, bulk_kinds);
	opts = mtx_scratch(L);
	mtx_opt_bool(L, req, "upsert", opts, "upsert");
	if (kind != 0) {
		lua_getfield(L, req, "filter");
		if (!lua_istable(L, -1))
			luaL_error(L, "mongotx: bulk request %d needs a filter", i);
		filter = mtx_check_document(L, -1);
	}
	if (kind == 0 || kind == 3) {
		lua_getfield(L, req, "doc");
		if (!lua_istable(L, -1))
			luaL_error(L, "mongotx: bulk request %d needs a doc", i);
		doc = kind == 0 ? mtx_check_insert(L, -1) : mtx_check_document(L, -1);
	} else if (kind == 1 || kind == 2) {
		lua_getfield(L, req, "update");
		if (!lua_istable(L, -1))
			luaL_error(L, "mongotx: bulk request %d needs an update", i);
		doc = mtx_check_document(L, -1);
	}
	switch (kind) {
	case 0:
		ok = mongoc_bulk_operation_insert_with_opts(bulk, doc, NULL, &err);
		break;
	case 1:
		ok = mongoc_bulk_operation_update_one_with_opts(bulk, filter, doc, opts, &err);
		break;
	case 2:
		ok = mongoc_bulk_operation_update_many_with_opts(bulk, filter, doc, opts, &err);
		break;
	case 3:
		ok = mongoc_bulk_operation_replace_one_with_opts(bulk, filter, doc, opts, &err);
		break;
	case 4:
		ok = mongoc_bulk_operation_remove_one_with_opts(bulk, filter, NULL, &err);
		break;
	case 5:
		ok = mongoc_bulk_operation_remove_many_with_opts(bulk, filter, NULL, &err);
		break;
	}
	if (!ok)
		luaL_error(L, "mongotx: bulk request %d: %s", i, err.message);
	lua_settop(L, req);
}

/* What a bulk reply says, read in one pass over its keys: a lookup per
 * key (five counts, two error arrays) scanned it seven times, about 7 000
 * instructions a bulk, a third of a single transfer's reply handling. */
typedef struct {
	int64_t inserted, matched, modified, deleted, upserted;
	/* non-empty arrays: writeErrors, writeConcernErrors, upserted */
	int write_errors, write_concern_errors, upserted_ids;
} bulk_reply;

static void
read_bulk_reply(const bson_t *reply, bulk_reply *r)
{
	static const char *const counts[] = {"nInserted", "nMatched",
		"nModified", "nRemoved", "nUpserted", NULL};
	int64_t *slots[5];
	bson_iter_t it, arr;
	const char *key;
	int i;

	memset(r, 0, sizeof *r);
	slots[0] = &r->inserted, slots[1] = &r->matched;
	slots[2] = &r->modified, slots[3] = &r->deleted;
	slots[4] = &r->upserted;
	if (!bson_iter_init(&it, reply))
		return;
	while (bson_iter_next(&it)) {
		key = bson_iter_key(&it);
		if (BSON_ITER_HOLDS_NUMBER(&it)) {
			for (i = 0; counts[i] && strcmp(key, counts[i]) != 0; i++)
				;
			if (counts[i])
				*slots[i] = bson_iter_as_int64(&it);
		} else if (BSON_ITER_HOLDS_ARRAY(&it) &&
			   bson_iter_recurse(&it, &arr) && bson_iter_next(&arr)) {
			if (strcmp(key, "writeErrors") == 0)
				r->write_errors = 1;
			else if (strcmp(key, "writeConcernErrors") == 0)
				r->write_concern_errors = 1;
			else if (strcmp(key, "upserted") == 0)
				r->upserted_ids = 1;
		}
	}
}

/* Pushes the item at index i of the items table at idx, made { ok = true }
 * when the table has none (MTX_BULK_FAILURES). */
static void
push_item(lua_State *L, int items, int i)
{
	lua_rawgeti(L, items, i);
	if (!lua_isnil(L, -1))
		return;
	lua_pop(L, 1);
	lua_createtable(L, 0, 3);
	lua_pushboolean(L, 1);
	lua_setfield(L, -2, "ok");
	lua_pushvalue(L, -1);
	lua_rawseti(L, items, i);
}

/* Per-request results: { ok = true [, upserted_id] } or { ok = false,
 * server_code, message } for a failed request (server_code as in error
 * tables: the server's number, 11000 for a duplicate key), { ok = false,
 * executed = false } for those an ordered bulk never reached.  With
 * MTX_BULK_FAILURES only the requests that failed or upserted have an
 * item (the steps' batches: a table per request was a tenth of a batched
 * transfer's allocations). */
static void
push_bulk_items(lua_State *L, const bson_t *reply, const bulk_reply *r, int n,
		int flags)
{
	bson_iter_t it, arr, fields;
	int i, items, first_error = n + 1, ordered = flags & MTX_BULK_ORDERED;

	lua_createtable(L, (flags & MTX_BULK_FAILURES) ? 0 : n, 0);
	items = lua_gettop(L);
	for (i = 1; i <= n && !(flags & MTX_BULK_FAILURES); i++) {
		lua_createtable(L, 0, 3);
		lua_pushboolean(L, 1);
		lua_setfield(L, -2, "ok");
		lua_rawseti(L, items, i);
	}
	if (r->write_errors && bson_iter_init_find(&it, reply, "writeErrors") &&
	    bson_iter_recurse(&it, &arr)) {
		while (bson_iter_next(&arr)) {
			if (!bson_iter_recurse(&arr, &fields) ||
			    !bson_iter_find(&fields, "index"))
				continue;
			i = (int)bson_iter_as_int64(&fields) + 1;
			if (i < 1 || i > n)
				continue;
			first_error = i < first_error ? i : first_error;
			push_item(L, items, i);
			lua_pushboolean(L, 0);
			lua_setfield(L, -2, "ok");
			bson_iter_recurse(&arr, &fields);
			if (bson_iter_find(&fields, "code")) {
				lua_pushinteger(L, (lua_Integer)bson_iter_as_int64(&fields));
				lua_setfield(L, -2, "server_code");
			}
			bson_iter_recurse(&arr, &fields);
			if (bson_iter_find(&fields, "errmsg") && BSON_ITER_HOLDS_UTF8(&fields)) {
				lua_pushstring(L, bson_iter_utf8(&fields, NULL));
				lua_setfield(L, -2, "message");
			}
			lua_pop(L, 1);
		}
	}
	if (r->upserted_ids && bson_iter_init_find(&it, reply, "upserted") &&
	    bson_iter_recurse(&it, &arr)) {
		while (bson_iter_next(&arr)) {
			if (!bson_iter_recurse(&arr, &fields) ||
			    !bson_iter_find(&fields, "index"))
				continue;
			i = (int)bson_iter_as_int64(&fields) + 1;
			bson_iter_recurse(&arr, &fields);
			if (i < 1 || i > n || !bson_iter_find(&fields, "_id"))
				continue;
			push_item(L, items, i);
			mtx_push_iter(L, &fields);
			lua_setfield(L, -2, "upserted_id");
			lua_pop(L, 1);
		}
	}
	for (i = first_error + 1; ordered && i <= n; i++) {
		push_item(L, items, i);
		lua_pushboolean(L, 0);
		lua_setfield(L, -2, "ok");
		lua_pushboolean(L, 0);
		lua_setfield(L, -2, "executed");
		lua_pop(L, 1);
	}
}

static void
push_count(lua_State *L, int64_t n, const char *field)
{
	lua_pushinteger(L, (lua_Integer)n);
	lua_setfield(L, -2, field);
}

/* coll:bulk_write(requests [, { ordered = true, write_concern }]), each
 * request a table { op = "insert", doc } | { op = "update_one" |
 * "update_many", filter, update, upsert } | { op = "replace_one", filter,
 * doc, upsert } | { op = "delete_one" | "delete_many", filter }.
 * Returns { ok, inserted, matched, modified, deleted, upserted, items };
 * write errors of single requests show in items and ok = false; a failure
 * of the whole command (network, write concern) is nil, err.  MongoDB
 * reports matched/modified for the whole batch only, not per request. */
int
mtx_collection_bulk_write(lua_State *L)
{
	static const char *const names[] = {"ordered", "write_concern", NULL};
	mtx_collection *c = mtx_check_collection(L, 1);
	mongoc_collection_t *coll = mtx_collection_handle(L, c);
	mongoc_bulk_operation_t *bulk;
	bson_t *opts;
	void **slot;
	int i, n, ordered;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	luaL_checktype(L, 2, LUA_TTABLE);
	mtx_check_options(L, 3, names);
	n = (int)mtx_rawlen(L, 2);
	luaL_argcheck(L, n > 0, 2, "an array of at least one request");
	opts = mtx_scratch(L);
	mtx_opt_bool(L, 3, "ordered", opts, "ordered");
	mtx_opt_write_concern(L, 3, opts);
	ordered = lua_isnoneornil(L, 3) ? 1
		  : (lua_getfield(L, 3, "ordered"), lua_isnil(L, -1) || lua_toboolean(L, -1));
	slot = mtx_guard(L, (void (*)(void *))mongoc_bulk_operation_destroy);
	bulk = (mongoc_bulk_operation_t *)(*slot =
		mongoc_collection_create_bulk_operation_with_opts(coll, opts));
	for (i = 1; i <= n; i++) {
		lua_rawgeti(L, 2, i);
		add_request(L, bulk, i);
		lua_pop(L, 1);
	}
	return mtx_bulk_execute(L, c->owner, bulk, NULL, n, ordered ? MTX_BULK_ORDERED : 0);
}

/* Executes bulk (n requests) between the crash points of `point` (none
 * when NULL), counts its statements as owner's writes, and pushes the
 * result table coll:bulk_write describes, or nil, err; returns the number
 * of values pushed.  The transaction steps share it for their batched
 * writes.  flags: MTX_BULK_ORDERED, MTX_BULK_FAILURES (mongotx.h).  (An
 * ordered bulk stops at a command that fails, and the commands after it
 * are not sent; their statements count all the same, as libmongoc does
 * not say how it cut the bulk into commands.) */
int
mtx_bulk_execute(lua_State *L, mtx_client *owner, mongoc_bulk_operation_t *bulk,
		 const char *point, int n, int flags)
{
	bson_t *reply = mtx_scratch(L);
	bson_error_t err;
	bulk_reply r;
	int64_t sent;
	bool ok;

	if (point)
		mtx_fault(point, "before");
	sent = mtx_commands_sent(owner);
	if (point && mtx_fault_drops(point, &err))
		return mtx_push_error(L, &err, NULL);
	ok = mongoc_bulk_operation_execute(bulk, reply, &err);
	mtx_count_writes(owner, sent, n);
	if (point)
		mtx_fault(point, "after");
	read_bulk_reply(reply, &r);
	if (!ok && (!r.write_errors || r.write_concern_errors))
		return mtx_push_error(L, &err, reply);
	lua_createtable(L, 0, 7);
	lua_pushboolean(L, !r.write_errors);
	lua_setfield(L, -2, "ok");
	push_count(L, r.inserted, "inserted");
	push_count(L, r.matched, "matched");
	push_count(L, r.modified, "modified");
	push_count(L, r.deleted, "deleted");
	push_count(L, r.upserted, "upserted");
	push_bulk_items(L, reply, &r, n, flags);
	lua_setfield(L, -2, "items");
	return 1;
}

/***
 * The core's bulk writes.
 * @module mongotx.core
 */

/***
 * Several writes in one command.
 * @syntax res, err = coll:bulk_write(requests [, { ordered = true, write_concern }])
 * @tparam table requests `{ op = "insert", doc }`, `{ op = "update_one" | "update_many", filter, update, upsert }`, `{ op = "replace_one", filter, doc, upsert }`, `{ op = "delete_one" | "delete_many", filter }`
 * @tparam[opt] table opts
 * @treturn table `{ ok, inserted, matched, modified, deleted, upserted, items }` (a request's error in `items[i]`)
 * @errors a failure of the whole command: nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage local r = assert(coll:bulk_write({ { op = "insert", doc = { _id = 1 } } }))
 * @function Collection:bulk_write
 */

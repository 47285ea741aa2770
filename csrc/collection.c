/* collection.c: mongotx.Collection and the operations the transaction
 * engine (and its users) need: insert, find, count, update, replace,
 * delete, findAndModify, indexes (bulk writes: bulk.c).  Results are plain
 * tables; failures are nil, err (error.c); misuse raises. */
#include <string.h>

#include "mongotx.h"

void
mtx_push_collection(lua_State *L, int client_idx, mtx_client *owner,
		    const char *db, const char *name)
{
	mtx_collection *c;

	client_idx = mtx_absindex(L, client_idx);
	c = (mtx_collection *)mtx_newuserdata(L, sizeof *c);
	c->coll = NULL;
	c->owner = owner;
	luaL_getmetatable(L, MTX_COLLECTION_MT);
	lua_setmetatable(L, -2);
	lua_pushvalue(L, client_idx);
	mtx_setparent(L, -2);
	c->coll = mongoc_client_get_collection(owner->client, db, name);
}

mtx_collection *
mtx_check_collection(lua_State *L, int idx)
{
	return (mtx_collection *)luaL_checkudata(L, idx, MTX_COLLECTION_MT);
}

mongoc_collection_t *
mtx_collection_handle(lua_State *L, mtx_collection *c)
{
	if (!c->coll)
		luaL_error(L, "attempt to use a closed collection");
	mtx_client_handle(L, c->owner); /* raises once the client is closed */
	return c->coll;
}

static mongoc_collection_t *
check_open(lua_State *L)
{
	return mtx_collection_handle(L, mtx_check_collection(L, 1));
}

/* The client whose counters a write of the collection at 1 adds to. */
static mtx_client *
owner(lua_State *L)
{
	return mtx_check_collection(L, 1)->owner;
}

/* mongoc_collection_destroy does not touch the client, so a collection
 * may outlive the close of its client. */
static int
collection_close(lua_State *L)
{
	mtx_collection *c = mtx_check_collection(L, 1);

	if (c->coll) {
		mongoc_collection_destroy(c->coll);
		c->coll = NULL;
	}
	return 0;
}

static int
collection_tostring(lua_State *L)
{
	mtx_collection *c = mtx_check_collection(L, 1);

	if (c->coll)
		lua_pushfstring(L, "mongotx.Collection (%s)",
				mongoc_collection_get_name(c->coll));
	else
		lua_pushliteral(L, "mongotx.Collection (closed)");
	return 1;
}

static int
collection_name(lua_State *L)
{
	lua_pushstring(L, mongoc_collection_get_name(check_open(L)));
	return 1;
}

/* Copies reply[bson_key] (a number) into the table on top as field. */
static void
copy_count(lua_State *L, const bson_t *reply, const char *bson_key,
	   const char *field)
{
	bson_iter_t it;

	if (bson_iter_init_find(&it, reply, bson_key) && BSON_ITER_HOLDS_NUMBER(&it))
		lua_pushinteger(L, (lua_Integer)bson_iter_as_int64(&it));
	else
		lua_pushinteger(L, 0);
	lua_setfield(L, -2, field);
}

static void
copy_value(lua_State *L, const bson_t *reply, const char *bson_key,
	   const char *field)
{
	bson_iter_t it;

	if (bson_iter_init_find(&it, reply, bson_key)) {
		mtx_push_iter(L, &it);
		lua_setfield(L, -2, field);
	}
}

static const char *const write_opts[] = {"write_concern", NULL};

/* coll:insert_one(doc [, { write_concern }]) -> { inserted_id } */
static int
collection_insert_one(lua_State *L)
{
	mongoc_collection_t *coll = check_open(L);
	bson_t *doc, *opts, *reply;
	bson_error_t err;
	int64_t sent = mtx_commands_sent(owner(L));
	int id;
	bool ok;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	mtx_check_options(L, 3, write_opts);
	doc = mtx_check_insert(L, 2);
	id = lua_gettop(L);
	opts = mtx_scratch(L);
	mtx_opt_write_concern(L, 3, opts);
	reply = mtx_scratch(L);
	ok = mongoc_collection_insert_one(coll, doc, opts, reply, &err);
	mtx_count_writes(owner(L), sent, 1);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	lua_createtable(L, 0, 1);
	lua_pushvalue(L, id);
	lua_setfield(L, -2, "inserted_id");
	return 1;
}

/* coll:insert_many(docs [, { ordered, write_concern }])
 *   -> { inserted = n, inserted_ids = { ... } } */
static int
collection_insert_many(lua_State *L)
{
	static const char *const names[] = {"ordered", "write_concern", NULL};
	mongoc_collection_t *coll = check_open(L);
	bson_t *opts, *reply;
	const bson_t **docs;
	bson_error_t err;
	size_t i, n;
	int64_t sent;
	int ids;
	bool ok;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	luaL_checktype(L, 2, LUA_TTABLE);
	mtx_check_options(L, 3, names);
	n = (size_t)mtx_rawlen(L, 2);
	luaL_argcheck(L, n > 0, 2, "an array of at least one document");
	docs = (const bson_t **)lua_newuserdata(L, n * sizeof *docs);
	lua_createtable(L, (int)n, 0);
	ids = lua_gettop(L);
	luaL_checkstack(L, (int)(2 * n) + 8, "too many documents");
	for (i = 0; i < n; i++) {
		lua_rawgeti(L, 2, (int)i + 1);
		if (!lua_istable(L, -1))
			return luaL_argerror(L, 2, "an array of documents");
		docs[i] = mtx_check_insert(L, -1); /* pushes doc, _id */
		lua_rawseti(L, ids, (int)i + 1);
		lua_remove(L, -2); /* the Lua document; the scratch stays */
	}
	opts = mtx_scratch(L);
	mtx_opt_bool(L, 3, "ordered", opts, "ordered");
	mtx_opt_write_concern(L, 3, opts);
	reply = mtx_scratch(L);
	sent = mtx_commands_sent(owner(L));
	ok = mongoc_collection_insert_many(coll, docs, n, opts, reply, &err);
	mtx_count_writes(owner(L), sent, (int64_t)n);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	lua_createtable(L, 0, 2);
	copy_count(L, reply, "insertedCount", "inserted");
	lua_pushvalue(L, ids);
	lua_setfield(L, -2, "inserted_ids");
	return 1;
}

static const char *const find_opts[] = {"batch_size", "limit", "projection",
	"read_preference", "skip", "sort", NULL};

/* Builds the find options and read preference from the table at idx. */
static bson_t *
check_find_opts(lua_State *L, int idx, mongoc_read_prefs_t **rp)
{
	bson_t *opts;

	mtx_check_options(L, idx, find_opts);
	opts = mtx_scratch(L);
	mtx_opt_doc(L, idx, "projection", opts, "projection");
	mtx_opt_doc(L, idx, "sort", opts, "sort");
	mtx_opt_int(L, idx, "limit", opts, "limit");
	mtx_opt_int(L, idx, "skip", opts, "skip");
	mtx_opt_int(L, idx, "batch_size", opts, "batchSize");
	*rp = mtx_opt_read_prefs(L, idx);
	return opts;
}

/* coll:find([filter [, { projection, sort, limit, skip, batch_size,
 * read_preference }]]) -> cursor */
static int
collection_find(lua_State *L)
{
	mongoc_collection_t *coll = check_open(L);
	mtx_collection *c = mtx_check_collection(L, 1);
	mongoc_read_prefs_t *rp;
	bson_t *filter, *opts;
	mtx_cursor *cur;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	if (lua_isnoneornil(L, 2)) {
		lua_settop(L, 3);
		lua_newtable(L);
		lua_replace(L, 2);
	}
	filter = mtx_check_document(L, 2);
	opts = check_find_opts(L, 3, &rp);
	cur = mtx_new_cursor(L, 1, c->owner);
	mtx_cursor_attach(cur, mongoc_collection_find_with_opts(coll, filter, opts, rp));
	return 1;
}

/* Drains the cursor on top of the stack into an array; leaves the array,
 * or nil, err, on top. */
static int
drain(lua_State *L)
{
	int cursor = lua_gettop(L), n = 0;

	lua_newtable(L);
	for (;;) {
		lua_getfield(L, cursor, "next");
		lua_pushvalue(L, cursor);
		lua_call(L, 1, 2);
		if (lua_isnil(L, -2)) {
			lua_getfield(L, cursor, "close");
			lua_pushvalue(L, cursor);
			lua_call(L, 1, 0);
			if (!lua_isnil(L, -1))
				return 2; /* nil, err */
			lua_pop(L, 2);
			return 1;
		}
		lua_pop(L, 1);
		lua_rawseti(L, cursor + 1, ++n);
	}
}

/* coll:find_all([filter [, opts]]) -> array of documents, or nil, err */
static int
collection_find_all(lua_State *L)
{
	collection_find(L);
	return drain(L);
}

/* coll:find_one([filter [, opts]]) -> document, nil, or nil, err */
static int
collection_find_one(lua_State *L)
{
	lua_settop(L, 3);
	if (lua_isnil(L, 3))
		lua_newtable(L);
	else
		lua_pushvalue(L, 3);
	mtx_check_options(L, 4, find_opts);
	/* a copy of the options with limit = 1 */
	lua_newtable(L);
	lua_pushnil(L);
	while (lua_next(L, 4)) {
		lua_pushvalue(L, -2);
		lua_insert(L, -2);
		lua_rawset(L, 5);
	}
	lua_pushinteger(L, 1);
	lua_setfield(L, 5, "limit");
	lua_replace(L, 3);
	lua_settop(L, 3);
	collection_find(L);
	if (drain(L) == 2)
		return 2;
	lua_rawgeti(L, -1, 1);
	return 1;
}

/* coll:count([filter [, { limit, skip, read_preference }]]) -> n */
static int
collection_count(lua_State *L)
{
	static const char *const names[] = {"limit", "read_preference", "skip",
		NULL};
	mongoc_collection_t *coll = check_open(L);
	mongoc_read_prefs_t *rp;
	bson_t *filter, *opts, *reply;
	bson_error_t err;
	int64_t n;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	if (lua_isnoneornil(L, 2)) {
		lua_settop(L, 3);
		lua_newtable(L);
		lua_replace(L, 2);
	}
	filter = mtx_check_document(L, 2);
	mtx_check_options(L, 3, names);
	opts = mtx_scratch(L);
	mtx_opt_int(L, 3, "limit", opts, "limit");
	mtx_opt_int(L, 3, "skip", opts, "skip");
	rp = mtx_opt_read_prefs(L, 3);
	reply = mtx_scratch(L);
	n = mongoc_collection_count_documents(coll, filter, opts, rp, reply, &err);
	if (n < 0)
		return mtx_push_error(L, &err, reply);
	lua_pushinteger(L, (lua_Integer)n);
	return 1;
}

typedef bool (*update_fn)(mongoc_collection_t *, const bson_t *,
			  const bson_t *, const bson_t *, bson_t *,
			  bson_error_t *);

/* The update family: (filter, update [, { upsert, write_concern }])
 *   -> { matched, modified, upserted_id } */
static int
do_update(lua_State *L, update_fn fn)
{
	static const char *const names[] = {"upsert", "write_concern", NULL};
	mongoc_collection_t *coll = check_open(L);
	bson_t *filter, *update, *opts, *reply;
	bson_error_t err;
	int64_t sent;
	bool ok;

	lua_settop(L, 4); /* absent optional arguments keep their slots */
	filter = mtx_check_document(L, 2);
	update = mtx_check_document(L, 3);
	mtx_check_options(L, 4, names);
	opts = mtx_scratch(L);
	mtx_opt_bool(L, 4, "upsert", opts, "upsert");
	mtx_opt_write_concern(L, 4, opts);
	reply = mtx_scratch(L);
	sent = mtx_commands_sent(owner(L));
	ok = !mtx_fault_refuses(filter, &err) && fn(coll, filter, update, opts, reply, &err);
	mtx_count_writes(owner(L), sent, 1);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	lua_createtable(L, 0, 3);
	copy_count(L, reply, "matchedCount", "matched");
	copy_count(L, reply, "modifiedCount", "modified");
	copy_value(L, reply, "upsertedId", "upserted_id");
	return 1;
}

static int
collection_update_one(lua_State *L)
{
	return do_update(L, mongoc_collection_update_one);
}

static int
collection_update_many(lua_State *L)
{
	return do_update(L, mongoc_collection_update_many);
}

static int
collection_replace_one(lua_State *L)
{
	return do_update(L, mongoc_collection_replace_one);
}

typedef bool (*delete_fn)(mongoc_collection_t *, const bson_t *,
			  const bson_t *, bson_t *, bson_error_t *);

/* (filter [, { write_concern }]) -> { deleted } */
static int
do_delete(lua_State *L, delete_fn fn)
{
	mongoc_collection_t *coll = check_open(L);
	bson_t *filter, *opts, *reply;
	bson_error_t err;
	int64_t sent;
	bool ok;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	filter = mtx_check_document(L, 2);
	mtx_check_options(L, 3, write_opts);
	opts = mtx_scratch(L);
	mtx_opt_write_concern(L, 3, opts);
	reply = mtx_scratch(L);
	sent = mtx_commands_sent(owner(L));
	ok = fn(coll, filter, opts, reply, &err);
	mtx_count_writes(owner(L), sent, 1);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	lua_createtable(L, 0, 1);
	copy_count(L, reply, "deletedCount", "deleted");
	return 1;
}

static int
collection_delete_one(lua_State *L)
{
	return do_delete(L, mongoc_collection_delete_one);
}

static int
collection_delete_many(lua_State *L)
{
	return do_delete(L, mongoc_collection_delete_many);
}

/* coll:find_and_modify(query, { update | remove, sort, fields, new,
 * upsert, write_concern })
 *   -> { value = doc or nil, n, updated_existing, upserted_id } */
static int
collection_find_and_modify(lua_State *L)
{
	static const char *const names[] = {"fields", "new", "remove", "sort",
		"update", "upsert", "write_concern", NULL};
	mongoc_collection_t *coll = check_open(L);
	bson_t *query, *extra, *reply, *doc;
	mongoc_find_and_modify_opts_t *fam;
	mongoc_find_and_modify_flags_t flags = MONGOC_FIND_AND_MODIFY_NONE;
	bson_error_t err;
	bson_iter_t it, sub;
	void **slot;
	int64_t sent;
	bool ok;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	query = mtx_check_document(L, 2);
	luaL_checktype(L, 3, LUA_TTABLE);
	mtx_check_options(L, 3, names);
	slot = mtx_guard(L, (void (*)(void *))mongoc_find_and_modify_opts_destroy);
	fam = (mongoc_find_and_modify_opts_t *)(*slot = mongoc_find_and_modify_opts_new());
	lua_getfield(L, 3, "update");
	lua_getfield(L, 3, "remove");
	if (lua_toboolean(L, -1) == !lua_isnil(L, -2))
		return luaL_argerror(L, 3, "exactly one of update and remove");
	if (!lua_isnil(L, -2))
		mongoc_find_and_modify_opts_set_update(fam, mtx_check_document(L, -2));
	else
		flags |= MONGOC_FIND_AND_MODIFY_REMOVE;
	lua_getfield(L, 3, "sort");
	if (!lua_isnil(L, -1))
		mongoc_find_and_modify_opts_set_sort(fam, mtx_check_ordered(L, -1));
	lua_getfield(L, 3, "fields");
	if (!lua_isnil(L, -1))
		mongoc_find_and_modify_opts_set_fields(fam, mtx_check_document(L, -1));
	lua_getfield(L, 3, "new");
	if (lua_toboolean(L, -1))
		flags |= MONGOC_FIND_AND_MODIFY_RETURN_NEW;
	lua_getfield(L, 3, "upsert");
	if (lua_toboolean(L, -1))
		flags |= MONGOC_FIND_AND_MODIFY_UPSERT;
	mongoc_find_and_modify_opts_set_flags(fam, flags);
	extra = mtx_scratch(L);
	mtx_opt_write_concern(L, 3, extra);
	mongoc_find_and_modify_opts_append(fam, extra);
	reply = mtx_scratch(L);
	sent = mtx_commands_sent(owner(L));
	ok = !mtx_fault_refuses(query, &err) &&
	     mongoc_collection_find_and_modify_with_opts(coll, query, fam, reply, &err);
	mtx_count_writes(owner(L), sent, 1);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	lua_createtable(L, 0, 4);
	if (bson_iter_init_find(&it, reply, "value") && BSON_ITER_HOLDS_DOCUMENT(&it)) {
		uint32_t len;
		const uint8_t *data;
		bson_t value;

		bson_iter_document(&it, &len, &data);
		if (bson_init_static(&value, data, len)) {
			mtx_push_document(L, &value);
			lua_setfield(L, -2, "value");
		}
	}
	if (bson_iter_init_find(&it, reply, "lastErrorObject") &&
	    BSON_ITER_HOLDS_DOCUMENT(&it) && bson_iter_recurse(&it, &sub)) {
		doc = mtx_scratch(L);
		while (bson_iter_next(&sub))
			bson_append_iter(doc, NULL, 0, &sub);
		lua_insert(L, -2);
		copy_count(L, doc, "n", "n");
		if (bson_iter_init_find(&it, doc, "updatedExisting"))
			lua_pushboolean(L, bson_iter_as_bool(&it));
		else
			lua_pushboolean(L, 0);
		lua_setfield(L, -2, "updated_existing");
		copy_value(L, doc, "upserted", "upserted_id");
	}
	return 1;
}

/* coll:create_index(keys [, { name, unique, sparse, expire_after }]):
 * true, or nil, err.  keys with several fields must be a mongotx.doc. */
static int
collection_create_index(lua_State *L)
{
	static const char *const names[] = {"expire_after", "name", "sparse",
		"unique", NULL};
	mongoc_collection_t *coll = check_open(L);
	bson_t *keys, *cmd, *reply, index, indexes;
	bson_error_t err;
	char *generated;

	lua_settop(L, 3); /* absent optional arguments keep their slots */
	keys = mtx_check_ordered(L, 2);
	mtx_check_options(L, 3, names);
	cmd = mtx_scratch(L);
	BSON_APPEND_UTF8(cmd, "createIndexes", mongoc_collection_get_name(coll));
	BSON_APPEND_ARRAY_BEGIN(cmd, "indexes", &indexes);
	BSON_APPEND_DOCUMENT_BEGIN(&indexes, "0", &index);
	BSON_APPEND_DOCUMENT(&index, "key", keys);
	if (!lua_isnoneornil(L, 3))
		lua_getfield(L, 3, "name");
	else
		lua_pushnil(L);
	if (lua_isnil(L, -1)) {
		generated = mongoc_collection_keys_to_index_string(keys);
		BSON_APPEND_UTF8(&index, "name", generated ? generated : "index");
		bson_free(generated);
	} else {
		BSON_APPEND_UTF8(&index, "name", luaL_checkstring(L, -1));
	}
	lua_pop(L, 1);
	mtx_opt_bool(L, 3, "unique", &index, "unique");
	mtx_opt_bool(L, 3, "sparse", &index, "sparse");
	mtx_opt_int(L, 3, "expire_after", &index, "expireAfterSeconds");
	bson_append_document_end(&indexes, &index);
	bson_append_array_end(cmd, &indexes);
	reply = mtx_scratch(L);
	if (!mongoc_collection_write_command_with_opts(coll, cmd, NULL, reply, &err))
		return mtx_push_error(L, &err, reply);
	lua_pushboolean(L, 1);
	return 1;
}

/* coll:drop(): true (also when the collection did not exist), or nil, err */
static int
collection_drop(lua_State *L)
{
	mongoc_collection_t *coll = check_open(L);
	bson_error_t err;

	if (!mongoc_collection_drop_with_opts(coll, NULL, &err) &&
	    err.code != 26 /* NamespaceNotFound */ &&
	    strstr(err.message, "ns not found") == NULL)
		return mtx_push_error(L, &err, NULL);
	lua_pushboolean(L, 1);
	return 1;
}

/***
 * The core's collection handles.
 * @module mongotx.core
 */

/***
 * Inserts a document.
 * @syntax res, err = coll:insert_one(doc [, { write_concern }])
 * @tparam table doc the document
 * @tparam[opt] table opts
 * @treturn table `{ inserted_id }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:insert_one({ _id = "A", balance = 100 }))
 * @function Collection:insert_one
 */

/***
 * Inserts documents.
 * @syntax res, err = coll:insert_many(docs [, { ordered, write_concern }])
 * @tparam table docs a list
 * @tparam[opt] table opts
 * @treturn table `{ inserted, inserted_ids }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:insert_many({ { _id = "A" }, { _id = "B" } }))
 * @function Collection:insert_many
 */

/***
 * A cursor over the matching documents.
 * @syntax cursor = coll:find([filter [, { projection, sort, limit, skip, batch_size, read_preference }]])
 * @tparam[opt] table filter the query
 * @tparam[opt] table opts (a `sort` of several keys must be a `core.doc`)
 * @treturn userdata the cursor
 * @errors raises on a bad option; errors of the read come from `cursor:next()`
 * @usage for doc in coll:find({}, { limit = 10 }).next do end
 * @function Collection:find
 */

/***
 * The matching documents as a list.
 * @syntax list, err = coll:find_all([filter [, opts]])
 * @tparam[opt] table filter
 * @tparam[opt] table opts as `find`
 * @treturn table the documents
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage local docs = assert(coll:find_all({ balance = { ["$gt"] = 0 } }, { limit = 100 }))
 * @function Collection:find_all
 */

/***
 * The first matching document.
 * @syntax doc, err = coll:find_one([filter [, opts]])
 * @tparam[opt] table filter
 * @tparam[opt] table opts as `find`
 * @treturn ?table the document, or nil
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage local a = coll:find_one({ _id = "A" })
 * @function Collection:find_one
 */

/***
 * Counts the matching documents.
 * @syntax n, err = coll:count([filter [, { limit, skip, read_preference }]])
 * @tparam[opt] table filter
 * @tparam[opt] table opts
 * @treturn integer the count
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage local n = assert(coll:count({}))
 * @function Collection:count
 */

/***
 * Updates the first matching document.
 * @syntax res, err = coll:update_one(filter, update [, { upsert, write_concern }])
 * @tparam table filter
 * @tparam table update update operators
 * @tparam[opt] table opts
 * @treturn table `{ matched, modified, upserted_id }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:update_one({ _id = "A" }, { ["$inc"] = { balance = 5 } }))
 * @function Collection:update_one
 */

/***
 * Updates every matching document.
 * @syntax res, err = coll:update_many(filter, update [, { upsert, write_concern }])
 * @tparam table filter
 * @tparam table update
 * @tparam[opt] table opts
 * @treturn table `{ matched, modified, upserted_id }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:update_many({}, { ["$set"] = { open = true } }))
 * @function Collection:update_many
 */

/***
 * Replaces the first matching document.
 * @syntax res, err = coll:replace_one(filter, doc [, { upsert, write_concern }])
 * @tparam table filter
 * @tparam table doc the new document
 * @tparam[opt] table opts
 * @treturn table `{ matched, modified, upserted_id }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:replace_one({ _id = "A" }, { balance = 0 }))
 * @function Collection:replace_one
 */

/***
 * Deletes the first matching document.
 * @syntax res, err = coll:delete_one(filter [, { write_concern }])
 * @tparam table filter
 * @tparam[opt] table opts
 * @treturn table `{ deleted }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:delete_one({ _id = "A" }))
 * @function Collection:delete_one
 */

/***
 * Deletes every matching document.
 * @syntax res, err = coll:delete_many(filter [, { write_concern }])
 * @tparam table filter
 * @tparam[opt] table opts
 * @treturn table `{ deleted }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:delete_many({}))
 * @function Collection:delete_many
 */

/***
 * Updates or removes one document and returns it, atomically.
 * @syntax res, err = coll:find_and_modify(query, { update | remove, sort, fields, new, upsert, write_concern })
 * @tparam table query
 * @tparam table opts
 * @treturn table `{ value, n, updated_existing, upserted_id }`
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage local r = assert(coll:find_and_modify({ _id = "A" }, { update = { ["$inc"] = { n = 1 } }, new = true }))
 * @function Collection:find_and_modify
 */

/***
 * Creates an index.
 * @syntax ok, err = coll:create_index(keys [, { name, unique, sparse, expire_after }])
 * @tparam table keys one field, or a `core.doc` of several
 * @tparam[opt] table opts
 * @treturn boolean true
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:create_index(core.doc("state", 1, "lastModified", 1)))
 * @function Collection:create_index
 */

/***
 * Drops the collection.
 * @syntax ok, err = coll:drop()
 * @treturn boolean true (also when it did not exist)
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage assert(coll:drop())
 * @function Collection:drop
 */

/***
 * The collection's name.
 * @syntax name = coll:name()
 * @treturn string
 * @usage print(coll:name())
 * @function Collection:name
 */

/***
 * Releases the handle.
 * @syntax coll:close()
 * @usage coll:close()
 * @function Collection:close
 */

int
mtx_open_collection(lua_State *L)
{
	static const luaL_Reg methods[] = {
		{"bulk_write", mtx_collection_bulk_write},
		{"close", collection_close},
		{"count", collection_count},
		{"create_index", collection_create_index},
		{"delete_many", collection_delete_many},
		{"delete_one", collection_delete_one},
		{"drop", collection_drop},
		{"find", collection_find},
		{"find_all", collection_find_all},
		{"find_and_modify", collection_find_and_modify},
		{"find_one", collection_find_one},
		{"insert_many", collection_insert_many},
		{"insert_one", collection_insert_one},
		{"name", collection_name},
		{"replace_one", collection_replace_one},
		{"update_many", collection_update_many},
		{"update_one", collection_update_one},
		{NULL, NULL},
	};
	static const luaL_Reg meta[] = {
		{"__close", collection_close},
		{"__gc", collection_close},
		{"__tostring", collection_tostring},
		{NULL, NULL},
	};

	luaL_newmetatable(L, MTX_COLLECTION_MT);
	luaL_setfuncs(L, meta, 0);
	lua_newtable(L);
	luaL_setfuncs(L, methods, 0);
	lua_setfield(L, -2, "__index");
	lua_pop(L, 1);
	return 0;
}

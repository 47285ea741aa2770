/* txn_state.c: the protocol's steps on the transaction document, one
 * function each: create (the transaction stored pending), claim (an owner
 * and its deadline, by epoch) and the transitions commit (to applied),
 * done, cancel (to canceling), cancelled and renew (a new deadline), most
 * with a _many for a batch.  What they share with the other steps is in
 * txn.c (txn.h). */
#include <string.h>

#include "txn.h"


/* Runs findAndModify(query, update) returning the new document, at crash
 * point `point`; pushes the document, or false when nothing matched, or
 * nil, err (returns the number of values pushed). */
static int
find_and_modify(lua_State *L, const char *point, mongoc_collection_t *coll,
		const bson_t *query, const bson_t *update, const bson_t *opts)
{
	mongoc_find_and_modify_opts_t *fam;
	bson_t *reply = mtx_scratch(L), value;
	bson_error_t err;
	bson_iter_t it;
	void **slot;
	uint32_t len;
	const uint8_t *data;
	int64_t sent;
	bool ok;

	slot = mtx_guard(L, (void (*)(void *))mongoc_find_and_modify_opts_destroy);
	fam = (mongoc_find_and_modify_opts_t *)(*slot = mongoc_find_and_modify_opts_new());
	mongoc_find_and_modify_opts_set_update(fam, update);
	mongoc_find_and_modify_opts_set_flags(fam, MONGOC_FIND_AND_MODIFY_RETURN_NEW);
	mongoc_find_and_modify_opts_append(fam, opts);
	sent = write_begin(L, point);
	ok = !mtx_fault_refuses(query, &err) &&
	     mongoc_collection_find_and_modify_with_opts(coll, query, fam, reply, &err);
	write_end(L, point, sent);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	if (bson_iter_init_find(&it, reply, "value") && BSON_ITER_HOLDS_DOCUMENT(&it)) {
		bson_iter_document(&it, &len, &data);
		if (bson_init_static(&value, data, len)) {
			mtx_push_document(L, &value);
			return 1;
		}
	}
	lua_pushboolean(L, 0);
	return 1;
}

/* The crash point of a move to state `to`, in the protocol's words. */
static const char *
transition_point(const char *to)
{
	if (strcmp(to, "applied") == 0)
		return "commit";
	if (strcmp(to, "canceling") == 0)
		return "cancel";
	if (strcmp(to, "pending") == 0)
		return "renew"; /* pending -> pending: an owner's new deadline */
	return to; /* done, cancelled */
}

/* The rest of a transition's filter ({state: from [, epoch]}, after the
 * caller's _id) and its update {$set: {state: to [, keys[i]: value + i]...},
 * $currentDate: {lastModified: true}}, and for a final state (done,
 * cancelled) $unset: {parked: ""}: parked says recovery gave up on an
 * unfinished transaction, which a finished one no longer is (its reason
 * stays).  epoch and value are stack indices (0 or nil: none); keys
 * (NULL: none) names the values at value, value + 1, ... (a nil one is
 * not set). */
static void
build_transition(lua_State *L, const char *from, const char *to, int epoch,
		 const char *const *keys, int value, bson_t *filter, bson_t *update)
{
	bson_t set, cd, unset;
	int i;

	BSON_APPEND_UTF8(filter, "state", from);
	if (epoch && !lua_isnil(L, epoch))
		mtx_append_value(L, epoch, filter, "epoch");
	bson_append_document_begin(update, "$set", 4, &set);
	BSON_APPEND_UTF8(&set, "state", to);
	for (i = 0; value && keys && keys[i]; i++)
		if (!lua_isnil(L, value + i))
			mtx_append_value(L, value + i, &set, keys[i]);
	bson_append_document_end(update, &set);
	bson_append_document_begin(update, "$currentDate", -1, &cd);
	BSON_APPEND_BOOL(&cd, "lastModified", true);
	bson_append_document_end(update, &cd);
	if (strcmp(to, "done") == 0 || strcmp(to, "cancelled") == 0) {
		bson_append_document_begin(update, "$unset", 6, &unset);
		BSON_APPEND_UTF8(&unset, "parked", "");
		bson_append_document_end(update, &unset);
	}
}

/* Moves the transaction (id at stack index 3, transactions collection
 * at 2) from `from` (at the epoch at stack index `epoch`, 0: any) to
 * `to`, also setting keys to the values from stack index `value` on (as
 * build_transition): findAndModify returning the new document, so the caller needs
 * no read to learn where it stands.  Pushes it, or false when the
 * transaction was not in `from` (at that epoch), or nil, err. */
static int
move(lua_State *L, const mtx_steps *s, const char *from, const char *to, int epoch,
     const char *const *keys, int value)
{
	mongoc_collection_t *coll = arg_collection(L, 2);
	bson_t *tid = check_tid(L, 3), *filter, *update;
	bson_iter_t it;

	scratch_pair(L, &filter, &update);
	bson_iter_init_find(&it, tid, "t");
	bson_append_iter(filter, "_id", 3, &it);
	build_transition(L, from, to, epoch, keys, value, filter, update);
	return find_and_modify(L, transition_point(to), coll, filter, update, s->wopts);
}

/* The same for many transactions (ids: a list at stack index 3) in one
 * update_many, also setting keys as move does; pushes { moved = <count> }. */
static int
move_many(lua_State *L, const mtx_steps *s, const char *from, const char *to, int epoch,
	  const char *const *keys, int value)
{
	mongoc_collection_t *coll = arg_collection(L, 2);
	bson_t *filter, *update, id;
	int64_t n = 0;
	int rc;

	luaL_checktype(L, 3, LUA_TTABLE);
	luaL_argcheck(L, mtx_rawlen(L, 3) > 0, 3, "at least one id");
	scratch_pair(L, &filter, &update);
	bson_append_document_begin(filter, "_id", 3, &id);
	mtx_append_value(L, 3, &id, "$in"); /* a sequence: an array */
	bson_append_document_end(filter, &id);
	build_transition(L, from, to, epoch, keys, value, filter, update);
	if ((rc = run_update(L, transition_point(to), coll, filter, update,
			     s->checked_wopts, 1, &n)))
		return rc;
	lua_createtable(L, 0, 1);
	lua_pushinteger(L, (lua_Integer)n);
	lua_setfield(L, -2, "moved");
	return 1;
}

/* The same for many transactions (ids at stack index 3) each at its own
 * epoch (a list as long at stack index `epochs`), in one bulk write of an
 * update_many per distinct epoch, {_id: {$in: <its ids>}, state: from,
 * epoch: e}, in the order first listed: one round trip, each found by
 * _id.  Recovery commits the ones it claimed from initial and from
 * pending (two epochs) so.  Pushes { moved = <count> }, or nil, err. */
static int
move_many_epochs(lua_State *L, const mtx_steps *s, const char *from, const char *to,
		 int epochs)
{
	mongoc_collection_t *coll = arg_collection(L, 2);
	mongoc_bulk_operation_t *bulk;
	bson_t *filter, *update, id, in;
	bson_error_t err;
	const char *key;
	char buf[16];
	int n = (int)mtx_rawlen(L, 3), i, k, m, groups = 0, first;

	luaL_argcheck(L, n > 0, 3, "at least one id");
	luaL_argcheck(L, (int)mtx_rawlen(L, epochs) == n, epochs, "an epoch for each id");
	bulk = new_bulk(L, coll, s->bopts);
	scratch_pair(L, &filter, &update);
	for (i = 1; i <= n; i++) {
		lua_rawgeti(L, epochs, i);
		for (k = 1, first = 1; k < i && first; k++) {
			lua_rawgeti(L, epochs, k);
			first = !lua_rawequal(L, -1, -2);
			lua_pop(L, 1);
		}
		if (first) {
			bson_reinit(filter);
			bson_reinit(update);
			bson_append_document_begin(filter, "_id", 3, &id);
			bson_append_array_begin(&id, "$in", 3, &in);
			for (k = i, m = 0; k <= n; k++) {
				lua_rawgeti(L, epochs, k);
				if (lua_rawequal(L, -1, -2)) {
					bson_uint32_to_string((uint32_t)m++, &key, buf, sizeof buf);
					lua_rawgeti(L, 3, k);
					mtx_append_value(L, -1, &in, key);
					lua_pop(L, 1);
				}
				lua_pop(L, 1);
			}
			bson_append_array_end(&id, &in);
			bson_append_document_end(filter, &id);
			build_transition(L, from, to, lua_gettop(L), NULL, 0, filter, update);
			check_added(L, mongoc_bulk_operation_update_many_with_opts(bulk, filter, update,
										   s->checked_req, &err),
				    ++groups, &err);
		}
		lua_pop(L, 1);
	}
	if (mtx_bulk_execute(L, step_owner(L), bulk, transition_point(to), groups,
			     MTX_BULK_FAILURES) != 1)
		return 2; /* nil, err */
	lua_getfield(L, -1, "matched");
	lua_createtable(L, 0, 1);
	lua_insert(L, -2);
	lua_setfield(L, -2, "moved");
	return 1;
}

/* steps:commit(txcoll, tid, epoch): pending -> applied, the commit point,
 * by the owner at that epoch. */
static int
l_commit(lua_State *L)
{
	mtx_steps *s = check_steps(L);

	lua_settop(L, 4);
	luaL_checkany(L, 4);
	return move(L, s, "pending", "applied", 4, NULL, 0);
}

/* steps:commit_many(txcoll, tids, epoch) -> { moved = <count> }; epoch:
 * every one's, or a list of each one's (move_many_epochs). */
static int
l_commit_many(lua_State *L)
{
	mtx_steps *s = check_steps(L);

	lua_settop(L, 4);
	luaL_checkany(L, 4);
	if (lua_istable(L, 4))
		return move_many_epochs(L, s, "pending", "applied", 4);
	return move_many(L, s, "pending", "applied", 4, NULL, 0);
}

/* steps:done(txcoll, tid): applied -> done, once every op is finished. */
static int
l_done(lua_State *L)
{
	lua_settop(L, 3);
	return move(L, check_steps(L), "applied", "done", 0, NULL, 0);
}

/* steps:done_many(txcoll, tids [, by]) -> { moved = <count> }; `by`, a
 * value unique to this call, is set as `doneBy`, so that the caller can
 * read which of them it moved when another moved some first. */
static int
l_done_many(lua_State *L)
{
	static const char *const done_fields[] = {"doneBy", NULL};

	lua_settop(L, 4);
	return move_many(L, check_steps(L), "applied", "done", 0, done_fields, 4);
}

/* What a cancel records: why in words (reason), as a code (cause) and,
 * for an op failure, which op (failedOp, its index). */
static const char *const cancel_fields[] = {"reason", "cause", "failedOp", NULL};

/* steps:cancel(txcoll, tid, epoch [, reason [, cause [, failedOp]]]):
 * pending -> canceling, by the owner at that epoch. */
static int
l_cancel(lua_State *L)
{
	mtx_steps *s = check_steps(L);

	lua_settop(L, 7);
	luaL_checkany(L, 4);
	return move(L, s, "pending", "canceling", 4, cancel_fields, 5);
}

/* steps:cancelled(txcoll, tid [, from [, epoch [, reason [, cause [, failedOp]]]]]):
 * canceling (or, with from = "initial", a transaction never started, at
 * that epoch) -> cancelled. */
static int
l_cancelled(lua_State *L)
{
	static const char *const froms[] = {"canceling", "initial", NULL};
	mtx_steps *s = check_steps(L);
	int from;

	lua_settop(L, 8);
	from = luaL_checkoption(L, 4, "canceling", froms);
	return move(L, s, froms[from], "cancelled", 5, cancel_fields, 6);
}

/* steps:cancelled_many(txcoll, tids) -> { moved = <count> }: canceling ->
 * cancelled for many transactions whose ops are all undone. */
static int
l_cancelled_many(lua_State *L)
{
	lua_settop(L, 3);
	return move_many(L, check_steps(L), "canceling", "cancelled", 0, NULL, 0);
}

/* steps:renew(txcoll, tid, epoch, deadline): pending -> pending with a new
 * deadline, by the owner at that epoch (an owner working past its
 * deadline renews it before it applies again). */
static int
l_renew(lua_State *L)
{
	static const char *const renew_fields[] = {"deadline", NULL};
	mtx_steps *s = check_steps(L);

	lua_settop(L, 5);
	luaL_checkany(L, 4);
	luaL_checkany(L, 5);
	return move(L, s, "pending", "pending", 4, renew_fields, 5);
}

/* The upsert that creates the transaction `doc` (stack index): filter
 * {_id: doc._id, state: {$exists: false}}, which never matches a
 * transaction (they all have a state), so an existing one is left
 * untouched and the upsert fails on its _id instead; update $setOnInsert
 * the rest of doc and $currentDate lastModified, so the time is the
 * server's.  Returns the crash point: compensate or create. */
static const char *
build_create(lua_State *L, int idx, bson_t *filter, bson_t *update)
{
	bson_t *doc = mtx_check_document(L, idx), sub;
	bson_iter_t it;

	luaL_argcheck(L, bson_iter_init_find(&it, doc, "_id"), idx, "needs an _id");
	bson_append_iter(filter, "_id", 3, &it);
	bson_append_document_begin(filter, "state", 5, &sub);
	BSON_APPEND_BOOL(&sub, "$exists", false);
	bson_append_document_end(filter, &sub);
	bson_append_document_begin(update, "$setOnInsert", -1, &sub);
	bson_iter_init(&it, doc);
	while (bson_iter_next(&it))
		if (strcmp(bson_iter_key(&it), "_id") != 0 &&
		    strcmp(bson_iter_key(&it), "lastModified") != 0) /* $currentDate's */
			bson_append_iter(&sub, NULL, 0, &it);
	bson_append_document_end(update, &sub);
	bson_append_document_begin(update, "$currentDate", -1, &sub);
	BSON_APPEND_BOOL(&sub, "lastModified", true);
	bson_append_document_end(update, &sub);
	return bson_has_field(doc, "compensates") ? "compensate" : "create";
}

/* steps:create(txcoll, doc) -> { created = bool }
 * build_create's upsert; repeating it fails on the _id and changes
 * nothing. */
static int
l_create(lua_State *L)
{
	mtx_steps *s = check_steps(L);
	mongoc_collection_t *coll = arg_collection(L, 2);
	bson_t *filter, *update, *opts, *reply;
	bson_iter_t it;
	bson_error_t err;
	const char *point;
	int64_t sent;
	bool ok;

	lua_settop(L, 3);
	luaL_checktype(L, 3, LUA_TTABLE);
	opts = step_opts(L, s);
	BSON_APPEND_BOOL(opts, "upsert", true);
	scratch_pair(L, &filter, &update);
	point = build_create(L, 3, filter, update);
	reply = mtx_scratch(L);
	sent = write_begin(L, point);
	ok = mongoc_collection_update_one(coll, filter, update, opts, reply, &err);
	write_end(L, point, sent);
	if (!ok) {
		/* two creators racing on one id: the loser sees a duplicate */
		if (err.code == 11000)
			return push_bool_result(L, "created", 0);
		return mtx_push_error(L, &err, reply);
	}
	return push_bool_result(L, "created",
				bson_iter_init_find(&it, reply, "upsertedId"));
}

/* steps:create_many(txcoll, docs [, common]) -> bulk result or nil, err
 * Inserts the transactions in one unordered bulk write: a duplicate key
 * (code 11000) in items[i] marks an id that exists already.  Unlike
 * create, the documents carry their own lastModified (an insert cannot
 * $currentDate; the caller uses the server's clock), because an insert
 * costs the server a third of an upsert.  common: the fields every
 * document of the batch shares (state, owner, lastModified, ...), encoded
 * once and appended to each document after its own fields. */
static int
l_create_many(lua_State *L)
{
	mtx_steps *s = check_steps(L);
	mongoc_collection_t *coll = arg_collection(L, 2);
	mongoc_bulk_operation_t *bulk;
	const bson_t *common = NULL;
	bson_error_t err;
	int i, n;

	lua_settop(L, 4);
	luaL_checktype(L, 3, LUA_TTABLE);
	if (!lua_isnil(L, 4))
		common = mtx_check_document(L, 4);
	n = (int)mtx_rawlen(L, 3);
	bulk = new_bulk(L, coll, batch_opts(L, s, n));
	for (i = 1; i <= n; i++) {
		int top = lua_gettop(L), item = batch_item(L, 3, i);
		bson_t *doc = mtx_check_document_reused(L, item);

		if (common && (!bson_concat(doc, common) || doc->len > MTX_MAX_BSON))
			luaL_error(L, "mongotx: transaction %d exceeds the 16 MiB limit", i);
		if (!bson_has_field(doc, "_id") || !bson_has_field(doc, "lastModified"))
			luaL_error(L, "mongotx: transaction %d needs an _id and lastModified", i);
		check_added(L, mongoc_bulk_operation_insert_with_opts(bulk, doc, s->checked_req,
								      &err),
			    i, &err);
		mtx_scratch_give(L, -1); /* the bulk holds a copy */
		lua_settop(L, top);
	}
	return mtx_bulk_execute(L, step_owner(L), bulk, "create", n, MTX_BULK_FAILURES);
}

/* A claim's filter {_id: tid, ...expect} and update {$set: set, $inc:
 * {epoch: 1, attempts: 1}, $currentDate: {lastModified: true}}; expect
 * and set are documents at those stack indices. */
static void
build_claim(lua_State *L, const bson_t *tid, int expect, int set, bson_t *query,
	    bson_t *update)
{
	bson_t sub;
	bson_iter_t it;

	bson_iter_init_find(&it, tid, "t");
	bson_append_iter(query, "_id", 3, &it);
	bson_iter_init(&it, mtx_check_document(L, expect));
	while (bson_iter_next(&it))
		bson_append_iter(query, NULL, 0, &it);
	BSON_APPEND_DOCUMENT(update, "$set", mtx_check_document(L, set));
	bson_append_document_begin(update, "$inc", 4, &sub);
	BSON_APPEND_INT32(&sub, "epoch", 1);
	BSON_APPEND_INT32(&sub, "attempts", 1);
	bson_append_document_end(update, &sub);
	bson_append_document_begin(update, "$currentDate", -1, &sub);
	BSON_APPEND_BOOL(&sub, "lastModified", true);
	bson_append_document_end(update, &sub);
}

/* steps:claim(txcoll, tid, expect, set) -> the claimed document or false
 * findAndModify of build_claim's query and update, returning the new
 * document.  expect carries what the claimer saw (state, epoch,
 * lastModified), so two claimers cannot both win. */
static int
l_claim(lua_State *L)
{
	mtx_steps *s = check_steps(L);
	mongoc_collection_t *coll = arg_collection(L, 2);
	bson_t *tid, *query, *update;

	lua_settop(L, 5);
	tid = check_tid(L, 3);
	scratch_pair(L, &query, &update);
	build_claim(L, tid, 4, 5, query, update);
	return find_and_modify(L, "claim", coll, query, update, s->wopts);
}

/* steps:claim_many(txcoll, items) -> bulk result or nil, err.
 * items[i] = { tid, expect, set }: claim's writes for many transactions in
 * one unordered bulk write.  MongoDB counts matches for the whole batch
 * only: when `matched` falls short, the caller reads which claims it won
 * (set names the claimer, and a won claim moved the epoch one on). */
static int
l_claim_many(lua_State *L)
{
	mtx_steps *s = check_steps(L);
	mongoc_collection_t *coll = arg_collection(L, 2);
	mongoc_bulk_operation_t *bulk;
	bson_t *tid, *query, *update, *docs[3];
	bson_error_t err;
	int i, n;

	lua_settop(L, 3);
	luaL_checktype(L, 3, LUA_TTABLE);
	n = (int)mtx_rawlen(L, 3);
	bulk = new_bulk(L, coll, batch_opts(L, s, n));
	mtx_scratches(L, 3, docs);
	tid = docs[0];
	query = docs[1];
	update = docs[2];
	for (i = 1; i <= n; i++) {
		int top = lua_gettop(L), item = batch_item(L, 3, i);

		item_tid(L, item, i, tid);
		lua_getfield(L, item, "expect");
		lua_getfield(L, item, "set");
		bson_reinit(query);
		bson_reinit(update);
		build_claim(L, tid, item + 1, item + 2, query, update);
		check_added(L, mongoc_bulk_operation_update_one_with_opts(bulk, query, update,
									  s->checked_req, &err),
			    i, &err);
		lua_settop(L, top);
	}
	return mtx_bulk_execute(L, step_owner(L), bulk, "claim", n, MTX_BULK_FAILURES);
}

const luaL_Reg mtx_txn_state_steps[] = {
	{"cancel", l_cancel},
	{"cancelled", l_cancelled},
	{"cancelled_many", l_cancelled_many},
	{"claim", l_claim},
	{"claim_many", l_claim_many},
	{"commit", l_commit},
	{"commit_many", l_commit_many},
	{"create", l_create},
	{"create_many", l_create_many},
	{"done", l_done},
	{"done_many", l_done_many},
	{"renew", l_renew},
	{NULL, NULL},
};

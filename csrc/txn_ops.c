/* txn_ops.c: the protocol's steps on a transaction's documents, one
 * function each (and a _many of each: one bulk write for a batch): apply
 * (an op's effect, its marker and the fences of txn.c's opening comment),
 * finish (the marker pulled once committed), undo (the effect reversed
 * once cancelled) and fence (an op's document touched by a new owner).
 * What they share with the other steps is in txn.c (txn.h). */
#include <string.h>

#include "txn.h"

static const char *const kinds[] = {"update", "insert", "remove", "assert",
	NULL};
enum { K_UPDATE, K_INSERT, K_REMOVE, K_ASSERT };

/* op[field], one of names (def when absent), as its index in names. */
static int
op_option(lua_State *L, int op, const char *field, const char *def,
	  const char *const names[])
{
	int k;

	lua_getfield(L, op, field);
	k = luaL_checkoption(L, -1, def, names);
	lua_pop(L, 1);
	return k;
}

static int
op_kind(lua_State *L, int op)
{
	return op_option(L, op, "kind", "update", kinds);
}

/* op.effect (see "Guards"); absent means the op may raise values. */
static int
op_effect(lua_State *L, int op)
{
	static const char *const effects[] = {"raises", "lowers", "escrow", NULL};

	return op_option(L, op, "effect", "raises", effects);
}

static int
op_floor(lua_State *L, int op)
{
	int floor;

	lua_getfield(L, op, "floor");
	floor = lua_toboolean(L, -1);
	lua_pop(L, 1);
	return floor;
}

/* Does the op's apply (or its undo) record the transaction in `held`? */
static int
op_holds(lua_State *L, int op, int kind)
{
	return (kind == K_UPDATE || kind == K_INSERT) && op_effect(L, op) == E_RAISES;
}

/* The array the op's apply, finish and undo push or pull the transaction
 * in with its marker: `held`, `escrow` (an escrowed credit) or none. */
static const char *
op_array(lua_State *L, int op, int kind, const fields *f)
{
	if (op_holds(L, op, kind))
		return f->held;
	if (kind == K_UPDATE && op_effect(L, op) == E_ESCROW)
		return f->escrow;
	return NULL;
}
/* The insert of op.doc carrying the marker [tid] (and `held` [tid]) and
 * version 1 (a scratch document left on the stack). */
static bson_t *
build_insert(lua_State *L, int op, const bson_t *tid, const fields *f)
{
	bson_t *doc, marker;
	bson_iter_t it;

	lua_getfield(L, op, "doc");
	doc = mtx_check_document(L, -1);
	bson_iter_init_find(&it, tid, "t");
	bson_append_array_begin(doc, f->marker, -1, &marker);
	bson_append_iter(&marker, "0", 1, &it);
	bson_append_array_end(doc, &marker);
	if (op_holds(L, op, K_INSERT)) {
		bson_append_array_begin(doc, f->held, -1, &marker);
		bson_append_iter(&marker, "0", 1, &it);
		bson_append_array_end(doc, &marker);
	}
	BSON_APPEND_INT32(doc, f->version, 1);
	return doc;
}

/* What the apply of an update/remove/assert op is made of.  kind, floor
 * and holds come from the op's table; its id, update and where from the
 * table too (op_parts_table: the update and where encoded, left on the
 * stack), or from the op as the transaction stores it (op_parts_stored:
 * the BSON core.stored_ops made, read where it lies). */
typedef struct {
	int kind, floor, holds, escrow;
	int id_idx;		      /* stack index of the id, 0: id_it */
	bson_iter_t id_it;
	const bson_t *update, *where; /* NULL: none */
	bson_t update_view, where_view; /* op_parts_stored's, for the above */
} op_parts;

static void
op_parts_flags(lua_State *L, int op, int kind, op_parts *p)
{
	p->kind = kind;
	p->floor = op_floor(L, op);
	p->holds = op_holds(L, op, kind);
	p->escrow = kind == K_UPDATE && op_effect(L, op) == E_ESCROW;
	p->update = p->where = NULL;
	p->id_idx = 0;
}

static void
op_parts_table(lua_State *L, int op, int kind, op_parts *p)
{
	op_parts_flags(L, op, kind, p);
	lua_getfield(L, op, "id");
	p->id_idx = lua_gettop(L);
	lua_getfield(L, op, "where");
	if (!lua_isnil(L, -1))
		p->where = mtx_check_document(L, -1);
	if (kind == K_UPDATE) {
		lua_getfield(L, op, "update");
		p->update = mtx_check_document(L, -1);
	}
}

/* The Binary holding BSON at it as a document view into *view. */
static const bson_t *
stored_part(lua_State *L, const bson_iter_t *it, bson_t *view)
{
	const uint8_t *data;
	uint32_t len;
	bson_subtype_t subtype;

	if (!BSON_ITER_HOLDS_BINARY(it))
		luaL_error(L, "mongotx: a stored %s is not a Binary", bson_iter_key(it));
	bson_iter_binary(it, &subtype, &len, &data);
	if (!bson_init_static(view, data, len))
		luaL_error(L, "mongotx: a stored %s is not BSON", bson_iter_key(it));
	return view;
}

/* op_parts from op i (1-based) of the stored array `ops`. */
static void
op_parts_stored(lua_State *L, int op, int kind, const bson_value_t *ops, int i,
		op_parts *p)
{
	bson_t arr;
	bson_iter_t it, fields_it;
	char buf[16];
	const char *key;

	op_parts_flags(L, op, kind, p);
	bson_uint32_to_string((uint32_t)(i - 1), &key, buf, sizeof buf);
	if (!bson_init_static(&arr, ops->value.v_doc.data, ops->value.v_doc.data_len) ||
	    !bson_iter_init_find(&it, &arr, key) || !BSON_ITER_HOLDS_DOCUMENT(&it) ||
	    !bson_iter_recurse(&it, &fields_it))
		luaL_error(L, "mongotx: no stored op %d", i);
	memset(&p->id_it, 0, sizeof p->id_it);
	while (bson_iter_next(&fields_it)) {
		const char *f = bson_iter_key(&fields_it);

		if (strcmp(f, "id") == 0)
			p->id_it = fields_it;
		else if (strcmp(f, "where") == 0)
			p->where = stored_part(L, &fields_it, &p->where_view);
		else if (strcmp(f, "update") == 0 && kind == K_UPDATE)
			p->update = stored_part(L, &fields_it, &p->update_view);
	}
	if (!p->id_it.raw || (kind == K_UPDATE && !p->update))
		luaL_error(L, "mongotx: stored op %d lacks its id or update", i);
}

/* How far a write of a takeover moves the version (the stack slot idx
 * true; csrc/txn.c, "Fencing"), else 1. */
static int64_t
version_step(lua_State *L, int idx)
{
	return lua_toboolean(L, idx) ? MTX_VERSION_BAND : 1;
}

/* The fence of an apply by the version its owner read (stack index
 * `version`): nil, the document had none: it still has none; false, none
 * read: no condition; a number v >= 0: the version still in v's band,
 * {$gte: v, $lt: (v / band + 1) * band}, which only a takeover's write
 * (or one after a write whose reply never came, mongotx.engine.bands)
 * leaves; anything else: equal to it. */
static void
append_version_fence(lua_State *L, int version, const fields *f, bson_t *filter)
{
	bson_t *read, range;
	bson_iter_t it;
	int64_t v;

	if (lua_isnil(L, version)) {
		bson_append_null(filter, f->version, -1);
		return;
	}
	if (lua_isboolean(L, version))
		return;
	read = mtx_scratch(L);
	mtx_append_value(L, version, read, "v");
	lua_pop(L, 1);
	bson_iter_init_find(&it, read, "v");
	v = bson_iter_as_int64(&it);
	if (!(BSON_ITER_HOLDS_INT32(&it) || BSON_ITER_HOLDS_INT64(&it) ||
	      (BSON_ITER_HOLDS_DOUBLE(&it) && bson_iter_double(&it) == (double)v)) ||
	    v < 0 || v > INT64_MAX - 2 * MTX_VERSION_BAND) {
		bson_append_iter(filter, f->version, -1, &it);
		return;
	}
	bson_append_document_begin(filter, f->version, -1, &range);
	BSON_APPEND_INT64(&range, "$gte", v);
	BSON_APPEND_INT64(&range, "$lt", (v / MTX_VERSION_BAND + 1) * MTX_VERSION_BAND);
	bson_append_document_end(filter, &range);
}

/* The apply of an update/remove/assert op: filter {_id, where...,
 * "held.0" absent (and "marker.0" for an exclusive op or a guard other
 * than a floor: "Isolation" in txn.h), marker: {$ne: tid}} fenced by the
 * version the owner read (stack index `version`, append_version_fence)
 * and, when `before` (deadline_condition) is given, by the server's
 * clock being before the deadline; update: op.update (update kind only;
 * an escrowed op's credits under `pending`) + $push marker + $inc version
 * by vinc (and the `held` array; see "Guards", like the condition a
 * guarded op adds). */
static void
build_apply(lua_State *L, const op_parts *p, const bson_t *tid, int version,
	    const bson_t *before, const fields *f, int64_t vinc, bson_t *filter,
	    bson_t *update)
{
	if (p->id_idx)
		mtx_append_value(L, p->id_idx, filter, "_id");
	else
		bson_append_iter(filter, "_id", 3, &p->id_it);
	append_conditions(L, p->where, before, p->escrow ? p->update : NULL, f, filter);
	/* Isolation (txn.h): no exclusive holder for anyone; no holder at
	 * all for an exclusive op or a guard other than a floor */
	if (p->holds || p->kind == K_REMOVE || (p->where && !p->floor))
		append_unheld(L, filter, f->marker);
	append_unheld(L, filter, f->held);
	append_marker_ne(filter, f, tid);
	bson_append_null(filter, f->removing, -1); /* absent: nobody removes it */
	append_version_fence(L, version, f, filter);
	merge_update(L, update, p->update, f, "$push", tid,
		     p->holds ? f->held : p->escrow ? f->escrow : NULL, p->escrow, vinc);
	if (p->kind == K_REMOVE)
		append_removing(update, "$set", f, tid);
}

/* steps:apply(coll, tid, op [, version|false [, deadline [, takeover]]])
 *   -> { applied = bool }
 * (takeover: the version moves by a band, version_step.)
 * update/remove/assert: update_one of build_apply's filter and update.
 * insert: insert_one of op.doc with the marker set; a duplicate key is
 * reported as applied = false. */
static int
l_apply(lua_State *L)
{
	mtx_steps *s = check_steps(L);
	mongoc_collection_t *coll = arg_collection(L, 2);
	const bson_t *opts = s->checked_wopts;
	bson_t *tid, *filter, *update, cond;
	op_parts parts;
	int64_t n = 0;
	int kind, rc;

	lua_settop(L, 7); /* absent optional arguments keep their slots */
	tid = check_tid(L, 3);
	luaL_checktype(L, 4, LUA_TTABLE);
	kind = op_kind(L, 4);
	if (kind == K_INSERT) {
		bson_t *doc = build_insert(L, 4, tid, &s->f), *reply = mtx_scratch(L);
		bson_error_t err;
		int64_t sent;
		bool ok;

		sent = write_begin(L, "apply");
		ok = mongoc_collection_insert_one(coll, doc, opts, reply, &err);
		write_end(L, "apply", sent);
		if (!ok) {
			if (err.code == 11000)
				return push_bool_result(L, "applied", 0);
			return mtx_push_error(L, &err, reply);
		}
		return push_bool_result(L, "applied", 1);
	}
	scratch_pair(L, &filter, &update);
	op_parts_table(L, 4, kind, &parts);
	build_apply(L, &parts, tid, 5, deadline_condition(L, lua_isnil(L, 6) ? 0 : 6, &cond),
		    &s->f, version_step(L, 7), filter, update);
	if ((rc = run_update(L, "apply", coll, filter, update, opts, 0, &n)))
		return rc;
	return push_bool_result(L, "applied", n);
}

/* A batch of ops of one collection: (steps, coll, items [, deadline]),
 * items[i] = { tid, op, ... } (apply_many, undo_many, fence_many), or
 * (steps, coll, transactions, name) for finish_many. */
typedef struct {
	mongoc_bulk_operation_t *bulk;
	bson_t *tid, *filter, *update; /* reused for every item */
	const bson_t *req;	       /* s->checked_req */
	fields f;
	int n;
} op_batch;

static void
op_batch_open(lua_State *L, op_batch *b)
{
	mtx_steps *s = check_steps(L);
	mongoc_collection_t *coll = arg_collection(L, 2);
	bson_t *docs[3];

	lua_settop(L, 4); /* apply_many's deadline, finish_many's name */
	luaL_checktype(L, 3, LUA_TTABLE);
	b->f = s->f;
	b->req = s->checked_req;
	b->n = (int)mtx_rawlen(L, 3);
	b->bulk = new_bulk(L, coll, batch_opts(L, s, b->n));
	mtx_scratches(L, 3, docs);
	b->tid = docs[0];
	b->filter = docs[1];
	b->update = docs[2];
}

/* Pushes item i and its op; loads its tid and empties filter and update.
 * Returns the op's stack index (the item is just below it). */
static int
op_batch_item(lua_State *L, op_batch *b, int i)
{
	int item = batch_item(L, 3, i);

	item_tid(L, item, i, b->tid);
	lua_getfield(L, item, "op");
	if (!lua_istable(L, -1))
		luaL_error(L, "mongotx: batch item %d has no op", i);
	bson_reinit(b->filter);
	bson_reinit(b->update);
	return lua_gettop(L);
}

/* The parts of the op of an apply_many item (at stack index item, its op
 * at op): from the stored ops when the item carries them (item.stored,
 * core.stored_ops's array, and item.i the op's index), else from the op's
 * table. */
static void
item_op_parts(lua_State *L, int item, int op, int kind, op_parts *p)
{
	mtx_value *stored;

	lua_getfield(L, item, "stored");
	stored = mtx_test_value(L, -1);
	if (stored && stored->v.value_type == BSON_TYPE_ARRAY) {
		lua_getfield(L, item, "i");
		op_parts_stored(L, op, kind, &stored->v, (int)luaL_checkinteger(L, -1), p);
		return; /* the value stays on the stack: p points into it */
	}
	op_parts_table(L, op, kind, p);
}

/* steps:apply_many(coll, items [, deadline]) -> bulk result (see
 * coll:bulk_write; as for every batch of the steps, its items list only
 * the requests that failed or upserted: MTX_BULK_FAILURES) or nil, err.
 * items[i] = { tid, op, version [, stored, i] [, takeover] }: apply's
 * writes for many
 * ops of one collection in one unordered bulk write, all fenced by the
 * same deadline (when given; its condition is built once); an op's id,
 * update and where
 * are read from `stored` (op i of the transaction's stored ops) when
 * given, rather than encoded from the op's tables again.  MongoDB counts
 * matches for the whole batch only: when `matched + inserted` falls
 * short, the caller reads which ops applied. */
static int
l_apply_many(lua_State *L)
{
	op_batch b;
	bson_error_t err;
	op_parts parts;
	bson_t cond;
	const bson_t *before;
	int i;

	op_batch_open(L, &b);
	before = deadline_condition(L, lua_isnil(L, 4) ? 0 : 4, &cond);
	for (i = 1; i <= b.n; i++) {
		int top = lua_gettop(L), op = op_batch_item(L, &b, i), kind = op_kind(L, op);
		bool ok;

		if (kind == K_INSERT) {
			ok = mongoc_bulk_operation_insert_with_opts(
				b.bulk, build_insert(L, op, b.tid, &b.f), b.req, &err);
		} else {
			int64_t vinc;

			lua_getfield(L, op - 1, "takeover");
			vinc = version_step(L, -1);
			lua_getfield(L, op - 1, "version");
			item_op_parts(L, op - 1, op, kind, &parts);
			build_apply(L, &parts, b.tid, op + 2, before, &b.f, vinc, b.filter,
				    b.update);
			ok = mongoc_bulk_operation_update_one_with_opts(
				b.bulk, b.filter, b.update, b.req, &err);
		}
		check_added(L, ok, i, &err);
		lua_settop(L, top);
	}
	return mtx_bulk_execute(L, step_owner(L), b.bulk, "apply", b.n, MTX_BULK_FAILURES);
}

/* The arguments finish, undo and fence share: (steps, coll, tid, op),
 * the op at OP_ARG; returns the collection. */
#define OP_ARG 4

static mongoc_collection_t *
op_step_args(lua_State *L, bson_t **tid, fields *f, bson_t **opts)
{
	mtx_steps *s = check_steps(L);
	mongoc_collection_t *coll = arg_collection(L, 2);

	lua_settop(L, OP_ARG);
	*tid = check_tid(L, 3);
	luaL_checktype(L, OP_ARG, LUA_TTABLE);
	*f = s->f;
	*opts = step_opts(L, s);
	return coll;
}

/* What an op's write is: an update_one, a delete_one of its filter, or an
 * update_one that upserts. */
enum { OP_UPDATE, OP_DELETE, OP_UPSERT };

/* The finish of op: filter {_id, marker: tid}; update $pull marker (and
 * `held` or `escrow`, op_array), $inc version and, for an escrowed op, its credits moved from
 * `pending` into their fields, or for an op with `settle` (a hold's
 * capture of part of it) settle's numbers added to them (append_settle),
 * all in one write: OP_UPDATE (a remove deletes the document: OP_DELETE). */
static int
build_finish(lua_State *L, int op, const bson_t *tid, const fields *f,
	     int64_t vinc, bson_t *filter, bson_t *update)
{
	int kind = op_kind(L, op), top = lua_gettop(L);
	const bson_t *settle = NULL, *credits = NULL;
	bson_t *inc;

	lua_getfield(L, op, "id");
	mtx_append_value(L, -1, filter, "_id");
	lua_pop(L, 1);
	append_marker_eq(filter, f, tid);
	if (kind == K_REMOVE)
		return OP_DELETE;
	if (kind == K_UPDATE) {
		lua_getfield(L, op, "settle");
		if (!lua_isnil(L, -1))
			settle = mtx_check_document(L, -1);
		if (op_effect(L, op) == E_ESCROW) {
			lua_getfield(L, op, "update");
			credits = mtx_check_document(L, -1);
		}
	}
	if (!settle && !credits) {
		lua_settop(L, top);
		merge_update(L, update, NULL, f, "$pull", tid, op_array(L, op, kind, f), 0, vinc);
		return OP_UPDATE;
	}
	inc = mtx_scratch(L);
	append_settle(L, inc, credits, settle, f);
	merge_update(L, update, inc, f, "$pull", tid, op_array(L, op, kind, f), 0, vinc);
	lua_settop(L, top);
	return OP_UPDATE;
}

/* Builds an op's write into filter and update (build_finish, build_undo,
 * build_fence); returns one of the enum above. */
typedef int (*op_builder)(lua_State *L, int op, const bson_t *tid, const fields *f,
			  int64_t vinc, bson_t *filter, bson_t *update);

/* The single-op steps (finish, undo, fence): steps:<point>(coll, tid, op
 * [, deadline]) runs the write `build` makes of op, its version moved by
 * vinc, and returns { [result] = whether it matched a document }.  With
 * `fenced` a deadline (a date, or nil) adds the apply's fence to the
 * filter: the server's clock before it (an owner giving back what a
 * pending transaction applied, which a new owner may drive forward once
 * the deadline passed). */
static int
op_step_run(lua_State *L, op_builder build, const char *point, const char *result,
	    int fenced, int64_t vinc)
{
	mongoc_collection_t *coll;
	bson_t *tid, *filter, *update, *opts, cond;
	const bson_t *before = NULL;
	fields f;
	int64_t n = 0;
	int how, rc;

	if (fenced && !lua_isnoneornil(L, OP_ARG + 1))
		before = deadline_condition(L, OP_ARG + 1, &cond);
	coll = op_step_args(L, &tid, &f, &opts);
	scratch_pair(L, &filter, &update);
	how = build(L, OP_ARG, tid, &f, vinc, filter, update);
	if (before)
		bson_concat(filter, before);
	if (how == OP_DELETE) {
		/* (a delete takes no validate option: libmongoc would send it on) */
		rc = run_delete(L, point, coll, filter, check_steps(L)->wopts, &n);
	} else {
		if (how == OP_UPSERT)
			BSON_APPEND_BOOL(opts, "upsert", true);
		rc = run_update(L, point, coll, filter, update, opts, 0, &n);
	}
	if (rc)
		return rc;
	return push_bool_result(L, result, n);
}

/* steps:finish(coll, tid, op) -> { finished = bool }
 * remove: delete_one {_id, marker: tid}; others: $pull marker and $inc
 * version where the marker is. */
static int
l_finish(lua_State *L)
{
	return op_step_run(L, build_finish, "finish", "finished", 0, 1);
}

/* Adds the write `build` makes of op (stack index) to b's bulk as its
 * request i; `req`: the options of an update that is not an upsert
 * (b->req when every update is built here, see "Built here"). */
static void
op_batch_add(lua_State *L, op_batch *b, op_builder build, int op, int i,
	     const bson_t *upsert, const bson_t *req, int64_t vinc)
{
	int how = build(L, op, b->tid, &b->f, vinc, b->filter, b->update);
	bson_error_t err;
	bool ok;

	if (how == OP_DELETE)
		ok = mongoc_bulk_operation_remove_one_with_opts(b->bulk, b->filter, NULL, &err);
	else
		ok = mongoc_bulk_operation_update_one_with_opts(
			b->bulk, b->filter, b->update, how == OP_UPSERT ? upsert : req, &err);
	check_added(L, ok, i, &err);
}

/* The writes `build` makes of a batch of ops of one collection (steps,
 * coll, items), in one unordered bulk write at crash point `point`; an
 * item's `takeover` moves its version by a band. */
static int
op_batch_run(lua_State *L, op_builder build, const char *point)
{
	op_batch b;
	bson_t *upsert;
	int i;

	op_batch_open(L, &b);
	upsert = mtx_scratch(L);
	BSON_APPEND_BOOL(upsert, "upsert", true);
	BSON_APPEND_BOOL(upsert, "validate", false);
	for (i = 1; i <= b.n; i++) {
		int top = lua_gettop(L), op = op_batch_item(L, &b, i);

		lua_getfield(L, op - 1, "takeover");
		op_batch_add(L, &b, build, op, i, upsert, b.req,
			     version_step(L, -1));
		lua_settop(L, top);
	}
	return mtx_bulk_execute(L, step_owner(L), b.bulk, point, b.n, MTX_BULK_FAILURES);
}

/* steps:finish_many(coll, list, name) -> bulk result or nil, err.
 * list[t] = a committed transaction { _id, ops [, mark] }: finish's writes for
 * every op of those transactions in collection `name` (the collection
 * coll), in one unordered bulk write, in the order of the list and of
 * each one's ops.  Read from the transactions themselves: no table per op
 * to make, and each transaction id encoded once. */
static int
l_finish_many(lua_State *L)
{
	op_batch b;
	const char *name;
	int t, n = 0;

	op_batch_open(L, &b);
	name = luaL_checkstring(L, 4);
	for (t = 1; t <= b.n; t++) {
		int top = lua_gettop(L), T = batch_item(L, 3, t), ops, k, nops;

		/* its mark (lua/mongotx/stored.lua): `mark`, else its _id */
		lua_getfield(L, T, "mark");
		if (lua_isnil(L, -1)) {
			lua_pop(L, 1);
			lua_getfield(L, T, "_id");
		}
		if (lua_isnil(L, -1))
			luaL_error(L, "mongotx: batch item %d has no _id", t);
		bson_reinit(b.tid);
		mtx_append_value(L, -1, b.tid, "t");
		lua_getfield(L, T, "ops");
		luaL_argcheck(L, lua_istable(L, -1), 3, "a transaction without ops");
		ops = lua_gettop(L);
		nops = (int)mtx_rawlen(L, ops);
		for (k = 1; k <= nops; k++) {
			int op = batch_item(L, ops, k);

			lua_getfield(L, op, "collection");
			if (lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), name) == 0) {
				bson_reinit(b.filter);
				bson_reinit(b.update);
				op_batch_add(L, &b, build_finish, op, ++n, NULL, b.req, 1);
			}
			lua_settop(L, ops);
		}
		lua_settop(L, top);
	}
	luaL_argcheck(L, n > 0, 4, "no op in this collection");
	return mtx_bulk_execute(L, step_owner(L), b.bulk, "finish", n, MTX_BULK_FAILURES);
}

/* The undo of op: filter {_id, marker: tid}; update op.undo (update
 * kind; an escrowed op's credits taken back from `pending`) + $pull
 * marker (and `held`) + $inc version, and $unset of
 * `removing` for a remove: OP_UPDATE; an insert's undo deletes the
 * document: OP_DELETE. */
static int
build_undo(lua_State *L, int op, const bson_t *tid, const fields *f,
	   int64_t vinc, bson_t *filter, bson_t *update)
{
	bson_t *undo = NULL;
	int kind = op_kind(L, op), top = lua_gettop(L);

	lua_getfield(L, op, "id");
	mtx_append_value(L, -1, filter, "_id");
	lua_pop(L, 1);
	append_marker_eq(filter, f, tid);
	if (kind == K_INSERT)
		return OP_DELETE;
	if (kind == K_UPDATE) {
		lua_getfield(L, op, "undo");
		undo = mtx_check_document(L, -1);
	}
	merge_update(L, update, undo, f, "$pull", tid, op_array(L, op, kind, f),
		     kind == K_UPDATE && op_effect(L, op) == E_ESCROW ? -1 : 0, vinc);
	if (kind == K_REMOVE)
		append_removing(update, "$unset", f, tid);
	lua_settop(L, top);
	return OP_UPDATE;
}

/* steps:undo(coll, tid, op [, deadline [, takeover]]) -> { undone = bool }
 * Only where the marker shows the op was applied: insert deletes the
 * document, update applies op.undo, all others just pull the marker;
 * with a deadline, only before it by the server's clock (a pending
 * transaction's owner giving a document back). */
static int
l_undo(lua_State *L)
{
	return op_step_run(L, build_undo, "undo", "undone", 1, version_step(L, OP_ARG + 2));
}

/* steps:undo_many(coll, items) -> bulk result or nil, err.
 * items[i] = { tid, op [, takeover] }: undo's writes for many ops of one collection in
 * one unordered bulk write (batched recovery of canceling transactions;
 * lua/mongotx/recovery.lua).  An op that was never applied matches
 * nothing, as with undo. */
static int
l_undo_many(lua_State *L)
{
	return op_batch_run(L, build_undo, "undo");
}

/* The fence of op: filter {_id, marker: {$ne: tid}}; update $inc version
 * by a band (a fence is a new owner's write, whatever vinc says),
 * and for an insert $setOnInsert of the placeholder field, upserted (a
 * late insert then fails on its _id): OP_UPSERT, else OP_UPDATE. */
static int
build_fence(lua_State *L, int op, const bson_t *tid, const fields *f,
	    int64_t vinc, bson_t *filter, bson_t *update)
{
	bson_t set;
	bson_iter_t it;

	(void)vinc;
	lua_getfield(L, op, "id");
	mtx_append_value(L, -1, filter, "_id");
	lua_pop(L, 1);
	append_marker_ne(filter, f, tid);
	if (op_kind(L, op) != K_INSERT) {
		merge_update(L, update, NULL, f, NULL, tid, NULL, 0, MTX_VERSION_BAND);
		return OP_UPDATE;
	}
	bson_append_document_begin(update, "$setOnInsert", -1, &set);
	bson_iter_init_find(&it, tid, "t");
	bson_append_iter(&set, f->placeholder, -1, &it);
	bson_append_document_end(update, &set);
	merge_update(L, update, NULL, f, NULL, tid, NULL, 0, MTX_VERSION_BAND);
	return OP_UPSERT;
}

/* steps:fence(coll, tid, op) -> { fenced = bool }
 * A new owner's write to a document the transaction has not applied yet:
 * $inc version where the marker is absent, so that an apply a former owner
 * prepared can no longer match.  For an insert, a placeholder document
 * {_id, version, txPlaceholder: tid} takes the id (prune removes it with
 * the cancelled transaction, after the retention period). */
static int
l_fence(lua_State *L)
{
	return op_step_run(L, build_fence, "fence", "fenced", 0, 1);
}

/* steps:fence_many(coll, items) -> bulk result or nil, err.
 * items[i] = { tid, op }: fence's writes for many ops of one collection
 * in one unordered bulk write; `matched + upserted` short of the items
 * means some document is missing or carries the marker again (a late
 * apply: the caller reads which and undoes it). */
static int
l_fence_many(lua_State *L)
{
	return op_batch_run(L, build_fence, "fence");
}

const luaL_Reg mtx_txn_op_steps[] = {
	{"apply", l_apply},
	{"apply_many", l_apply_many},
	{"fence", l_fence},
	{"fence_many", l_fence_many},
	{"finish", l_finish},
	{"finish_many", l_finish_many},
	{"undo", l_undo},
	{"undo_many", l_undo_many},
	{NULL, NULL},
};

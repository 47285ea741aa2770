/* txn.c: the steps of the two-phase-commit protocol, one function each.
 * Each issues exactly one write (one single-document write, or for the
 * _many steps one bulk write covering a batch) and reports what happened;
 * deciding what to do next is the Lua layer's job.
 *
 * Fencing: every write mongotx makes to a document also increments its
 * version field, and an apply is conditioned on the version the owner
 * read before it claimed the transaction (when it read one) and on the
 * owner's deadline by the server's clock (where the server evaluates
 * $$NOW).  A new owner touches (and so versions) every document of the
 * transaction before the transaction leaves `pending`, so a stalled
 * former owner that wakes up can never match its apply again, even after
 * the markers were pulled; and no one may claim a transaction before its
 * deadline passed (lua/mongotx/manager.lua), so an apply fenced by the
 * deadline cannot run after a takeover either, nor after a recovery by a
 * writer that knows nothing of versions but waits for the transaction to
 * be stale (README, "Other writers"). */
#include <string.h>
#include <time.h>

#include "mongotx.h"

/* The names a step needs (from the manager): the marker and version
 * fields; the field a remove op sets on its document while it is open,
 * so that no other transaction applies to a document on its way out (two
 * removes of one document must not both succeed); the array of the
 * open transactions whose effect on the document may have raised a value
 * (see "Guards" below); and the field of a fence's placeholder. */
typedef struct {
	const char *marker;
	const char *version;
	const char *removing;
	const char *held;
	const char *placeholder;
} fields;

/* Guards.  A guard (an op's where) must never pass on an effect that may
 * still be undone: a credit of a transaction that ends cancelled would
 * let a debit through that the undo then takes below its floor.  So:
 *
 * - a debit (an update that only lowers numbers with $inc, undone by an
 *   $inc back; op.effect "lowers") leaves only its marker: undoing it can
 *   only raise the value;
 * - any other effect (a credit, a $set, an insert, ...) also records the
 *   transaction in the `held` array until it is finished or undone.
 *
 * A floor guard (op.floor: only $gte/$gt of numbers) then applies only
 * where `held` is empty, since what is uncommitted there can only have
 * lowered values; any other guard only where no transaction holds the
 * document at all (its marker array is empty).  Effects take place at the
 * apply, as in the tutorial, so that a marker means "applied" to any
 * writer that follows the tutorial's recipe. */
enum { E_RAISES, E_LOWERS };

/* Checked here.  libmongoc validates every document a write sends
 * (bson_validate: no empty key, and for an insert, in some versions, no
 * `$` first or dot in a key; then every top-level key of an update an
 * operator), 5 000 instructions a request.  Everything the steps send is
 * either built below (operators, the manager's field names, which
 * core.steps checks once: not empty, UTF-8, no `$` first, no dot; state
 * names; ids that went through core.id_key) or the caller's content that
 * csrc/checks.c refused at begin if it held any such key (an update or
 * undo, an inserted doc, meta; spec/04 and spec/30 pin them).  A refusal
 * by libmongoc at this point would be worse than useless: it raises after
 * the transaction is stored, on every attempt, where the server's refusal
 * of a write is an op that failed and is handled.  So the writes go out
 * with validate: false (s->checked_wopts, s->checked_req); only the
 * findAndModify steps (claim, the single transition) keep s->wopts, as
 * that command takes no such option. */

/* A manager's steps (core.steps{...}): the field names and the write
 * options bound once, so that each step takes only what varies: (coll,
 * id, op [, version]) for the steps on documents, (txcoll, id, ...) for
 * those on the transaction.  Owned by the userdata; freed by __gc. */
typedef struct {
	fields f;      /* the names, copies owned by the object */
	bson_t *wopts; /* {writeConcern: ...}; NULL until set up */
	bson_t *bopts; /* wopts and ordered: false, for the batches */
	/* What libmongoc need not validate ("Checked here", below): wopts
	 * with validate: false, and a bulk request's {validate: false}. */
	bson_t *checked_wopts, *checked_req;
} mtx_steps;

#define MTX_STEPS_MT "mongotx.Steps"

static mtx_steps *
check_steps(lua_State *L)
{
	mtx_steps *s = (mtx_steps *)luaL_checkudata(L, 1, MTX_STEPS_MT);

	luaL_argcheck(L, s->wopts != NULL, 1, "steps not set up");
	return s;
}

/* A step's write options to add to (upsert): a copy of the bound ones.
 * A step that adds nothing passes s->checked_wopts itself, which libmongoc only
 * reads: the copy, a scratch document, was about 3 000 instructions. */
static bson_t *
step_opts(lua_State *L, const mtx_steps *s)
{
	bson_t *opts = mtx_scratch(L);

	bson_concat(opts, s->checked_wopts);
	return opts;
}

/* A step's filter and update (or query and update): two scratch documents
 * in one userdata. */
static void
scratch_pair(lua_State *L, bson_t **filter, bson_t **update)
{
	bson_t *docs[2];

	mtx_scratches(L, 2, docs);
	*filter = docs[0];
	*update = docs[1];
}

/* Appends {op: {removing: value}} ($set of the tid, or $unset). */
static void
append_removing(bson_t *update, const char *op, const fields *f,
		const bson_t *tid_holder)
{
	bson_t sub;
	bson_iter_t it;

	bson_append_document_begin(update, op, -1, &sub);
	bson_iter_init_find(&it, tid_holder, "t");
	bson_append_iter(&sub, f->removing, -1, &it);
	bson_append_document_end(update, &sub);
}

/* The fence of an apply by its owner's deadline (stack index, 0 for
 * none; a date): {$expr: {$lt: ["$$NOW", deadline]}} into cond, or NULL.
 * Made once for all the applies of a batch.  Built inside out and copied
 * up (no child document open: libbson moves a document with an open child
 * to the heap), its 50 bytes stay in each bson_t's own storage: nothing
 * to free, whatever raises later. */
static const bson_t *
deadline_condition(lua_State *L, int deadline, bson_t *cond)
{
	const mtx_value *d;
	bson_t expr, lt;

	if (!deadline)
		return NULL;
	d = mtx_test_value(L, deadline);
	luaL_argcheck(L, d && d->v.value_type == BSON_TYPE_DATE_TIME, deadline,
		      "a deadline is a date");
	bson_init(&lt);
	BSON_APPEND_UTF8(&lt, "0", "$$NOW");
	BSON_APPEND_DATE_TIME(&lt, "1", d->v.value.v_datetime);
	bson_init(&expr);
	BSON_APPEND_ARRAY(&expr, "$lt", &lt);
	bson_init(cond);
	BSON_APPEND_DOCUMENT(cond, "$expr", &expr);
	return cond;
}

/* Appends the conditions of where (NULL: none) to filter: flattened, or
 * with a deadline's condition (deadline_condition; NULL for none) $and:
 * [where, before], so that neither can shadow a key of the other. */
static void
append_conditions(const bson_t *where, const bson_t *before, bson_t *filter)
{
	bson_t and;
	bson_iter_t it;

	if (!before) {
		if (where && bson_iter_init(&it, where))
			while (bson_iter_next(&it))
				bson_append_iter(filter, NULL, 0, &it);
		return;
	}
	bson_append_array_begin(filter, "$and", 4, &and);
	if (where)
		BSON_APPEND_DOCUMENT(&and, "0", where);
	BSON_APPEND_DOCUMENT(&and, where ? "1" : "0", before);
	bson_append_array_end(filter, &and);
}

static void
append_marker_ne(bson_t *filter, const fields *f, const bson_t *tid_holder)
{
	bson_t ne;
	bson_iter_t it;

	bson_iter_init_find(&it, tid_holder, "t");
	bson_append_document_begin(filter, f->marker, -1, &ne);
	bson_append_iter(&ne, "$ne", 3, &it);
	bson_append_document_end(filter, &ne);
}

/* {"<array>.0": {$exists: false}}: the array (the marker, or `held`) is
 * empty or absent, so no open transaction's effect there can help the
 * guard (see "Guards").  The Lua layer finishes a holder that has
 * committed and waits for one that has not (manager.lua, _apply_one). */
static void
append_unheld(lua_State *L, bson_t *filter, const char *array)
{
	bson_t cond;

	lua_pushfstring(L, "%s.0", array);
	bson_append_document_begin(filter, lua_tostring(L, -1), -1, &cond);
	BSON_APPEND_BOOL(&cond, "$exists", false);
	bson_append_document_end(filter, &cond);
	lua_pop(L, 1);
}

static void
append_marker_eq(bson_t *filter, const fields *f, const bson_t *tid_holder)
{
	bson_iter_t it;

	bson_iter_init_find(&it, tid_holder, "t");
	bson_append_iter(filter, f->marker, -1, &it);
}

/* The transaction id at idx, wrapped as {t: id} so it can be appended
 * under any key.  The steps on documents (apply, finish, undo, fence)
 * take the transaction's mark there, what names it on a document across
 * transactions collections (lua/mongotx/stored.lua): its _id, or a
 * Binary naming its collection and _id. */
static bson_t *
check_tid(lua_State *L, int idx)
{
	bson_t *holder = mtx_scratch(L);

	luaL_argcheck(L, !lua_isnoneornil(L, idx), idx, "a transaction id");
	mtx_append_value(L, idx, holder, "t");
	return holder;
}

/* The same for item i of a batch, into holder (reused across items). */
static void
item_tid(lua_State *L, int item, int i, bson_t *holder)
{
	lua_getfield(L, item, "tid");
	if (lua_isnil(L, -1))
		luaL_error(L, "mongotx: batch item %d has no tid", i);
	bson_reinit(holder);
	mtx_append_value(L, -1, holder, "t");
	lua_pop(L, 1);
}

/* Copies the operators of update (may be NULL) into out, adding the
 * marker change (`$push` or `$pull` of the transaction id, or none; and
 * the same of `held` when `held`) and `$inc` of the version field. */
static void
merge_update(bson_t *out, const bson_t *update, const fields *f,
	     const char *marker_op, const bson_t *tid_holder, int held)
{
	bson_iter_t it, inner, tid;
	bson_t sub;
	int saw_inc = 0, saw_marker = 0;

	bson_iter_init_find(&tid, tid_holder, "t");
	if (update && bson_iter_init(&it, update)) {
		while (bson_iter_next(&it)) {
			const char *op = bson_iter_key(&it);
			int is_inc = strcmp(op, "$inc") == 0;
			int is_marker = marker_op && strcmp(op, marker_op) == 0;

			if (!is_inc && !is_marker) {
				bson_append_iter(out, NULL, 0, &it);
				continue;
			}
			bson_append_document_begin(out, op, -1, &sub);
			if (bson_iter_recurse(&it, &inner))
				while (bson_iter_next(&inner))
					bson_append_iter(&sub, NULL, 0, &inner);
			if (is_inc) {
				BSON_APPEND_INT32(&sub, f->version, 1);
				saw_inc = 1;
			}
			if (is_marker) {
				bson_append_iter(&sub, f->marker, -1, &tid);
				if (held)
					bson_append_iter(&sub, f->held, -1, &tid);
				saw_marker = 1;
			}
			bson_append_document_end(out, &sub);
		}
	}
	if (!saw_inc) {
		bson_append_document_begin(out, "$inc", 4, &sub);
		BSON_APPEND_INT32(&sub, f->version, 1);
		bson_append_document_end(out, &sub);
	}
	if (marker_op && !saw_marker) {
		bson_append_document_begin(out, marker_op, -1, &sub);
		bson_append_iter(&sub, f->marker, -1, &tid);
		if (held)
			bson_append_iter(&sub, f->held, -1, &tid);
		bson_append_document_end(out, &sub);
	}
}

static mongoc_collection_t *
arg_collection(lua_State *L, int idx)
{
	return mtx_collection_handle(L, mtx_check_collection(L, idx));
}

/* The client whose counters a step's writes add to: every step takes
 * the collection it writes to second (steps, coll, ...). */
static mtx_client *
step_owner(lua_State *L)
{
	return mtx_check_collection(L, 2)->owner;
}

/* Around each single write of a step: its crash points (fault.c) and
 * the count of its statement (client:counters). */
static int64_t
write_begin(lua_State *L, const char *point)
{
	mtx_fault(point, "before");
	return mtx_commands_sent(step_owner(L));
}

static void
write_end(lua_State *L, const char *point, int64_t since)
{
	mtx_count_writes(step_owner(L), since, 1);
	mtx_fault(point, "after");
}

/* Runs an update_one (update_many if `many`) at crash point `point`
 * (fault.c); sets *matched (an upsert counts as one), or
 * pushes nil, err and returns 2 (0 on success). */
static int
run_update(lua_State *L, const char *point, mongoc_collection_t *coll,
	   const bson_t *filter, const bson_t *update, const bson_t *opts,
	   int many, int64_t *matched)
{
	bson_t *reply = mtx_scratch(L);
	bson_error_t err;
	bson_iter_t it;
	int64_t sent;
	bool ok;

	sent = write_begin(L, point);
	ok = many ? mongoc_collection_update_many(coll, filter, update, opts, reply, &err)
		     : mongoc_collection_update_one(coll, filter, update, opts, reply, &err);
	write_end(L, point, sent);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	*matched = bson_iter_init_find(&it, reply, "matchedCount")
			   ? bson_iter_as_int64(&it) : 0;
	if (bson_iter_init_find(&it, reply, "upsertedId"))
		(*matched)++; /* fence's placeholder: written, so it counts */
	return 0;
}

static int
run_delete(lua_State *L, const char *point, mongoc_collection_t *coll,
	   const bson_t *filter, const bson_t *opts, int64_t *deleted)
{
	bson_t *reply = mtx_scratch(L);
	bson_error_t err;
	bson_iter_t it;
	int64_t sent;
	bool ok;

	sent = write_begin(L, point);
	ok = mongoc_collection_delete_one(coll, filter, opts, reply, &err);
	write_end(L, point, sent);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	*deleted = bson_iter_init_find(&it, reply, "deletedCount")
			   ? bson_iter_as_int64(&it) : 0;
	return 0;
}

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
	static const char *const effects[] = {"raises", "lowers", NULL};

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

static int
push_bool_result(lua_State *L, const char *field, int64_t n)
{
	lua_createtable(L, 0, 1);
	lua_pushboolean(L, n > 0);
	lua_setfield(L, -2, field);
	return 1;
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
	int kind, floor, holds;
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

/* The apply of an update/remove/assert op: filter {_id, where...,
 * marker: {$ne: tid}} fenced by the version the owner read (stack index
 * `version`; nil means the document had none, false that the owner read
 * none) and, when `before` (deadline_condition) is given, by the server's
 * clock being before the deadline; update: op.update (update kind only) + $push marker +
 * $inc version (and the `held` array; see "Guards", like the condition a
 * guarded op adds). */
static void
build_apply(lua_State *L, const op_parts *p, const bson_t *tid, int version,
	    const bson_t *before, const fields *f, bson_t *filter, bson_t *update)
{
	if (p->id_idx)
		mtx_append_value(L, p->id_idx, filter, "_id");
	else
		bson_append_iter(filter, "_id", 3, &p->id_it);
	append_conditions(p->where, before, filter);
	if (p->where)
		append_unheld(L, filter, p->floor ? f->held : f->marker);
	append_marker_ne(filter, f, tid);
	bson_append_null(filter, f->removing, -1); /* absent: nobody removes it */
	if (lua_isnil(L, version))
		bson_append_null(filter, f->version, -1);
	else if (!lua_isboolean(L, version))
		mtx_append_value(L, version, filter, f->version);
	merge_update(update, p->update, f, "$push", tid, p->holds);
	if (p->kind == K_REMOVE)
		append_removing(update, "$set", f, tid);
}

/* steps:apply(coll, tid, op [, version|false [, deadline]])
 *   -> { applied = bool }
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

	lua_settop(L, 6); /* absent optional arguments keep their slots */
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
		    &s->f, filter, update);
	if ((rc = run_update(L, "apply", coll, filter, update, opts, 0, &n)))
		return rc;
	return push_bool_result(L, "applied", n);
}

/* The options of a batch: the write concern, unordered (one failing
 * request does not stop the others).  Bound once, as libmongoc only reads
 * them: a scratch copy a command was about 3 000 instructions. */
static const bson_t *
batch_opts(lua_State *L, const mtx_steps *s, int n)
{
	luaL_argcheck(L, n > 0, 3, "at least one item");
	return s->bopts;
}

static mongoc_bulk_operation_t *
new_bulk(lua_State *L, mongoc_collection_t *coll, const bson_t *opts)
{
	void **slot = mtx_guard(L, (void (*)(void *))mongoc_bulk_operation_destroy);

	*slot = mongoc_collection_create_bulk_operation_with_opts(coll, opts);
	return (mongoc_bulk_operation_t *)*slot;
}

/* Pushes item i of the batch at idx (a table) and returns its index. */
static int
batch_item(lua_State *L, int idx, int i)
{
	lua_rawgeti(L, idx, i);
	if (!lua_istable(L, -1))
		luaL_error(L, "mongotx: batch item %d is not a table", i);
	return lua_gettop(L);
}

static void
check_added(lua_State *L, bool ok, int i, const bson_error_t *err)
{
	if (!ok)
		luaL_error(L, "mongotx: batch item %d: %s", i, err->message);
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
 * items[i] = { tid, op, version [, stored, i] }: apply's writes for many
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
			lua_getfield(L, op - 1, "version");
			item_op_parts(L, op - 1, op, kind, &parts);
			build_apply(L, &parts, b.tid, op + 1, before, &b.f, b.filter, b.update);
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
 * `held`) and $inc version (unused for a remove, which deletes the
 * document: OP_DELETE), else OP_UPDATE. */
static int
build_finish(lua_State *L, int op, const bson_t *tid, const fields *f,
	     bson_t *filter, bson_t *update)
{
	int kind = op_kind(L, op);

	lua_getfield(L, op, "id");
	mtx_append_value(L, -1, filter, "_id");
	lua_pop(L, 1);
	append_marker_eq(filter, f, tid);
	if (kind == K_REMOVE)
		return OP_DELETE;
	merge_update(update, NULL, f, "$pull", tid, op_holds(L, op, kind));
	return OP_UPDATE;
}

/* Builds an op's write into filter and update (build_finish, build_undo,
 * build_fence); returns one of the enum above. */
typedef int (*op_builder)(lua_State *L, int op, const bson_t *tid, const fields *f,
			  bson_t *filter, bson_t *update);

/* The single-op steps (finish, undo, fence): steps:<point>(coll, tid, op)
 * runs the write `build` makes of op and returns { [result] = whether it
 * matched a document }. */
static int
op_step_run(lua_State *L, op_builder build, const char *point, const char *result)
{
	mongoc_collection_t *coll;
	bson_t *tid, *filter, *update, *opts;
	fields f;
	int64_t n = 0;
	int how, rc;

	coll = op_step_args(L, &tid, &f, &opts);
	scratch_pair(L, &filter, &update);
	how = build(L, OP_ARG, tid, &f, filter, update);
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
	return op_step_run(L, build_finish, "finish", "finished");
}

/* Adds the write `build` makes of op (stack index) to b's bulk as its
 * request i; `req`: the options of an update that is not an upsert
 * (b->req when every update is built here, see "Built here"). */
static void
op_batch_add(lua_State *L, op_batch *b, op_builder build, int op, int i,
	     const bson_t *upsert, const bson_t *req)
{
	int how = build(L, op, b->tid, &b->f, b->filter, b->update);
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
 * coll, items), in one unordered bulk write at crash point `point`. */
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
		int top = lua_gettop(L);

		op_batch_add(L, &b, build, op_batch_item(L, &b, i), i, upsert, b.req);
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
				op_batch_add(L, &b, build_finish, op, ++n, NULL, b.req);
			}
			lua_settop(L, ops);
		}
		lua_settop(L, top);
	}
	luaL_argcheck(L, n > 0, 4, "no op in this collection");
	return mtx_bulk_execute(L, step_owner(L), b.bulk, "finish", n, MTX_BULK_FAILURES);
}

/* The undo of op: filter {_id, marker: tid}; update op.undo (update
 * kind) + $pull marker (and `held`) + $inc version, and $unset of
 * `removing` for a remove: OP_UPDATE; an insert's undo deletes the
 * document: OP_DELETE. */
static int
build_undo(lua_State *L, int op, const bson_t *tid, const fields *f,
	   bson_t *filter, bson_t *update)
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
	merge_update(update, undo, f, "$pull", tid, op_holds(L, op, kind));
	if (kind == K_REMOVE)
		append_removing(update, "$unset", f, tid);
	lua_settop(L, top);
	return OP_UPDATE;
}

/* steps:undo(coll, tid, op) -> { undone = bool }
 * Only where the marker shows the op was applied: insert deletes the
 * document, update applies op.undo, all others just pull the marker. */
static int
l_undo(lua_State *L)
{
	return op_step_run(L, build_undo, "undo", "undone");
}

/* steps:undo_many(coll, items) -> bulk result or nil, err.
 * items[i] = { tid, op }: undo's writes for many ops of one collection in
 * one unordered bulk write (batched recovery of canceling transactions;
 * lua/mongotx/recovery.lua).  An op that was never applied matches
 * nothing, as with undo. */
static int
l_undo_many(lua_State *L)
{
	return op_batch_run(L, build_undo, "undo");
}

/* The fence of op: filter {_id, marker: {$ne: tid}}; update $inc version,
 * and for an insert $setOnInsert of the placeholder field, upserted (a
 * late insert then fails on its _id): OP_UPSERT, else OP_UPDATE. */
static int
build_fence(lua_State *L, int op, const bson_t *tid, const fields *f,
	    bson_t *filter, bson_t *update)
{
	bson_t set;
	bson_iter_t it;

	lua_getfield(L, op, "id");
	mtx_append_value(L, -1, filter, "_id");
	lua_pop(L, 1);
	append_marker_ne(filter, f, tid);
	if (op_kind(L, op) != K_INSERT) {
		merge_update(update, NULL, f, NULL, tid, 0);
		return OP_UPDATE;
	}
	bson_append_document_begin(update, "$setOnInsert", -1, &set);
	bson_iter_init_find(&it, tid, "t");
	bson_append_iter(&set, f->placeholder, -1, &it);
	bson_append_document_end(update, &set);
	merge_update(update, NULL, f, NULL, tid, 0);
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
	return op_step_run(L, build_fence, "fence", "fenced");
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
	ok = mongoc_collection_find_and_modify_with_opts(coll, query, fam, reply, &err);
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
 * caller's _id) and its update {$set: {state: to [, key: value]},
 * $currentDate: {lastModified: true}}, and for a final state (done,
 * cancelled) $unset: {parked: ""}: parked says recovery gave up on an
 * unfinished transaction, which a finished one no longer is (its reason
 * stays).  epoch and value are stack indices (0 or nil: none). */
static void
build_transition(lua_State *L, const char *from, const char *to, int epoch,
		 const char *key, int value, bson_t *filter, bson_t *update)
{
	bson_t set, cd, unset;

	BSON_APPEND_UTF8(filter, "state", from);
	if (epoch && !lua_isnil(L, epoch))
		mtx_append_value(L, epoch, filter, "epoch");
	bson_append_document_begin(update, "$set", 4, &set);
	BSON_APPEND_UTF8(&set, "state", to);
	if (value && !lua_isnil(L, value))
		mtx_append_value(L, value, &set, key);
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
 * `to`, also setting key to the value at stack index `value` (0 or nil:
 * nothing): findAndModify returning the new document, so the caller needs
 * no read to learn where it stands.  Pushes it, or false when the
 * transaction was not in `from` (at that epoch), or nil, err. */
static int
move(lua_State *L, const mtx_steps *s, const char *from, const char *to, int epoch,
     const char *key, int value)
{
	mongoc_collection_t *coll = arg_collection(L, 2);
	bson_t *tid = check_tid(L, 3), *filter, *update;
	bson_iter_t it;

	scratch_pair(L, &filter, &update);
	bson_iter_init_find(&it, tid, "t");
	bson_append_iter(filter, "_id", 3, &it);
	build_transition(L, from, to, epoch, key, value, filter, update);
	return find_and_modify(L, transition_point(to), coll, filter, update, s->wopts);
}

/* The same for many transactions (ids: a list at stack index 3) in one
 * update_many; pushes { moved = <count> }. */
static int
move_many(lua_State *L, const mtx_steps *s, const char *from, const char *to, int epoch)
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
	build_transition(L, from, to, epoch, NULL, 0, filter, update);
	if ((rc = run_update(L, transition_point(to), coll, filter, update,
			     s->checked_wopts, 1, &n)))
		return rc;
	lua_createtable(L, 0, 1);
	lua_pushinteger(L, (lua_Integer)n);
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

/* steps:commit_many(txcoll, tids, epoch) -> { moved = <count> } */
static int
l_commit_many(lua_State *L)
{
	mtx_steps *s = check_steps(L);

	lua_settop(L, 4);
	luaL_checkany(L, 4);
	return move_many(L, s, "pending", "applied", 4);
}

/* steps:done(txcoll, tid): applied -> done, once every op is finished. */
static int
l_done(lua_State *L)
{
	lua_settop(L, 3);
	return move(L, check_steps(L), "applied", "done", 0, NULL, 0);
}

/* steps:done_many(txcoll, tids) -> { moved = <count> } */
static int
l_done_many(lua_State *L)
{
	lua_settop(L, 3);
	return move_many(L, check_steps(L), "applied", "done", 0);
}

/* steps:cancel(txcoll, tid, epoch [, reason]): pending -> canceling, by
 * the owner at that epoch. */
static int
l_cancel(lua_State *L)
{
	mtx_steps *s = check_steps(L);

	lua_settop(L, 5);
	luaL_checkany(L, 4);
	return move(L, s, "pending", "canceling", 4, "reason", 5);
}

/* steps:cancelled(txcoll, tid [, from [, epoch [, reason]]]): canceling
 * (or, with from = "initial", a transaction never started, at that
 * epoch) -> cancelled. */
static int
l_cancelled(lua_State *L)
{
	static const char *const froms[] = {"canceling", "initial", NULL};
	mtx_steps *s = check_steps(L);
	int from;

	lua_settop(L, 6);
	from = luaL_checkoption(L, 4, "canceling", froms);
	return move(L, s, froms[from], "cancelled", 5, "reason", 6);
}

/* steps:cancelled_many(txcoll, tids) -> { moved = <count> }: canceling ->
 * cancelled for many transactions whose ops are all undone. */
static int
l_cancelled_many(lua_State *L)
{
	lua_settop(L, 3);
	return move_many(L, check_steps(L), "canceling", "cancelled", 0);
}

/* steps:renew(txcoll, tid, epoch, deadline): pending -> pending with a new
 * deadline, by the owner at that epoch (an owner working past its
 * deadline renews it before it applies again). */
static int
l_renew(lua_State *L)
{
	mtx_steps *s = check_steps(L);

	lua_settop(L, 5);
	luaL_checkany(L, 4);
	luaL_checkany(L, 5);
	return move(L, s, "pending", "pending", 4, "deadline", 5);
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

/* Monotonic milliseconds, for leases measured by this process. */
static int
l_monotonic_ms(lua_State *L)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	lua_pushnumber(L, (lua_Number)ts.tv_sec * 1000 + ts.tv_nsec / 1e6);
	return 1;
}

/* sleep(seconds): blocks the process (OpenResty users pass ngx.sleep as
 * the policy's sleep instead). */
static int
l_sleep(lua_State *L)
{
	lua_Number s = luaL_checknumber(L, 1);
	struct timespec ts;

	luaL_argcheck(L, s >= 0, 1, "not a duration");
	ts.tv_sec = (time_t)s;
	ts.tv_nsec = (long)((s - (lua_Number)ts.tv_sec) * 1e9);
	while (nanosleep(&ts, &ts) != 0)
		;
	return 0;
}

/* __gc (and the only way) to free a Steps object. */
static int
l_steps_gc(lua_State *L)
{
	mtx_steps *s = (mtx_steps *)luaL_checkudata(L, 1, MTX_STEPS_MT);

	bson_free((char *)s->f.marker);
	bson_free((char *)s->f.version);
	bson_free((char *)s->f.removing);
	bson_free((char *)s->f.held);
	bson_free((char *)s->f.placeholder);
	if (s->wopts)
		bson_destroy(s->wopts);
	if (s->bopts)
		bson_destroy(s->bopts);
	if (s->checked_wopts)
		bson_destroy(s->checked_wopts);
	if (s->checked_req)
		bson_destroy(s->checked_req);
	memset(s, 0, sizeof *s);
	return 0;
}

/* core.steps{ marker, version, removing, held, placeholder [,
 * write_concern] } -> a Steps object: the protocol's steps with those
 * names and that write concern bound. */
static int
l_new_steps(lua_State *L)
{
	static const char *const names[] = {"marker", "version", "removing", "held",
		"placeholder", "write_concern", NULL};
	const char *field[5];
	size_t len;
	mtx_steps *s;
	bson_t *opts;
	int i;

	luaL_checktype(L, 1, LUA_TTABLE);
	mtx_check_options(L, 1, names);
	for (i = 0; i < 5; i++) {
		lua_getfield(L, 1, names[i]);
		field[i] = luaL_checklstring(L, -1, &len); /* kept alive by the table */
		/* "Built here": these names go out unvalidated */
		if (len == 0 || strlen(field[i]) != len || !mtx_utf8_valid(field[i], len))
			luaL_error(L, "mongotx: steps: %s must be a non-empty UTF-8 field name",
				   names[i]);
		lua_pop(L, 1);
	}
	opts = mtx_scratch(L);
	mtx_opt_write_concern(L, 1, opts);
	/* the userdata first, empty, so that a failure below leaks nothing */
	s = (mtx_steps *)lua_newuserdata(L, sizeof *s);
	memset(s, 0, sizeof *s);
	luaL_getmetatable(L, MTX_STEPS_MT);
	lua_setmetatable(L, -2);
	s->f.marker = bson_strdup(field[0]);
	s->f.version = bson_strdup(field[1]);
	s->f.removing = bson_strdup(field[2]);
	s->f.held = bson_strdup(field[3]);
	s->f.placeholder = bson_strdup(field[4]);
	s->wopts = bson_copy(opts);
	s->checked_wopts = bson_copy(opts);
	BSON_APPEND_BOOL(s->checked_wopts, "validate", false);
	s->checked_req = BCON_NEW("validate", BCON_BOOL(false));
	BSON_APPEND_BOOL(opts, "ordered", false);
	s->bopts = bson_copy(opts);
	return 1;
}

int
mtx_open_txn(lua_State *L)
{
	static const luaL_Reg steps[] = {
		{"apply", l_apply},
		{"apply_many", l_apply_many},
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
		{"fence", l_fence},
		{"fence_many", l_fence_many},
		{"finish", l_finish},
		{"finish_many", l_finish_many},
		{"renew", l_renew},
		{"undo", l_undo},
		{"undo_many", l_undo_many},
		{NULL, NULL},
	};

	luaL_newmetatable(L, MTX_STEPS_MT);
	lua_pushcfunction(L, l_steps_gc);
	lua_setfield(L, -2, "__gc");
	lua_newtable(L);
	luaL_setfuncs(L, steps, 0);
	lua_setfield(L, -2, "__index");
	lua_pop(L, 1);
	lua_pushcfunction(L, l_new_steps);
	lua_setfield(L, -2, "steps");
	lua_pushcfunction(L, l_monotonic_ms);
	lua_setfield(L, -2, "monotonic_ms");
	lua_pushcfunction(L, l_sleep);
	lua_setfield(L, -2, "sleep");
	return 0;
}

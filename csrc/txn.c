/* txn.c: the Steps object of the two-phase-commit protocol (core.steps),
 * the filter and update builders and the write runners its steps share
 * (txn.h); the steps themselves are in txn_ops.c (on the transaction's
 * documents) and txn_state.c (on the transaction document), one function
 * each.  Each step issues exactly one write (one single-document write, or for the
 * _many steps one bulk write covering a batch) and reports what happened;
 * deciding what to do next is the Lua layer's job.
 *
 * Fencing: every write mongotx makes to a document also increments its
 * version field, by 1, or by a band (MTX_VERSION_BAND) for a takeover's
 * (an owner at epoch > 1: its applies and undos; every fence); and an
 * apply is conditioned on the version staying in the band of the version
 * the owner read before it claimed the transaction (when it read one:
 * txn_ops.c, append_version_fence) and on the owner's deadline by the
 * server's clock (where the server evaluates $$NOW).  A new owner touches
 * (and so moves a band) every document of the transaction before the
 * transaction leaves `pending`, so a stalled former owner that wakes up
 * can never match its apply again, even after the markers were pulled
 * (an owner's own apply whose reply was lost is the other late copy:
 * lua/mongotx/engine/bands.lua); and no one may claim a transaction before its
 * deadline passed (lua/mongotx/manager.lua), so an apply fenced by the
 * deadline cannot run after a takeover either, nor after a recovery by a
 * writer that knows nothing of versions but waits for the transaction to
 * be stale (docs/ownership.md, "Other writers"). */
#include <string.h>
#include <time.h>

#include "txn.h"

/* Checked here.  libmongoc validates every document a write sends
 * (bson_validate: no empty key, and for an insert, in some versions, no
 * `$` first or dot in a key; then every top-level key of an update an
 * operator), 5 000 instructions a request.  Everything the steps send is
 * either built by the steps (operators, the manager's field names, which
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

#define MTX_STEPS_MT "mongotx.Steps"

mtx_steps *
check_steps(lua_State *L)
{
	mtx_steps *s = (mtx_steps *)luaL_checkudata(L, 1, MTX_STEPS_MT);

	luaL_argcheck(L, s->wopts != NULL, 1, "steps not set up");
	return s;
}

/* A step's write options to add to (upsert): a copy of the bound ones.
 * A step that adds nothing passes s->checked_wopts itself, which libmongoc only
 * reads: the copy, a scratch document, was about 3 000 instructions. */
bson_t *
step_opts(lua_State *L, const mtx_steps *s)
{
	bson_t *opts = mtx_scratch(L);

	bson_concat(opts, s->checked_wopts);
	return opts;
}

/* A step's filter and update (or query and update): two scratch documents
 * in one userdata. */
void
scratch_pair(lua_State *L, bson_t **filter, bson_t **update)
{
	bson_t *docs[2];

	mtx_scratches(L, 2, docs);
	*filter = docs[0];
	*update = docs[1];
}

/* Appends {op: {removing: value}} ($set of the tid, or $unset). */
void
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
const bson_t *
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

/* The sign of the number at it (int32, int64 or double): 1, -1 or 0.
 * An escrowed op's $inc holds only those (checks_update.c, inc_escrow). */
static int
number_sign(const bson_iter_t *it)
{
	switch (bson_iter_type(it)) {
	case BSON_TYPE_INT32:
		return (bson_iter_int32(it) > 0) - (bson_iter_int32(it) < 0);
	case BSON_TYPE_INT64:
		return (bson_iter_int64(it) > 0) - (bson_iter_int64(it) < 0);
	case BSON_TYPE_DOUBLE:
		return (bson_iter_double(it) > 0) - (bson_iter_double(it) < 0);
	default:
		return 0;
	}
}

/* Does the update (NULL: none) credit a field: a positive number in its
 * $inc? */
static int
has_credit(const bson_t *update)
{
	bson_iter_t it, inner;

	if (update && bson_iter_init_find(&it, update, "$inc") && bson_iter_recurse(&it, &inner))
		while (bson_iter_next(&inner))
			if (number_sign(&inner) == 1)
				return 1;
	return 0;
}

/* {key: {$not: {$gt: bound}}} into doc: the field at key is no number
 * above bound (absent, or no number, it matches). */
static void
append_at_most(bson_t *doc, const char *key, double bound)
{
	bson_t not, gt;

	bson_append_document_begin(doc, key, -1, &not);
	bson_append_document_begin(&not, "$not", 4, &gt);
	BSON_APPEND_DOUBLE(&gt, "$gt", bound);
	bson_append_document_end(&not, &gt);
	bson_append_document_end(doc, &not);
}

/* The room an escrowed credit's finish needs (txn.h, "Room"), into doc:
 * for each positive n of the update's $inc on path p, p at most
 * MTX_ROOM_FIELD and "<pending>.p" at most MTX_ROOM - n. */
static void
append_room(lua_State *L, bson_t *doc, const bson_t *update, const fields *f)
{
	bson_iter_t it, inner;

	bson_iter_init_find(&it, update, "$inc");
	bson_iter_recurse(&it, &inner);
	while (bson_iter_next(&inner)) {
		if (number_sign(&inner) != 1)
			continue;
		append_at_most(doc, bson_iter_key(&inner), MTX_ROOM_FIELD);
		lua_pushfstring(L, "%s.%s", f->pending, bson_iter_key(&inner));
		append_at_most(doc, lua_tostring(L, -1), MTX_ROOM - bson_iter_as_double(&inner));
		lua_pop(L, 1);
	}
}

/* Appends the conditions of where (NULL: none) to filter: flattened, or
 * with a deadline's condition (deadline_condition; NULL for none) or the
 * room of an escrowed op's credits (`escrowed`: its update, else NULL;
 * append_room) $and: [where, before, room], so that none can shadow a
 * key of another. */
void
append_conditions(lua_State *L, const bson_t *where, const bson_t *before,
		  const bson_t *escrowed, const fields *f, bson_t *filter)
{
	bson_t and, room;
	bson_iter_t it;
	char buf[16];
	const char *key;
	uint32_t n = 0;
	int credit = has_credit(escrowed);

	if (!before && !credit) {
		if (where && bson_iter_init(&it, where))
			while (bson_iter_next(&it))
				bson_append_iter(filter, NULL, 0, &it);
		return;
	}
	bson_append_array_begin(filter, "$and", 4, &and);
	if (where) {
		bson_uint32_to_string(n++, &key, buf, sizeof buf);
		BSON_APPEND_DOCUMENT(&and, key, where);
	}
	if (before) {
		bson_uint32_to_string(n++, &key, buf, sizeof buf);
		BSON_APPEND_DOCUMENT(&and, key, before);
	}
	if (credit) {
		bson_uint32_to_string(n++, &key, buf, sizeof buf);
		bson_append_document_begin(&and, key, -1, &room);
		append_room(L, &room, escrowed, f);
		bson_append_document_end(&and, &room);
	}
	bson_append_array_end(filter, &and);
}

void
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
void
append_unheld(lua_State *L, bson_t *filter, const char *array)
{
	bson_t cond;

	lua_pushfstring(L, "%s.0", array);
	bson_append_document_begin(filter, lua_tostring(L, -1), -1, &cond);
	BSON_APPEND_BOOL(&cond, "$exists", false);
	bson_append_document_end(filter, &cond);
	lua_pop(L, 1);
}

void
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
bson_t *
check_tid(lua_State *L, int idx)
{
	bson_t *holder = mtx_scratch(L);

	luaL_argcheck(L, !lua_isnoneornil(L, idx), idx, "a transaction id");
	mtx_append_value(L, idx, holder, "t");
	return holder;
}

/* The same for item i of a batch, into holder (reused across items). */
void
item_tid(lua_State *L, int item, int i, bson_t *holder)
{
	lua_getfield(L, item, "tid");
	if (lua_isnil(L, -1))
		luaL_error(L, "mongotx: batch item %d has no tid", i);
	bson_reinit(holder);
	mtx_append_value(L, -1, holder, "t");
	lua_pop(L, 1);
}

/* The $inc element at it into sub, as `pending`.<its path> when its sign
 * is `escrow` (1: the apply's credits; -1: the undo's, which take them
 * back), else as it is.  An apply's credit also adds 0 to its path: the
 * server then refuses the apply (a string there, a parent that is no
 * document) rather than the finish's $inc after the commit point
 * ("Guards"). */
static void
append_inc(lua_State *L, bson_t *sub, const bson_iter_t *it, const fields *f, int escrow)
{
	if (escrow && number_sign(it) == escrow) {
		lua_pushfstring(L, "%s.%s", f->pending, bson_iter_key(it));
		bson_append_iter(sub, lua_tostring(L, -1), -1, it);
		lua_pop(L, 1);
		if (escrow == 1)
			BSON_APPEND_INT32(sub, bson_iter_key(it), 0);
	} else {
		bson_append_iter(sub, NULL, 0, it);
	}
}

static void
append_version_inc(bson_t *sub, const fields *f, int64_t vinc)
{
	if (vinc == 1)
		BSON_APPEND_INT32(sub, f->version, 1);
	else
		BSON_APPEND_INT64(sub, f->version, vinc);
}

/* Copies the operators of update (may be NULL) into out, adding the
 * marker change (`$push` or `$pull` of the transaction id, or none; and
 * the same of the array `also` names: `held`, `escrow`, or NULL) and
 * `$inc` of the version field by vinc (1, or MTX_VERSION_BAND for a
 * takeover's write: "Fencing" above; an int64, so that no int32 version
 * overflows).  With
 * `escrow` (1 or -1, see append_inc) the $inc paths of that sign go to
 * the escrow subdocument instead (an escrowed op's apply and undo). */
void
merge_update(lua_State *L, bson_t *out, const bson_t *update, const fields *f,
	     const char *marker_op, const bson_t *tid_holder, const char *also, int escrow,
	     int64_t vinc)
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
					append_inc(L, &sub, &inner, f, is_inc ? escrow : 0);
			if (is_inc) {
				append_version_inc(&sub, f, vinc);
				saw_inc = 1;
			}
			if (is_marker) {
				bson_append_iter(&sub, f->marker, -1, &tid);
				if (also)
					bson_append_iter(&sub, also, -1, &tid);
				saw_marker = 1;
			}
			bson_append_document_end(out, &sub);
		}
	}
	if (!saw_inc) {
		bson_append_document_begin(out, "$inc", 4, &sub);
		append_version_inc(&sub, f, vinc);
		bson_append_document_end(out, &sub);
	}
	if (marker_op && !saw_marker) {
		bson_append_document_begin(out, marker_op, -1, &sub);
		bson_append_iter(&sub, f->marker, -1, &tid);
		if (also)
			bson_append_iter(&sub, also, -1, &tid);
		bson_append_document_end(out, &sub);
	}
}

/* The number at it appended to sub under `key`, negated. */
static void
append_negated(bson_t *sub, const char *key, const bson_iter_t *it)
{
	switch (bson_iter_type(it)) {
	case BSON_TYPE_INT32:
		BSON_APPEND_INT32(sub, key, -bson_iter_int32(it));
		break;
	case BSON_TYPE_INT64:
		BSON_APPEND_INT64(sub, key, -bson_iter_int64(it));
		break;
	default:
		BSON_APPEND_DOUBLE(sub, key, -bson_iter_double(it));
	}
}

/* The $inc of an op's finish, into out (empty): for an escrowed op
 * (update, else NULL) its credits moved from the escrow subdocument into
 * their fields, {path: n, "<pending>.path": -n} for each positive n of
 * update's $inc; with `settle` (the op's, else NULL: a capture of part of
 * a hold, lua/mongotx/holds.lua) the fields get settle's numbers instead
 * of those credits (the escrow is emptied all the same), and an op that
 * is not escrowed gets them too (the remainder of a hold back to where it
 * was debited). */
void
append_settle(lua_State *L, bson_t *out, const bson_t *update, const bson_t *settle,
	      const fields *f)
{
	bson_iter_t it, inner;
	bson_t sub;

	bson_append_document_begin(out, "$inc", 4, &sub);
	if (update && bson_iter_init_find(&it, update, "$inc") && bson_iter_recurse(&it, &inner)) {
		while (bson_iter_next(&inner)) {
			if (number_sign(&inner) != 1)
				continue;
			if (!settle)
				bson_append_iter(&sub, NULL, 0, &inner);
			lua_pushfstring(L, "%s.%s", f->pending, bson_iter_key(&inner));
			append_negated(&sub, lua_tostring(L, -1), &inner);
			lua_pop(L, 1);
		}
	}
	if (settle && bson_iter_init(&it, settle))
		while (bson_iter_next(&it))
			if (number_sign(&it) != 0)
				bson_append_iter(&sub, NULL, 0, &it);
	bson_append_document_end(out, &sub);
}

mongoc_collection_t *
arg_collection(lua_State *L, int idx)
{
	return mtx_collection_handle(L, mtx_check_collection(L, idx));
}

/* The client whose counters a step's writes add to: every step takes
 * the collection it writes to second (steps, coll, ...). */
mtx_client *
step_owner(lua_State *L)
{
	return mtx_check_collection(L, 2)->owner;
}

/* Around each single write of a step: its crash points (fault.c) and
 * the count of its statement (client:counters). */
int64_t
write_begin(lua_State *L, const char *point)
{
	mtx_fault(point, "before");
	return mtx_commands_sent(step_owner(L));
}

void
write_end(lua_State *L, const char *point, int64_t since)
{
	mtx_count_writes(step_owner(L), since, 1);
	mtx_fault(point, "after");
}

/* Runs an update_one (update_many if `many`) at crash point `point`
 * (fault.c); sets *matched (an upsert counts as one), or
 * pushes nil, err and returns 2 (0 on success). */
int
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
	ok = !mtx_fault_refuses(filter, &err) && !mtx_fault_drops(point, &err) &&
	     (many ? mongoc_collection_update_many(coll, filter, update, opts, reply, &err)
		   : mongoc_collection_update_one(coll, filter, update, opts, reply, &err));
	write_end(L, point, sent);
	if (!ok)
		return mtx_push_error(L, &err, reply);
	*matched = bson_iter_init_find(&it, reply, "matchedCount")
			   ? bson_iter_as_int64(&it) : 0;
	if (bson_iter_init_find(&it, reply, "upsertedId"))
		(*matched)++; /* fence's placeholder: written, so it counts */
	return 0;
}

int
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


int
push_bool_result(lua_State *L, const char *field, int64_t n)
{
	lua_createtable(L, 0, 1);
	lua_pushboolean(L, n > 0);
	lua_setfield(L, -2, field);
	return 1;
}

/* The options of a batch: the write concern, unordered (one failing
 * request does not stop the others).  Bound once, as libmongoc only reads
 * them: a scratch copy a command was about 3 000 instructions. */
const bson_t *
batch_opts(lua_State *L, const mtx_steps *s, int n)
{
	luaL_argcheck(L, n > 0, 3, "at least one item");
	return s->bopts;
}

mongoc_bulk_operation_t *
new_bulk(lua_State *L, mongoc_collection_t *coll, const bson_t *opts)
{
	void **slot = mtx_guard(L, (void (*)(void *))mongoc_bulk_operation_destroy);

	*slot = mongoc_collection_create_bulk_operation_with_opts(coll, opts);
	return (mongoc_bulk_operation_t *)*slot;
}

/* Pushes item i of the batch at idx (a table) and returns its index. */
int
batch_item(lua_State *L, int idx, int i)
{
	lua_rawgeti(L, idx, i);
	if (!lua_istable(L, -1))
		luaL_error(L, "mongotx: batch item %d is not a table", i);
	return lua_gettop(L);
}

void
check_added(lua_State *L, bool ok, int i, const bson_error_t *err)
{
	if (!ok)
		luaL_error(L, "mongotx: batch item %d: %s", i, err->message);
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
	bson_free((char *)s->f.pending);
	bson_free((char *)s->f.escrow);
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

/* core.steps{ marker, version, removing, held, placeholder, pending,
 * escrow [, write_concern] } -> a Steps object: the protocol's steps with
 * those names and that write concern bound. */
static int
l_new_steps(lua_State *L)
{
	static const char *const names[] = {"marker", "version", "removing", "held",
		"placeholder", "pending", "escrow", "write_concern", NULL};
	const char *field[7];
	size_t len;
	mtx_steps *s;
	bson_t *opts;
	int i;

	luaL_checktype(L, 1, LUA_TTABLE);
	mtx_check_options(L, 1, names);
	for (i = 0; i < 7; i++) {
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
	s->f.pending = bson_strdup(field[5]);
	s->f.escrow = bson_strdup(field[6]);
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
	luaL_newmetatable(L, MTX_STEPS_MT);
	lua_pushcfunction(L, l_steps_gc);
	lua_setfield(L, -2, "__gc");
	lua_newtable(L);
	luaL_setfuncs(L, mtx_txn_op_steps, 0);
	luaL_setfuncs(L, mtx_txn_state_steps, 0);
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

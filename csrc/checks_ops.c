/* checks_ops.c: the check of one op (its kind, collection, id, update,
 * undo, doc and where, each snapshotted) and the op walk over a
 * transaction's op list, core.check_ops, which appends each op to the
 * stored form in the same pass.  The rest of the checks is in checks.c
 * (checks.h). */
#include <math.h>
#include <string.h>

#include "checks.h"

/* ---- one op ---- */

/* The fields of an op, in the order the Lua checks snapshotted them. */
enum { F_UPDATE, F_UNDO, F_DOC, F_WHERE, N_FIELDS };
static const char *const snapshot_fields[] = {"update", "undo", "doc", "where"};

static int
is_op_key(lua_State *L, int idx)
{
	static const char *const keys[] = {"collection", "id", "kind", "update",
					   "doc", "undo", "where", NULL};

	return lua_type(L, idx) == LUA_TSTRING && is_listed(lua_tostring(L, idx), keys);
}

/* Where check_op keeps what it works with: stack slots. */
typedef struct {
	int op, txcoll, owned, built, where_check, index;
	int collection, id, key;
	int value[N_FIELDS], bytes[N_FIELDS];
	int kind, out, doc, effect, floor;
	int escrow; /* the manager's escrow option: credits may be escrowed */
	lua_Integer name_max;
} op_slots;

static void
push_slot(lua_State *L, int *slot)
{
	lua_pushnil(L);
	*slot = lua_gettop(L);
}

/* ---- snapshots ---- */

/* How deep quick_snapshot goes before it leaves a value to the encoder. */
#define QUICK_DEPTH 8

static int quick_fields(lua_State *L, int idx, bson_t *b, int depth);

/* Appends the value at idx to b when it has the quick shape: a boolean, a
 * number, a string, or a table without a metatable of at most one string
 * key whose value has the quick shape.  0 when it has not (b is then
 * left half made). */
static int
quick_append(lua_State *L, int idx, bson_t *b, const char *key, int keylen, int depth)
{
	bson_t child;
	size_t len;
	const char *s;

	switch (lua_type(L, idx)) {
	case LUA_TBOOLEAN:
		return bson_append_bool(b, key, keylen, lua_toboolean(L, idx));
	case LUA_TNUMBER:
		mtx_append_number(L, idx, b, key, keylen, MTX_HINT_NONE);
		return 1;
	case LUA_TSTRING:
		s = lua_tolstring(L, idx, &len);
		return len < 64 && bson_append_utf8(b, key, keylen, s, (int)len);
	case LUA_TTABLE:
		if (depth >= QUICK_DEPTH)
			return 0;
		if (lua_getmetatable(L, idx)) {
			lua_pop(L, 1);
			return 0;
		}
		return bson_append_document_begin(b, key, keylen, &child) &&
		       quick_fields(L, idx, &child, depth + 1) &&
		       bson_append_document_end(b, &child);
	default:
		return 0;
	}
}

/* The fields of the table at idx (no metatable) into b: at most one, a
 * key the encoder takes (no NUL, UTF-8) with a value of the quick shape. */
static int
quick_fields(lua_State *L, int idx, bson_t *b, int depth)
{
	const char *key;
	size_t len;
	int ok, top = lua_gettop(L);

	idx = mtx_absindex(L, idx);
	lua_pushnil(L);
	if (!lua_next(L, idx))
		return 1; /* an empty table is an empty document */
	if (lua_type(L, -2) != LUA_TSTRING) {
		lua_settop(L, top);
		return 0;
	}
	key = lua_tolstring(L, -2, &len);
	ok = strlen(key) == len && mtx_utf8_valid(key, len) &&
	     quick_append(L, lua_gettop(L), b, key, (int)len, depth);
	lua_pop(L, 1);
	if (!ok || lua_next(L, idx)) {
		lua_settop(L, top);
		return 0;
	}
	return 1;
}

/* Pushes a copy of the value at idx, of the quick shape: what decoding
 * its BSON gives (a table of one key has no metatable to keep an order). */
static void
quick_copy(lua_State *L, int idx)
{
	idx = mtx_absindex(L, idx);
	if (lua_type(L, idx) != LUA_TTABLE) {
		lua_pushvalue(L, idx);
		return;
	}
	lua_createtable(L, 0, 1);
	lua_pushnil(L);
	if (lua_next(L, idx)) {
		quick_copy(L, -1);
		lua_remove(L, -2);
		lua_rawset(L, -3);
	}
}

/* The BSON of the table at idx when it has the quick shape (no
 * metatable, at most QUICK_BYTES): pushed as a string, and 1; else 0
 * and nothing pushed. */
static int
quick_bytes(lua_State *L, int idx)
{
	bson_t b;
	uint8_t bytes[QUICK_BYTES];
	uint32_t len;
	int top = lua_gettop(L), ok;

	idx = mtx_absindex(L, idx);
	if (lua_getmetatable(L, idx)) {
		lua_pop(L, 1);
		return 0;
	}
	bson_init(&b);
	ok = quick_fields(L, idx, &b, 1) && b.len <= QUICK_BYTES;
	len = b.len;
	if (ok)
		memcpy(bytes, bson_get_data(&b), len);
	bson_destroy(&b);
	lua_settop(L, top);
	if (!ok)
		return 0;
	lua_pushlstring(L, (const char *)bytes, len);
	return 1;
}

/* core.snapshot without the general encoder and decoder for the small
 * tables most ops hold ({ ["$inc"] = { balance = -5 } }): pushes the copy
 * and its BSON and returns 1, or 0 (nothing pushed) for any other value. */
static int
quick_snapshot(lua_State *L, int idx)
{
	idx = mtx_absindex(L, idx);
	if (!quick_bytes(L, idx))
		return 0;
	quick_copy(L, idx);
	lua_insert(L, -2);
	return 1;
}

/* Snapshots op[f] into its slots (a table as the copy and its BSON, any
 * other value as it is): 1, or the message pushed and 0. */
static int
snapshot_field(lua_State *L, const op_slots *s, int f)
{
	lua_pushstring(L, snapshot_fields[f]);
	lua_rawget(L, s->op);
	if (lua_type(L, -1) != LUA_TTABLE || s->built) {
		/* a built op's table is mongotx's own: its BSON for the
		 * stored form, without the general encoder when it can */
		if (s->built && lua_istable(L, -1) && quick_bytes(L, -1))
			lua_replace(L, s->bytes[f]);
		lua_replace(L, s->value[f]);
		return 1;
	}
	if (quick_snapshot(L, -1)) {
		lua_replace(L, s->bytes[f]);
		lua_replace(L, s->value[f]);
		lua_pop(L, 1);
		return 1;
	}
	lua_pushcfunction(L, mtx_l_snapshot);
	lua_insert(L, -2);
	if (lua_pcall(L, 1, 2, 0) != 0) {
		lua_pushfstring(L, "%s cannot be stored: %s", snapshot_fields[f],
				strip_prefix(L));
		return 0;
	}
	lua_replace(L, s->bytes[f]);
	lua_replace(L, s->value[f]);
	return 1;
}

/* The kind: op.kind, else insert for an op with a doc, update for one
 * with an update.  1, or the message pushed and 0. */
const char *const kinds[] = {"update", "insert", "remove", "assert", NULL};

static int
check_kind(lua_State *L, const op_slots *s)
{
	const char *k;

	lua_pushliteral(L, "kind");
	lua_rawget(L, s->op);
	if (!lua_toboolean(L, -1)) {
		lua_pop(L, 1);
		if (!lua_isnil(L, s->value[F_DOC]))
			lua_pushliteral(L, "insert");
		else if (!lua_isnil(L, s->value[F_UPDATE]))
			lua_pushliteral(L, "update");
		else
			lua_pushnil(L);
	}
	lua_replace(L, s->kind);
	k = lua_type(L, s->kind) == LUA_TSTRING ? lua_tostring(L, s->kind) : "";
	if (is_listed(k, kinds))
		return 1;
	lua_pushliteral(L, "kind must be update, insert, remove or assert");
	return 0;
}

static int
kind_is(lua_State *L, const op_slots *s, const char *kind)
{
	return strcmp(lua_tostring(L, s->kind), kind) == 0;
}

/* The largest number of the $inc of the update at u (an escrowable one:
 * inc_escrow). */
static lua_Number
max_inc(lua_State *L, int u)
{
	lua_Number max = 0;

	lua_getfield(L, u, "$inc");
	lua_pushnil(L);
	while (lua_next(L, -2)) {
		if (lua_tonumber(L, -1) > max)
			max = lua_tonumber(L, -1);
		lua_pop(L, 1);
	}
	lua_pop(L, 1);
	return max;
}

/* The update and undo of an update op, into out (undo derived for an
 * update of $inc only), with its effect.  1, or the message pushed and 0. */
static int
check_update_op(lua_State *L, const op_slots *s)
{
	int top = lua_gettop(L), derived = lua_isnil(L, s->value[F_UNDO]);

	if (!check_update(L, s->value[F_UPDATE], s->owned, "update"))
		return 0;
	if (derived) {
		/* the checked update's paths, its numbers negated: nothing
		 * more to check */
		if (!push_inverse_inc(L, s->value[F_UPDATE])) {
			lua_pushliteral(L, "an update other than $inc needs an explicit undo");
			return 0;
		}
		lua_replace(L, s->bytes[F_UNDO]);
		lua_replace(L, s->value[F_UNDO]);
	} else if (!check_update(L, s->value[F_UNDO], s->owned, "undo")) {
		return 0;
	}
	lua_pushvalue(L, s->value[F_UPDATE]);
	lua_setfield(L, s->out, "update");
	lua_pushvalue(L, s->value[F_UNDO]);
	lua_setfield(L, s->out, "undo");
	/* a debit (only $inc of negative numbers, undone by an $inc of
	 * positive ones) lowers what a guard reads (csrc/txn.h, "Guards");
	 * a derived undo negates the update's numbers, none 0 there */
	if (inc_sign(L, s->value[F_UPDATE]) == -1 &&
	    (derived || inc_sign(L, s->value[F_UNDO]) == 1))
		lua_pushliteral(L, "lowers");
	/* a credit (some $inc positive) waits in the escrow subdocument
	 * until its finish; its undo must be the derived inverse, whose
	 * negative numbers then take it back from there */
	else if (s->escrow && derived && inc_escrow(L, s->value[F_UPDATE])) {
		if (max_inc(L, s->value[F_UPDATE]) > MTX_ROOM) {
			lua_pushliteral(L, "an escrowed credit is at most 2^62");
			return 0;
		}
		lua_pushliteral(L, "escrow");
	} else
		lua_pushnil(L);
	if (!lua_isnil(L, -1)) {
		lua_pushvalue(L, -1);
		lua_replace(L, s->effect);
		lua_setfield(L, s->out, "effect");
	}
	lua_settop(L, top);
	return 1;
}

/* Is the key at idx one of the fields of the list at owned? */
static int
touched_exactly(lua_State *L, int owned, int idx)
{
	int k, same;

	idx = mtx_absindex(L, idx);
	for (k = 1;; k++) {
		lua_rawgeti(L, owned, k);
		if (lua_isnil(L, -1)) {
			lua_pop(L, 1);
			return 0;
		}
		same = lua_rawequal(L, -1, idx);
		lua_pop(L, 1);
		if (same)
			return 1;
	}
}

/* The doc of an insert op: a copy of its snapshot with the op's id as
 * _id, into out.  1, or the message pushed and 0. */
static int
check_insert_doc(lua_State *L, const op_slots *s)
{
	int src = s->value[F_DOC], doc, top = lua_gettop(L);

	if (lua_type(L, src) != LUA_TTABLE) {
		lua_pushliteral(L, "insert needs a doc");
		return 0;
	}
	lua_newtable(L);
	doc = lua_gettop(L);
	lua_pushnil(L);
	while (lua_next(L, src)) {
		if (lua_type(L, -2) != LUA_TSTRING) {
			lua_pushliteral(L, "doc keys are strings");
			return 0;
		}
		if (lua_tostring(L, -2)[0] == '$') {
			push_format(L, "doc may not hold the key %q", -2);
			return 0;
		}
		if (touched_exactly(L, s->owned, -2)) {
			lua_pushfstring(L, "doc may not set %s", lua_tostring(L, -2));
			return 0;
		}
		lua_pushvalue(L, -2);
		lua_insert(L, -2);
		lua_rawset(L, doc);
	}
	/* (_id is one of the owned fields: the op's id becomes it, below) */
	if (find_key(L, doc, 0, starts_with_dollar)) {
		push_format(L, "doc may not hold the key %q", -1);
		return 0;
	}
	if (find_key(L, doc, 0, holds_dot)) {
		push_format(L, "doc may not hold the key %q (dots are paths)", -1);
		return 0;
	}
	if (find_key(L, doc, 0, is_empty)) {
		lua_pushliteral(L, "doc may not hold an empty key");
		return 0;
	}
	if (mtx_find_bad_scalar(L, doc, 0)) {
		lua_pushfstring(L, "doc holds %s", lua_tostring(L, -1));
		return 0;
	}
	lua_pushvalue(L, s->id);
	lua_setfield(L, doc, "_id");
	lua_pushvalue(L, doc);
	lua_replace(L, s->doc);
	lua_setfield(L, s->out, "doc");
	lua_settop(L, top);
	return 1;
}

/* The where of an op: checked by validate.lua's filter grammar (the
 * function at where_check: where, owned, i -> true, floor | nil, err).
 * 1, or 0 with the error table pushed. */
static int
check_where(lua_State *L, const op_slots *s)
{
	if (lua_isnil(L, s->value[F_WHERE]))
		return 1;
	lua_pushvalue(L, s->where_check);
	lua_pushvalue(L, s->value[F_WHERE]);
	lua_pushvalue(L, s->owned);
	lua_pushvalue(L, s->index);
	lua_call(L, 3, 2);
	if (!lua_toboolean(L, -2))
		return 0;
	lua_replace(L, s->floor);
	lua_pop(L, 1);
	return 1;
}

/* Checks the op at s->op (the caller's table, read raw) and fills s->out
 * with its normal form { collection, id, kind, where, update, undo, doc,
 * effect, floor }, s->key with its document's key and s->bytes with the
 * BSON of its update, undo and where, which the stored form reuses.
 * Returns 1; 0 with the message pushed; -1 with an error table pushed. */
static int
check_op(lua_State *L, op_slots *s)
{
	if (lua_type(L, s->op) != LUA_TTABLE) {
		lua_pushliteral(L, "must be a table");
		return 0;
	}
	lua_pushnil(L);
	while (lua_next(L, s->op)) {
		lua_pop(L, 1);
		if (!is_op_key(L, -1)) {
			lua_pushfstring(L, "unknown key %s", push_tostring(L, -1));
			return 0;
		}
	}
	lua_pushliteral(L, "collection");
	lua_rawget(L, s->op);
	lua_replace(L, s->collection);
	if (!check_collection(L, s->collection, s->txcoll, s->name_max))
		return 0;
	lua_pushliteral(L, "id");
	lua_rawget(L, s->op);
	if (!check_id(L, -1))
		return 0;
	lua_replace(L, s->key);
	lua_replace(L, s->id);
	lua_pop(L, 1);
	if (!snapshot_field(L, s, F_UPDATE) || !snapshot_field(L, s, F_UNDO) ||
	    !snapshot_field(L, s, F_DOC) || !snapshot_field(L, s, F_WHERE))
		return 0;
	if (!check_kind(L, s))
		return 0;
	if (!check_where(L, s))
		return -1;
	if (mtx_find_bad_scalar(L, s->value[F_WHERE], 0)) {
		lua_pushfstring(L, "where holds %s", lua_tostring(L, -1));
		return 0;
	}
	lua_createtable(L, 0, 8);
	lua_replace(L, s->out);
	lua_pushvalue(L, s->collection);
	lua_setfield(L, s->out, "collection");
	lua_pushvalue(L, s->id);
	lua_setfield(L, s->out, "id");
	lua_pushvalue(L, s->kind);
	lua_setfield(L, s->out, "kind");
	lua_pushvalue(L, s->value[F_WHERE]);
	lua_setfield(L, s->out, "where");
	if (kind_is(L, s, "update")) {
		if (!check_update_op(L, s))
			return 0;
	} else if (!lua_isnil(L, s->value[F_UPDATE]) || !lua_isnil(L, s->value[F_UNDO])) {
		lua_pushliteral(L, "only an update op takes update and undo");
		return 0;
	}
	if (kind_is(L, s, "insert")) {
		if (!check_insert_doc(L, s))
			return 0;
	} else if (!lua_isnil(L, s->value[F_DOC])) {
		lua_pushliteral(L, "only an insert op takes a doc");
		return 0;
	}
	if (lua_toboolean(L, s->floor)) {
		lua_pushvalue(L, s->floor);
		lua_setfield(L, s->out, "floor");
	}
	return 1;
}

/* Refuses an op of the same document as an earlier one (by the key
 * check_id made, as the server reads ids): seen[collection][key] is the
 * op that took it.  1, or the message pushed and 0. */
static int
check_unique(lua_State *L, const op_slots *s, int seen, int i)
{
	lua_pushvalue(L, s->collection);
	lua_rawget(L, seen);
	if (lua_isnil(L, -1)) {
		lua_pop(L, 1);
		lua_newtable(L);
		lua_pushvalue(L, s->collection);
		lua_pushvalue(L, -2);
		lua_rawset(L, seen);
	}
	lua_pushvalue(L, s->key);
	lua_pushvalue(L, -1);
	lua_rawget(L, -3);
	if (!lua_isnil(L, -1)) {
		int first = (int)lua_tointeger(L, -1);

		lua_pushfstring(L, "document %s of %s is also op %d: one op per document (the "
				   "server reads these ids as one)",
				push_tostring(L, s->id), lua_tostring(L, s->collection), first);
		return 0;
	}
	lua_pop(L, 1);
	lua_pushinteger(L, i);
	lua_rawset(L, -3);
	lua_pop(L, 1);
	return 1;
}

/* Appends op i, checked, to the stored array arr (csrc/stored.c). */
static void
append_stored(lua_State *L, const op_slots *s, bson_t *arr, lua_Integer i)
{
	int parts[MTX_SO_N];
	int f, k;
	static const int part[N_FIELDS] = {MTX_SO_UPDATE, MTX_SO_UNDO, MTX_SO_DOC, MTX_SO_WHERE};

	parts[MTX_SO_COLLECTION] = s->collection;
	parts[MTX_SO_ID] = s->id;
	parts[MTX_SO_KIND] = s->kind;
	parts[MTX_SO_EFFECT] = s->effect;
	for (f = 0; f < N_FIELDS; f++) {
		k = part[f];
		/* the bytes the snapshot made, else (built) the table */
		parts[k] = lua_isnil(L, s->bytes[f]) ? s->value[f] : s->bytes[f];
	}
	parts[MTX_SO_DOC] = s->doc;
	mtx_append_stored_op(L, parts, arr, (uint32_t)(i - 1));
}

/* core.check_ops(ops, txcoll, owned, built, where_check, name_max, escrow)
 * -> out,
 * stored, size | nil, message, i | nil, err.  ops: the caller's list (a
 * table), read raw; txcoll: the transactions collection's name; owned: the
 * fields mongotx keeps on documents ({ "_id", marker, version }); built:
 * the ops are mongotx's own, made from checked scalars (nothing to
 * snapshot); where_check: see check_where; name_max: the most bytes a
 * collection name may have (nil: no limit); escrow: credits are escrowed
 * (csrc/txn.h, "Guards").  out[i]: op i's normal form;
 * stored: the ops as the transaction stores them (what core.stored_ops
 * makes of out, built here from the snapshots' bytes) and its size.  A
 * bad op gives its message and index (none for a fault of the whole
 * list), a bad where the error table its check made. */
int
l_check_ops(lua_State *L)
{
	op_slots s;
	lua_Integer n, i, k;
	int f, outs, seen, held, base, r, too_big = 0;
	bson_t *arr;

	lua_settop(L, 7);
	luaL_checktype(L, 1, LUA_TTABLE);
	luaL_checktype(L, 3, LUA_TTABLE);
	s.name_max = luaL_optinteger(L, 6, -1);
	s.escrow = lua_toboolean(L, 7);
	/* A C function may push LUA_MINSTACK (20) values unasked; the list,
	 * the scratch and the slots below take 21, and check_op pushes up to
	 * ~35 more (a quick snapshot 3 a level, 8 levels) before anything
	 * grows the stack: room for them all, asked once. */
	luaL_checkstack(L, 64, "mongotx: no room to check the ops");
	s.txcoll = 2, s.owned = 3, s.built = lua_toboolean(L, 4), s.where_check = 5;
	n = (lua_Integer)mtx_rawlen(L, 1);
	if (n == 0) {
		lua_pushnil(L);
		lua_pushliteral(L, "a transaction needs at least one op");
		return 2;
	}
	lua_pushnil(L);
	while (lua_next(L, 1)) {
		lua_pop(L, 1);
		if (!mtx_is_integer_key(L, -1, &k) || k < 1 || k > n) {
			lua_pushnil(L);
			lua_pushliteral(L, "ops must be a list");
			return 2;
		}
	}
	lua_createtable(L, (int)n, 0);
	outs = lua_gettop(L);
	lua_newtable(L);
	seen = lua_gettop(L);
	arr = mtx_scratch_take(L);
	held = lua_gettop(L);
	push_slot(L, &s.op);
	push_slot(L, &s.index);
	push_slot(L, &s.collection);
	push_slot(L, &s.id);
	push_slot(L, &s.key);
	for (f = 0; f < N_FIELDS; f++) {
		push_slot(L, &s.value[f]);
		push_slot(L, &s.bytes[f]);
	}
	push_slot(L, &s.kind);
	push_slot(L, &s.out);
	push_slot(L, &s.doc);
	push_slot(L, &s.effect);
	push_slot(L, &s.floor);
	base = lua_gettop(L);
	for (i = 1; i <= n; i++) {
		for (f = s.op; f <= base; f++) {
			lua_pushnil(L);
			lua_replace(L, f);
		}
		lua_rawgeti(L, 1, (int)i);
		lua_replace(L, s.op);
		lua_pushinteger(L, i);
		lua_replace(L, s.index);
		r = check_op(L, &s);
		if (r == 1 && !check_unique(L, &s, seen, (int)i))
			r = 0;
		if (r != 1)
			mtx_scratch_give(L, held);
		if (r == -1)
			return 2; /* nil, err: the where's check made it */
		if (r == 0) {
			lua_pushnil(L);
			lua_insert(L, -2);
			lua_pushinteger(L, i);
			return 3;
		}
		lua_settop(L, base);
		lua_pushvalue(L, s.out);
		lua_rawseti(L, outs, (int)i);
		/* too big for one document is bad content, told once every op
		 * is checked, as core.stored_ops would raise it */
		if (!too_big) {
			append_stored(L, &s, arr, i);
			too_big = arr->len > MTX_MAX_BSON;
		}
	}
	mtx_scratch_give(L, held);
	if (too_big) {
		lua_pushnil(L);
		lua_pushliteral(L, "the ops cannot be stored: the ops take more than 16 MiB");
		return 2;
	}
	lua_pushvalue(L, outs);
	mtx_push_stored_ops(L, arr);
	return 3;
}

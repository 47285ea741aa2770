/* txn.h: what the files of the protocol's steps share (not the rest of
 * the C core): txn.c (the Steps object, the filter and update builders
 * and the write runners every step uses), txn_ops.c (the steps on the
 * transaction's documents: apply, finish, undo, fence) and txn_state.c
 * (the steps on the transaction document: create, claim and the
 * transitions).  Each function's comment is at its definition. */
#ifndef MONGOTX_TXN_H
#define MONGOTX_TXN_H

#include "mongotx.h"

/* ---- the Steps object (txn.c) ---- */

/* The names a step needs (from the manager): the marker and version
 * fields; the field a remove op sets on its document while it is open,
 * so that no other transaction applies to a document on its way out (two
 * removes of one document must not both succeed); the array of the
 * open transactions whose effect on the document may have raised a value
 * (see "Guards" below); the field of a fence's placeholder; the
 * subdocument an escrowed credit waits in until its finish, and the array
 * of the transactions whose escrowed credits wait there ("Guards"). */
typedef struct {
	const char *marker;
	const char *version;
	const char *removing;
	const char *held;
	const char *placeholder;
	const char *pending;
	const char *escrow;
} fields;

/* Guards.  A guard (an op's where) must never pass on an effect that may
 * still be undone: a credit of a transaction that ends cancelled would
 * let a debit through that the undo then takes below its floor.  So:
 *
 * - a debit (an update that only lowers numbers with $inc, undone by an
 *   $inc back; op.effect "lowers") leaves only its marker: undoing it can
 *   only raise the value;
 * - an escrowed credit (an update of $inc only with a positive number,
 *   its undo derived; op.effect "escrow", escrow on) lowers its negative
 *   paths in place and adds its positive ones to the same paths under
 *   `pending` ({$inc: {"txPending.balance": 30}}); the finish moves them
 *   into the fields in the update that pulls the marker, the undo takes
 *   them back out of `pending`: no value a guard reads is ever raised by
 *   an effect that may be undone, and nobody waits (O'Neil's escrow).
 *   The apply also adds 0 to each credited path, so that the server
 *   checks there what the finish's $inc needs (a number, or nothing,
 *   under documents): an $inc it would refuse is refused before the
 *   commit point (an absent field is created at 0 there).  The apply
 *   records the transaction in the `escrow` array, which its finish and
 *   undo pull with the marker: any manager's floor guard finds the
 *   committed ones there (whatever their marker field) and finishes them
 *   first, so that it reads their credit;
 * - any other effect (a credit with escrow off, a $set, an insert, ...)
 *   also records the transaction in the `held` array until it is
 *   finished or undone.
 *
 * A floor guard (op.floor: only $gte/$gt of numbers) then applies only
 * where `held` is empty, since what is uncommitted there can only have
 * lowered values; any other guard only where no transaction holds the
 * document at all (its marker array is empty).  Other effects take place
 * at the apply, as in the tutorial, so that a marker means "applied" to
 * any writer that follows the tutorial's recipe.
 *
 * Isolation (docs/guards.md, "Isolation").  The ops that commute with
 * each other (debits, escrowed credits: $inc only; asserts, which write
 * nothing) share a document; every other op (held, or a remove) is
 * exclusive.  So every apply requires `held` empty (no exclusive
 * holder, whatever its marker field), and an exclusive op's apply the
 * marker array empty too (no op of another transaction in flight there);
 * a remove is kept exclusive by `removing` as before.  An insert's new
 * document carries `held`.  The Lua layer finishes committed holders and
 * waits for open ones (phases.lua, release). */
enum { E_RAISES, E_LOWERS, E_ESCROW };

/* Room.  The finish of an escrowed credit runs after the commit point,
 * where a refusal (a 64-bit integer past 2^63 - 1) would leave the credit
 * stuck.  So the apply of a credit of n to path p matches only where p is
 * no number above MTX_ROOM_FIELD and "<pending>.p" (the credits in flight
 * there) no number above MTX_ROOM - n: the field, every credit waiting
 * for it and n then add up to less than 2^63, whatever the comparisons
 * round (doubles, so that phases.lua's mirror reads the same bounds).  No
 * other op raises p while credits wait there (a credit not escrowed is
 * exclusive: "Isolation"), and a credit above MTX_ROOM is refused before
 * (checks_ops.c). */

/* A manager's steps (core.steps{...}): the field names and the write
 * options bound once, so that each step takes only what varies: (coll,
 * id, op [, version]) for the steps on documents, (txcoll, id, ...) for
 * those on the transaction.  Owned by the userdata; freed by __gc. */
typedef struct {
	fields f;      /* the names, copies owned by the object */
	bson_t *wopts; /* {writeConcern: ...}; NULL until set up */
	bson_t *bopts; /* wopts and ordered: false, for the batches */
	/* What libmongoc need not validate (txn.c, "Checked here"): wopts
	 * with validate: false, and a bulk request's {validate: false}. */
	bson_t *checked_wopts, *checked_req;
} mtx_steps;

MTX_HIDDEN mtx_steps *check_steps(lua_State *L);
MTX_HIDDEN bson_t *step_opts(lua_State *L, const mtx_steps *s);
MTX_HIDDEN void scratch_pair(lua_State *L, bson_t **filter, bson_t **update);

/* ---- filter and update builders (txn.c) ---- */

MTX_HIDDEN void append_removing(bson_t *update, const char *op, const fields *f,
		const bson_t *tid_holder);
MTX_HIDDEN const bson_t *deadline_condition(lua_State *L, int deadline, bson_t *cond);
MTX_HIDDEN void append_conditions(lua_State *L, const bson_t *where, const bson_t *before,
		const bson_t *escrowed, const fields *f, bson_t *filter);
MTX_HIDDEN void append_marker_ne(bson_t *filter, const fields *f, const bson_t *tid_holder);
MTX_HIDDEN void append_unheld(lua_State *L, bson_t *filter, const char *array);
MTX_HIDDEN void append_marker_eq(bson_t *filter, const fields *f, const bson_t *tid_holder);
MTX_HIDDEN bson_t *check_tid(lua_State *L, int idx);
MTX_HIDDEN void item_tid(lua_State *L, int item, int i, bson_t *holder);
MTX_HIDDEN void merge_update(lua_State *L, bson_t *out, const bson_t *update,
	     const fields *f, const char *marker_op, const bson_t *tid_holder,
	     const char *also, int escrow, int64_t vinc);
MTX_HIDDEN void append_settle(lua_State *L, bson_t *out, const bson_t *update,
	     const bson_t *settle, const fields *f);

/* ---- writes: arguments, crash points, counters, results (txn.c) ---- */

MTX_HIDDEN mongoc_collection_t *arg_collection(lua_State *L, int idx);
MTX_HIDDEN mtx_client *step_owner(lua_State *L);
MTX_HIDDEN int64_t write_begin(lua_State *L, const char *point);
MTX_HIDDEN void write_end(lua_State *L, const char *point, int64_t since);
MTX_HIDDEN int run_update(lua_State *L, const char *point, mongoc_collection_t *coll,
	   const bson_t *filter, const bson_t *update, const bson_t *opts,
	   int many, int64_t *matched);
MTX_HIDDEN int run_delete(lua_State *L, const char *point, mongoc_collection_t *coll,
	   const bson_t *filter, const bson_t *opts, int64_t *deleted);
MTX_HIDDEN int push_bool_result(lua_State *L, const char *field, int64_t n);

/* ---- batches: one bulk write per step (txn.c) ---- */

MTX_HIDDEN const bson_t *batch_opts(lua_State *L, const mtx_steps *s, int n);
MTX_HIDDEN mongoc_bulk_operation_t *new_bulk(lua_State *L, mongoc_collection_t *coll, const bson_t *opts);
MTX_HIDDEN int batch_item(lua_State *L, int idx, int i);
MTX_HIDDEN void check_added(lua_State *L, bool ok, int i, const bson_error_t *err);

/* ---- the steps, by family: the methods of a Steps object ---- */

/* apply, finish, undo, fence and their _many (txn_ops.c). */
MTX_HIDDEN extern const luaL_Reg mtx_txn_op_steps[];
/* create, claim, commit, done, cancel, cancelled, renew and their _many
 * (txn_state.c). */
MTX_HIDDEN extern const luaL_Reg mtx_txn_state_steps[];

#endif

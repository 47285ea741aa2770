/* mongotx.h: what the files of the C core share.  Nothing here is exported
 * from the shared object except luaopen_mongotx_core (see core.c). */
#ifndef MONGOTX_H
#define MONGOTX_H

#include <mongoc/mongoc.h>

#include "compat.h"

#define MONGOTX_VERSION "0.1.0"

#define MTX_HIDDEN __attribute__((visibility("hidden")))

/* Registry names, also the metatables' __name. */
#define MTX_VALUE_MT "mongotx.Value"
#define MTX_CLIENT_MT "mongotx.Client"
#define MTX_COLLECTION_MT "mongotx.Collection"
#define MTX_CURSOR_MT "mongotx.Cursor"
#define MTX_ERROR_MT "mongotx.Error"
#define MTX_ARRAY_MT "mongotx.Array"

/* Largest document MongoDB stores (maxBsonObjectSize): the bridge refuses
 * to encode a bigger one rather than send what the server must reject. */
#define MTX_MAX_BSON (16 * 1024 * 1024)
/* Deepest nesting the bridge encodes or decodes (MongoDB stores 100). */
#define MTX_MAX_DEPTH 100
/* Longest namespace (<database>.<collection>, in bytes) every server
 * mongotx supports takes: MongoDB before 4.4 stores at most 120 bytes
 * (255 from 4.4), mongo-java-server 128.  A transaction's op on a longer
 * one would be refused only at its apply, once the transaction is stored
 * (core.MAX_NAMESPACE; core.check_ops refuses it first). */
#define MTX_MAX_NAMESPACE 120

/* A document's version moves by 1 with each write of mongotx, and by a
 * band (MTX_VERSION_BAND) with a takeover's (csrc/txn.c, "Fencing"): an
 * apply matches only while the version is in the band it read. */
#define MTX_VERSION_BAND ((int64_t)1 << 24)

/* The largest escrowed credit, and the most a field and the credits
 * waiting for it may hold, 2^62; the most the field alone may hold
 * (csrc/txn.h, "Room"; core.ROOM, core.ROOM_FIELD). */
#define MTX_ROOM 4611686018427387904.0
#define MTX_ROOM_FIELD (MTX_ROOM - 4096.0)

/* ---- scratch.c: Lua-owned temporaries ---- */

/* Every C resource a call needs is owned by a userdata on the Lua stack, so
 * a raise (luaL_error, a failed encode, out of memory) anywhere in the call
 * leaks nothing: the garbage collector frees what the call did not. */
MTX_HIDDEN bson_t *mtx_scratch(lua_State *L);
/* n of them (out[0..n-1]) in one userdata: one allocation and one
 * finaliser for a step's filter, update, ... (a scratch cost about 1 500
 * instructions to set up and finalise, a step used two to four). */
MTX_HIDDEN void mtx_scratches(lua_State *L, int n, bson_t **out);
/* mtx_scratch for the hot paths (core.encode, a batch's documents): pushes
 * the scratch document kept from an earlier call, emptied, when there is
 * one, and takes it out of the registry so that a nested call makes its
 * own.  mtx_scratch_give(L, idx) keeps the one at idx for the next call; a
 * raise in between leaves it to the garbage collector. */
MTX_HIDDEN bson_t *mtx_scratch_take(lua_State *L);
MTX_HIDDEN void mtx_scratch_give(lua_State *L, int idx);
/* Pushes a userdata that will call destroy(*slot) when collected unless the
 * slot was cleared; returns the slot. */
MTX_HIDDEN void **mtx_guard(lua_State *L, void (*destroy)(void *));
MTX_HIDDEN void mtx_guard_free(void **slot);
MTX_HIDDEN int mtx_open_scratch(lua_State *L);

/* ---- value.c, encode.c, decode.c: Lua <-> BSON ----
 *
 * Plain Lua values map to their natural BSON types; everything else is a
 * mongotx.Value userdata holding a bson_value_t.  Decoded tables remember
 * what plain Lua cannot: the order of their keys and, where a number would
 * re-encode as another type (an int64 that fits in 32 bits, an integral
 * double on LuaJIT), that type.  Both live in the table's metatable:
 *
 *   { __mongotx = "document", "k1", "k2", ..., __types = { k = "int64" } }
 *   { __mongotx = "array", __types = { [3] = "double" } }
 *
 * so decoding and re-encoding gives the same bytes, while the tables stay
 * ordinary tables to read and change. */

/* The type hints of __types, named by mtx_hint_names (NULL-terminated). */
enum mtx_hint { MTX_HINT_NONE, MTX_HINT_INT64, MTX_HINT_DOUBLE };
MTX_HIDDEN extern const char *const mtx_hint_names[];

/* ---- value.c: mongotx.Value and the constructors ---- */

typedef struct {
	bson_value_t v;
} mtx_value;

/* Pushes a new mongotx.Value holding a copy of src. */
MTX_HIDDEN mtx_value *mtx_push_value(lua_State *L, const bson_value_t *src);
/* The mongotx.Value at idx, or NULL for any other value. */
MTX_HIDDEN mtx_value *mtx_test_value(lua_State *L, int idx);
/* Pushes an int64 as a Lua integer (a number on LuaJIT). */
MTX_HIDDEN void mtx_push_int64(lua_State *L, int64_t i);
/* Sets the bridge's functions and constants in the module table on top
 * of the stack and registers the metatables they use. */
MTX_HIDDEN int mtx_open_bson(lua_State *L);

/* ---- encode.c: Lua -> BSON ---- */

/* Encodes the Lua table at idx into a new scratch document (pushed on the
 * stack) and returns it.  Raises, naming the path of the value, when
 * something cannot be encoded. */
MTX_HIDDEN bson_t *mtx_check_document(lua_State *L, int idx);
/* The same into mtx_scratch_take's document (mtx_scratch_give it back). */
MTX_HIDDEN bson_t *mtx_check_document_reused(lua_State *L, int idx);
/* The same, but a document without _id gets a new ObjectId first; pushes
 * the scratch document and then the _id. */
MTX_HIDDEN bson_t *mtx_check_insert(lua_State *L, int idx);
/* The same for a document whose key order matters (command, sort, index
 * keys): a plain table with several keys is refused, since Lua does not
 * keep its order; mongotx.doc() does. */
MTX_HIDDEN bson_t *mtx_check_ordered(lua_State *L, int idx);
/* Appends the Lua value at idx to b under key; raises like above. */
MTX_HIDDEN void mtx_append_value(lua_State *L, int idx, bson_t *b,
				 const char *key);

/* How a Lua number encodes without a hint. */
enum mtx_numkind { MTX_NUM_INT32, MTX_NUM_INT64, MTX_NUM_DOUBLE };
MTX_HIDDEN enum mtx_numkind mtx_number_kind(lua_State *L, int idx, int64_t *i,
					    double *d);
/* Appends the number at idx as the encoder sends it (hint: MTX_HINT_NONE,
 * or the type a decoded table remembers). */
MTX_HIDDEN void mtx_append_number(lua_State *L, int idx, bson_t *b, const char *key,
				  int keylen, enum mtx_hint hint);
/* Is the key at idx an integer (LuaJIT: an integral number within 2^53)?
 * Sets *out when it is. */
MTX_HIDDEN int mtx_is_integer_key(lua_State *L, int idx, lua_Integer *out);
/* Is s (len bytes) valid UTF-8, a NUL taken as in a string value?  ASCII
 * without asking libbson. */
MTX_HIDDEN int mtx_utf8_valid(const char *s, size_t len);
/* The __mongotx kind ("document"/"array") of the table at idx, with its
 * metatable pushed (or nil pushed when it has none of ours). */
MTX_HIDDEN const char *mtx_table_kind(lua_State *L, int idx);
/* 1 when the value at key is among the first n entries of the order list
 * at meta. */
MTX_HIDDEN int mtx_listed_in_order(lua_State *L, int meta, lua_Integer n,
				   int key);
/* 1 when the table at idx, without a metatable of ours, encodes as an
 * array; raises like mtx_check_document for one that cannot encode. */
MTX_HIDDEN int mtx_plain_is_array(lua_State *L, int idx);
/* core.encode(t). */
MTX_HIDDEN int mtx_l_encode(lua_State *L);
/* core.type(v). */
MTX_HIDDEN int mtx_l_type(lua_State *L);

/* ---- decode.c: BSON -> Lua ---- */

MTX_HIDDEN void mtx_push_document(lua_State *L, const bson_t *b);
MTX_HIDDEN void mtx_push_iter(lua_State *L, const bson_iter_t *it);
/* core.decode(bytes). */
MTX_HIDDEN int mtx_l_decode(lua_State *L);

/* ---- error.c: error tables ---- */

/* Pushes nil and an error table made from a libmongoc error and the
 * server's reply (may be NULL); returns 2 for `return mtx_push_error(...)`. */
MTX_HIDDEN int mtx_push_error(lua_State *L, const bson_error_t *err,
			      const bson_t *reply);
MTX_HIDDEN int mtx_push_error_msg(lua_State *L, const char *code,
				  int server_code, const char *msg);
MTX_HIDDEN int mtx_open_error(lua_State *L);

/* ---- options.c: Lua option tables ---- */

/* Raises unless every key of the option table at idx is in names (a
 * NULL-terminated list).  nil is an empty option table. */
MTX_HIDDEN void mtx_check_options(lua_State *L, int idx,
				  const char *const names[]);
/* The same for a table inside an option table, named `name` in errors
 * ("unknown option 'write_concern.x'"); raises unless idx holds a table. */
MTX_HIDDEN void mtx_check_suboptions(lua_State *L, int idx, const char *name,
				     const char *const names[]);
/* Raises "mongotx: option '<name>' must be <expected>, got <the value at
 * idx>". */
MTX_HIDDEN void mtx_option_error(lua_State *L, int idx, const char *name,
				 const char *expected);
MTX_HIDDEN mongoc_write_concern_t *mtx_check_write_concern(lua_State *L,
							   int idx);
MTX_HIDDEN mongoc_read_prefs_t *mtx_check_read_prefs(lua_State *L, int idx);
/* Reads field `name` of the option table at idx as the named kind and
 * appends it to opts under bson_key; absent fields are skipped. */
MTX_HIDDEN void mtx_opt_bool(lua_State *L, int idx, const char *name,
			     bson_t *opts, const char *bson_key);
MTX_HIDDEN void mtx_opt_int(lua_State *L, int idx, const char *name,
			    bson_t *opts, const char *bson_key);
MTX_HIDDEN void mtx_opt_doc(lua_State *L, int idx, const char *name,
			    bson_t *opts, const char *bson_key);
MTX_HIDDEN void mtx_opt_write_concern(lua_State *L, int idx, bson_t *opts);
/* opts.read_preference as a guarded libmongoc object (pushes two values),
 * or NULL when absent (pushes nothing). */
MTX_HIDDEN mongoc_read_prefs_t *mtx_opt_read_prefs(lua_State *L, int idx);

/* ---- uri.c ---- */

/* mongoc_uri_new_with_error, but an integer option that does not parse is
 * refused here, without libmongoc's warning on stderr. */
MTX_HIDDEN mongoc_uri_t *mtx_uri_new(const char *uristr, bson_error_t *err);

/* ---- client.c ---- */

typedef struct mtx_cursor mtx_cursor;

/* What the client sent: commands is round trips, counted by libmongoc's
 * command monitoring (APM, client.c); writes the statements of write
 * commands, counted where mongotx hands them to libmongoc
 * (mtx_count_writes); returned the documents the server's find, getMore
 * and aggregate replies carried (APM too). */
typedef struct {
	int64_t commands;
	int64_t writes;
	int64_t returned;
} mtx_counters;

/* A process-wide pool of libmongoc clients (client.c, connect with
 * pool = true). */
typedef struct mtx_pool mtx_pool;

typedef struct {
	mongoc_client_t *client; /* NULL once closed */
	mtx_cursor *cursors;	 /* open cursors: destroyed before the client */
	mtx_counters counters;	 /* the APM context: the userdata never moves */
	mtx_pool *pool;		 /* the pool client came from, or NULL */
} mtx_client;

MTX_HIDDEN mtx_client *mtx_check_client(lua_State *L, int idx);
/* The client's libmongoc handle; raises if the client was closed. */
MTX_HIDDEN mongoc_client_t *mtx_client_handle(lua_State *L, mtx_client *c);
MTX_HIDDEN int mtx_open_client(lua_State *L);
/* Around every write mongotx sends: since = mtx_commands_sent(c) before
 * the libmongoc call, then mtx_count_writes(c, since, n) after it, which
 * counts its n statements when a command went out meanwhile (not when
 * libmongoc refused the write before sending it). */
MTX_HIDDEN int64_t mtx_commands_sent(mtx_client *c);
MTX_HIDDEN void mtx_count_writes(mtx_client *c, int64_t since, int64_t n);

/* ---- collection.c ---- */

typedef struct {
	mongoc_collection_t *coll; /* NULL once closed */
	mtx_client *owner;	   /* kept alive through the uservalue */
} mtx_collection;

MTX_HIDDEN void mtx_push_collection(lua_State *L, int client_idx,
				    mtx_client *owner, const char *db,
				    const char *name);
MTX_HIDDEN mtx_collection *mtx_check_collection(lua_State *L, int idx);
MTX_HIDDEN mongoc_collection_t *mtx_collection_handle(lua_State *L,
						      mtx_collection *c);
MTX_HIDDEN int mtx_open_collection(lua_State *L);
/* ---- bulk.c ---- */
/* coll:bulk_write, a method of the collections (collection.c). */
MTX_HIDDEN int mtx_collection_bulk_write(lua_State *L);
/* mtx_bulk_execute's flags: the bulk was ordered; items only for the
 * requests that failed or upserted (the others are ok). */
#define MTX_BULK_ORDERED 1
#define MTX_BULK_FAILURES 2
MTX_HIDDEN int mtx_bulk_execute(lua_State *L, mtx_client *owner,
				mongoc_bulk_operation_t *bulk, const char *point,
				int n, int flags);

/* ---- cursor.c ---- */

struct mtx_cursor {
	mongoc_cursor_t *cursor; /* NULL once closed */
	mtx_client *owner;
	mtx_cursor *prev, *next; /* in owner->cursors */
};

/* Pushes a closed cursor that keeps the value at parent_idx alive; attach
 * gives it the libmongoc cursor (created after, so nothing can leak). */
MTX_HIDDEN mtx_cursor *mtx_new_cursor(lua_State *L, int parent_idx,
				      mtx_client *owner);
MTX_HIDDEN void mtx_cursor_attach(mtx_cursor *c, mongoc_cursor_t *cur);
MTX_HIDDEN void mtx_cursor_release(mtx_cursor *c);
MTX_HIDDEN int mtx_open_cursor(lua_State *L);

/* ---- ids.c: what may be an id, and its canonical key ---- */

MTX_HIDDEN int mtx_open_ids(lua_State *L);
/* core.id_key(v) -> key, snapshot | nil, message; raises for a value the
 * encoder refuses. */
MTX_HIDDEN int mtx_l_id_key(lua_State *L);

/* ---- stored.c: the ops as a transaction stores them ---- */

MTX_HIDDEN int mtx_open_stored(lua_State *L);
/* The parts of a stored op, by their stack indices (nil: left out):
 * collection, id, kind, doc and effect as values; update, undo and where
 * as their BSON in a string, or a table to encode. */
enum { MTX_SO_COLLECTION, MTX_SO_ID, MTX_SO_KIND, MTX_SO_UPDATE, MTX_SO_UNDO,
       MTX_SO_WHERE, MTX_SO_DOC, MTX_SO_EFFECT, MTX_SO_N };
MTX_HIDDEN extern const char *const mtx_stored_fields[MTX_SO_N];
/* Appends op i of the array arr as a transaction stores it. */
MTX_HIDDEN void mtx_append_stored_op(lua_State *L, const int parts[MTX_SO_N],
				     bson_t *arr, uint32_t i);
/* Pushes the array (a mongotx.Value, a copy) and its size. */
MTX_HIDDEN void mtx_push_stored_ops(lua_State *L, const bson_t *arr);
/* core.snapshot(t) -> copy, bytes; raises as the encoder does. */
MTX_HIDDEN int mtx_l_snapshot(lua_State *L);

/* ---- checks.c: the checks of a transaction's ops ---- */

MTX_HIDDEN int mtx_open_checks(lua_State *L);

/* ---- storable.c: values no stored document should hold ---- */

/* The first NaN or infinite number, or string that is not UTF-8, anywhere
 * in the value at idx (walked to depth MTX_MAX_DEPTH): what is wrong with
 * it (and under which key) pushed, and 1; else 0. */
MTX_HIDDEN int mtx_find_bad_scalar(lua_State *L, int idx, int depth);

/* ---- txn.c: the two-phase-commit steps (txn_ops.c, txn_state.c; txn.h) ---- */

MTX_HIDDEN int mtx_open_txn(lua_State *L);

/* fault.c: named crash points around every write of a step. */
#define MTX_FAULT_EXIT 86
MTX_HIDDEN void mtx_fault(const char *point, const char *when);
/* 1 with err set when core.refuse_now stands for a server that refuses
 * $$NOW in this write's filter, else 0. */
MTX_HIDDEN int mtx_fault_refuses(const bson_t *filter, bson_error_t *err);
/* A write at point that core.fault("<point>:drop:<n>") drops: 1 with err
 * set (a network error), else 0 (csrc/fault.c). */
MTX_HIDDEN int mtx_fault_drops(const char *point, bson_error_t *err);
MTX_HIDDEN int mtx_open_fault(lua_State *L);

/* signals.c: SIGINT and SIGTERM noted as a flag (the mongotx command). */
MTX_HIDDEN int mtx_open_signals(lua_State *L);

#endif

/* stored.c: the ops as a transaction document stores them
 * (lua/mongotx/stored.lua), built in one pass from the checked ops, and
 * the snapshots of the caller's tables they are made from.
 *
 * The array is made once per transaction and used three times: its size
 * is the size check of validate.ops, the insert (create, create_many)
 * appends it as it is (a mongotx.Value holding an array), and the
 * batched steps read each op's filter and update parts from it
 * (txn.c) instead of encoding the op's tables again. */
#include <string.h>

#include "mongotx.h"

/* The op fields kept as plain values, in the order they are stored. */
static const char *const plain_fields[] = {"collection", "id", "kind", NULL};

/* update, undo and where hold `$` keys, which servers refuse in a stored
 * document: each is kept as its BSON inside a Binary. */
static const char *const operator_fields[] = {"update", "undo", "where", NULL};

/* Appends op[f] (op at stack index op) as a Binary of its BSON: the bytes
 * encoded[f] (encoded a table or nil at stack index enc) when validate
 * kept them from its snapshot, else the table encoded here.  enc 0: none
 * kept. */
static void
append_operator_field(lua_State *L, int op, int enc, const char *f, bson_t *out)
{
	int top = lua_gettop(L);
	const char *bytes = NULL;
	size_t len = 0;

	lua_getfield(L, op, f);
	if (lua_isnil(L, -1)) {
		lua_settop(L, top);
		return;
	}
	if (enc && lua_istable(L, enc)) {
		lua_getfield(L, enc, f);
		bytes = lua_tolstring(L, -1, &len);
	}
	if (!bytes) {
		bson_t *doc = mtx_check_document_reused(L, top + 1);

		bson_append_binary(out, f, -1, BSON_SUBTYPE_BINARY, bson_get_data(doc),
				   doc->len);
		mtx_scratch_give(L, -1);
	} else {
		bson_append_binary(out, f, -1, BSON_SUBTYPE_BINARY, (const uint8_t *)bytes,
				   (uint32_t)len);
	}
	lua_settop(L, top);
}

static void
append_field(lua_State *L, int op, const char *f, bson_t *out)
{
	lua_getfield(L, op, f);
	if (!lua_isnil(L, -1))
		mtx_append_value(L, -1, out, f);
	lua_pop(L, 1);
}

/* core.stored_ops(ops [, encoded]) -> the ops as stored (a mongotx.Value
 * holding the array), its size in bytes.  ops: as validate.ops normalises
 * them (collection, id, kind, update, undo, where, doc, effect; `floor`
 * is derived again on loading, so not stored); encoded[i]: op i's
 * update, undo and where as BSON when already encoded.  Raises when
 * something cannot be encoded or the array passes 16 MiB. */
static int
l_stored_ops(lua_State *L)
{
	bson_t *arr, op_doc;
	bson_value_t v;
	char buf[16];
	const char *key;
	int i, n, k;

	lua_settop(L, 2);
	luaL_checktype(L, 1, LUA_TTABLE);
	n = (int)mtx_rawlen(L, 1);
	arr = mtx_scratch(L);
	for (i = 1; i <= n; i++) {
		int top = lua_gettop(L), op, enc;

		lua_rawgeti(L, 1, i);
		op = lua_gettop(L);
		luaL_argcheck(L, lua_istable(L, op), 1, "a list of ops");
		enc = 0;
		if (lua_istable(L, 2)) {
			lua_rawgeti(L, 2, i);
			enc = lua_gettop(L);
		}
		bson_uint32_to_string((uint32_t)(i - 1), &key, buf, sizeof buf);
		bson_append_document_begin(arr, key, -1, &op_doc);
		for (k = 0; plain_fields[k]; k++)
			append_field(L, op, plain_fields[k], &op_doc);
		for (k = 0; operator_fields[k]; k++)
			append_operator_field(L, op, enc, operator_fields[k], &op_doc);
		append_field(L, op, "doc", &op_doc);
		append_field(L, op, "effect", &op_doc);
		bson_append_document_end(arr, &op_doc);
		if (arr->len > MTX_MAX_BSON)
			luaL_error(L, "mongotx: the ops take more than 16 MiB");
		lua_settop(L, top);
	}
	v.value_type = BSON_TYPE_ARRAY;
	v.value.v_doc.data = (uint8_t *)bson_get_data(arr); /* copied */
	v.value.v_doc.data_len = arr->len;
	mtx_push_value(L, &v);
	lua_pushinteger(L, (lua_Integer)arr->len);
	return 2;
}

/* core.snapshot(t) -> copy, bytes: the table as it would be sent (encoded
 * as the field v of a document, so that it may be an array too, and
 * decoded again: plain tables, whatever metatables t carried) and its
 * BSON (what core.stored_ops keeps).  One call for validate's
 * encode-then-decode, which sends no string of the whole document and
 * skips the validation of bytes just encoded here.  Raises as
 * core.encode({ v = t }) does. */
static int
l_snapshot(lua_State *L)
{
	bson_t *holder;
	bson_iter_t it;
	const uint8_t *data;
	uint32_t len;

	luaL_checktype(L, 1, LUA_TTABLE);
	lua_settop(L, 1);
	lua_createtable(L, 0, 1);
	lua_pushvalue(L, 1);
	lua_setfield(L, 2, "v");
	holder = mtx_check_document_reused(L, 2);
	if (!bson_iter_init_find(&it, holder, "v"))
		return luaL_error(L, "mongotx: snapshot lost its value");
	if (BSON_ITER_HOLDS_ARRAY(&it))
		bson_iter_array(&it, &len, &data);
	else
		bson_iter_document(&it, &len, &data);
	mtx_push_iter(L, &it);
	lua_pushlstring(L, (const char *)data, len);
	mtx_scratch_give(L, 3);
	return 2;
}

int
mtx_open_stored(lua_State *L)
{
	lua_pushcfunction(L, l_stored_ops);
	lua_setfield(L, -2, "stored_ops");
	lua_pushcfunction(L, l_snapshot);
	lua_setfield(L, -2, "snapshot");
	return 0;
}

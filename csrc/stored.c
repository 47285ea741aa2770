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

/* Appends the plain value at idx under key: the strings and integers of
 * every op without the general encoder, anything else through it. */
static void
append_plain(lua_State *L, int idx, bson_t *out, const char *key)
{
	size_t len;
	const char *s;

	switch (lua_type(L, idx)) {
	case LUA_TNIL:
		return;
	case LUA_TSTRING:
		s = lua_tolstring(L, idx, &len);
		if (len <= MTX_MAX_BSON) {
			bson_append_utf8(out, key, -1, s, (int)len);
			return;
		}
		break;
	case LUA_TNUMBER:
		mtx_append_number(L, idx, out, key, -1, MTX_HINT_NONE);
		return;
	default:
		break;
	}
	mtx_append_value(L, idx, out, key);
}

/* update, undo and where hold `$` keys, which servers refuse in a stored
 * document: each is kept as its BSON inside a Binary, given as a string
 * (the bytes a snapshot made) or as a table encoded here. */
static void
append_operator_part(lua_State *L, int idx, bson_t *out, const char *key)
{
	const char *bytes;
	size_t len;

	if (lua_type(L, idx) == LUA_TSTRING) {
		bytes = lua_tolstring(L, idx, &len);
		bson_append_binary(out, key, -1, BSON_SUBTYPE_BINARY, (const uint8_t *)bytes,
				   (uint32_t)len);
	} else if (!lua_isnil(L, idx)) {
		bson_t *doc = mtx_check_document_reused(L, idx);

		bson_append_binary(out, key, -1, BSON_SUBTYPE_BINARY, bson_get_data(doc),
				   doc->len);
		mtx_scratch_give(L, -1);
		lua_pop(L, 1);
	}
}

/* The fields of a stored op, in the order they are stored. */
const char *const mtx_stored_fields[MTX_SO_N] = {
	"collection", "id", "kind", "update", "undo", "where", "doc", "effect"};

void
mtx_append_stored_op(lua_State *L, const int parts[MTX_SO_N], bson_t *arr, uint32_t i)
{
	bson_t op_doc;
	char buf[16];
	const char *key;
	int k;

	bson_uint32_to_string(i, &key, buf, sizeof buf);
	bson_append_document_begin(arr, key, -1, &op_doc);
	for (k = 0; k < MTX_SO_N; k++) {
		if (k == MTX_SO_UPDATE || k == MTX_SO_UNDO || k == MTX_SO_WHERE)
			append_operator_part(L, parts[k], &op_doc, mtx_stored_fields[k]);
		else
			append_plain(L, parts[k], &op_doc, mtx_stored_fields[k]);
	}
	bson_append_document_end(arr, &op_doc);
}

void
mtx_push_stored_ops(lua_State *L, const bson_t *arr)
{
	bson_value_t v;

	v.value_type = BSON_TYPE_ARRAY;
	v.value.v_doc.data = (uint8_t *)bson_get_data(arr); /* copied */
	v.value.v_doc.data_len = arr->len;
	mtx_push_value(L, &v);
	lua_pushinteger(L, (lua_Integer)arr->len);
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
	bson_t *arr;
	int i, n, k, parts[MTX_SO_N];

	lua_settop(L, 2);
	luaL_checktype(L, 1, LUA_TTABLE);
	n = (int)mtx_rawlen(L, 1);
	arr = mtx_scratch(L);
	for (i = 1; i <= n; i++) {
		int top = lua_gettop(L), op, enc = 0;

		lua_rawgeti(L, 1, i);
		op = lua_gettop(L);
		luaL_argcheck(L, lua_istable(L, op), 1, "a list of ops");
		if (lua_istable(L, 2)) {
			lua_rawgeti(L, 2, i);
			enc = lua_istable(L, -1) ? lua_gettop(L) : 0;
		}
		for (k = 0; k < MTX_SO_N; k++) {
			lua_getfield(L, op, mtx_stored_fields[k]);
			if (enc && (k == MTX_SO_UPDATE || k == MTX_SO_UNDO || k == MTX_SO_WHERE) &&
			    !lua_isnil(L, -1)) {
				lua_getfield(L, enc, mtx_stored_fields[k]);
				if (lua_isnil(L, -1))
					lua_pop(L, 1);
				else
					lua_remove(L, -2); /* the bytes kept */
			}
			parts[k] = lua_gettop(L);
		}
		mtx_append_stored_op(L, parts, arr, (uint32_t)(i - 1));
		if (arr->len > MTX_MAX_BSON)
			luaL_error(L, "mongotx: the ops take more than 16 MiB");
		lua_settop(L, top);
	}
	mtx_push_stored_ops(L, arr);
	return 2;
}

/* core.snapshot(t) -> copy, bytes: the table as it would be sent (encoded
 * as the field v of a document, so that it may be an array too, and
 * decoded again: plain tables, whatever metatables t carried) and its
 * BSON (what core.stored_ops keeps).  One call for validate's
 * encode-then-decode, which sends no string of the whole document and
 * skips the validation of bytes just encoded here.  Raises as
 * core.encode({ v = t }) does. */
int
mtx_l_snapshot(lua_State *L)
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
	lua_pushcfunction(L, mtx_l_snapshot);
	lua_setfield(L, -2, "snapshot");
	return 0;
}

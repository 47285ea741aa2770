/* checks.h: what the files of the op checks share (not the rest of the
 * C core): checks.c (the messages, the rules on the keys and numbers of
 * a stored value, ids and collections, and the core.check_* bindings),
 * checks_update.c (an update's operators, paths and modifiers, and the
 * undo derived from an $inc) and checks_ops.c (one op and the op walk,
 * core.check_ops).  Each function's comment is at its definition. */
#ifndef MONGOTX_CHECKS_H
#define MONGOTX_CHECKS_H

#include "mongotx.h"

/* The most the quick snapshots and the derived undo make without the
 * encoder: the bytes are copied out and the bson_t freed before anything
 * can raise (a child document moves even a small bson_t to the heap). */
#define QUICK_BYTES 120

/* ---- messages (checks.c) ---- */

MTX_HIDDEN const char *push_format(lua_State *L, const char *fmt, int idx);
MTX_HIDDEN const char *push_tostring(lua_State *L, int idx);
MTX_HIDDEN const char *push_type_name(lua_State *L, int idx);
MTX_HIDDEN const char *strip_prefix(lua_State *L);
MTX_HIDDEN int is_listed(const char *s, const char *const *list);

/* ---- walks of a value's tables: the keys and numbers no stored value may hold (checks.c) ---- */

MTX_HIDDEN int starts_with_dollar(const char *s, size_t n);
MTX_HIDDEN int holds_dot(const char *s, size_t n);
MTX_HIDDEN int is_empty(const char *s, size_t n);
MTX_HIDDEN int find_key(lua_State *L, int idx, int depth, int (*bad)(const char *, size_t));

/* ---- ids and collections (checks.c) ---- */

MTX_HIDDEN int check_id(lua_State *L, int idx);
MTX_HIDDEN int check_collection(lua_State *L, int idx, int txcoll, lua_Integer name_max);

/* ---- updates: operators, paths, modifiers, the derived undo (checks_update.c) ---- */

MTX_HIDDEN int touched(lua_State *L, int owned, const char *path, size_t np, const char *to, size_t nt);
MTX_HIDDEN int check_path(lua_State *L, int owned, const char *what, const char *opname);
MTX_HIDDEN int find_unstorable(lua_State *L, int u, const char *what);
MTX_HIDDEN int check_update(lua_State *L, int u, int owned, const char *what);
MTX_HIDDEN int inc_sign(lua_State *L, int u);
MTX_HIDDEN int inc_escrow(lua_State *L, int u);
MTX_HIDDEN int push_inverse_inc(lua_State *L, int u);

/* ---- the op walk (checks_ops.c) ---- */

MTX_HIDDEN int l_check_ops(lua_State *L);
/* The kinds of op (core.op_kinds). */
MTX_HIDDEN extern const char *const kinds[];

#endif

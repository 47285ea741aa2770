/* harness.h: what the two fuzz harnesses share (harness.c).  Both drive the
 * Lua <-> BSON bridge (csrc/value.c, encode.c, decode.c) through the same
 * Lua functions a user calls (core.encode, core.decode, the value
 * constructors), in a fresh lua_State per input so that lua_close frees
 * everything the input made and LeakSanitizer sees any C allocation the
 * bridge forgot. */
#ifndef MONGOTX_FUZZ_HARNESS_H
#define MONGOTX_FUZZ_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "../csrc/mongotx.h"

/* Stack index of the core table in every state fz_open makes. */
#define FZ_CORE 1

/* A new state holding the bridge's part of mongotx.core at FZ_CORE. */
lua_State *fz_open(void);

/* Aborts (a crash libFuzzer records) with the message when cond is false:
 * a broken promise of the bridge, not a clean error. */
void fz_require(int cond, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* Calls core[name] with the nargs values on top of the stack under
 * lua_pcall; leaves nres results (or the error value) and returns the
 * status.  An error value must be what the bridge raises: a string. */
int fz_call(lua_State *L, const char *name, int nargs, int nres);

/* Nesting depth of a valid document, the top level counting as 1. */
int fz_depth(const bson_t *b);

/* 1 when bson_init_static accepts every document, array and scope of a
 * code with scope in b, bson_iter walks each to its end, bson_validate
 * passes each scope, and every key of a document is UTF-8 (encode refuses
 * others).  What
 * bson_validate (libbson 1.23) passes may fail either: it does not look
 * inside a nested document or scope that lacks its final NUL, nor past a
 * regex that is not UTF-8 (where a 0 type byte then ends the walk early).
 * The bridge must refuse such BSON, not lose the rest of it. */
int fz_walks(const bson_t *b);

/* NULL when the bridge can give b back byte for byte, else why not (see
 * the rules in bson_roundtrip.c): a repeated key in a document, an array
 * whose keys are not "0", "1", ..., regex options libbson rewrites, code
 * with a NUL byte. */
const char *fz_not_exact(const bson_t *b);

/* Checks the bridge's round-trip promise on BSON it produced itself,
 * `bytes` (len bytes): valid, decodes, and re-encodes to the same bytes. */
void fz_check_reencode(lua_State *L, const char *bytes, size_t len);

/* Reads every decoded value of the table at idx back through the value
 * methods (tostring, :type(), :value(), core.type), so that the code
 * turning a BSON value into Lua runs for every type the input holds. */
void fz_touch(lua_State *L, int idx, int depth);

#endif

/* client.c: mongotx.Client, a connection pool of one to a MongoDB URI,
 * or (connect with pool = true) a client taken from the process-wide pool
 * of that URI until close.  Lifetimes follow liolib.c: the userdata exists
 * (closed) before the libmongoc client does; close, __gc and __close are
 * one idempotent function; a closed client's methods raise "attempt to use
 * a closed client".  Cursors are destroyed before their client, since
 * libmongoc needs the client to kill a server-side cursor. */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "mongotx.h"

/* ---- the process-wide pools ----
 *
 * One mongoc_client_pool_t (thread-safe) per URI and appname/TLS settings
 * per process, shared by every Lua state of the process (nginx's worker
 * and its worker-thread VMs), so that a process holds as many connections
 * as it has calls in flight, not one per Lua state.  Sharing between Lua
 * states is the point, so this is the one place where the core keeps
 * state in C globals: a list under a mutex, whose entries live as long as
 * the process: closing a Lua state does not end them (core.c pins the
 * module so that their threads' code stays mapped), exit() does (below).
 * Each entry remembers the process that made it: after a fork() the child
 * makes its own (libmongoc's monitoring threads of the parent's pools did
 * not follow it). */
struct mtx_pool {
	mtx_pool *next;
	char *key;		    /* URI, appname and TLS settings */
	pid_t pid;		    /* the process that made the pool */
	mongoc_uri_t *uri;	    /* its write concern and read preference
				       are what a pop starts from */
	mongoc_client_pool_t *pool;
	mtx_counters counters;	    /* of every client of the pool (atomic) */
	int64_t in_use, peak, pops; /* clients out, most out at once, pops */
	int64_t taking;		    /* pops under way (atomic) */
	int closed;		    /* set at exit: no more pops (atomic) */
};

static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;
static mtx_pool *pools;

#define MTX_ATOMIC_ADD(p, n) __atomic_add_fetch((p), (n), __ATOMIC_RELAXED)
#define MTX_ATOMIC_GET(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define MTX_ATOMIC_SET(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

mtx_client *
mtx_check_client(lua_State *L, int idx)
{
	return (mtx_client *)luaL_checkudata(L, idx, MTX_CLIENT_MT);
}

mongoc_client_t *
mtx_client_handle(lua_State *L, mtx_client *c)
{
	if (!c->client)
		luaL_error(L, "attempt to use a closed client");
	return c->client;
}

static int
client_close(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);

	while (c->cursors)
		mtx_cursor_release(c->cursors);
	if (c->client && c->pool) {
		/* a client a forked child inherited is not its to give back */
		if (c->pool->pid == getpid()) {
			mongoc_client_pool_push(c->pool->pool, c->client);
			MTX_ATOMIC_ADD(&c->pool->in_use, -1);
		}
		c->client = NULL;
	} else if (c->client) {
		mongoc_client_destroy(c->client);
		c->client = NULL;
	}
	return 0;
}

static int
client_tostring(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);

	if (c->client && c->pool)
		lua_pushfstring(L, "mongotx.Client (pooled, %p)", (void *)c);
	else if (c->client)
		lua_pushfstring(L, "mongotx.Client (%p)", (void *)c);
	else
		lua_pushliteral(L, "mongotx.Client (closed)");
	return 1;
}

/* Reads field `name` of the tls table at idx: a string (or nil), pushed. */
static const char *
tls_string(lua_State *L, int idx, const char *name, const char *option)
{
	lua_getfield(L, idx, name);
	if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TSTRING)
		mtx_option_error(L, -1, option, "a string");
	return lua_tostring(L, -1);
}

static int
tls_bool(lua_State *L, int idx, const char *name, const char *option)
{
	lua_getfield(L, idx, name);
	if (!lua_isnil(L, -1) && !lua_isboolean(L, -1))
		mtx_option_error(L, -1, option, "a boolean");
	return lua_toboolean(L, -1);
}

/* Checks the tls table at idx; with a client, hands it to libmongoc. */
static void
apply_tls(lua_State *L, int idx, mongoc_client_t *client)
{
	static const char *const names[] = {"ca_file", "pem_file",
		"pem_password", "allow_invalid_certificates",
		"allow_invalid_hostname", NULL};
	mongoc_ssl_opt_t tls = *mongoc_ssl_opt_get_default();

	mtx_check_suboptions(L, idx, "tls", names);
	tls.ca_file = tls_string(L, idx, "ca_file", "tls.ca_file");
	tls.pem_file = tls_string(L, idx, "pem_file", "tls.pem_file");
	tls.pem_pwd = tls_string(L, idx, "pem_password", "tls.pem_password");
	tls.weak_cert_validation = tls_bool(L, idx, "allow_invalid_certificates",
					    "tls.allow_invalid_certificates");
	tls.allow_invalid_hostname = tls_bool(L, idx, "allow_invalid_hostname",
					      "tls.allow_invalid_hostname");
	if (client)
		mongoc_client_set_ssl_opts(client, &tls); /* copies the strings */
	lua_pop(L, 5);
}

/* Statements a write command carries (client:command's): the length of
 * its documents, updates or deletes array, 1 for findAndModify, 0 for
 * anything else. */
static int64_t
count_writes(const char *name, const bson_t *cmd)
{
	const char *key;
	bson_iter_t it, arr;
	int64_t n = 0;

	if (strcmp(name, "insert") == 0)
		key = "documents";
	else if (strcmp(name, "update") == 0)
		key = "updates";
	else if (strcmp(name, "delete") == 0)
		key = "deletes";
	else
		return strcmp(name, "findAndModify") == 0;
	if (bson_iter_init_find(&it, cmd, key) && BSON_ITER_HOLDS_ARRAY(&it) &&
	    bson_iter_recurse(&it, &arr))
		while (bson_iter_next(&arr))
			n++;
	return n;
}

/* Commands: libmongoc ends every command it sends (a getMore, a
 * killCursors, each command a bulk write is cut into) with one succeeded
 * or one failed event, on the calling thread (a client is
 * single-threaded).  Not the started event, which would do as well but
 * makes libmongoc copy the command (its document sequence made an
 * array): about 4 000 instructions a command, against 200 for these
 * (bench/README.md, "Per command in libmongoc").  The statements are
 * counted by mongotx where it hands them over (mtx_count_writes). */
/* The documents of a reply's cursor batch (firstBatch of a find or an
 * aggregate, nextBatch of a getMore): what a read brought, however the
 * server cut it into replies.  Other replies carry none. */
static int64_t
batch_length(const mongoc_apm_command_succeeded_t *event)
{
	const char *name = mongoc_apm_command_succeeded_get_command_name(event);
	const char *key = strcmp(name, "getMore") ? "cursor.firstBatch" : "cursor.nextBatch";
	bson_iter_t it, docs;
	int64_t n = 0;

	if (strcmp(name, "find") && strcmp(name, "getMore") && strcmp(name, "aggregate"))
		return 0;
	if (!bson_iter_init(&it, mongoc_apm_command_succeeded_get_reply(event)) ||
	    !bson_iter_find_descendant(&it, key, &docs) || !BSON_ITER_HOLDS_ARRAY(&docs) ||
	    !bson_iter_recurse(&docs, &it))
		return 0;
	while (bson_iter_next(&it))
		n++;
	return n;
}

static void
count_succeeded(const mongoc_apm_command_succeeded_t *event)
{
	mtx_counters *k = (mtx_counters *)mongoc_apm_command_succeeded_get_context(event);

	k->commands++;
	k->returned += batch_length(event);
}

static void
count_failed(const mongoc_apm_command_failed_t *event)
{
	((mtx_counters *)mongoc_apm_command_failed_get_context(event))->commands++;
}

/* The same for the clients of a pool, which run on many threads. */
static void
count_pooled_succeeded(const mongoc_apm_command_succeeded_t *event)
{
	mtx_pool *p = (mtx_pool *)mongoc_apm_command_succeeded_get_context(event);

	MTX_ATOMIC_ADD(&p->counters.commands, 1);
	MTX_ATOMIC_ADD(&p->counters.returned, batch_length(event));
}

static void
count_pooled_failed(const mongoc_apm_command_failed_t *event)
{
	mtx_pool *p = (mtx_pool *)mongoc_apm_command_failed_get_context(event);

	MTX_ATOMIC_ADD(&p->counters.commands, 1);
}

static void
watch_commands(mtx_client *c)
{
	mongoc_apm_callbacks_t *cbs = mongoc_apm_callbacks_new();

	mongoc_apm_set_command_succeeded_cb(cbs, count_succeeded);
	mongoc_apm_set_command_failed_cb(cbs, count_failed);
	mongoc_client_set_apm_callbacks(c->client, cbs, &c->counters); /* copies cbs */
	mongoc_apm_callbacks_destroy(cbs);
}

/* The counters c adds to: a pool counts for all its clients (APM is set
 * per pool). */
static mtx_counters *
counters_of(mtx_client *c)
{
	return c->pool ? &c->pool->counters : &c->counters;
}

int64_t
mtx_commands_sent(mtx_client *c)
{
	return MTX_ATOMIC_GET(&counters_of(c)->commands);
}

/* With a pool, another thread's command may have moved the count too: a
 * write libmongoc refused before sending it (a document it would not
 * validate) can then count, nothing else. */
void
mtx_count_writes(mtx_client *c, int64_t since, int64_t n)
{
	mtx_counters *k = counters_of(c);

	if (MTX_ATOMIC_GET(&k->commands) != since)
		MTX_ATOMIC_ADD(&k->writes, n);
}

/* The key of a pool: the URI and what is set on the pool rather than on
 * each client (appname, TLS), from the option values at 3 (appname) and 4
 * (tls, checked).  The caller frees it. */
static char *
pool_key(lua_State *L, const char *uristr)
{
	static const char *const fields[] = {"ca_file", "pem_file",
		"pem_password", "allow_invalid_certificates",
		"allow_invalid_hostname", NULL};
	bson_string_t *key = bson_string_new(uristr);
	int i;

	bson_string_append_c(key, '\n');
	if (!lua_isnil(L, 3))
		bson_string_append(key, lua_tostring(L, 3));
	for (i = 0; !lua_isnil(L, 4) && fields[i]; i++) {
		lua_getfield(L, 4, fields[i]);
		bson_string_append_printf(key, "\n%s=", fields[i]);
		if (lua_isboolean(L, -1))
			bson_string_append(key, lua_toboolean(L, -1) ? "1" : "0");
		else if (lua_isstring(L, -1))
			bson_string_append(key, lua_tostring(L, -1));
		lua_pop(L, 1);
	}
	return bson_string_free(key, false);
}

/* A new pool entry for uristr (NULL and err set when libmongoc refuses
 * the URI) with the appname and TLS options given (each may be NULL). */
static mtx_pool *
new_pool(const char *uristr, char *key, const char *appname,
	 const mongoc_ssl_opt_t *tls, bson_error_t *err)
{
	mongoc_apm_callbacks_t *cbs;
	mtx_pool *p;
	mongoc_uri_t *uri;

	if (!(uri = mtx_uri_new(uristr, err)))
		return NULL;
	p = (mtx_pool *)bson_malloc0(sizeof *p);
	p->uri = uri;
	if (!(p->pool = mongoc_client_pool_new_with_error(uri, err))) {
		mongoc_uri_destroy(uri);
		bson_free(p);
		return NULL;
	}
	p->key = key;
	p->pid = getpid();
	mongoc_client_pool_set_error_api(p->pool, MONGOC_ERROR_API_VERSION_2);
	cbs = mongoc_apm_callbacks_new();
	mongoc_apm_set_command_succeeded_cb(cbs, count_pooled_succeeded);
	mongoc_apm_set_command_failed_cb(cbs, count_pooled_failed);
	mongoc_client_pool_set_apm_callbacks(p->pool, cbs, p); /* copies cbs */
	mongoc_apm_callbacks_destroy(cbs);
	if (appname)
		mongoc_client_pool_set_appname(p->pool, appname);
	if (tls)
		mongoc_client_pool_set_ssl_opts(p->pool, tls); /* copies */
	return p;
}

/* ---- the end of the process ----
 *
 * exit() runs libmongoc's own destructor (mongoc_cleanup: it frees the
 * driver's globals) while the monitoring threads of a pool still run.  So
 * the pools of this process are destroyed first, by a handler registered
 * with atexit (which exit() runs before the libraries' destructors) when
 * the first pool is made: mongoc_client_pool_destroy stops and joins the
 * threads and frees the clients given back.  (Registered from a shared
 * object, the handler would also run at its dlclose, before the unmap:
 * with core.c's pin that never happens, so it runs at exit.)  A pool
 * with a client still out (taken by another thread or Lua state that runs
 * on while exit() does, or by a program that exits without closing its
 * Lua state) is left as it is, since that client may be in use: its
 * threads end with the process, and the pin keeps their code mapped until
 * then; pops that come after the handler fail.  Pools inherited over a
 * fork() are not the child's to destroy (their threads live in the
 * parent).  spec/42-exit_spec.lua shows each case. */
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static void
destroy_pools(void)
{
	mtx_pool **link = &pools, *p;
	pid_t pid = getpid();

	pthread_mutex_lock(&pools_lock);
	while ((p = *link)) {
		/* closed first, then the count of pops under way: a pop
		 * either sees closed or is counted here (both seq_cst) */
		__atomic_store_n(&p->closed, 1, __ATOMIC_SEQ_CST);
		if (p->pid != pid || __atomic_load_n(&p->taking, __ATOMIC_SEQ_CST) ||
		    __atomic_load_n(&p->in_use, __ATOMIC_SEQ_CST)) {
			link = &p->next;
			continue;
		}
		*link = p->next;
		mongoc_client_pool_destroy(p->pool);
		mongoc_uri_destroy(p->uri);
		bson_free(p->key);
		bson_free(p);
	}
	pthread_mutex_unlock(&pools_lock);
}

static void
register_exit(void)
{
	atexit(destroy_pools);
}

/* The pool of this process for the URI and the options at 3 (appname)
 * and 4 (tls, checked), made on first use; NULL and err set when the URI
 * is refused.  Everything is read from Lua before the lock is taken, so
 * nothing can raise while it is held. */
static mtx_pool *
find_pool(lua_State *L, const char *uristr, bson_error_t *err)
{
	const char *appname = lua_tostring(L, 3);
	mongoc_ssl_opt_t tls = *mongoc_ssl_opt_get_default();
	char *key = pool_key(L, uristr);
	pid_t pid = getpid();
	mtx_pool *p;

	lua_pushvalue(L, 4); /* the tls strings stay on the stack meanwhile */
	if (!lua_isnil(L, 4)) {
		tls.ca_file = tls_string(L, 4, "ca_file", "tls.ca_file");
		tls.pem_file = tls_string(L, 4, "pem_file", "tls.pem_file");
		tls.pem_pwd = tls_string(L, 4, "pem_password", "tls.pem_password");
		tls.weak_cert_validation = tls_bool(L, 4,
			"allow_invalid_certificates",
			"tls.allow_invalid_certificates");
		tls.allow_invalid_hostname = tls_bool(L, 4,
			"allow_invalid_hostname", "tls.allow_invalid_hostname");
	}
	pthread_mutex_lock(&pools_lock);
	for (p = pools; p; p = p->next)
		if (p->pid == pid && strcmp(p->key, key) == 0)
			break;
	if (p) {
		bson_free(key);
	} else if ((p = new_pool(uristr, key, appname,
				 lua_isnil(L, 4) ? NULL : &tls, err))) {
		p->next = pools;
		pools = p;
		pthread_once(&exit_once, register_exit);
	} else {
		bson_free(key);
	}
	pthread_mutex_unlock(&pools_lock);
	return p;
}

/* Takes a client of the pool for the closed client c (which then owns
 * it): libmongoc's pop, which waits while maxPoolSize clients are out
 * (at most waitQueueTimeoutMS when the URI sets it).  NULL, or why not. */
static const char *
pop_client(mtx_client *c, mtx_pool *p)
{
	int64_t out, peak;

	c->pool = p;
	__atomic_add_fetch(&p->taking, 1, __ATOMIC_SEQ_CST);
	if (__atomic_load_n(&p->closed, __ATOMIC_SEQ_CST)) {
		__atomic_add_fetch(&p->taking, -1, __ATOMIC_SEQ_CST);
		return "the pool is closed: the process is exiting";
	}
	if (!(c->client = mongoc_client_pool_pop(p->pool))) {
		__atomic_add_fetch(&p->taking, -1, __ATOMIC_SEQ_CST);
		return "no client of the pool came free within waitQueueTimeoutMS";
	}
	out = __atomic_add_fetch(&p->in_use, 1, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(&p->taking, -1, __ATOMIC_SEQ_CST);
	MTX_ATOMIC_ADD(&p->pops, 1);
	peak = MTX_ATOMIC_GET(&p->peak);
	while (out > peak && !__atomic_compare_exchange_n(&p->peak, &peak, out,
		0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
	/* what the last holder set does not carry over */
	mongoc_client_set_write_concern(c->client,
					mongoc_uri_get_write_concern(p->uri));
	mongoc_client_set_read_prefs(c->client,
				     mongoc_uri_get_read_prefs_t(p->uri));
	return NULL;
}

/* connect(uri [, { appname, write_concern, read_preference, tls, pool }]).
 * Authentication, TLS, timeouts and the rest come in the URI as libmongoc
 * reads it; the options cover what a URI cannot say as well.  With pool =
 * true the client is taken from this process's pool for the URI (made on
 * first use; maxPoolSize in the URI sizes it, default 100) and given back
 * by close() or __gc. */
static int
l_connect(lua_State *L)
{
	static const char *const names[] = {"appname", "pool",
		"read_preference", "tls", "write_concern", NULL};
	const char *uristr = luaL_checkstring(L, 1);
	mtx_client *c;
	mtx_pool *p;
	mongoc_uri_t *uri;
	mongoc_write_concern_t *wc;
	mongoc_read_prefs_t *rp;
	bson_error_t err;
	const char *appname, *why;
	int pooled = 0;

	mtx_check_options(L, 2, names);
	lua_settop(L, 2);
	if (!lua_isnil(L, 2)) {
		lua_getfield(L, 2, "pool");
		if (!lua_isnil(L, -1) && !lua_isboolean(L, -1))
			mtx_option_error(L, -1, "pool", "a boolean");
		pooled = lua_toboolean(L, -1);
		lua_pop(L, 1);
	}
	if (!lua_isnil(L, 2)) {
		lua_getfield(L, 2, "appname");
		lua_getfield(L, 2, "tls");
		lua_getfield(L, 2, "write_concern");
		lua_getfield(L, 2, "read_preference");
	} else {
		lua_settop(L, 6);
	}
	/* every option is checked before anything is created */
	if (!lua_isnil(L, 3) && lua_type(L, 3) != LUA_TSTRING)
		mtx_option_error(L, 3, "appname", "a string");
	appname = lua_tostring(L, 3);
	if (!lua_isnil(L, 4))
		apply_tls(L, 4, NULL);
	mongoc_write_concern_destroy(mtx_check_write_concern(L, 5));
	mongoc_read_prefs_destroy(mtx_check_read_prefs(L, 6));

	c = (mtx_client *)mtx_newuserdata(L, sizeof *c);
	c->client = NULL;
	c->cursors = NULL;
	c->counters.commands = c->counters.writes = c->counters.returned = 0;
	c->pool = NULL;
	luaL_getmetatable(L, MTX_CLIENT_MT);
	lua_setmetatable(L, -2);

	if (pooled) {
		if (!(p = find_pool(L, uristr, &err)))
			return mtx_push_error(L, &err, NULL);
		if ((why = pop_client(c, p)))
			return mtx_push_error_msg(L, "client", 0, why);
		/* from here on the userdata owns the client */
		if ((wc = mtx_check_write_concern(L, 5))) {
			mongoc_client_set_write_concern(c->client, wc);
			mongoc_write_concern_destroy(wc);
		}
		if ((rp = mtx_check_read_prefs(L, 6))) {
			mongoc_client_set_read_prefs(c->client, rp);
			mongoc_read_prefs_destroy(rp);
		}
		lua_settop(L, 7);
		return 1;
	}
	if (!(uri = mtx_uri_new(uristr, &err)))
		return mtx_push_error(L, &err, NULL);
	c->client = mongoc_client_new_from_uri_with_error(uri, &err);
	mongoc_uri_destroy(uri);
	if (!c->client)
		return mtx_push_error(L, &err, NULL);
	mongoc_client_set_error_api(c->client, MONGOC_ERROR_API_VERSION_2);
	watch_commands(c);
	if (appname)
		mongoc_client_set_appname(c->client, appname);
	/* from here on the userdata owns the client: raising cannot leak */
	if ((wc = mtx_check_write_concern(L, 5))) {
		mongoc_client_set_write_concern(c->client, wc);
		mongoc_write_concern_destroy(wc);
	}
	if ((rp = mtx_check_read_prefs(L, 6))) {
		mongoc_client_set_read_prefs(c->client, rp);
		mongoc_read_prefs_destroy(rp);
	}
	if (!lua_isnil(L, 4))
		apply_tls(L, 4, c->client);
	lua_settop(L, 7);
	return 1;
}

/* client:collection(db, name) */
static int
client_collection(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);
	const char *db = luaL_checkstring(L, 2);
	const char *name = luaL_checkstring(L, 3);

	/* libmongoc aborts the process (a failed precondition) on the first
	 * read of a collection whose database or name is empty */
	if (!*db || !*name)
		return luaL_argerror(L, *db ? 3 : 2, "may not be empty");
	mtx_client_handle(L, c);
	mtx_push_collection(L, 1, c, db, name);
	return 1;
}

/* client:command(db, command [, { read_preference, write_concern }]):
 * the server's reply, or nil, err. */
static int
client_command(lua_State *L)
{
	static const char *const names[] = {"read_preference", "write_concern",
		NULL};
	mtx_client *c = mtx_check_client(L, 1);
	const char *db = luaL_checkstring(L, 2);
	bson_t *cmd, *opts, *reply;
	mongoc_read_prefs_t *rp;
	bson_error_t err;
	bson_iter_t it;
	int64_t sent;
	bool ok;

	lua_settop(L, 4); /* absent optional arguments keep their slots */
	mongoc_client_t *client = mtx_client_handle(L, c);
	cmd = mtx_check_ordered(L, 3);
	mtx_check_options(L, 4, names);
	opts = mtx_scratch(L);
	mtx_opt_write_concern(L, 4, opts);
	rp = mtx_opt_read_prefs(L, 4);
	reply = mtx_scratch(L);
	sent = mtx_commands_sent(c);
	ok = mongoc_client_command_with_opts(client, db, cmd, rp, opts, reply, &err);
	if (bson_iter_init(&it, cmd) && bson_iter_next(&it))
		mtx_count_writes(c, sent, count_writes(bson_iter_key(&it), cmd));
	if (!ok)
		return mtx_push_error(L, &err, reply);
	mtx_push_document(L, reply);
	return 1;
}

/* client:counters() -> { commands, writes } since connect or the last
 * reset_counters(): round trips and write statements, as sent. */
static int
client_counters(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);
	mtx_counters *n = counters_of(c);

	mtx_client_handle(L, c);
	lua_createtable(L, 0, 2);
	lua_pushinteger(L, (lua_Integer)MTX_ATOMIC_GET(&n->commands));
	lua_setfield(L, -2, "commands");
	lua_pushinteger(L, (lua_Integer)MTX_ATOMIC_GET(&n->writes));
	lua_setfield(L, -2, "writes");
	return 1;
}

static int
client_reset_counters(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);
	mtx_counters *n = counters_of(c);

	mtx_client_handle(L, c);
	MTX_ATOMIC_SET(&n->commands, 0);
	MTX_ATOMIC_SET(&n->writes, 0);
	MTX_ATOMIC_SET(&n->returned, 0);
	return 0;
}

/* client:returned() -> the documents the server's find, getMore and
 * aggregate replies carried since connect or the last reset_counters():
 * what reads brought, not what the caller took from its cursors. */
static int
client_returned(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);
	mtx_counters *n = counters_of(c);

	mtx_client_handle(L, c);
	lua_pushinteger(L, (lua_Integer)MTX_ATOMIC_GET(&n->returned));
	return 1;
}

/* client:pool() -> { id, pid, max_size, in_use, peak, pops } for a client
 * of a pool (nil for another): the pool's identity (one per URI and
 * options per process), maxPoolSize, clients out now, most clients out at
 * once (libmongoc makes a client, and its connections, only when none is
 * free, so this is how many it made) and pops so far. */
static int
client_pool(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);
	mtx_pool *p = c->pool;

	mtx_client_handle(L, c);
	if (!p) {
		lua_pushnil(L);
		return 1;
	}
	lua_createtable(L, 0, 6);
	lua_pushfstring(L, "%p", (void *)p);
	lua_setfield(L, -2, "id");
	lua_pushinteger(L, (lua_Integer)p->pid);
	lua_setfield(L, -2, "pid");
	lua_pushinteger(L, (lua_Integer)mongoc_uri_get_option_as_int32(
		p->uri, MONGOC_URI_MAXPOOLSIZE, 100));
	lua_setfield(L, -2, "max_size");
	lua_pushinteger(L, (lua_Integer)MTX_ATOMIC_GET(&p->in_use));
	lua_setfield(L, -2, "in_use");
	lua_pushinteger(L, (lua_Integer)MTX_ATOMIC_GET(&p->peak));
	lua_setfield(L, -2, "peak");
	lua_pushinteger(L, (lua_Integer)MTX_ATOMIC_GET(&p->pops));
	lua_setfield(L, -2, "pops");
	return 1;
}

static int
client_set_write_concern(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);
	mongoc_client_t *client = mtx_client_handle(L, c);
	mongoc_write_concern_t *wc;

	luaL_checktype(L, 2, LUA_TTABLE);
	wc = mtx_check_write_concern(L, 2);
	mongoc_client_set_write_concern(client, wc);
	mongoc_write_concern_destroy(wc);
	return 0;
}

static int
client_set_read_preference(lua_State *L)
{
	mtx_client *c = mtx_check_client(L, 1);
	mongoc_client_t *client = mtx_client_handle(L, c);
	mongoc_read_prefs_t *rp;

	luaL_checkstring(L, 2);
	rp = mtx_check_read_prefs(L, 2);
	mongoc_client_set_read_prefs(client, rp);
	mongoc_read_prefs_destroy(rp);
	return 0;
}

/***
 * The core's client handles.
 * @module mongotx.core
 */

/***
 * A client of the deployment (no round trip until its first call).
 * @syntax client = core.connect(uri [, { appname, write_concern, read_preference, tls, pool }])
 * @string uri a MongoDB URI
 * @tparam[opt] table opts as `mongotx.connect` but `database`; `pool = true` takes a client of the process's pool
 * @treturn userdata the client
 * @errors raises on a bad URI or option
 * @usage local client = core.connect("mongodb://127.0.0.1:27017")
 * @function connect
 */

/***
 * A collection handle.
 * @syntax coll = client:collection(db, name)
 * @string db the database
 * @string name the collection
 * @treturn userdata the collection
 * @usage local accounts = client:collection("bank", "accounts")
 * @function Client:collection
 */

/***
 * Runs a database command.
 * @syntax reply, err = client:command(db, command [, { read_preference, write_concern }])
 * @string db the database
 * @tparam table command a `core.doc` (the command name first)
 * @tparam[opt] table opts
 * @treturn table the server's reply
 * @errors nil, err: the C core's codes (`server`, `stream`, `server_selection`, `write_concern`, ...); a wrong Lua type raises
 * @usage local reply = assert(client:command("admin", core.doc("ping", 1)))
 * @function Client:command
 */

/***
 * Round trips and write statements sent since connect or `reset_counters`.
 * @syntax c = client:counters()
 * @treturn table `{ commands, writes }`
 * @usage print(client:counters().commands)
 * @function Client:counters
 */

/***
 * The documents the server's find, getMore and aggregate replies carried since connect or `reset_counters`:
 * what reads brought, not what the caller took from its cursors.
 * @syntax n = client:returned()
 * @treturn integer the documents
 * @usage print(client:returned())
 * @function Client:returned
 */

/***
 * Sets the counters (and `returned`) to 0.
 * @syntax client:reset_counters()
 * @usage client:reset_counters()
 * @function Client:reset_counters
 */

/***
 * The figures of the pool a pooled client came from.
 * @syntax figures = client:pool()
 * @treturn ?table `{ id, pid, max_size, in_use, peak, pops }`, or nil for a client of its own
 * @usage local p = client:pool()
 * @function Client:pool
 */

/***
 * The write concern of this client's calls from now on.
 * @syntax client:set_write_concern(wc)
 * @tparam table wc `{ w, j, wtimeout }`
 * @errors raises on a bad value
 * @usage client:set_write_concern({ w = "majority", j = true })
 * @function Client:set_write_concern
 */

/***
 * The read preference of this client's calls from now on.
 * @syntax client:set_read_preference(mode)
 * @string mode "primary", "secondary", "primaryPreferred", "secondaryPreferred" or "nearest"
 * @errors raises on a bad mode
 * @usage client:set_read_preference("primaryPreferred")
 * @function Client:set_read_preference
 */

/***
 * Closes the client (a pooled one goes back to its pool); its collections stay usable until closed.
 * @syntax client:close()
 * @usage client:close()
 * @function Client:close
 */

int
mtx_open_client(lua_State *L)
{
	static const luaL_Reg methods[] = {
		{"close", client_close},
		{"collection", client_collection},
		{"command", client_command},
		{"counters", client_counters},
		{"pool", client_pool},
		{"reset_counters", client_reset_counters},
		{"returned", client_returned},
		{"set_read_preference", client_set_read_preference},
		{"set_write_concern", client_set_write_concern},
		{NULL, NULL},
	};
	static const luaL_Reg meta[] = {
		{"__close", client_close},
		{"__gc", client_close},
		{"__tostring", client_tostring},
		{NULL, NULL},
	};

	luaL_newmetatable(L, MTX_CLIENT_MT);
	luaL_setfuncs(L, meta, 0);
	lua_newtable(L);
	luaL_setfuncs(L, methods, 0);
	lua_setfield(L, -2, "__index");
	lua_pop(L, 1);
	lua_pushcfunction(L, l_connect);
	lua_setfield(L, -2, "connect");
	return 0;
}

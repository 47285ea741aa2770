/* signals.c: SIGINT and SIGTERM as a flag, for the `mongotx` command
 * (lua/mongotx/cli.lua).
 *
 * Lua's standalone interpreters (lua5.4, luajit) turn SIGINT into an
 * `interrupted!` error raised wherever the script happens to be, in the
 * middle of a transaction's steps, and leave SIGTERM to kill the process.
 * A command that steps many transactions wants neither: it stops between
 * two of them.  core.catch_signals() replaces both handlers with one that
 * only notes the signal; core.signal_caught() tells which came, and the
 * command stops when it next asks.  SA_RESETHAND puts the default action
 * back after the first one, so a second Ctrl-C ends the process at once
 * (the transactions it held are then recovered after their lease).
 * SA_RESTART keeps the reads and writes in flight going: libmongoc
 * retries a poll() that a signal interrupted. */
#include <signal.h>

#include "mongotx.h"

static volatile sig_atomic_t caught;

static void
note(int sig)
{
	caught = sig;
}

/* catch_signals(): from now on SIGINT and SIGTERM are noted, not acted
 * on (once each; see above).  Returns nothing, raises if sigaction fails. */
static int
l_catch_signals(lua_State *L)
{
	static const int sigs[] = {SIGINT, SIGTERM};
	struct sigaction sa;
	size_t i;

	sa.sa_handler = note;
	sa.sa_flags = SA_RESTART | SA_RESETHAND;
	sigemptyset(&sa.sa_mask);
	for (i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
		if (sigaction(sigs[i], &sa, NULL) != 0)
			return luaL_error(L, "mongotx: cannot catch signal %d", sigs[i]);
	}
	return 0;
}

/* signal_caught() -> the name ("SIGINT", "SIGTERM") and number of the
 * last signal noted, or nothing. */
static int
l_signal_caught(lua_State *L)
{
	int sig = caught;

	if (sig == 0)
		return 0;
	lua_pushstring(L, sig == SIGINT ? "SIGINT" : "SIGTERM");
	lua_pushinteger(L, sig);
	return 2;
}

int
mtx_open_signals(lua_State *L)
{
	lua_pushcfunction(L, l_catch_signals);
	lua_setfield(L, -2, "catch_signals");
	lua_pushcfunction(L, l_signal_caught);
	lua_setfield(L, -2, "signal_caught");
	return 0;
}

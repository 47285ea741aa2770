# mongotx: the one entry point.  `make` builds the C module for Lua 5.4,
# `make test` sets up what is missing and runs the specs against a
# mongo-java-server it starts itself; see README.md for the rest.

LUA        ?= lua5.4
LUA_PC     ?= lua5.4
BUILD      ?= build/lua54
CC         ?= cc
CFLAGS     ?= -O2 -g
WARN       := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes
MONGOC_CFLAGS := $(shell pkg-config --cflags libmongoc-1.0 2>/dev/null)
MONGOC_LIBS   := $(shell pkg-config --libs libmongoc-1.0 2>/dev/null)
LUA_CFLAGS    := $(shell pkg-config --cflags $(LUA_PC) 2>/dev/null)
ALL_CFLAGS := -std=c99 -D_DEFAULT_SOURCE -fPIC -fvisibility=hidden $(WARN) \
              $(MONGOC_CFLAGS) $(LUA_CFLAGS) $(CFLAGS)

SRC := $(wildcard csrc/*.c)
HDR := $(wildcard csrc/*.h)
OBJ := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(SRC))
SO  := $(BUILD)/mongotx/core.so

BUSTED      = spec/support/busted-lua5.4
SPEC_ENV    = MONGOTX_CPATH="$(CURDIR)/$(BUILD)/?.so"
SERVER     ?= memory
WITH_SERVER = spec/support/with-server

.PHONY: all setup server test test-docs docs test-ferretdb test-luajit test-openresty memcheck asan fuzz fuzz-ci demo bench bench-openresty bench-memory bench-valgrind bench-scale torture torture-ci lint clean

all: $(SO)

$(BUILD)/obj/%.o: csrc/%.c $(HDR)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(SO): $(OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared -o $@ $(OBJ) $(MONGOC_LIBS) $(LDFLAGS)

setup:
	@spec/support/setup.sh

test: setup
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- $(BUSTED) $(BUSTED_ARGS)

test-ferretdb:
	@spec/support/setup.sh deps java ferretdb
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) ferretdb -- $(BUSTED) $(BUSTED_ARGS)

test-luajit: setup
	@$(MAKE) --no-print-directory all LUA=luajit LUA_PC=luajit BUILD=build/luajit
	MONGOTX_CPATH="$(CURDIR)/build/luajit/?.so" $(WITH_SERVER) $(SERVER) -- spec/support/busted-luajit $(BUSTED_ARGS)

# mongotx.resty in real nginx (docs/openresty.md): Debian's nginx with
# its Lua module, OpenResty's LuaJIT and the LuaJIT build; the spec starts
# its own test server (it stops it with SIGSTOP) and nginx; spec/44 is
# group commit (mongotx.group) in nginx.  About 2 minutes.
test-openresty:
	@spec/support/setup.sh deps java openresty
	@$(MAKE) --no-print-directory all LUA=luajit LUA_PC=luajit BUILD=build/luajit
	MONGOTX_OPENRESTY=1 MONGOTX_CPATH="$(CURDIR)/build/luajit/?.so" spec/support/busted-luajit \
	  $(or $(BUSTED_ARGS),spec/40-openresty_spec.lua spec/44-openresty-group_spec.lua spec/45-openresty-metrics_spec.lua \
	  spec/49-openresty-kill_spec.lua spec/69-openresty-holds_spec.lua spec/72-openresty-fresh-deploy_spec.lua \
	  spec/73-openresty-held-ungrouped_spec.lua spec/77-openresty-group-holds_spec.lua \
	  spec/81-openresty-group-busy_spec.lua spec/83-group-busy-takeover_spec.lua)

# The specs under valgrind: every leak or invalid access fails the run.
# valgrind runs the interpreter itself (not the sh wrapper, which it would
# follow into exec); spec/support/valgrind.supp says what it ignores and why.
memcheck: setup
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- valgrind --quiet --error-exitcode=99 \
	  --leak-check=full --errors-for-leak-kinds=definite \
	  --suppressions=spec/support/valgrind.supp $(LUA) /usr/bin/busted $(BUSTED_ARGS)

# The specs against a build with AddressSanitizer and UBSan (leak detection
# off: the interpreter is not instrumented and exits without freeing; the
# fuzzers in fuzz/ check the bridge for leaks).  Any UBSan finding aborts
# the run (-fno-sanitize-recover), whatever UBSAN_OPTIONS says.
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined \
              -fno-omit-frame-pointer
ASAN_BUILD ?= build/asan
asan: setup
	@$(MAKE) --no-print-directory all BUILD=$(ASAN_BUILD) CC=gcc \
	  CFLAGS="-O1 -g $(ASAN_FLAGS)" LDFLAGS="$(ASAN_FLAGS)"
	MONGOTX_CPATH="$(CURDIR)/$(ASAN_BUILD)/?.so" $(WITH_SERVER) $(SERVER) -- env \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(LUA) /usr/bin/busted $(BUSTED_ARGS)

# Fuzzing the Lua <-> BSON bridge: fuzz/*.c are libFuzzer harnesses built
# with clang, ASan and UBSan over the bridge's files (not the engine's).
# fuzz-ci runs each for FUZZ_CI_SECONDS (CI), fuzz for FUZZ_SECONDS; both
# print "fuzz: <harness> runs=N crashes=K" and fail on any crash or leak.
FUZZ_CC         ?= clang
FUZZ_SECONDS    ?= 600
FUZZ_CI_SECONDS ?= 60
FUZZ_HARNESSES  := bson_roundtrip lua_encode
FUZZ_BINS       := $(patsubst %,$(BUILD)/fuzz/%,$(FUZZ_HARNESSES))
FUZZ_SRC        := csrc/value.c csrc/encode.c csrc/decode.c csrc/ids.c csrc/scratch.c \
                   csrc/error.c fuzz/harness.c

$(BUILD)/fuzz/%: fuzz/%.c $(FUZZ_SRC) fuzz/harness.h $(HDR)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -std=c99 -D_DEFAULT_SOURCE $(WARN) $(MONGOC_CFLAGS) \
	  $$(pkg-config --cflags lua5.4) -g -O1 -fno-omit-frame-pointer \
	  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
	  $< $(FUZZ_SRC) -o $@ $$(pkg-config --libs libbson-1.0 lua5.4)

fuzz:
	@spec/support/setup.sh fuzz
	@$(MAKE) --no-print-directory $(FUZZ_BINS)
	fuzz/run.sh $(FUZZ_SECONDS) $(BUILD)/fuzz $(FUZZ_HARNESSES)

fuzz-ci:
	@spec/support/setup.sh fuzz
	@$(MAKE) --no-print-directory $(FUZZ_BINS)
	fuzz/run.sh $(FUZZ_CI_SECONDS) $(BUILD)/fuzz $(FUZZ_HARNESSES)

demo: setup
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- sh -c \
	  '$(LUA) examples/00-accounts.lua && $(LUA) examples/01-tutorial.lua'

# A test server for one's own code (the README's quick start): prints the
# lines to paste into another shell and keeps the server until Ctrl-C,
# which stops it (with-server stops its server when the command ends).
server: setup
	@$(MAKE) --no-print-directory all
	@$(WITH_SERVER) $(SERVER) -- sh -c 'echo; \
	  echo "export MONGOTX_TEST_URI=\"$$MONGOTX_TEST_URI\""; \
	  echo "export LUA_PATH=\"$(CURDIR)/lua/?.lua;$(CURDIR)/lua/?/init.lua;;\" LUA_CPATH=\"$(CURDIR)/$(BUILD)/?.so;;\""; \
	  echo; echo "make server: $(SERVER) test server up; Ctrl-C stops it"; \
	  exec sleep infinity' || true

# Benchmarks (bench/README.md): figures, not tests; each starts its own
# server.  bench took 4-8 minutes before the recovery and ledger rows,
# which add several (batch-1 recovery at +1 ms is slow); it rewrites the table in
# bench/results.md and bench/throughput.png (BENCH_ARGS: --runs, --scale,
# --only, --loopback-only); its latency rows run through toxiproxy, which
# setup.sh builds with Go the first time.  bench-memory checks that RSS
# stays flat over 1 000 000 transfers; bench-valgrind runs 10 000 under
# valgrind (a definite leak or an invalid access fails it).
bench: setup
	@spec/support/setup.sh toxiproxy
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- $(LUA) bench/run.lua $(BENCH_ARGS)

bench-memory: setup
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- $(LUA) bench/memory.lua 1000000 --check-rss

bench-valgrind: setup
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- valgrind --error-exitcode=99 \
	  --leak-check=full --errors-for-leak-kinds=definite \
	  --suppressions=spec/support/valgrind.supp $(LUA) bench/memory.lua 10000

# Recovery of backlogs of stale transactions (bench/README.md, "Recovery
# at scale"): BENCH_SCALE_SIZES (default 1000,10000: a few minutes) and
# BENCH_SCALE_MODES; BENCH_ARGS="--write" rewrites the table and
# bench/scale.png.  A million needs MONGOTX_SERVER_HEAP=8g.
bench-scale: setup
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- $(LUA) bench/scale.lua $(BENCH_ARGS)

# wrk against examples/openresty's transfer endpoint in nginx (bench/README.md,
# "OpenResty: group commit"): grouped against ungrouped, 1 and 2 workers,
# 1, 16, 64 connections, on loopback and through toxiproxy at +1 ms,
# medians of 3 runs; the database is checked after every run.  About 12
# minutes (BENCH_ARGS: --seconds, --accounts, --threads, --runs, --delay,
# --loopback 1).  Figures, not a test.
bench-openresty:
	@spec/support/setup.sh deps java openresty toxiproxy
	@$(MAKE) --no-print-directory all LUA=luajit LUA_PC=luajit BUILD=build/luajit
	MONGOTX_CPATH="$(CURDIR)/build/luajit/?.so" luajit bench/openresty.lua $(BENCH_ARGS)

# The torture suite (TESTING.md): crash points, kill -9 of workers, stalls,
# server faults, and the hostile-input spec and fuzz-ci as rows of one
# summary table, plus the sections of batched recovery, the batch job
# and the four modules; fails on any violation.  torture-ci (what CI
# runs) takes about 9 minutes; torture took 19 before those sections,
# which add a few.  TORTURE_ARGS: e.g. --only kills.
TORTURE = $(SPEC_ENV) MONGOTX_TORTURE_BUILD=$(BUILD) $(LUA) torture/run.lua
torture:
	@spec/support/setup.sh deps java ferretdb
	@$(MAKE) --no-print-directory all
	$(TORTURE) $(TORTURE_ARGS)

torture-ci:
	@spec/support/setup.sh deps java ferretdb
	@$(MAKE) --no-print-directory all
	$(TORTURE) --ci $(TORTURE_ARGS)

# Every Lua block of README.md and docs/ (each in a fresh Lua state after
# spec/support/docs-prelude.lua; <!-- fragment: why --> blocks are only
# syntax-checked) and every examples/ script, against a test server; about
# 20 s (spec/support/test-docs.lua).
test-docs: setup
	@$(MAKE) --no-print-directory all
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- $(LUA) spec/support/test-docs.lua

# The reference (LDoc, config.ld) into build/docs, then the check that
# every public function has a doc comment and every documented one still
# exists (spec/support/check-docs.lua: it makes the objects on a test server).
docs: all
	ldoc .
	$(SPEC_ENV) $(WITH_SERVER) $(SERVER) -- $(LUA) spec/support/check-docs.lua

lint:
	luacheck -q lua spec examples bin/mongotx $(wildcard bench torture fuzz)

clean:
	rm -rf build

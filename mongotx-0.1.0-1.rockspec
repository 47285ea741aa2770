-- LuaRocks build of mongotx: the C core (mongotx.core, on libmongoc) and the
-- Lua layer.  libmongoc and libbson are found under the usual prefixes; when
-- their headers live elsewhere, point LuaRocks at them:
--
--   luarocks install mongotx LIBMONGOC_INCDIR=/opt/mongo-c/include \
--     LIBBSON_INCDIR=/opt/mongo-c/include \
--     LIBMONGOC_LIBDIR=/opt/mongo-c/lib LIBBSON_LIBDIR=/opt/mongo-c/lib
rockspec_format = "3.0"
package = "mongotx"
version = "0.1.0-1"

source = {
  url = "git+https://example.invalid/mongotx.git",
  tag = "v0.1.0",
}

description = {
  summary = "Two-phase-commit transactions across MongoDB documents",
  detailed = [[
Changes several MongoDB documents, in one or several collections, as one
unit with the two-phase-commit pattern: all-or-nothing with crash recovery,
using only single-document atomic writes.  A C core on libmongoc issues
each protocol step; the Lua layer holds the policies.]],
  license = "MIT",
}

dependencies = {
  "lua >= 5.1",
  -- for bin/mongotx only (Debian: lua-argparse)
  "argparse",
}

external_dependencies = {
  LIBMONGOC = { header = "libmongoc-1.0/mongoc/mongoc.h" },
  LIBBSON = { header = "libbson-1.0/bson/bson.h" },
}

build = {
  type = "builtin",
  modules = {
    ["mongotx.core"] = {
      sources = {
        "csrc/bulk.c",
        "csrc/checks.c", "csrc/checks_ops.c", "csrc/checks_update.c",
        "csrc/client.c", "csrc/collection.c", "csrc/core.c", "csrc/cursor.c",
        "csrc/decode.c", "csrc/encode.c", "csrc/error.c", "csrc/fault.c",
        "csrc/ids.c", "csrc/options.c", "csrc/scratch.c", "csrc/signals.c", "csrc/storable.c",
        "csrc/stored.c", "csrc/txn.c", "csrc/txn_ops.c", "csrc/txn_state.c", "csrc/uri.c",
        "csrc/value.c",
      },
      libraries = { "mongoc-1.0", "bson-1.0" },
      incdirs = {
        "$(LIBMONGOC_INCDIR)/libmongoc-1.0",
        "$(LIBBSON_INCDIR)/libbson-1.0",
      },
      libdirs = { "$(LIBMONGOC_LIBDIR)", "$(LIBBSON_LIBDIR)" },
      -- The Makefile's -D_DEFAULT_SOURCE.  Its -std=c99 -fvisibility=hidden
      -- cannot be set per module (the builtin backend takes only defines,
      -- incdirs, libraries, libdirs); nothing depends on them: the sources
      -- mark every shared function hidden and export only
      -- luaopen_mongotx_core.  To build exactly like the Makefile anyway:
      --   luarocks make CFLAGS="-O2 -fPIC -std=c99 -fvisibility=hidden"
      defines = { "_DEFAULT_SOURCE" },
    },
    ["mongotx"] = "lua/mongotx/init.lua",
    ["mongotx.policy"] = "lua/mongotx/policy.lua",
    ["mongotx.manager"] = "lua/mongotx/manager.lua",
    ["mongotx.manager.checks"] = "lua/mongotx/manager/checks.lua",
    ["mongotx.manager.batches"] = "lua/mongotx/manager/batches.lua",
    ["mongotx.manager.counts"] = "lua/mongotx/manager/counts.lua",
    ["mongotx.manager.holds"] = "lua/mongotx/manager/holds.lua",
    ["mongotx.manager.operate"] = "lua/mongotx/manager/operate.lua",
    ["mongotx.validate"] = "lua/mongotx/validate.lua",
    ["mongotx.options"] = "lua/mongotx/options.lua",
    ["mongotx.errors"] = "lua/mongotx/errors.lua",
    ["mongotx.batch"] = "lua/mongotx/batch.lua",
    ["mongotx.batch.settle"] = "lua/mongotx/batch/settle.lua",
    ["mongotx.each"] = "lua/mongotx/each.lua",
    ["mongotx.stored"] = "lua/mongotx/stored.lua",
    ["mongotx.engine"] = "lua/mongotx/engine.lua",
    ["mongotx.engine.phases"] = "lua/mongotx/engine/phases.lua",
    ["mongotx.engine.holders"] = "lua/mongotx/engine/holders.lua",
    ["mongotx.engine.applies"] = "lua/mongotx/engine/applies.lua",
    ["mongotx.engine.bands"] = "lua/mongotx/engine/bands.lua",
    ["mongotx.engine.forward"] = "lua/mongotx/engine/forward.lua",
    ["mongotx.engine.commands"] = "lua/mongotx/engine/commands.lua",
    ["mongotx.recovery"] = "lua/mongotx/recovery.lua",
    ["mongotx.holds"] = "lua/mongotx/holds.lua",
    ["mongotx.holds.open"] = "lua/mongotx/holds/open.lua",
    ["mongotx.holds.views"] = "lua/mongotx/holds/views.lua",
    ["mongotx.stepwise"] = "lua/mongotx/stepwise.lua",
    ["mongotx.group"] = "lua/mongotx/group.lua",
    ["mongotx.group.queue"] = "lua/mongotx/group/queue.lua",
    ["mongotx.group.busy"] = "lua/mongotx/group/busy.lua",
    ["mongotx.pool"] = "lua/mongotx/pool.lua",
    ["mongotx.resty"] = "lua/mongotx/resty.lua",
    ["mongotx.resty.wire"] = "lua/mongotx/resty/wire.lua",
    ["mongotx.resty.group"] = "lua/mongotx/resty/group.lua",
    ["mongotx.resty.held"] = "lua/mongotx/resty/held.lua",
    ["mongotx.resty.thread"] = "lua/mongotx/resty/thread.lua",
    ["mongotx.clock"] = "lua/mongotx/clock.lua",
    ["mongotx.ledger"] = "lua/mongotx/ledger.lua",
    ["mongotx.ledger.accounts"] = "lua/mongotx/ledger/accounts.lua",
    ["mongotx.ledger.committer"] = "lua/mongotx/ledger/committer.lua",
    ["mongotx.ledger.writer"] = "lua/mongotx/ledger/writer.lua",
    ["mongotx.points"] = "lua/mongotx/points.lua",
    ["mongotx.sync"] = "lua/mongotx/sync.lua",
    ["mongotx.versioned"] = "lua/mongotx/versioned.lua",
    ["mongotx.catalog"] = "lua/mongotx/catalog.lua",
    ["mongotx.queue"] = "lua/mongotx/queue.lua",
    ["mongotx.queue.worker"] = "lua/mongotx/queue/worker.lua",
    ["mongotx.metrics"] = "lua/mongotx/metrics.lua",
    ["mongotx.metrics.exposition"] = "lua/mongotx/metrics/exposition.lua",
    ["mongotx.metrics.marks"] = "lua/mongotx/metrics/marks.lua",
    ["mongotx.metrics.backlog"] = "lua/mongotx/metrics/backlog.lua",
    ["mongotx.metrics.shared"] = "lua/mongotx/metrics/shared.lua",
    ["mongotx.cli"] = "lua/mongotx/cli.lua",
    ["mongotx.cli.args"] = "lua/mongotx/cli/args.lua",
    ["mongotx.cli.commands"] = "lua/mongotx/cli/commands.lua",
    ["mongotx.cli.output"] = "lua/mongotx/cli/output.lua",
    ["mongotx.cli.policy"] = "lua/mongotx/cli/policy.lua",
    ["mongotx.cli.progress"] = "lua/mongotx/cli/progress.lua",
  },
  -- the operator's command (README, "Operating mongotx")
  install = {
    bin = { mongotx = "bin/mongotx" },
  },
}

test = {
  type = "command",
  command = "make test",
}

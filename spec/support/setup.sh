#!/usr/bin/env bash
# Installs what mongotx's build, specs and test servers need (DESIGN.md §9).
# Idempotent; a second run only checks and is quick.
#
#   spec/support/setup.sh [deps|java|ferretdb|all]...
#     deps      Debian packages (apt-get, as root or through sudo)
#     java      mongo-java-server 1.47.0 (Maven Central) + MongoServerMain
#     ferretdb  FerretDB v1.24.0 built with Go (about a minute the first time)
#     all       all three
#     fuzz      clang and libFuzzer for make fuzz / make fuzz-ci (fuzz/)
#     openresty nginx with the Lua module, lua-resty-core, lua-cjson, wrk and
#               OpenResty's LuaJIT (luajit2) for make test-openresty
#     toxiproxy toxiproxy v2.12.0 (server and cli) built with Go, and curl,
#               for make bench's runs at a network's latency (bench/latency.lua)
#     prometheus Python's prometheus_client and pymongo (PyPI, pinned) in a
#               venv: the independent parser spec/70-metrics_spec.lua checks
#               the exposition format with (spec/support/promparse.py), and
#               the tutorial's recipe of spec/54 (spec/support/recipe_writer.py)
#   default: deps java prometheus, and ferretdb where a Go toolchain is
#            found (what `make test` runs: spec/32 needs FerretDB v1; without
#            Go it says so and that spec is pending with the reason)
#
# Artifacts go to $MONGOTX_CACHE (default ~/.cache/mongotx):
#   server.classpath  classes/  bin/ferretdb  bin/toxiproxy-server  bin/toxiproxy-cli
#   venv/ (prometheus_client, pymongo)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${MONGOTX_CACHE:-$HOME/.cache/mongotx}
FERRETDB_VERSION=v1.24.0
TOXIPROXY_VERSION=v2.12.0
PROMETHEUS_CLIENT_VERSION=0.21.1
PYMONGO_VERSION=4.10.1

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

# "a|b": either package will do (the first is installed when neither is).
# luajit2 (OpenResty's LuaJIT, see do_openresty) replaces Debian's luajit and
# is a drop-in for everything deps needs it for.
# lua-argparse for bin/mongotx, tmux and lua-cjson for its spec (spec/50),
# lua-ldoc and lua-markdown for make docs (the reference).
PACKAGES=(lua5.4 liblua5.4-dev libmongoc-dev libbson-dev lua-busted lua-check
  luarocks "luajit|luajit2" "libluajit-5.1-dev|libluajit2-5.1-dev" valgrind
  gnuplot-nox pkg-config make gcc python3 default-jdk-headless maven
  lua-argparse tmux lua-cjson lua-ldoc lua-markdown)

# clang 14 with libFuzzer and the sanitizer runtimes (-fsanitize=fuzzer
# needs libclang-rt-14-dev), and what the harnesses link: Lua 5.4, libbson.
FUZZ_PACKAGES=(clang libclang-rt-14-dev liblua5.4-dev libbson-dev libmongoc-dev pkg-config make)

# nginx built --with-threads (ngx.run_worker_thread) and its Lua module
# (lua-nginx-module 0.10.23), resty.core, cjson for the handlers, wrk for
# make bench-openresty, curl for the specs, and OpenResty's LuaJIT fork: the
# Lua module links against libluajit2 and mongotx.core is built against its
# headers (apt removes Debian's luajit and libluajit-5.1-dev, which conflict).
OPENRESTY_PACKAGES=(nginx libnginx-mod-http-lua lua-resty-core lua-cjson wrk
  luajit2 libluajit2-5.1-dev curl)

installed() {
  [[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true) == "install ok installed" ]]
}

# Installs the Debian packages named that are missing ("a|b": either).
apt_install() {
  local missing=() p alt ok alts
  for p in "$@"; do
    ok=0
    IFS='|' read -r -a alts <<<"$p"
    for alt in "${alts[@]}"; do
      if installed "$alt"; then ok=1; break; fi
    done
    ((ok)) || missing+=("${alts[0]}")
  done
  if ((${#missing[@]} == 0)); then
    say "Debian packages: all $# present"
  else
    local sudo=()
    [[ $(id -u) == 0 ]] || sudo=(sudo)
    say "Debian packages missing: ${missing[*]}"
    say "apt-get update"
    "${sudo[@]}" apt-get update -qq
    say "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

do_deps() {
  apt_install "${PACKAGES[@]}"
  # busted: Debian's lua-busted installs its modules for Lua 5.1-5.4, so the
  # same runner works under every interpreter: `luajit /usr/bin/busted` and
  # `lua5.4 /usr/bin/busted` (plain `busted` uses /usr/bin/lua = lua5.1).
  # spec/support/busted-luajit and spec/support/busted-lua5.4 wrap that.
  local lua
  for lua in luajit lua5.4; do
    "$lua" -e 'require "busted.runner"' 2>/dev/null \
      || die "$lua cannot load busted.runner (is lua-busted installed?)"
  done
  say "busted runs under luajit and lua5.4 (spec/support/busted-luajit, busted-lua5.4)"
}

ensure_go() {
  if ! command -v go >/dev/null 2>&1; then
    [[ -x /usr/local/go/bin/go ]] || die "no Go toolchain (go, /usr/local/go/bin/go)"
    export PATH=$PATH:/usr/local/go/bin
  fi
}

do_java() {
  command -v mvn >/dev/null || die "mvn missing: run $0 deps"
  command -v javac >/dev/null || die "javac missing: run $0 deps"
  mkdir -p "$CACHE"
  local src=$here/server/MongoServerMain.java pom=$here/server/pom.xml
  local stamp=$CACHE/java.stamp want
  want=$(cat "$pom" "$src" | sha256sum | cut -d' ' -f1)
  if [[ -f $stamp && $(cat "$stamp") == "$want" && -f $CACHE/classes/MongoServerMain.class \
        && -s $CACHE/server.classpath ]]; then
    local jar ok=1
    IFS=: read -r -a jars < "$CACHE/server.classpath" || true
    for jar in "${jars[@]}"; do [[ -f $jar ]] || ok=0; done
    if ((ok)); then
      say "mongo-java-server: up to date in $CACHE"
      return
    fi
  fi
  say "mongo-java-server: fetching with Maven ($pom)"
  (cd "$here/server" && mvn -B -Dstyle.color=never dependency:build-classpath \
      -Dmdep.outputFile="$CACHE/server.classpath.tmp") > "$CACHE/mvn.log" 2>&1 \
    || { tail -40 "$CACHE/mvn.log" >&2; die "mvn failed (log: $CACHE/mvn.log)"; }
  mv "$CACHE/server.classpath.tmp" "$CACHE/server.classpath"
  say "mongo-java-server: compiling MongoServerMain into $CACHE/classes"
  rm -rf "$CACHE/classes"
  mkdir -p "$CACHE/classes"
  javac -nowarn -cp "$(cat "$CACHE/server.classpath")" -d "$CACHE/classes" "$src"
  echo "$want" > "$stamp"
  say "mongo-java-server: ready (classpath in $CACHE/server.classpath)"
}

# Does the binary report FerretDB's pinned version?  Its output is read
# whole first: `--version | grep -q` under pipefail fails when grep exits
# at its match and the binary then dies of SIGPIPE (more often on a loaded
# machine), which made set-up rebuild FerretDB, or give up, now and then.
ferretdb_is_pinned() {
  local out
  out=$("$1" --version 2>/dev/null) || return 1
  [[ $out == *"version: $FERRETDB_VERSION"$'\n'* || $out == *"version: $FERRETDB_VERSION" ]]
}

do_ferretdb() {
  local bin=$CACHE/bin/ferretdb
  if [[ -x $bin ]] && ferretdb_is_pinned "$bin"; then
    say "FerretDB $FERRETDB_VERSION: present ($bin)"
    return
  fi
  ensure_go
  # `go install ...@v1.24.0` does not work here (the module proxy refuses the
  # module's version list), so build from a module pinning it:
  # spec/support/ferretdb/go.mod and go.sum, copied to a scratch directory.
  # The module zip lacks build/version/version.txt (generated by FerretDB's
  # release tooling) and the binary then panics at start-up, so build from a
  # copy of the module's source with that file added (a go.mod replace).
  local build=$CACHE/ferretdb-build
  rm -rf "$build"
  mkdir -p "$build" "$CACHE/bin"
  cp "$here/ferretdb/go.mod" "$here/ferretdb/go.sum" "$build/"
  say "FerretDB $FERRETDB_VERSION: downloading the module (Go module proxy)"
  local dir
  dir=$(cd "$build" && go mod download -json "github.com/FerretDB/FerretDB@$FERRETDB_VERSION" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -n $dir && -d $dir ]] || die "go mod download github.com/FerretDB/FerretDB@$FERRETDB_VERSION failed"
  cp -r "$dir" "$build/FerretDB"
  chmod -R u+w "$build/FerretDB"
  echo "$FERRETDB_VERSION" > "$build/FerretDB/build/version/version.txt"
  (cd "$build" && go mod edit -replace github.com/FerretDB/FerretDB=./FerretDB)
  say "FerretDB $FERRETDB_VERSION: building with $(go version | cut -d' ' -f3) (about a minute)"
  (cd "$build" && GOFLAGS=-mod=mod GOBIN=$CACHE/bin go install github.com/FerretDB/FerretDB/cmd/ferretdb)
  ferretdb_is_pinned "$bin" || die "built $bin but its --version is not $FERRETDB_VERSION"
  say "FerretDB $FERRETDB_VERSION: ready ($bin)"
}

do_fuzz() {
  apt_install "${FUZZ_PACKAGES[@]}"
  # the package list is not the proof: libFuzzer must link
  local tmp
  tmp=$(mktemp -d)
  printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
    > "$tmp/t.c"
  clang -fsanitize=fuzzer,address,undefined "$tmp/t.c" -o "$tmp/t" 2>"$tmp/err" \
    || { cat "$tmp/err" >&2; rm -rf "$tmp"; die "clang -fsanitize=fuzzer does not link"; }
  rm -rf "$tmp"
  say "clang $(clang -dumpversion) links -fsanitize=fuzzer,address,undefined"
}

do_openresty() {
  # nginx's postinst would start the default site on port 80: keep it
  # from starting services while installing (Debian's policy-rc.d hook).
  local policy=/usr/sbin/policy-rc.d added=0
  if [[ ! -e $policy && $(id -u) == 0 ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    added=1
  fi
  apt_install "${OPENRESTY_PACKAGES[@]}"
  ((added)) && rm -f "$policy"
  local mod=/usr/lib/nginx/modules/ngx_http_lua_module.so
  [[ -f $mod ]] || die "no $mod (libnginx-mod-http-lua)"
  # read whole, not piped to grep -q (see ferretdb_is_pinned)
  [[ $(nginx -V 2>&1) == *--with-threads* ]] || die "nginx is not built --with-threads"
  luajit -e 'assert(jit.version:find("LuaJIT 2.1"))' \
    || die "luajit does not run"
  luajit -e 'require "busted.runner"' 2>/dev/null \
    || die "luajit cannot load busted.runner (is lua-busted installed?)"
  pkg-config --exists luajit || die "no luajit.pc (libluajit2-5.1-dev)"
  say "nginx $(nginx -v 2>&1 | sed 's#.*/##'), $(luajit -v | cut -d' ' -f1-2), lua module $mod"
}

# toxiproxy's server and cli from the Go module proxy, renamed (go install
# names them server and cli).  `--version` prints "git" for a go-installed
# binary, so the pinned version is kept in a stamp next to them.
do_toxiproxy() {
  apt_install curl # bench/latency.lua configures the proxy through its HTTP API
  local stamp=$CACHE/bin/toxiproxy.version
  if [[ -x $CACHE/bin/toxiproxy-server && -x $CACHE/bin/toxiproxy-cli && -f $stamp \
        && $(cat "$stamp") == "$TOXIPROXY_VERSION" ]]; then
    say "toxiproxy $TOXIPROXY_VERSION: present ($CACHE/bin/toxiproxy-server)"
    return
  fi
  ensure_go
  local build=$CACHE/toxiproxy-build
  rm -rf "$build"
  mkdir -p "$build" "$CACHE/bin"
  say "toxiproxy $TOXIPROXY_VERSION: building with $(go version | cut -d' ' -f3) (Go module proxy)"
  GOBIN=$build go install "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" \
    "github.com/Shopify/toxiproxy/v2/cmd/cli@$TOXIPROXY_VERSION" \
    || die "go install github.com/Shopify/toxiproxy/v2@$TOXIPROXY_VERSION failed"
  mv "$build/server" "$CACHE/bin/toxiproxy-server"
  mv "$build/cli" "$CACHE/bin/toxiproxy-cli"
  rm -rf "$build"
  echo "$TOXIPROXY_VERSION" > "$stamp"
  say "toxiproxy $TOXIPROXY_VERSION: ready ($CACHE/bin/toxiproxy-server, toxiproxy-cli)"
}

# The Python packages the specs use, from PyPI in a venv of Debian's
# python3 (python3-venv), so that neither the system's Python nor pip's
# --user site changes: prometheus_client (spec/70's parser) and pymongo
# (spec/54: the tutorial's recipe as a writer that knows nothing of
# mongotx).  A package missing or at another version is installed into
# the venv there is (specs may be using it meanwhile).
do_prometheus() {
  apt_install python3 python3-venv
  local venv=$CACHE/venv pkg want have
  if [[ ! -x $venv/bin/python ]]; then
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv" || die "python3 -m venv $venv failed"
  fi
  for pkg in "prometheus_client==$PROMETHEUS_CLIENT_VERSION" "pymongo==$PYMONGO_VERSION"; do
    want=${pkg#*==}
    have=$("$venv/bin/python" -c "import importlib.metadata as m
print(m.version('${pkg%%==*}'))" 2>/dev/null || true)
    if [[ $have == "$want" ]]; then
      say "${pkg%%==*} $want: present ($venv)"
      continue
    fi
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$pkg" \
      || die "pip install $pkg failed (PyPI)"
    say "${pkg%%==*} $want: ready ($venv)"
  done
}

# Is a Go toolchain there to build FerretDB with?
have_go() { command -v go >/dev/null 2>&1 || [[ -x /usr/local/go/bin/go ]]; }

targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(deps java prometheus)
  if have_go; then
    targets+=(ferretdb)
  else
    say "FerretDB: no Go toolchain (go, /usr/local/go/bin/go): not built; spec/32 will be pending"
  fi
fi
for t in "${targets[@]}"; do
  case $t in
    deps) do_deps ;;
    java) do_java ;;
    ferretdb) do_ferretdb ;;
    all) do_deps; do_java; do_ferretdb ;;
    fuzz) do_fuzz ;;
    openresty) do_openresty ;;
    toxiproxy) do_toxiproxy ;;
    prometheus) do_prometheus ;;
    *) die "unknown target '$t' (deps|java|ferretdb|all|fuzz|openresty|toxiproxy|prometheus)" ;;
  esac
done

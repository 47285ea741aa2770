#!/usr/bin/env bash
# Runs each libFuzzer harness for a bounded time and prints one line per
# harness, "fuzz: <harness> runs=<n> crashes=<k>"; exits non-zero when any
# harness crashed, leaked, timed out or ran out of memory.
#
#   fuzz/run.sh <seconds> <bindir> <harness>...
#
# New inputs go to <bindir>/work/<harness> (the committed corpus in
# fuzz/corpus/<harness> is only read), crashing inputs and logs to
# <bindir>/crashes/<harness> and <bindir>/<harness>.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

(($# >= 3)) || { echo "usage: $0 <seconds> <bindir> <harness>..." >&2; exit 2; }
seconds=$1 bindir=$2
shift 2
status=0
for h in "$@"; do
  work=$bindir/work/$h crashes=$bindir/crashes/$h log=$bindir/$h.log
  mkdir -p "$work" "$crashes"
  rm -f "$crashes"/*
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: 2 GiB, the
  # machine is shared; -max_len: programs and documents of up to 4 KiB.
  "$bindir/$h" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=4096 -print_final_stats=1 -artifact_prefix="$crashes/" \
    "$work" "fuzz/corpus/$h" >"$log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  # a crash may end the run before the final stats: the last status line
  [[ -n $runs ]] || runs=$(sed -n 's/^#\([0-9]*\).*/\1/p' "$log" | tail -1)
  k=$(find "$crashes" -type f | wc -l)
  if ((rc != 0 && k == 0)); then
    k=1 # died without writing an input (e.g. the harness did not start)
  fi
  echo "fuzz: $h runs=${runs:-0} crashes=$k"
  if ((k > 0)); then
    status=1
    # what broke and where (the top frames), then the summary line
    grep -a -m1 -A12 -E 'broken promise|runtime error|==ERROR|ERROR: libFuzzer' "$log" | sed 's/^/  /'
    grep -a -m1 '^SUMMARY' "$log" | sed 's/^/  /'
    echo "  log: $log  inputs: $crashes"
  fi
done
exit "$status"

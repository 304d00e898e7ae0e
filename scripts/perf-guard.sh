#!/usr/bin/env bash
# The performance goals of docs/performance.md checked in one sitting: runs
# scripts/compare-pingpong.sh for each path (alternated rounds, medians) and the engine's
# criterion bench, then prints every ratio beside its goal and what falls short. Run it before
# and after a change that may touch speed; it exits 1 when a goal is not met (3 when it could
# not measure). Nothing else should run on the machine meanwhile: busy-polling figures on a
# shared CPU mean nothing.
#
#   scripts/perf-guard.sh [-r ROUNDS] [-q]
#
# -r: rounds per path (default 3, at least 3). -q: only the default same-host path and the shm
# device at 64 B (a quick look, about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3 quick=""
while getopts "r:q" o; do
    case $o in
    r) rounds=$OPTARG ;;
    q) quick=1 ;;
    *) exit 2 ;;
    esac
done
if [ "$rounds" -lt 3 ]; then echo "perf-guard: a ratio needs at least 3 rounds" >&2; exit 2; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "# perf-guard: CPU ${cpu:-unknown} ($(nproc) CPUs); kernel $(uname -r); $(date -u '+%Y-%m-%d %H:%M UTC'); $rounds rounds"

cmp() { # cmp NAME ARGS...: one compare-pingpong run, its table in $tmp/NAME.tsv
    local name=$1; shift
    echo "## $name: scripts/compare-pingpong.sh $*"
    scripts/compare-pingpong.sh -r "$rounds" -o "$tmp/$name.tsv" "$@" | grep -v "^round" || true
}
cmp local -p local -s 64 shm
if [ -n "$quick" ]; then shm_sizes=64; else shm_sizes=64,65536,1048576; fi
cmp shm -p shm -s "$shm_sizes" shm
if [ -z "$quick" ]; then
    cmp udp -p udp -s 64,1048576 floor "udp;ofi_rxd" "tcp;ofi_rxm"
    cmp dgram -e dgram -p udp -s 64 udp
    echo "## engine: cargo bench --bench engine -- engine/direct_rate/64"
    cargo bench --quiet --bench engine -- engine/direct_rate/64 2>/dev/null | tee "$tmp/engine.txt" | grep -E "thrpt" || true
fi

# field FILE SIZE CONFIG COLUMN: a cell of a compare-pingpong table (5: latency ratio, 6:
# bandwidth ratio).
field() { awk -F'\t' -v s="$2" -v c="$3" -v k="$4" '$1 == s && $2 == c { print $k }' "$tmp/$1.tsv" 2>/dev/null; }
short=0 missing=0
# check LABEL VALUE OP GOAL
check() {
    local label=$1 v=$2 op=$3 goal=$4 ok
    if [ -z "$v" ] || [ "$v" = nan ] || [ "$v" = n/a ]; then
        printf "%-46s %10s %3s %-6s %s\n" "$label" "-" "$op" "$goal" "NOT MEASURED"
        missing=1
        return
    fi
    ok=$(awk -v v="$v" -v g="$goal" -v op="$op" 'BEGIN { print (op == "<=" ? v <= g : v >= g) ? "met" : "SHORT" }')
    printf "%-46s %10s %3s %-6s %s\n" "$label" "$v" "$op" "$goal" "$ok"
    if [ "$ok" != met ]; then short=1; fi
}
echo
printf "%-46s %10s %3s %-6s %s\n" goal value "" target ""
check "default same-host path 64 B latency / shm" "$(field local 64 shm 5)" "<=" 1.0
check "shm device 64 B latency / shm" "$(field shm 64 shm 5)" "<=" 1.0
if [ -z "$quick" ]; then
    check "shm device 64 KiB latency / shm" "$(field shm 65536 shm 5)" "<=" 1.0
    check "shm device 1 MiB bandwidth / shm" "$(field shm 1048576 shm 6)" ">=" 1.0
    check "udp RDM 64 B latency / UDP floor" "$(field udp 64 floor 5)" "<=" 1.5
    check "udp RDM 64 B latency / udp;ofi_rxd" "$(field udp 64 'udp;ofi_rxd' 5)" "<=" 0.5
    check "udp RDM 1 MiB bandwidth / tcp;ofi_rxm" "$(field udp 1048576 'tcp;ofi_rxm' 6)" ">=" 1.0
    check "DGRAM udp 64 B latency / libfabric udp" "$(field dgram 64 udp 5)" "<=" 1.0
    # criterion: "thrpt:  [low mid high]" with units; the middle estimate in M messages/s.
    # (The first such line; a second one, in percent, is the change against the last run.)
    rate=$(awk '/thrpt/ && $5 ~ /elem/ { v = $4; u = $5; if (u ~ /^Kelem/) v /= 1000; if (u ~ /^elem/) v /= 1e6; print v; exit }' "$tmp/engine.txt")
    check "engine direct_rate 64 B, M messages/s" "$rate" ">=" 5
fi
if [ "$missing" = 1 ]; then exit 3; fi
exit "$short"

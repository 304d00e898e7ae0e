#!/usr/bin/env bash
# Are the hot paths slower after a change? Builds examples/ping-pong (release) at two git
# revisions and runs them alternately, round by round, as two processes on loopback: RDM over
# `shm` and over `udp` (FI_EFA_ENABLE_SHM_TRANSFER=0), 64 B (latency) and 1 MiB (bandwidth).
# Prints every round and the medians, with the ratio new/old.
#
#   scripts/compare-revs.sh [-r ROUNDS] [-s SIZES] [-d DEVICES] OLD_REV [NEW_REV]
#
# SIZES and DEVICES are comma-separated (defaults: 64,1048576 and shm,udp).
#
# NEW_REV defaults to the working tree. Each revision builds in a worktree of its own under
# $TMPDIR with its own target directory (kept for reruns: efa-revs-<rev>).
#
# Two things this VM taught (docs/performance.md, sitting of 2026-11-28 13:11): the same binary
# run from two files differed by 15% at 64 B on shm, run after run (the kernel maps an
# executable's text in page-cache folios whose size and placement differ from file to file), and
# unpinned processes make the 64-byte figures bimodal. So every run starts from a fresh copy of
# its binary, and with two CPUs or more small-message runs put the server on CPU 0 and the client
# on CPU 1 (`taskset`; not the 1 MiB runs: pinned with its helper threads on one CPU, shm 1 MiB
# fell from 20 to 3 GB/s); 64-byte runs take 200 000 round trips on shm (20 000 on udp).
#
# Both revisions build with the same release profile whatever their Cargo.toml says: fat LTO and
# one codegen unit (the profile since 2026-11-28; set CARGO_PROFILE_RELEASE_LTO and
# CARGO_PROFILE_RELEASE_CODEGEN_UNITS to compare with another). On this VM the profile alone moved
# the shm device's 64-byte round trip by 20% with the same instructions, so revisions built
# differently cannot be compared.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_PROFILE_RELEASE_LTO=${CARGO_PROFILE_RELEASE_LTO:-fat}
export CARGO_PROFILE_RELEASE_CODEGEN_UNITS=${CARGO_PROFILE_RELEASE_CODEGEN_UNITS:-1}

rounds=5 sizelist="64,1048576" devlist="shm,udp"
while getopts "r:s:d:" o; do
    case $o in
    r) rounds=$OPTARG ;;
    s) sizelist=$OPTARG ;;
    d) devlist=$OPTARG ;;
    *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { echo "usage: $0 [-r ROUNDS] [-s SIZES] [-d DEVICES] OLD_REV [NEW_REV]" >&2; exit 2; }
IFS=, read -r -a sizes <<<"$sizelist"
IFS=, read -r -a devs <<<"$devlist"
tmpbase=${TMPDIR:-/tmp}

# build REV: prints the path of that revision's ping-pong binary.
build() {
    local rev=$1 dir
    if [ "$rev" = "." ]; then
        cargo build --release --quiet --example ping-pong
        echo "${CARGO_TARGET_DIR:-$PWD/target}/release/examples/ping-pong"
        return
    fi
    local sha; sha=$(git rev-parse --short "$rev")
    dir=$tmpbase/efa-revs-$sha
    if [ ! -d "$dir/src" ]; then
        rm -rf "$dir"
        git worktree add --detach -q "$dir" "$sha"
    fi
    (cd "$dir" && CARGO_TARGET_DIR="$dir/target" cargo build --release --quiet --example ping-pong)
    echo "$dir/target/release/examples/ping-pong"
}

old=$(build "$1")
new=$(build "${2:-.}")
lscpu | grep "Model name" || true
echo "old: $1 ($old)"
echo "new: ${2:-working tree} ($new)"

port=$((40000 + RANDOM % 20000))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
iters() {
    if [ "$1" -ge 1048576 ]; then echo 300; elif [ "$2" = shm ]; then echo 200000; else echo 20000; fi
}
pin_srv=() pin_cli=()
if [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null; then pin_srv=(taskset -c 0) pin_cli=(taskset -c 1); fi

# run BIN DEV SIZE: "usec MB/sec" from the client's result line, from a fresh copy of BIN.
run() {
    local bin=$1 dev=$2 s=$3 i; i=$(iters "$s" "$dev"); port=$((port + 1))
    local copy="$tmp/run-$port" ps=() pc=()
    cp "$bin" "$copy"
    if [ "$s" -lt 65536 ]; then ps=("${pin_srv[@]}") pc=("${pin_cli[@]}"); fi
    FI_EFA_ENABLE_SHM_TRANSFER=0 "${ps[@]}" "$copy" -p "$dev" -e rdm -S "$s" -I "$i" -l -B $port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    FI_EFA_ENABLE_SHM_TRANSFER=0 "${pc[@]}" timeout 120 "$copy" -p "$dev" -e rdm -S "$s" -I "$i" -P $port 127.0.0.1 2>/dev/null |
        grep -v "^#" | tail -1 | awk '{print $7, $6}'
    wait $srv || true
    rm -f "$copy"
}

for r in $(seq "$rounds"); do
    for dev in "${devs[@]}"; do
        for s in "${sizes[@]}"; do
            # Alternate which goes first, round by round.
            if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
            for w in $order; do
                bin=$old
                [ "$w" = new ] && bin=$new
                run "$bin" "$dev" "$s" >>"$tmp/$w-$dev-$s"
                echo "round $r $dev $s $w: $(tail -1 "$tmp/$w-$dev-$s") (usec/xfer MB/sec)"
            done
        done
    done
done

median() { sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "nan"}'; }
printf "%-5s %-9s %12s %12s %10s %12s %12s %10s\n" dev size "old usec" "new usec" "lat new/old" "old MB/s" "new MB/s" "bw new/old"
for dev in "${devs[@]}"; do
    for s in "${sizes[@]}"; do
        ol=$(cut -d' ' -f1 "$tmp/old-$dev-$s" | median); nl=$(cut -d' ' -f1 "$tmp/new-$dev-$s" | median)
        ob=$(cut -d' ' -f2 "$tmp/old-$dev-$s" | median); nb=$(cut -d' ' -f2 "$tmp/new-$dev-$s" | median)
        lr=$(awk -v a="$nl" -v b="$ol" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "nan" }')
        br=$(awk -v a="$nb" -v b="$ob" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "nan" }')
        printf "%-5s %-9s %12s %12s %10s %12s %12s %10s\n" "$dev" "$s" "$ol" "$nl" "$lr" "$ob" "$nb" "$br"
    done
done

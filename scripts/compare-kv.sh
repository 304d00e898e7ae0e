#!/usr/bin/env bash
# Issue 27's figures in one sitting: examples/kv-transfer (one region of -M bytes cut into pages,
# -W writes in flight from scattered page slices to scattered pages, a write_data per batch,
# every page checked) against examples/rma-bw -o write (one 64 KiB buffer, 64 writes in flight,
# its best pipelined bandwidth), two processes on loopback, alternated run by run, on udp
# (FI_EFA_ENABLE_SHM_TRANSFER=0) and on the default same-host setup (=1); and write_batch
# against one write per call (examples/batch, 64 B, batches of 32, udp). Prints each round, the
# medians and the ratios with their goals (kv/rma-bw >= 0.9, batch >= 2x), and whether every
# kv-transfer run registered nothing after start-up. Nothing else should run meanwhile (or run
# the script under `chrt -r 50`, which its programs inherit, and call the figures RT).
#
# A second reference, without a goal, says how much of a shortfall is memory rather than the
# API: rma-bw with --span 256m cycles its writes through 256 MiB of source and target (as
# kv-transfer's pages are), one write at a time, instead of one 64 KiB buffer that stays in the
# cache.
#
#   scripts/compare-kv.sh [-r ROUNDS] [-I KV_ROUNDS] [-1]
#
# -r: alternated rounds (default 3, at least 3 for a ratio). -I: kv-transfer rounds of the whole
# region per run (default 8: 2 GiB of 256 MiB). -1: also one process (both ends in one).
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3 kv_iters=8 one=""
while getopts "r:I:1" o; do
    case $o in
    r) rounds=$OPTARG ;;
    I) kv_iters=$OPTARG ;;
    1) one=1 ;;
    *) exit 2 ;;
    esac
done
cargo build --release --quiet --example kv-transfer --example rma-bw --example batch
E=${CARGO_TARGET_DIR:-target}/release/examples
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "# compare-kv: CPU ${cpu:-unknown} ($(nproc) CPUs); kernel $(uname -r); $(date -u '+%Y-%m-%d %H:%M UTC'); $rounds rounds, alternated; medians"
if [ "$rounds" -lt 3 ]; then echo "# fewer than 3 rounds: no ratios"; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
port=$((40000 + RANDOM % 20000))

# two SHM PROGRAM ARGS...: server and client in two processes; the client's output.
two() {
    local shm=$1 ex=$2; shift 2
    port=$((port + 1))
    FI_EFA_ENABLE_SHM_TRANSFER=$shm "$E/$ex" "$@" -l -B $port -s 127.0.0.1 >"$tmp/srv" 2>&1 &
    local srv=$!
    sleep 0.3
    FI_EFA_ENABLE_SHM_TRANSFER=$shm timeout 300 "$E/$ex" "$@" -P $port 127.0.0.1 2>&1 || true
    wait $srv || true
}
# one SHM PROGRAM ARGS...: both ends in this process.
one_proc() {
    local shm=$1 ex=$2; shift 2
    FI_EFA_ENABLE_SHM_TRANSFER=$shm timeout 300 "$E/$ex" "$@" 2>&1 || true
}
# MB/s of a kv-transfer run (its "# ... GB/sec" line), and whether it registered nothing.
kv_mbs() {
    local out; out=$("$@")
    if ! grep -q " 0 registrations after start-up" <<<"$out"; then echo "registrations" >>"$tmp/kv-regs"; fi
    grep -o "[0-9.]* GB/sec" <<<"$out" | head -1 | awk '{printf "%.0f", $1 * 1000}' || true
}
rma_mbs() { "$@" | awk '$1 == "64k" { print $5 }' | tail -1 || true; }
# "single batched" operations/s of one batch run (it alternates one write per call and
# write_batch itself and prints both).
ops() {
    local out; out=$("$@")
    local a b
    a=$(grep -o "one call per operation: [0-9.]* operations/s" <<<"$out" | awk '{print $5}' | tail -1 || true)
    b=$(grep -o "per batch: [0-9.]* operations/s" <<<"$out" | awk '{print $3}' | tail -1 || true)
    echo "${a:-nan} ${b:-nan}"
}

modes=(two)
if [ -n "$one" ]; then modes+=(one); fi
for r in $(seq "$rounds"); do
    for mode in "${modes[@]}"; do
        run=two
        if [ "$mode" = one ]; then run=one_proc; fi
        for shm in 0 1; do
            k=$(kv_mbs $run $shm kv-transfer -p udp -I "$kv_iters")
            m=$(rma_mbs $run $shm rma-bw -p udp -o write -S 64k -W 64 -I 30000)
            w=$(rma_mbs $run $shm rma-bw -p udp -o write -S 64k -W 64 -I 30000 --span 256m)
            echo "${k:-nan}" >>"$tmp/kv-$mode-$shm"
            echo "${m:-nan}" >>"$tmp/rma-$mode-$shm"
            echo "${w:-nan}" >>"$tmp/span-$mode-$shm"
            echo "round $r $mode process(es), shm transfer $shm: kv-transfer ${k:-?} MB/s, rma-bw ${m:-?} MB/s, rma-bw --span 256m ${w:-?} MB/s"
        done
    done
    read -r b1 b32 < <(ops two 0 batch -p udp -o write -S 64 -b 32 -I 200000)
    echo "$b1" >>"$tmp/b1"
    echo "$b32" >>"$tmp/b32"
    echo "round $r write_batch: 1 per call ${b1:-?} ops/s, batches of 32 ${b32:-?} ops/s"
done

median() { sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "nan"}'; }
ratio() { if [ "$rounds" -lt 3 ]; then echo n/a; else awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "nan" }'; fi; }
verdict() { awk -v v="$1" -v g="$2" 'BEGIN { if (v == "n/a" || v == "nan") print "-"; else print (v >= g) ? "met" : "SHORT" }'; }
printf "%-34s %12s %12s %8s %6s %s\n" case ours reference ratio goal verdict
for mode in "${modes[@]}"; do
    for shm in 0 1; do
        path=udp; if [ "$shm" = 1 ]; then path=same-host; fi
        k=$(median <"$tmp/kv-$mode-$shm"); m=$(median <"$tmp/rma-$mode-$shm"); q=$(ratio "$k" "$m")
        printf "%-34s %12s %12s %8s %6s %s\n" "kv/rma-bw MB/s, $mode proc, $path" "$k" "$m" "$q" 0.9 "$(verdict "$q" 0.9)"
        w=$(median <"$tmp/span-$mode-$shm"); q=$(ratio "$k" "$w")
        printf "%-34s %12s %12s %8s %6s %s\n" "kv/rma-bw --span 256m, $mode, $path" "$k" "$w" "$q" - "(same memory; no goal)"
    done
done
b1=$(median <"$tmp/b1"); b32=$(median <"$tmp/b32"); q=$(ratio "$b32" "$b1")
printf "%-34s %12s %12s %8s %6s %s\n" "write_batch/single ops/s, udp" "$b32" "$b1" "$q" 2 "$(verdict "$q" 2)"
if [ -s "$tmp/kv-regs" ]; then echo "kv-transfer registered memory after start-up in $(wc -l <"$tmp/kv-regs") run(s)"; else echo "kv-transfer: 0 registrations after start-up in every run"; fi

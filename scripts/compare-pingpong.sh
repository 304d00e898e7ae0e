#!/usr/bin/env bash
# Runs this crate's ping-pong and Debian's fi_pingpong (libfabric-bin) back to back, with the same
# sizes and iterations, two processes each, on the loopback interface, and prints usec/xfer
# (one-way latency) and MB/sec side by side with the ratios.
#
#   scripts/compare-pingpong.sh [-e rdm|dgram] [-r ROUNDS] [-p efa-device] [-s SIZES] [-g PLOT.svg] [-o TSV] [PROVIDER...]
#   scripts/compare-pingpong.sh -p emu [-e rdm|dgram] [-r ROUNDS] [-s SIZES]
#   scripts/compare-pingpong.sh -p local [-r ROUNDS] [-s SIZES] [PROVIDER...]
#
# PROVIDER defaults to "udp;ofi_rxd" and "tcp;ofi_rxm" for rdm, "udp" for dgram, "shm" for -p local.
# -p local: the default same-host path (a udp domain whose same-host peers use the local channel,
# FI_EFA_ENABLE_SHM_TRANSFER on, as every user of two processes on one host gets it), against
# libfabric's shm provider. With any other device the crate's shm routing is off, as the libfabric
# providers compared (udp;ofi_rxd, tcp;ofi_rxm) do not use shm either.
# The header names the CPU (lscpu), the kernel, the date and the rounds; ratios need at least 3
# rounds (fewer print "n/a"). -o TSV also writes the table as tab-separated lines (size, config,
# usec, MB/s, latency ratio, bandwidth ratio) for scripts/perf-guard.sh.
# -p emu: the same emulated EFA NIC for both (emu/, `efa-emu run`, one NIC per process): our
# ping-pong with its efa device against fi_pingpong -p efa (libfabric's EFA provider); PROVIDER
# defaults to "efa", the sizes to 64 and 1048576 (64 B latency, 1 MiB bandwidth). Each round runs
# every configuration once, alternating; the table gives the median of the rounds. -s takes a
# comma-separated list of sizes in bytes; -g draws latency and bandwidth against size as an SVG
# (scripts/plot-svg.awk), one curve per configuration. The PROVIDER "floor" is no libfabric
# provider: it runs examples/udp-floor, plain UDP datagrams between busy-polling sockets (sizes
# up to 65000 bytes), the floor under every udp figure.
set -euo pipefail
cd "$(dirname "$0")/.."

ep=rdm rounds=3 dev=udp sizelist="" plot="" tsv=""
while getopts "e:r:p:s:g:o:" o; do
    case $o in
    e) ep=$OPTARG ;;
    r) rounds=$OPTARG ;;
    p) dev=$OPTARG ;;
    s) sizelist=$OPTARG ;;
    g) plot=$OPTARG ;;
    o) tsv=$OPTARG ;;
    *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
emu="" shm_transfer=0
if [ "$dev" = emu ]; then emu=1 dev=efa; fi
if [ "$dev" = local ]; then shm_transfer=1 dev=udp; fi
if [ $# -gt 0 ]; then provs=("$@"); elif [ -n "$emu" ]; then provs=(efa); elif [ "$shm_transfer" = 1 ]; then provs=(shm); elif [ "$ep" = rdm ]; then provs=("udp;ofi_rxd" "tcp;ofi_rxm"); else provs=(udp); fi
if [ -n "$sizelist" ]; then IFS=, read -r -a sizes <<<"$sizelist"
elif [ -n "$emu" ]; then sizes=(64 1048576)
elif [ "$ep" = rdm ]; then sizes=(64 65536 1048576); else sizes=(64 1024); fi
command -v fi_pingpong >/dev/null || { echo "fi_pingpong not found: apt-get install libfabric-bin" >&2; exit 1; }
if [ -n "$emu" ]; then
    cargo build --release --quiet -p efa-emu
    cargo build --release --quiet --features efa --example ping-pong --example udp-floor
else
    cargo build --release --quiet --example ping-pong --example udp-floor
fi
pp=${CARGO_TARGET_DIR:-target}/release/examples/ping-pong
floor=${CARGO_TARGET_DIR:-target}/release/examples/udp-floor
efa_emu=${CARGO_TARGET_DIR:-target}/release/efa-emu
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "# CPU: ${cpu:-unknown} ($(nproc) CPUs); kernel $(uname -r); $(date -u '+%Y-%m-%d %H:%M UTC'); $rounds round(s), alternated; medians"
if [ "$rounds" -lt 3 ]; then echo "# fewer than 3 rounds: no ratios (a figure needs at least 3 alternated rounds)"; fi
# on_nic N PROGRAM...: on the emulated NIC, PROGRAM runs on a NIC of its own, 127.0.9.N (server
# 1, client 2); elsewhere it just runs.
on_nic() {
    local n=$1; shift
    # Measured without the emulated NIC's default reordering (EFA_EMU_FAULTS=none).
    if [ -n "$emu" ]; then EFA_EMU_FAULTS=${EFA_EMU_FAULTS:-none} "$efa_emu" run --addr "127.0.9.$n" -- "$@"; else "$@"; fi
}
port=$((40000 + RANDOM % 20000))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Round trips per run: small messages on the same-host paths take well under a microsecond, so
# they get many (a run of a few milliseconds shows start-up, not the steady state).
iters() {
    if [ "$1" -ge 1048576 ]; then echo 200; elif [ "$1" -ge 65536 ]; then echo 2000
    elif [ "$dev" = shm ] || [ "$shm_transfer" = 1 ]; then echo 200000; else echo 10000; fi
}

# One run: prints "usec MB/sec" taken from the client's last output line.
run_ours() {
    local s=$1 i; i=$(iters "$s"); port=$((port + 1))
    # No shm routing unless -p local: the libfabric providers compared (udp;ofi_rxd, tcp;ofi_rxm)
    # do not use shm.
    FI_EFA_ENABLE_SHM_TRANSFER=$shm_transfer on_nic 1 "$pp" -p "$dev" -e "$ep" -S "$s" -I "$i" -l -B $port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    FI_EFA_ENABLE_SHM_TRANSFER=$shm_transfer on_nic 2 timeout 120 "$pp" -p "$dev" -e "$ep" -S "$s" -I "$i" -P $port 127.0.0.1 2>/dev/null | grep -v "^#" | tail -1 | awk '{print $7, $6}'
    wait $srv || true
}
run_fi() {
    local prov=$1 s=$2 i; i=$(iters "$s"); port=$((port + 1))
    if [ "$prov" = floor ]; then
        if [ "$s" -gt 65000 ]; then echo "nan nan"; return; fi
        "$floor" -S "$s" -I "$i" -l -B $port >/dev/null 2>&1 &
        local fsrv=$!
        sleep 0.3
        timeout 120 "$floor" -S "$s" -I "$i" -P $port 127.0.0.1 2>/dev/null | grep -v "^#" | tail -1 | awk '{print $6, $5}'
        wait $fsrv || true
        return
    fi
    FI_EFA_ENABLE_SHM_TRANSFER=0 on_nic 1 fi_pingpong -p "$prov" -e "$ep" -S "$s" -I "$i" -B $port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    FI_EFA_ENABLE_SHM_TRANSFER=0 on_nic 2 timeout 120 fi_pingpong -p "$prov" -e "$ep" -S "$s" -I "$i" -P $port 127.0.0.1 2>/dev/null | grep -v "^#" | tail -1 | awk '{print $7, $6}'
    wait $srv || true
}

for r in $(seq "$rounds"); do
    for s in "${sizes[@]}"; do
        run_ours "$s" >>"$tmp/ours-$s"
        echo "round $r $s ours: $(tail -1 "$tmp/ours-$s") (usec/xfer MB/sec)"
        for p in "${provs[@]}"; do
            f="$tmp/$(echo "$p" | tr ';' _)-$s"
            run_fi "$p" "$s" >>"$f"
            echo "round $r $s $p: $(tail -1 "$f")"
        done
    done
done

median() { sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "nan"}'; }
ratio() { if [ "$rounds" -lt 3 ]; then echo n/a; else awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "nan" }'; fi; }
suffix=""; if [ "$shm_transfer" = 1 ]; then suffix=+local; fi
ours_name="efa ${emu:+emu-}$dev$suffix $ep"
if [ -n "$tsv" ]; then : >"$tsv"; fi
printf "%-10s %-18s %12s %12s %10s %10s\n" size config usec/xfer MB/sec lat-ratio bw-ratio
for s in "${sizes[@]}"; do
    ol=$(cut -d' ' -f1 "$tmp/ours-$s" | median); ob=$(cut -d' ' -f2 "$tmp/ours-$s" | median)
    printf "%-10s %-18s %12s %12s %10s %10s\n" "$s" "$ours_name" "$ol" "$ob" 1 1
    if [ -n "$tsv" ]; then printf "%s\t%s\t%s\t%s\t1\t1\n" "$s" "$ours_name" "$ol" "$ob" >>"$tsv"; fi
    for p in "${provs[@]}"; do
        f="$tmp/$(echo "$p" | tr ';' _)-$s"
        fl=$(cut -d' ' -f1 "$f" | median); fb=$(cut -d' ' -f2 "$f" | median)
        lr=$(ratio "$ol" "$fl"); br=$(ratio "$ob" "$fb")
        printf "%-10s %-18s %12s %12s %10s %10s\n" "$s" "$p" "$fl" "$fb" "$lr" "$br"
        if [ -n "$tsv" ]; then printf "%s\t%s\t%s\t%s\t%s\t%s\n" "$s" "$p" "$fl" "$fb" "$lr" "$br" >>"$tsv"; fi
    done
done
echo "lat-ratio = efa usec / libfabric usec (below 1: efa faster); bw-ratio = efa MB/s / libfabric MB/s"
if [ -n "$plot" ]; then
    for s in "${sizes[@]}"; do
        echo "efa-${emu:+emu-}$dev-$ep $s $(cut -d' ' -f1 "$tmp/ours-$s" | median) $(cut -d' ' -f2 "$tmp/ours-$s" | median)"
        for p in "${provs[@]}"; do
            f="$tmp/$(echo "$p" | tr ';' _)-$s"
            echo "$(echo "$p" | tr ';' '+') $s $(cut -d' ' -f1 "$f" | median) $(cut -d' ' -f2 "$f" | median)"
        done
    done | awk '$3 != "nan" && $4 != "nan"' | sort -s -k1,1 | awk -v title="$ep ping-pong, two processes on loopback (medians of $rounds rounds)" -f scripts/plot-svg.awk >"$plot"
    echo "plot: $plot"
fi

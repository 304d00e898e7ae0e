#!/usr/bin/env bash
# Soak: the udp device's RDM ping-pong (both ends in one process, every size up to 6 MiB, data
# checked) inside a network namespace that drops a share of the UDP datagrams on the way out
# (sendmsg fails with EPERM) or on the way in, with a busy loop competing for the CPUs
# (issue 30, point 15). Needs root (ip netns, nft).
#
#   scripts/soak-loss.sh [-n RUNS] [-p PERCENT] [-I ITERS] [out|in|both]
#
# Reports each run's verdict and the totals; exits non-zero when any run failed. The logs of
# failed runs stay in $TMPDIR/efa-soak-*/.
#
# Both ends run in one process, so their messages would take the same-host path (the local
# channel, shared memory) where the loss cannot reach them: the soak sets
# FI_EFA_ENABLE_SHM_TRANSFER=0 so that every message crosses the lossy udp device (the case of
# issue 30, point 15); give FI_EFA_ENABLE_SHM_TRANSFER=1 to soak the same-host path instead.
set -euo pipefail
runs=50
pct=5
iters=100
while getopts "n:p:I:" o; do
    case $o in
        n) runs=$OPTARG ;;
        p) pct=$OPTARG ;;
        I) iters=$OPTARG ;;
        *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
dirs=${1:-both}
case $dirs in out | in) ;; both) dirs="out in" ;; *) echo "out, in or both" >&2; exit 2 ;; esac

cargo build --release --quiet --example ping-pong
pp=$(realpath "${CARGO_TARGET_DIR:-target}/release/examples/ping-pong")
lscpu | grep "Model name" || true
ns=efa-soak-$$
logs=$(mktemp -d "${TMPDIR:-/tmp}/efa-soak-XXXXXX")
hog=
cleanup() {
    [ -n "$hog" ] && kill "$hog" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$ns"
ip -n "$ns" link set lo up
# One busy loop beside the test, as a competing process would be.
(while :; do :; done) &
hog=$!

failed=0
for dir in $dirs; do
    hook=output
    [ "$dir" = in ] && hook=input
    ip netns exec "$ns" nft flush ruleset
    ip netns exec "$ns" nft add table inet soak
    ip netns exec "$ns" nft add chain inet soak c "{ type filter hook $hook priority 0; }"
    ip netns exec "$ns" nft add rule inet soak c meta l4proto udp numgen random mod 100 "<" "$pct" drop
    bad=0
    for i in $(seq 1 "$runs"); do
        log=$logs/$dir-$i.log
        start=$(date +%s)
        if FI_EFA_ENABLE_SHM_TRANSFER=${FI_EFA_ENABLE_SHM_TRANSFER:-0} \
            ip netns exec "$ns" timeout 600 "$pp" -p udp -e rdm -S all -I "$iters" -c >"$log" 2>&1; then
            echo "$dir $i: ok ($(( $(date +%s) - start )) s)"
            rm -f "$log"
        else
            bad=$((bad + 1))
            echo "$dir $i: FAILED ($(( $(date +%s) - start )) s): $(grep -m1 -i -E "error|not complete|panicked" "$log" || tail -1 "$log")"
        fi
    done
    echo "# $dir: $bad of $runs failed ($pct% dropped on the way $dir)"
    failed=$((failed + bad))
done
[ "$failed" = 0 ] && rm -rf "$logs"
[ "$failed" = 0 ] || { echo "# logs: $logs"; exit 1; }

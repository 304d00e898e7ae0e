#!/usr/bin/env bash
# libfabric's fi_pingpong -p efa on the emulated EFA NIC beside this crate's ping-pong over udp,
# two processes each, alternated rounds (docs/performance.md, "The emulated EFA NIC").
#   scripts/compare-emulator.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cargo build --release -q -p efa-emu
cargo build --release -q --example ping-pong
E=target/release/efa-emu
P=target/release/examples/ping-pong
export FI_EFA_ENABLE_SHM_TRANSFER=0
lscpu | grep "Model name" || true
port=$((41000 + RANDOM % 10000))
for round in $(seq "$rounds"); do
  for spec in "64 2000" "65536 500" "1048576 100"; do
    set -- $spec
    port=$((port + 1))
    timeout 120 $E run --addr 127.0.9.1 -- fi_pingpong -p efa -e rdm -B $port -S "$1" -I "$2" >/dev/null 2>&1 &
    sleep 0.3
    echo "round $round emulator+libfabric $(timeout 120 $E run --addr 127.0.9.2 -- fi_pingpong -p efa -e rdm -P $port -S "$1" -I "$2" 127.0.0.1 2>&1 | grep -v "^#" | tail -1)"
    wait
    port=$((port + 1))
    # Both ends take the test options (ping-pong, like fi_pingpong, exchanges none).
    timeout 120 $P -p udp -e rdm -l -B $port -S "$1" -I "$2" >/dev/null 2>&1 &
    sleep 0.3
    echo "round $round crate-udp          $(timeout 120 $P -p udp -e rdm -P $port -S "$1" -I "$2" 127.0.0.1 2>&1 | grep -v "^#" | tail -1)"
    wait
  done
done

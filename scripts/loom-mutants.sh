#!/usr/bin/env bash
# Shows that the loom model tests (docs/architecture.md, "Model checking") can fail: weakens one
# ordering or removes one check at a time, runs the model tests, expects a failure, and puts
# the source back. Not in CI (each mutant is a rebuild); run it after changing the lock-free
# shared-memory code or its model tests (it edits the work tree while it runs: leave it be):
#   scripts/loom-mutants.sh            every mutant
#   scripts/loom-mutants.sh NAME...    some (names below)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/loom}" RUSTFLAGS="--cfg loom"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
exec python3 - "$@" <<'PY'
import re, subprocess, sys

# name: (file, text, replacement); the text must occur exactly once.
MUTANTS = {
    "ring-publish-relaxed": ("src/device/shm/ring.rs",
        "w.store(pos.wrapping_add(1), Ordering::Release);",
        "w.store(pos.wrapping_add(1), Ordering::Relaxed);"),
    "core-release-relaxed": ("src/shmem/file.rs",
        "w.store(pos.wrapping_add(u64::from(slots)), Ordering::Release);",
        "w.store(pos.wrapping_add(u64::from(slots)), Ordering::Relaxed);"),
    "core-reserve-relaxed": ("src/shmem/file.rs",
        "let seq = m.u64(slot(pos))?.load(Ordering::Acquire);",
        "let seq = m.u64(slot(pos))?.load(Ordering::Relaxed);"),
    # (Not here: `file::published` with a relaxed load goes unnoticed. Its callers only use it
    # to decide whether to look or wake; the consumer's own read, `peek`, loads the sequence
    # again with `Acquire` before it reads the slot.)
    "chan-push-relaxed": ("src/local/chan.rs",
        "w.store(pos.wrapping_add(1), Ordering::Release);",
        "w.store(pos.wrapping_add(1), Ordering::Relaxed);"),
    "chan-peek-relaxed": ("src/local/chan.rs",
        "let seq = r.word(off + S_SEQ)?.load(Ordering::Acquire);",
        "let seq = r.word(off + S_SEQ)?.load(Ordering::Relaxed);"),
    # The sleeper does not look at the ring again after counting itself a sleeper.
    "sleeper-no-recheck": ("src/shmem/file.rs",
        "if !ready() {\n            map::futex_wait",
        "if !ready() || true {\n            map::futex_wait"),
    "sleeper-no-fence": ("src/shmem/file.rs",
        "self.sleepers.store(1, Ordering::Relaxed);\n        fence(Ordering::SeqCst);",
        "self.sleepers.store(1, Ordering::Relaxed);"),
    "waker-no-fence": ("src/shmem/file.rs",
        "fence(Ordering::SeqCst);\n        self.ring_if_seen_asleep();",
        "self.ring_if_seen_asleep();"),
    # A state change that does not check the state it changes from.
    "transition-unchecked": ("src/device/shm/ring.rs",
        "w.compare_exchange(\n                state_word(pos, from),",
        "w.compare_exchange(\n                w.load(Ordering::Acquire),"),
}

names = sys.argv[1:] or list(MUTANTS)
bad = 0
for name in names:
    path, old, new = MUTANTS[name]
    src = open(path).read()
    if src.count(old) != 1:
        print(f"MUTANT {name}: cannot apply ({path} changed; update this script)")
        bad = 1
        continue
    open(path, "w").write(src.replace(old, new))
    try:
        out = subprocess.run(["cargo", "test", "--lib", "loom"],
                             capture_output=True, text=True, timeout=900)
        text = out.stdout + out.stderr
    finally:
        open(path, "w").write(src)
    failed = re.findall(r"test (\S+) \.\.\. FAILED", text)
    ran = "Running unittests" in text
    if out.returncode == 0 or not ran:
        print(f"MUTANT {name}: NOT caught" + ("" if ran else " (build failed)"))
        bad = 1
        continue
    # A deadlock found by loom aborts the test binary: no per-test line, the reason below.
    print(f"MUTANT {name}: caught by {len(failed) or 'the aborted'} test(s)")
    for t in failed:
        print(f"    {t}")
    whys = re.findall(r"(Causality violation[^\n]*|[Dd]eadlock[^\n]*|assertion[^\n]*failed[^\n]*|"
                      r"exactly one[^\n]*|as written[^\n]*|Model exceeded[^\n]*)", text)
    for w in sorted(set(whys))[:4]:
        print(f"    why: {w.strip()}")
sys.exit(bad)
PY

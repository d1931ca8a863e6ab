#!/usr/bin/env bash
# Configures, builds and tests torchrpc: the one test command that README.md
# gives and .ci/run runs.
#
#   bash tools/test.sh
#
# 1. The whole suite in a build with AddressSanitizer, LeakSanitizer and
#    UndefinedBehaviorSanitizer (-O2, in ./build-asan): any memory error,
#    leak or undefined behaviour fails the test it happens in. The tests
#    that run in one process run in 4 processes per binary
#    (TORCHRPC_TEST_SHARDS in tests/CMakeLists.txt): starting libtorch
#    under the sanitizers costs each process 1-2 s of CPU. SANITIZE=none
#    runs the suite in a Release build (./build) instead, one process per
#    test.
# 2. ThreadSanitizer over the tiers that do not fork (tools/sanitize.sh
#    thread, in ./build-thread); TORCHRPC_TSAN=0 skips it.
# 3. When clang is installed, a bounded fuzz run (tools/fuzz.sh: builds rpc/
#    and the fuzzers with clang in ./build-fuzz, runs each target
#    FUZZ_SECONDS, default 12 s); TORCHRPC_FUZZ=0 skips it.
#
# Ninja when installed, ccache in ~/.cache/ccache (CCACHE_DIR overrides; up
# to CCACHE_MAXSIZE, 20G unless set: three trees of -g objects fit;
# paths relative to the clone, CCACHE_BASEDIR, and the build directory not
# hashed, CCACHE_NOHASHDIR, so that a clone anywhere reuses the cache), JOBS=2
# parallel jobs; BUILD_DIR overrides the suite's build tree.
# Exits non-zero when a build, any test, the TSan run or the fuzz run fails;
# prints a summary of each stage last.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${JOBS:-2}"
sanitize="${SANITIZE:-address,undefined}"
export CCACHE_DIR="${CCACHE_DIR:-${HOME:-/tmp}/.cache/ccache}"
# Paths inside the clone hash as relative ones, so a clone elsewhere (a
# fresh CI checkout) reuses what an earlier build of the same sources cached.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-${repo}}"
# With -g (the sanitizer and fuzzer builds) ccache hashes the build
# directory, which differs in every clone.
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
# The sanitizer, TSan, fuzz and Release trees together exceed ccache's 5 GB
# default; evicting one tree's objects would make the next run rebuild it.
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-20G}"
mkdir -p "${CCACHE_DIR}"

case "${sanitize}" in
  none)
    build="${BUILD_DIR:-${repo}/build}"
    configure=(cmake -S "${repo}" -B "${build}" -DCMAKE_BUILD_TYPE=Release)
    ;;
  address,undefined)
    build="${BUILD_DIR:-${repo}/build-asan}"
    # -O2 as in Release, line tables (-g1) for the sanitizers' reports.
    configure=(cmake -S "${repo}" -B "${build}"
      -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1"
      "-DSANITIZE=${sanitize}" -DTORCHRPC_TEST_SHARDS=4)
    # Leaks are checked at every test process's exit (nothing is
    # suppressed); undefined behaviour stops the process with a report (the
    # build does not recover from it).
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:${ASAN_OPTIONS:-}"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
    ;;
  *)
    echo "test.sh: SANITIZE must be address,undefined (the default) or none, not '${sanitize}'" >&2
    exit 2
    ;;
esac
# An existing build tree keeps its generator; CMake refuses to switch it.
if [[ ! -f "${build}/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  configure+=(-G Ninja)
fi

start=${SECONDS}
"${configure[@]}"
cmake --build "${build}" -j "${jobs}"
echo "test.sh: configured and built in $((SECONDS - start)) s"

log="${build}/ctest.log"
status=0
ctest --test-dir "${build}" --output-on-failure -j "${jobs}" --timeout 300 \
  2>&1 | tee "${log}" || status=$?

# Runs of their own rather than CTest tests: ThreadSanitizer and the fuzzers
# each need a tree of their own, which a CTest test of this tree could only
# skip.
tsan="skipped (TORCHRPC_TSAN=0)"
if [[ "${TORCHRPC_TSAN:-1}" != 0 ]]; then
  tsan_start=${SECONDS}
  # env -u BUILD_DIR: that variable names this script's suite tree; the
  # TSan and fuzz scripts would otherwise reconfigure that tree as theirs.
  if env -u BUILD_DIR JOBS="${jobs}" bash "${repo}/tools/sanitize.sh" thread </dev/null; then
    tsan="passed in $((SECONDS - tsan_start)) s"
  else
    tsan="FAILED after $((SECONDS - tsan_start)) s"
    status=1
  fi
fi

fuzz="skipped (TORCHRPC_FUZZ=0)"
if [[ "${TORCHRPC_FUZZ:-1}" != 0 ]]; then
  if ! command -v clang++ >/dev/null; then
    fuzz="skipped (no clang++; tools/setup_debian.sh installs it)"
  else
    fuzz_start=${SECONDS}
    if env -u BUILD_DIR FUZZ_SECONDS="${FUZZ_SECONDS:-12}" JOBS="${jobs}" \
        bash "${repo}/tools/fuzz.sh" </dev/null; then
      fuzz="passed in $((SECONDS - fuzz_start)) s"
    else
      fuzz="FAILED after $((SECONDS - fuzz_start)) s"
      status=1
    fi
  fi
fi

echo "test.sh: suite (SANITIZE=${sanitize}) $(grep -E 'tests passed|No tests were found' "${log}" | tail -1 || echo 'ctest printed no summary')"
# The failed tests and the end of their output, and their names, so that
# the last lines of a CI log say what failed and why.
awk -f "${repo}/tools/failed_test_output.awk" "${log}" || true
sed -n '/The following tests FAILED:/,/^Errors while running/p' "${log}" \
  | sed 's/^/test.sh: /' || true
echo "test.sh: ThreadSanitizer ${tsan}"
echo "test.sh: fuzzing ${fuzz}"
echo "test.sh: total $((SECONDS - start)) s"
exit "${status}"

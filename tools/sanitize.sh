#!/usr/bin/env bash
# Builds the test binaries (rpc/, rref/, autograd/) with a sanitizer and runs each in one
# process (every test, one after another: that also exercises start, shutdown
# and start again of many runtimes in one process).
#
#   bash tools/sanitize.sh address   # ASan + LSan: all tiers
#   bash tools/sanitize.sh thread    # TSan: the in-process tiers only
#
# Build tree: build-<sanitizer>/ (BUILD_DIR overrides). libtorch and
# TensorPipe are not instrumented; tests/tsan.supp silences what TSan reports
# inside them.
set -euo pipefail

sanitizer="${1:-address}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-${repo}/build-${sanitizer}}"
jobs="${JOBS:-2}"

configure=(cmake -S "${repo}" -B "${build}" -DCMAKE_BUILD_TYPE=RelWithDebInfo
  "-DSANITIZE=${sanitizer}" -DTORCHRPC_BUILD_BENCH=OFF
  -DTORCHRPC_BUILD_EXAMPLES=OFF)
if [[ ! -f "${build}/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  configure+=(-G Ninja)
fi
"${configure[@]}"
cmake --build "${build}" -j "${jobs}" --target torchrpc_rpc_tests \
  torchrpc_rref_tests torchrpc_autograd_tests

case "${sanitizer}" in
  address)
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
    filter="*"
    ;;
  thread)
    export TSAN_OPTIONS="suppressions=${repo}/tests/tsan.supp:halt_on_error=0"
    # fork() under TSan is not supported with threads running: skip the
    # process tiers.
    filter="-*MultiProcess*:*Multiprocess*:*Tcp*Stopped*:*Tcp*Killed*:*TcpTransport*Process*"
    ;;
  *)
    echo "usage: $0 address|thread" >&2
    exit 2
    ;;
esac
status=0
for binary in torchrpc_rpc_tests torchrpc_rref_tests torchrpc_autograd_tests; do
  timeout 1800 "${build}/tests/${binary}" --gtest_filter="${filter}" ||
    status=1
done
exit "${status}"

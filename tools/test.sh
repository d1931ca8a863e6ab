#!/usr/bin/env bash
# Configures, builds and tests torchrpc: the one test command that README.md
# gives and .ci/run runs.
#
#   bash tools/test.sh
#
# Release build in ./build (BUILD_DIR overrides), Ninja when installed,
# ccache in ~/.cache/ccache (CCACHE_DIR overrides; paths relative to the
# clone, CCACHE_BASEDIR), JOBS=2 parallel jobs.
# Then, when clang is installed, a bounded fuzz run (tools/fuzz.sh: builds
# rpc/ and the fuzzers with clang in ./build-fuzz, runs each target
# FUZZ_SECONDS, default 12 s); TORCHRPC_FUZZ=0 skips it.
# Exits non-zero when the build, any test or the fuzz run fails; prints
# ctest's summary last.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-${repo}/build}"
jobs="${JOBS:-2}"
export CCACHE_DIR="${CCACHE_DIR:-${HOME:-/tmp}/.cache/ccache}"
# Paths inside the clone hash as relative ones, so a clone elsewhere (a
# fresh CI checkout) reuses what an earlier build of the same sources cached.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-${repo}}"
mkdir -p "${CCACHE_DIR}"

configure=(cmake -S "${repo}" -B "${build}" -DCMAKE_BUILD_TYPE=Release)
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

# A run of its own rather than a CTest test: the fuzzers need a second,
# clang-built tree, which a CTest test of this tree could only skip.
fuzz="skipped (TORCHRPC_FUZZ=0)"
if [[ "${TORCHRPC_FUZZ:-1}" != 0 ]]; then
  if ! command -v clang++ >/dev/null; then
    fuzz="skipped (no clang++; tools/setup_debian.sh installs it)"
  else
    fuzz_start=${SECONDS}
    if FUZZ_SECONDS="${FUZZ_SECONDS:-12}" JOBS="${jobs}" \
        bash "${repo}/tools/fuzz.sh" </dev/null; then
      fuzz="passed in $((SECONDS - fuzz_start)) s"
    else
      fuzz="FAILED after $((SECONDS - fuzz_start)) s"
      status=1
    fi
  fi
fi

echo "test.sh: $(grep -E 'tests passed|No tests were found' "${log}" | tail -1 || echo 'ctest printed no summary')"
echo "test.sh: fuzzing ${fuzz}"
echo "test.sh: total $((SECONDS - start)) s"
exit "${status}"

#!/usr/bin/env bash
# Installs everything torchrpc needs to build, test and benchmark on Debian 12
# (bookworm), from Debian's own archive. Idempotent: when every package is
# already installed it only asks dpkg and exits, without touching the network.
#
#   bash tools/setup_debian.sh
#
# Runs apt-get as root, through sudo when not root. Never prompts
# (DEBIAN_FRONTEND=noninteractive), so it also runs in CI with no stdin.
set -euo pipefail

# One package a line, with why. Keep README.md's list in sync.
packages=(
  build-essential      # g++, make, libc headers
  cmake                # the build (>= 3.18; bookworm has 3.25)
  ninja-build          # the generator tools/test.sh and README use
  ccache               # the top-level CMakeLists.txt uses it when present
  pkg-config
  libtorch-dev         # libtorch 1.13 headers + TorchConfig.cmake; Depends on
                       # libgflags-dev, libgoogle-glog-dev, libprotobuf-dev
  libgflags-dev        # Caffe2Config.cmake fails without the gflags target
  libgoogle-glog-dev   # Caffe2Config.cmake fails without glog::glog; c10 headers
                       # include glog (C10_USE_GLOG); glog's config needs gflags
  libunwind-dev        # glog-config.cmake does find_dependency(Unwind)
  libtensorpipe-dev    # the TensorPipe transport (pulls libnop-dev)
  libnop-dev           # TensorPipe's public headers include nop/
  libprotobuf-dev      # the wire envelope; Caffe2Config.cmake needs it too
  protobuf-compiler    # protoc for proto/*.proto
  libboost-dev         # Boost.Asio (strands, timers, the TCP transport)
  libboost-system-dev
  libgtest-dev         # tests
  libgmock-dev
  libbenchmark-dev     # bench/
  libssl-dev           # OpenSSL, for the optional shared secret between peers
  iproute2             # ip/ss, for network tests and the launcher
  libcli11-dev         # command-line flags of torchrpc-launch and the examples
  nlohmann-json3-dev   # JSON for torchrpc-trace-merge (tools/trace/), header-only
  libgloo-dev          # Gloo's headers, which c10d's ProcessGroupGloo.hpp
                       # includes (the DDP + RPC example)
  openmpi-bin          # mpirun, to test that workers run under Open MPI
  slurmd               # srun, slurmctld, slurmd and munged, to test that workers
  slurmctld            # run under Slurm: the test starts its own one-node
  slurm-client         # cluster in a scratch directory (the system's slurmd
  munge                # and slurmctld stay idle without /etc/slurm/slurm.conf)
  python3-torch        # the PyTorch side of the benchmarks (/usr/bin/python3);
                       # torchrun, to test that workers run under it
  dataset-fashion-mnist  # the parameter-server example's data (gzip'd idx files)
  zlib1g-dev           # the example unpacks them for libtorch's MNIST reader
  gnuplot-nox          # the example's curves.png
  python3-protobuf     # the test that reads the example's TensorBoard files
  python3-yaml         # the test that reads examples/kubernetes/ manifests
  graphviz             # dot, to render autograd::graphDot() (its test does)
  clang                # tools/fuzz.sh: libFuzzer needs clang (clang++ -> clang-14)
  libclang-rt-14-dev   # libFuzzer's runtime and clang's ASan/UBSan runtimes
                       # (clang-14 only recommends it)
)

missing=()
for package in "${packages[@]}"; do
  status="$(dpkg-query -W -f='${db:Status-Abbrev}' "${package}" 2>/dev/null || true)"
  if [[ "${status}" != ii* ]]; then
    missing+=("${package}")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup_debian: all ${#packages[@]} packages already installed"
  exit 0
fi

if [[ ! -r /etc/debian_version ]] || ! command -v apt-get >/dev/null; then
  echo "setup_debian: this script needs Debian 12 (apt-get); missing: ${missing[*]}" >&2
  exit 1
fi

if ((EUID == 0)); then
  as_root=(env DEBIAN_FRONTEND=noninteractive)
elif command -v sudo >/dev/null; then
  as_root=(sudo env DEBIAN_FRONTEND=noninteractive)
else
  echo "setup_debian: not root and no sudo; as root run: apt-get install ${missing[*]}" >&2
  exit 1
fi

echo "setup_debian: installing ${missing[*]}"
# Wait for a running apt/dpkg (unattended-upgrades on a fresh machine) rather
# than failing on its lock.
apt_options=(-o DPkg::Lock::Timeout=600 -o Acquire::Retries=3)
# A third-party source that is unreachable makes `update` fail even when
# Debian's archive answered; the install below is what must succeed.
if ! "${as_root[@]}" apt-get "${apt_options[@]}" update </dev/null; then
  echo "setup_debian: warning: apt-get update reported errors; trying the install anyway" >&2
fi
"${as_root[@]}" apt-get "${apt_options[@]}" install -y --no-install-recommends \
  "${missing[@]}" </dev/null

still_missing=()
for package in "${missing[@]}"; do
  status="$(dpkg-query -W -f='${db:Status-Abbrev}' "${package}" 2>/dev/null || true)"
  if [[ "${status}" != ii* ]]; then
    still_missing+=("${package}")
  fi
done
if ((${#still_missing[@]} > 0)); then
  echo "setup_debian: still not installed: ${still_missing[*]}" >&2
  exit 1
fi
echo "setup_debian: done"

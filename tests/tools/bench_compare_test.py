#!/usr/bin/python3
"""bench/compare's "machine" and "limit" figures (README "Benchmarks", bench/README.md).

  bench_compare_test.py REPO BUILD_DIR

Runs compare on quick workloads with a stand-in for the PyTorch side
(TORCHRPC_BENCH_PYTHON: a script that prints a fixed line per workload), so
that the test needs neither PyTorch's RPC nor its minutes:
  1. with BUILD_DIR and --rounds 2: the line has "machine", the median of
     "machine_runs", two positive figures from bench/machine_speed, and no
     "machine_error";
  2. with a build directory that has torchrpc_bench but not machine_speed:
     "machine" is null and "machine_error" says why, and the run still
     succeeds (the machine's speed never changes compare's exit status);
  3. call_rtt_1elem with BUILD_DIR and --rounds 2: the line has "limit" and
     "limit_shm" (bench/call_limits over a Unix socket, and through shared
     memory: its log shows the --socket shm runs), each the median of its
     two positive runs, with its ratio to torchrpc's figure and no error;
  4. the same with the build directory of step 2 (no call_limits): both
     limits null, and "limit_error" and "limit_shm_error" say why.
  5. dist_autograd_overhead with BUILD_DIR: the line has "limit"
     (bench/autograd_limit: the log shows its run) and its ratio, and no
     "limit_shm".
Exits 0 when all hold, 1 otherwise.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

# What the stand-in prints for each workload ($3 of its arguments).
PYTORCH_LINES = {
    "idle_cpu_cores": ('{"workload": "idle_cpu_cores", "metric": "idle_cpu", "unit": "cores", '
                       '"value": 2.0, "better": "lower"}'),
    "call_rtt_1elem": ('{"workload": "call_rtt_1elem", "metric": "median_rtt", "unit": "us", '
                       '"value": 500.0, "better": "lower"}'),
    "dist_autograd_overhead": ('{"workload": "dist_autograd_overhead", "metric": '
                               '"overhead_per_iter", "unit": "us", "value": 5000.0, '
                               '"better": "lower"}'),
}


def run_compare(repo, build_dir, stub, rounds, workload="idle_cpu_cores"):
    cmd = [sys.executable, os.path.join(repo, "bench", "compare"), build_dir, "--quick",
           "--workloads", workload, "--rounds", str(rounds), "--timeout", "120"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=600, env=dict(os.environ, TORCHRPC_BENCH_PYTHON=stub))
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    if p.returncode != 0 or len(lines) != 1:
        sys.exit(f"FAIL: compare exited {p.returncode} with {len(lines)} lines\n"
                 f"stdout:\n{p.stdout}\nstderr tail:\n{p.stderr[-2000:]}")
    return json.loads(lines[0]), p.stderr


def check(condition, what, line):
    if not condition:
        sys.exit(f"FAIL: {what}\nline: {json.dumps(line)}")


def main():
    repo, build_dir = sys.argv[1], os.path.abspath(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        stub = os.path.join(tmp, "pytorch_stub")
        with open(stub, "w") as f:
            f.write("#!/bin/sh\ncase \"$3\" in\n"
                    + "".join(f"  {w}) echo '{l}' ;;\n" for w, l in PYTORCH_LINES.items())
                    + "  *) exit 1 ;;\nesac\n")
        os.chmod(stub, 0o755)

        line, _ = run_compare(repo, build_dir, stub, rounds=2)
        check(line.get("pytorch") == 2.0, "the stand-in PyTorch side was not used", line)
        runs = line.get("machine_runs")
        check(isinstance(runs, list) and len(runs) == 2, "machine_runs is not two rounds", line)
        check(all(isinstance(v, (int, float)) and v > 0 for v in runs),
              "a round has no machine figure", line)
        check(line.get("machine") == statistics.median(runs),
              "machine is not the median of machine_runs", line)
        check("machine_error" not in line, "machine_error on a measured run", line)

        # Only torchrpc_bench: machine_speed is missing.
        os.makedirs(os.path.join(tmp, "build", "bench"))
        os.symlink(os.path.join(build_dir, "bench", "torchrpc_bench"),
                   os.path.join(tmp, "build", "bench", "torchrpc_bench"))
        line, _ = run_compare(repo, os.path.join(tmp, "build"), stub, rounds=1)
        check(line.get("torchrpc") is not None, "the torchrpc side failed", line)
        check("machine" in line and line["machine"] is None, "machine is not null", line)
        check(line.get("machine_error") == "machine_speed not built",
              "machine_error does not say why", line)

        # The round trip's limits, over a socket and through shared memory.
        line, log = run_compare(repo, build_dir, stub, rounds=2, workload="call_rtt_1elem")
        x = line.get("torchrpc")
        check(isinstance(x, (int, float)) and x > 0, "the torchrpc side failed", line)
        check(log.count("call_limits --workload call_rtt_1elem --socket shm --quick -> rc=0") == 2,
              "the log does not show two shared-memory limit runs", line)
        for key in ("limit", "limit_shm"):
            w = line.get(key)
            runs = line.get(f"{key}_runs")
            check(isinstance(runs, list) and len(runs) == 2
                  and all(isinstance(v, (int, float)) and v > 0 for v in runs),
                  f"{key}_runs is not two measured rounds", line)
            check(w == statistics.median(runs), f"{key} is not the median of its runs", line)
            check(line.get(f"{key}_ratio") == x / w, f"{key}_ratio is not torchrpc / {key}",
                  line)
            check(f"{key}_error" not in line, f"{key}_error on a measured run", line)

        # Without call_limits (the directory above has only torchrpc_bench).
        line, _ = run_compare(repo, os.path.join(tmp, "build"), stub, rounds=1,
                              workload="call_rtt_1elem")
        for key in ("limit", "limit_shm"):
            check(key in line and line[key] is None, f"{key} is not null", line)
            check(line.get(f"{key}_error") == "call_limits not built",
                  f"{key}_error does not say why", line)

        # The autograd workload's limit: the split training over a bare socket.
        line, log = run_compare(repo, build_dir, stub, rounds=1,
                                workload="dist_autograd_overhead")
        x, w = line.get("torchrpc"), line.get("limit")
        check(isinstance(x, (int, float)), "the torchrpc side failed", line)
        check(log.count("autograd_limit --workload dist_autograd_overhead --quick -> rc=0") == 1,
              "the log does not show the autograd limit's run", line)
        check(isinstance(w, (int, float)) and "limit_error" not in line,
              "no autograd limit", line)
        check(line.get("limit_ratio") == (x / w if w else None),
              "limit_ratio is not torchrpc / limit", line)
        check("limit_shm" not in line, "a shared-memory limit for the autograd workload", line)
    print("PASS")


if __name__ == "__main__":
    main()

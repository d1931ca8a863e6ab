#!/usr/bin/python3
"""bench/autograd_limit (bench/README.md, "autograd_limit").

  autograd_limit_test.py AUTOGRAD_LIMIT

1. A quick run, blocking and with --spin-us 200: exit 0 (the owner's
   parameters equal the local model's bit for bit: it exits 1 otherwise)
   and one JSON line naming the workload, with a finite value and the
   spin it ran with; stderr has both sides' medians and the phases.
2. Bad usage exits 2 with the usage line and prints nothing on stdout.
3. Neither side outlives the other: a client whose owner is killed exits 1
   saying so; an owner whose client is killed dies.
Exits 0 when all hold, 1 otherwise.
"""

import json
import math
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in tests/tools/
from process_tree import (become_subreaper, expect_killed_server_reported,  # noqa: E402
                          expect_server_dies_with_client, start_with_server)


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120)


def fail(what, p):
    sys.exit(f"FAIL: {what}\nstatus {p.returncode}\nstdout:\n{p.stdout}\n"
             f"stderr tail:\n{p.stderr[-2000:]}")


def start_full_run(binary):
    """A run of 220 pairs (seconds to minutes), and its owner's pid, once
    the owner is into the loop (it builds its model within a second)."""
    return start_with_server([binary, "--workload", "dist_autograd_overhead"], settle=1.0)


def main():
    binary = sys.argv[1]
    if not become_subreaper():
        sys.exit("FAIL: prctl(PR_SET_CHILD_SUBREAPER)")

    for spin in (None, 200):
        extra = ["--spin-us", str(spin)] if spin is not None else []
        p = run([binary, "--workload", "dist_autograd_overhead", "--quick"] + extra)
        lines = [l for l in p.stdout.splitlines() if l.strip()]
        if p.returncode != 0 or len(lines) != 1:
            fail(f"spin {spin}: expected status 0 and one line", p)
        line = json.loads(lines[0])
        value = line.get("value")
        if (line.get("workload") != "dist_autograd_overhead_limit"
                or line.get("metric") != "overhead_per_iter" or line.get("unit") != "us"
                or line.get("better") != "lower" or line.get("spin_us") != (spin or 0)
                or not isinstance(value, (int, float)) or not math.isfinite(value)):
            fail(f"spin {spin}: unexpected line {lines[0]}", p)
        if "local iteration: median" not in p.stderr:
            fail(f"spin {spin}: no medians on stderr", p)
        if not all(f"{phase} exchange " in p.stderr for phase in ("forward", "backward", "step")):
            fail(f"spin {spin}: no phases on stderr", p)

    for args in ([], ["--workload", "call_rtt_1elem"],
                 ["--workload", "dist_autograd_overhead", "--spin-us", "-1"]):
        p = run([binary] + args)
        if p.returncode != 2 or "usage: autograd_limit" not in p.stderr or p.stdout:
            fail(f"{args} was not refused", p)

    # The owner dies: the client stops waiting and says so.
    expect_killed_server_reported(lambda: start_full_run(binary), "the owner closed the socket")
    # The client dies: its owner goes too.
    expect_server_dies_with_client(lambda: start_full_run(binary))
    print("autograd_limit: blocking and spinning runs trained the same parameters as "
          "one process; bad usage refused; neither side outlives the other")


if __name__ == "__main__":
    main()

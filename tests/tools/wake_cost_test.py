#!/usr/bin/python3
"""bench/wake_cost measures what it says (bench/README.md, "wake_cost").

  wake_cost_test.py WAKE_COST

Runs it with --quick and checks that it exits 0 with one JSON line holding
the four medians, each a positive number of microseconds under a second
(a write that wakes a sleeper returns within that on any machine; a
missing or zero figure means a measurement was not made), and 60 rounds.
Then checks that an unknown argument exits 2 with the usage. Exits 0 when
all hold, 1 otherwise.
"""

import json
import subprocess
import sys

KEYS = ("first_after_compute_us", "second_after_compute_us",
        "first_after_sleep_us", "second_after_sleep_us")


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60)


def fail(what, p):
    sys.exit(f"FAIL: {what}\nstatus {p.returncode}\nstdout:\n{p.stdout}\n"
             f"stderr tail:\n{p.stderr[-2000:]}")


def main():
    binary = sys.argv[1]
    p = run([binary, "--quick"])
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    if p.returncode != 0 or len(lines) != 1:
        fail("expected status 0 and one line", p)
    try:
        figures = json.loads(lines[0])
    except ValueError:
        fail("the line is not JSON", p)
    for key in KEYS:
        value = figures.get(key)
        if not isinstance(value, (int, float)) or not 0 < value < 1e6:
            fail(f"{key}: expected a positive figure under a second, got {value!r}", p)
    if figures.get("rounds") != 60:
        fail(f"expected 60 rounds, got {figures.get('rounds')!r}", p)
    p = run([binary, "--rounds", "5"])
    if p.returncode != 2 or "usage: wake_cost" not in p.stderr:
        fail("an unknown argument: expected status 2 and the usage", p)
    print("wake_cost: " + ", ".join(f"{k} {figures[k]}" for k in KEYS))


if __name__ == "__main__":
    main()

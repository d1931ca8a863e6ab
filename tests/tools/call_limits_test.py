#!/usr/bin/python3
"""bench/call_limits' round trip over each channel (bench/README.md, "call_limits").

  call_limits_test.py CALL_LIMITS

For --socket unix, tcp and shm, runs 200 quick round trips and checks that
the program exits 0 (every reply was x + 1: it exits 1 on a wrong answer)
and prints one JSON line naming the channel, with a positive median. Then
checks that the shared page refuses what it cannot measure (--blocking, the
pipelined workload) with status 2 and a message. Exits 0 when all hold, 1
otherwise.
"""

import json
import subprocess
import sys


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120)


def fail(what, p):
    sys.exit(f"FAIL: {what}\nstatus {p.returncode}\nstdout:\n{p.stdout}\n"
             f"stderr tail:\n{p.stderr[-2000:]}")


def main():
    binary = sys.argv[1]
    for channel in ("unix", "tcp", "shm"):
        p = run([binary, "--workload", "call_rtt_1elem", "--socket", channel,
                 "--quick", "--calls", "200"])
        lines = [l for l in p.stdout.splitlines() if l.strip()]
        if p.returncode != 0 or len(lines) != 1:
            fail(f"{channel}: expected status 0 and one line", p)
        line = json.loads(lines[0])
        if (line.get("workload") != "call_rtt_1elem_limit" or line.get("socket") != channel
                or line.get("reads") != "polled" or not line.get("value", 0) > 0):
            fail(f"{channel}: unexpected line {lines[0]}", p)
        if "n=200 " not in p.stderr:
            fail(f"{channel}: no distribution of 200 calls on stderr", p)
    for extra in (["--workload", "call_rtt_1elem", "--blocking"],
                  ["--workload", "calls_per_s_64_outstanding"]):
        p = run([binary, "--socket", "shm"] + extra)
        if p.returncode != 2 or "polled reads only" not in p.stderr or p.stdout:
            fail(f"--socket shm {' '.join(extra)} was not refused", p)
    print("call_limits: unix, tcp and shm round trips answered; shm refusals hold")


if __name__ == "__main__":
    main()

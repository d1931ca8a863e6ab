#!/usr/bin/python3
"""bench/call_limits' round trip over each channel (bench/README.md, "call_limits").

  call_limits_test.py CALL_LIMITS

For --socket unix, tcp and shm, runs 200 quick round trips and checks that
the program exits 0 (every reply was x + 1: it exits 1 on a wrong answer;
through the shared page each call sends another value, so a stale reply is
wrong too) and prints one JSON line naming the channel, with a positive
median. Then checks that the shared page refuses what it cannot measure
(--blocking, the pipelined workload) with status 2 and a message, and that
neither side of the shared page outlives the other: a client whose server
is killed exits 1 saying so, and a server whose client is killed dies.
Exits 0 when all hold, 1 otherwise.
"""

import json
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in tests/tools/
from process_tree import (become_subreaper, expect_killed_server_reported,  # noqa: E402
                          expect_server_dies_with_client, start_with_server)


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=30)


def start_long_shm_run(binary):
    """A shared-page run far longer than the test, and its server's pid.

    50 million calls take minutes at any speed this machine has shown, and
    the client's record of them (8 bytes a call, reserved up front) stays
    under half a gigabyte of address space, also under the sanitizers.
    """
    return start_with_server([binary, "--workload", "call_rtt_1elem", "--socket", "shm",
                              "--calls", "50000000"])


def fail(what, p):
    sys.exit(f"FAIL: {what}\nstatus {p.returncode}\nstdout:\n{p.stdout}\n"
             f"stderr tail:\n{p.stderr[-2000:]}")


def main():
    binary = sys.argv[1]
    if not become_subreaper():
        sys.exit("FAIL: prctl(PR_SET_CHILD_SUBREAPER)")
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

    # The server dies: the client stops waiting and says so.
    expect_killed_server_reported(lambda: start_long_shm_run(binary), "the server died")
    # The client dies: its server does not spin on.
    expect_server_dies_with_client(lambda: start_long_shm_run(binary))
    print("call_limits: unix, tcp and shm round trips answered; shm refusals hold; "
          "neither side of the shared page outlives the other")


if __name__ == "__main__":
    main()

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

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120)


def fail(what, p):
    sys.exit(f"FAIL: {what}\nstatus {p.returncode}\nstdout:\n{p.stdout}\n"
             f"stderr tail:\n{p.stderr[-2000:]}")


def children(pid):
    """The pids whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def ended(pid):
    """Whether `pid` has ended; reaps it once it is this process's child."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass  # not (yet) reparented to this process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone


def wait_until(condition, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def start_full_run(binary):
    """A run of 220 pairs (seconds to minutes), and its owner's pid."""
    client = subprocess.Popen([binary, "--workload", "dist_autograd_overhead"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    owners = []
    if not wait_until(lambda: owners.extend(children(client.pid)) or owners, 20):
        client.kill()
        client.wait()
        sys.exit("FAIL: the run started no owner")
    # Into the loop: the owner has its model (a second of warm-up at most).
    time.sleep(1.0)
    return client, owners[0]


def main():
    binary = sys.argv[1]
    # Orphans become this process's children, so that an owner whose client
    # was killed can be waited for here.
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
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
    client, owner = start_full_run(binary)
    try:
        os.kill(owner, signal.SIGKILL)
        out, err = client.communicate(timeout=60)
        if client.returncode != 1 or "the owner closed the socket" not in err:
            sys.exit(f"FAIL: after its owner was killed the client exited "
                     f"{client.returncode}\nstderr tail:\n{err[-2000:]}")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()

    # The client dies: its owner goes too.
    client, owner = start_full_run(binary)
    try:
        client.kill()
        client.wait()
        if not wait_until(lambda: ended(owner), 20):
            os.kill(owner, signal.SIGKILL)
            sys.exit("FAIL: the owner outlived its killed client")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    print("autograd_limit: blocking and spinning runs trained the same parameters as "
          "one process; bad usage refused; neither side outlives the other")


if __name__ == "__main__":
    main()

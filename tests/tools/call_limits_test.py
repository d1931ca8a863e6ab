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

import ctypes
import json
import os
import signal
import subprocess
import sys
import time


def run(cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=30)


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


def start_long_shm_run(binary):
    """A shared-page run far longer than the test, and its server's pid.

    50 million calls take minutes at any speed this machine has shown, and
    the client's record of them (8 bytes a call, reserved up front) stays
    under half a gigabyte of address space, also under the sanitizers.
    """
    client = subprocess.Popen([binary, "--workload", "call_rtt_1elem", "--socket", "shm",
                               "--calls", "50000000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    servers = []
    if not wait_until(lambda: servers.extend(children(client.pid)) or servers, 20):
        client.kill()
        client.wait()
        sys.exit("FAIL: the shared-page run started no server child")
    return client, servers[0]


def fail(what, p):
    sys.exit(f"FAIL: {what}\nstatus {p.returncode}\nstdout:\n{p.stdout}\n"
             f"stderr tail:\n{p.stderr[-2000:]}")


def main():
    binary = sys.argv[1]
    # Orphans become this process's children, so that a server whose client
    # was killed can be waited for here, and reaped, rather than left to
    # whatever init the machine has.
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
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
    client, server = start_long_shm_run(binary)
    try:
        os.kill(server, signal.SIGKILL)
        out, err = client.communicate(timeout=20)
        if client.returncode != 1 or "the server died" not in err:
            sys.exit(f"FAIL: after its server was killed the client exited "
                     f"{client.returncode}\nstderr tail:\n{err[-2000:]}")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()

    # The client dies: its server does not spin on.
    client, server = start_long_shm_run(binary)
    try:
        client.kill()
        client.wait()
        if not wait_until(lambda: ended(server), 20):
            os.kill(server, signal.SIGKILL)
            sys.exit("FAIL: the server outlived its killed client")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    print("call_limits: unix, tcp and shm round trips answered; shm refusals hold; "
          "neither side of the shared page outlives the other")


if __name__ == "__main__":
    main()

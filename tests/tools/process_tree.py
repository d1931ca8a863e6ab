"""For the tests of the bench programs that fork a server
(call_limits_test.py, autograd_limit_test.py): finding the server from
/proc, and checking that neither side outlives the other."""

import ctypes
import os
import signal
import subprocess
import sys
import time


def become_subreaper():
    """Orphans become this process's children, so that a server whose client
    was killed can be waited for here, and reaped, rather than left to
    whatever init the machine has. False if the kernel refused."""
    PR_SET_CHILD_SUBREAPER = 36
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


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
    """Polls `condition` every 50 ms for up to `seconds`; its last value."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def start_with_server(cmd, settle=0.0):
    """Starts `cmd`, a client that forks one server, and returns (client
    Popen, server pid) once the server shows (20 s at most), `settle`
    seconds later; exits the test if no server shows."""
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    servers = []
    if not wait_until(lambda: servers.extend(children(client.pid)) or servers, 20):
        client.kill()
        client.wait()
        sys.exit(f"FAIL: {cmd[0]} started no server")
    time.sleep(settle)
    return client, servers[0]


def expect_killed_server_reported(start, message):
    """Kills the server of the run `start()` returns: its client must exit 1
    within 60 s saying `message`."""
    client, server = start()
    try:
        os.kill(server, signal.SIGKILL)
        _, err = client.communicate(timeout=60)
        if client.returncode != 1 or message not in err:
            sys.exit(f"FAIL: after its server was killed the client exited "
                     f"{client.returncode}\nstderr tail:\n{err[-2000:]}")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()


def expect_server_dies_with_client(start):
    """Kills the client of the run `start()` returns: its server must end
    within 20 s (it is killed by pid if not)."""
    client, server = start()
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

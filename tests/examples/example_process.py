"""What the example tests share: failing with a message, and running an
example bounded in time with every process it started killed afterwards."""

import os
import signal
import subprocess
import sys


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def run(binary, args, timeout_s):
    """Runs `binary args` in a process group of its own; returns (exit code,
    stdout, stderr). Fails the test if it does not finish in timeout_s; kills
    the whole group however it ends, so no worker outlives the test."""
    name = os.path.basename(binary)
    process = subprocess.Popen(
        [binary] + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        print(out, err)
        fail("%s %s did not finish in %d s" % (name, " ".join(args), timeout_s))
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print("--- %s %s" % (name, " ".join(args)))
    print(out)
    print(err, file=sys.stderr)
    return process.returncode, out, err

#!/usr/bin/env python3
"""End-to-end test of the DDP + RPC example (ddp_rpc).

  ddp_rpc_test.py BINARY

Runs it in local mode for a few dozen steps and checks: exit 0, a loss line
every few steps, the last loss below the first, and each trainer's line
saying its dense replica is bit-identical to the others'.

The run is bounded; the example runs in a process group of its own, killed
by its id whatever happens here.
"""

import os
import re
import signal
import subprocess
import sys

RUN_TIMEOUT_S = 120
TRAINERS = 2
STEPS = 40


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def run(binary, args):
    """Runs the example; returns (exit code, stdout, stderr)."""
    process = subprocess.Popen(
        [binary] + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        print(out, err)
        fail("ddp_rpc %s did not finish in %d s" % (" ".join(args), RUN_TIMEOUT_S))
    finally:
        # The workers are in the example's group; none may outlive the test.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print("--- ddp_rpc " + " ".join(args))
    print(out)
    print(err, file=sys.stderr)
    return process.returncode, out, err


def main():
    if len(sys.argv) != 2:
        fail("usage: ddp_rpc_test.py BINARY")
    binary = sys.argv[1]
    code, out, _ = run(
        binary,
        ["--trainers", str(TRAINERS), "--steps", str(STEPS), "--print-every", "10"],
    )
    check(code == 0, "exit code %d" % code)
    losses = [float(m) for m in re.findall(r"^step \d+/\d+ loss ([0-9.]+)$", out, re.M)]
    check(len(losses) == STEPS // 10, "expected %d loss lines, got %s" % (STEPS // 10, losses))
    check(losses[-1] < losses[0], "the loss did not fall: %s" % losses)
    for trainer in range(1, TRAINERS + 1):
        check(
            re.search(
                r"^trainer%d: dense replicas identical across %d trainers" % (trainer, TRAINERS),
                out,
                re.M,
            ),
            "no 'replicas identical' line from trainer%d" % trainer,
        )
    print("OK: losses %s; replicas identical" % losses)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""End-to-end test of the DDP + RPC example (ddp_rpc).

  ddp_rpc_test.py local    BINARY   starts every worker itself
  ddp_rpc_test.py launcher BINARY   one process per worker, as a launcher
                                    starts them (RANK, WORLD_SIZE,
                                    MASTER_ADDR, MASTER_PORT): the trainers'
                                    group meets at MASTER_PORT + 1

Runs it for a few dozen steps and checks: exit 0, a loss line every few
steps, the last loss below the first, and each trainer's line saying its
dense replica is bit-identical to the others'.

Every run is bounded; the example runs in process groups of its own, killed
by their ids whatever happens here.
"""

import os
import re
import signal
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import example_process  # noqa: E402  (tests/examples/example_process.py)
from example_process import check, fail  # noqa: E402

RUN_TIMEOUT_S = 120
TRAINERS = 2
STEPS = 40


def run(binary, args):
    """Runs the example; returns (exit code, stdout, stderr)."""
    return example_process.run(binary, args, RUN_TIMEOUT_S)


def free_port_pair():
    """A port p with p + 1 free too (the RPC store's and the group's)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                    return port
            except OSError:
                continue
    fail("no two consecutive free ports")


def run_launched(binary, args):
    """Starts one process per worker, as a launcher does."""
    port = free_port_pair()
    processes = []
    for rank in range(TRAINERS + 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(TRAINERS + 1),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        processes.append(subprocess.Popen(
            [binary] + args, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True))
    outs, codes = [], []
    try:
        for p in processes:
            try:
                out, err = p.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                fail("ddp_rpc (rank %d) did not finish in %d s" % (processes.index(p), RUN_TIMEOUT_S))
            print(out)
            print(err, file=sys.stderr)
            outs.append(out)
            codes.append(p.returncode)
    finally:
        for p in processes:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return max(codes), "".join(outs)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("local", "launcher"):
        fail("usage: ddp_rpc_test.py local|launcher BINARY")
    binary = sys.argv[2]
    args = ["--steps", str(STEPS), "--print-every", "10"]
    if sys.argv[1] == "local":
        code, out, _ = run(binary, ["--trainers", str(TRAINERS)] + args)
    else:
        code, out = run_launched(binary, args)
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

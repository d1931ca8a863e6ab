#!/usr/bin/env python3
"""Runs model_parallel for a few steps: exit 0, the last loss below the first,
both throughput lines printed. Bounded; the process group is killed however
it ends."""
import os, re, signal, subprocess, sys

binary, cache = sys.argv[1], sys.argv[2]
proc = subprocess.Popen(
    [binary, "--steps", "20", "--log-every", "5", "--cache-dir", cache],
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    start_new_session=True)
try:
    out, _ = proc.communicate(timeout=150)
finally:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
print(out)
assert proc.returncode == 0, f"exit code {proc.returncode}"
losses = [float(x) for x in re.findall(r"^step \d+ micro-batches \d+ loss ([\d.]+)$", out, re.M)]
assert len(losses) >= 2, f"loss lines: {losses}"
assert losses[-1] < losses[0], f"loss did not fall: {losses}"
assert re.search(r"^throughput micro-batches 1: \d+ samples/s", out, re.M), "no unpipelined throughput"
assert re.search(r"^throughput micro-batches 4: \d+ samples/s", out, re.M), "no pipelined throughput"
print("ok: loss", losses[0], "->", losses[-1])

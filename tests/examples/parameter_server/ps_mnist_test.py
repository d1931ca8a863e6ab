#!/usr/bin/env python3
"""End-to-end tests of the parameter-server example (ps_mnist).

  ps_mnist_test.py trains   BINARY PROTO SCRATCH   few steps, events, PNG, --resume
  ps_mnist_test.py no-data  BINARY PROTO SCRATCH   the missing-data error
  ps_mnist_test.py launcher BINARY PROTO SCRATCH   one process per worker, as
                                                   a launcher starts them

The event files are read here independently of the C++ writer: records are
split and their CRC-32C checked by this script's own code, Events are parsed
with Python protobuf classes that protoc generates from the .proto, and the
field numbers are checked on the raw bytes against TensorBoard's
(event.proto: wall_time 1, step 2, file_version 3, summary 5; summary.proto:
value 1, tag 1, simple_value 2).

Every run is bounded; the example runs in a process group of its own,
killed by its id whatever happens here.
"""

import glob
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import example_process  # noqa: E402  (tests/examples/example_process.py)
from example_process import check, fail  # noqa: E402

RUN_TIMEOUT_S = 240
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(binary, args):
    """Runs the example; returns (exit code, stdout, stderr)."""
    return example_process.run(binary, args, RUN_TIMEOUT_S)


# --- An independent reader of TensorBoard's record format -----------------

def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path):
    with open(path, "rb") as f:
        data = f.read()
    records, offset = [], 0
    while offset < len(data):
        check(len(data) - offset >= 12, "%s: truncated record header" % path)
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
        check(length_crc == masked(crc32c(header)),
              "%s: bad length CRC at byte %d" % (path, offset))
        body = data[offset + 12:offset + 12 + length]
        check(len(body) == length, "%s: truncated record" % path)
        (body_crc,) = struct.unpack(
            "<I", data[offset + 12 + length:offset + 16 + length])
        check(body_crc == masked(crc32c(body)),
              "%s: bad data CRC at byte %d" % (path, offset))
        records.append(body)
        offset += 16 + length
    return records


def varint(data, at):
    value, shift = 0, 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        shift += 7
        if not byte & 0x80:
            return value, at


def wire_fields(data, payloads=False):
    """[(field number, wire type)] of a protobuf message, from its bytes."""
    fields, at = [], 0
    while at < len(data):
        key, at = varint(data, at)
        number, kind = key >> 3, key & 7
        start = at
        if kind == 0:
            _, at = varint(data, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == 2:
            length, at = varint(data, at)
            start = at
            at += length
        else:
            fail("unexpected wire type %d" % kind)
        fields.append((number, kind, data[start:at]) if payloads
                      else (number, kind))
    return fields


def read_events(path, event_pb2):
    """{tag: [(step, value)]} and the raw records of one event file."""
    records = read_records(path)
    check(records, "%s: no records" % path)
    first = event_pb2.Event()
    first.ParseFromString(records[0])
    check(first.file_version == "brain.Event:2",
          "%s: first event is not file_version brain.Event:2" % path)
    # Field numbers and wire types as TensorBoard's, on the raw bytes.
    check(wire_fields(records[0]) == [(1, 1), (3, 2)],
          "%s: the file_version event's fields are not TensorBoard's" % path)
    scalars = {}
    for raw in records[1:]:
        event = event_pb2.Event()
        event.ParseFromString(raw)
        check(event.WhichOneof("what") == "summary",
              "%s: an event after the first has no summary" % path)
        # wall_time 1 (double), step 2 (varint), summary 5; in the summary
        # value 1, in which tag 1 and simple_value 2 (fixed32).
        top = wire_fields(raw, payloads=True)
        summary = [p for n, t, p in top if n == 5]
        values = [p for n, t, p in wire_fields(summary[0], payloads=True)
                  if n == 1] if summary else []
        check([(n, t) for n, t, _ in top] == [(1, 1), (2, 0), (5, 2)] and
              values and all(wire_fields(v) == [(1, 2), (2, 5)]
                             for v in values),
              "%s: a scalar event's fields are not TensorBoard's" % path)
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append(
                (event.step, value.simple_value))
    return scalars


def load_event_pb2(proto, scratch):
    out = os.path.join(scratch, "pb")
    os.makedirs(out, exist_ok=True)
    subprocess.run(
        ["protoc", "--proto_path=" + os.path.dirname(proto),
         "--python_out=" + out, proto],
        check=True, timeout=60)
    sys.path.insert(0, out)
    import tfevents_pb2  # noqa: E402
    return tfevents_pb2


# --- The tests -------------------------------------------------------------

PROGRESS = re.compile(
    r"^trainer(\d) epoch (\d+)/(\d+) step (\d+)/(\d+) \(\d+/\d+ of the epoch\) "
    r"loss ([0-9.]+) acc ([0-9.]+)% ([0-9.]+) steps/s ETA [0-9:?]+$",
    re.MULTILINE)


def progress_steps(out):
    return [(int(m.group(1)), int(m.group(4)), float(m.group(6)))
            for m in PROGRESS.finditer(out)]


def test_trains(binary, proto, scratch):
    event_pb2 = load_event_pb2(proto, scratch)
    logs = os.path.join(scratch, "runs")
    checkpoints = os.path.join(scratch, "checkpoints")
    common = ["--cache-dir", os.path.join(scratch, "cache"),
              "--log-dir", logs, "--checkpoint-dir", checkpoints,
              "--progress-seconds", "0.5"]

    # 1. Thirty steps from scratch.
    code, out, err = run(binary, common + ["--max-steps", "30"])
    check(code == 0, "the first run exited with %d" % code)
    lines = progress_steps(out)
    check({t for t, _, _ in lines} == {1, 2},
          "no progress line from each trainer")
    check(max(s for _, s, _ in lines) == 30, "the trainers did not reach step 30")
    accuracy = re.search(r"^test accuracy: ([0-9.]+)% on 10000", out, re.MULTILINE)
    check(accuracy, "no test accuracy line")
    check(float(accuracy.group(1)) > 50,
          "test accuracy %s%% after 30 steps" % accuracy.group(1))

    files = glob.glob(os.path.join(logs, "events.out.tfevents.*"))
    check(len(files) == 1, "expected one event file, found %s" % files)
    first = read_events(files[0], event_pb2)
    for tag in ("loss/trainer1", "loss/trainer2",
                "accuracy/trainer1", "accuracy/trainer2"):
        check([s for s, _ in first.get(tag, [])] == [10, 20, 30],
              "%s: steps %s, not 10, 20, 30" % (tag, first.get(tag)))
    check([s for s, _ in first.get("test/accuracy", [])] == [30],
          "test/accuracy: %s" % first.get("test/accuracy"))
    for tag, points in first.items():
        for _, value in points:
            check(math.isfinite(value), "%s: %r" % (tag, value))
            if tag.startswith("loss/"):
                check(0 < value < 5, "%s: loss %r" % (tag, value))
            else:
                check(0 <= value <= 1, "%s: accuracy %r" % (tag, value))
    # The same numbers as the plotted series, which the C++ writes apart.
    with open(os.path.join(logs, "train-1.tsv")) as f:
        series = [line.split("\t") for line in f.read().split("\n") if line]
    for (step, loss, _), (event_step, event_loss) in zip(
            series, first["loss/trainer1"]):
        check(int(step) == event_step and abs(float(loss) - event_loss) < 1e-4,
              "loss/trainer1 at %s: %s in the TSV, %r in the events"
              % (step, loss, event_loss))
    png = os.path.join(logs, "curves.png")
    check(os.path.isfile(png), "no curves.png")
    with open(png, "rb") as f:
        check(f.read(8) == PNG_SIGNATURE, "curves.png is not a PNG")
    with open(os.path.join(checkpoints, "checkpoint.txt")) as f:
        check("step 30\n" in f.read(), "checkpoint.txt is not at step 30")

    # 2. Resumed up to step 60: continues the step counter and the loss.
    code, out, err = run(binary, common + ["--resume", "--max-steps", "60"])
    check(code == 0, "the resumed run exited with %d" % code)
    check("resuming from the checkpoint at step 30" in out, "did not resume")
    lines = progress_steps(out)
    check(lines and min(s for _, s, _ in lines) > 30,
          "the resumed run restarted its step counter: %s" % lines)
    check(max(s for _, s, _ in lines) == 60, "the resumed run did not reach 60")
    files = sorted(glob.glob(os.path.join(logs, "events.out.tfevents.*")))
    check(len(files) == 2, "expected a second event file, found %s" % files)
    second = next(s for s in [read_events(f, event_pb2) for f in files]
                  if s.get("loss/trainer1", [(0, 0)])[0][0] > 30)
    for trainer in (1, 2):
        tag = "loss/trainer%d" % trainer
        check([s for s, _ in second[tag]] == [40, 50, 60],
              "%s after resuming: %s" % (tag, second[tag]))
        start_loss = first[tag][0][1]
        left_at = first[tag][-1][1]
        resumed_at = second[tag][0][1]
        # Trained parameters, not fresh ones: well below the loss of fresh
        # parameters (about ln 10 = 2.30 for ten classes), near where the
        # first run left off. Not below the first run's first logged loss:
        # with asynchronous trainers, one trainer's step 10 may come after
        # many updates of the other (0.730 at step 10 was seen).
        check(resumed_at < 0.8 * max(start_loss, math.log(10)) and
              resumed_at < left_at + 0.5,
              "%s: %.3f after resuming; the first run began at %.3f and left "
              "off at %.3f" % (tag, resumed_at, start_loss, left_at))
    with open(os.path.join(checkpoints, "checkpoint.txt")) as f:
        check("step 60\n" in f.read(), "checkpoint.txt is not at step 60")
    check(not glob.glob(os.path.join(checkpoints, "*-step30*")),
          "the files of the step-30 checkpoint were not removed")


def test_no_data(binary, proto, scratch):
    empty = os.path.join(scratch, "empty")
    os.makedirs(empty, exist_ok=True)
    code, out, err = run(binary, [
        "--data-dir", empty, "--cache-dir", os.path.join(scratch, "cache"),
        "--log-dir", os.path.join(scratch, "runs")])
    check(code == 2, "exit code %d, not 2" % code)
    for needed in ("train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
                   "dataset-fashion-mnist", empty, "--data-dir"):
        check(needed in err, "the error does not say %r: %s" % (needed, err))
    check("Traceback" not in err and "frame #" not in err,
          "the error carries a backtrace")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launcher(binary, proto, scratch):
    """Three processes with torchrun's variables: no forking of its own."""
    port = str(free_port())
    processes = []
    try:
        for rank in range(3):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="3",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            processes.append(subprocess.Popen(
                [binary, "--max-steps", "20", "--trainers", "5",
                 "--cache-dir", os.path.join(scratch, "cache"),
                 "--log-dir", os.path.join(scratch, "runs"),
                 "--checkpoint-dir", os.path.join(scratch, "checkpoints")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, start_new_session=True))
        outputs = []
        for rank, process in enumerate(processes):
            try:
                out, err = process.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                fail("rank %d did not finish in %d s" % (rank, RUN_TIMEOUT_S))
            print("--- rank %d\n%s\n%s" % (rank, out, err))
            check(process.returncode == 0,
                  "rank %d exited with %d" % (rank, process.returncode))
            outputs.append(out)
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # WORLD_SIZE, not --trainers, decides: one server and two trainers.
    check("WORLD_SIZE 3 gives 2 trainers" in outputs[0],
          "the server did not take the trainers from WORLD_SIZE")
    check(re.search(r"^test accuracy: [0-9.]+% on 10000", outputs[0],
                    re.MULTILINE), "the server printed no test accuracy")
    for rank in (1, 2):
        check("trainer%d: done, 20 steps in this run" % rank in outputs[rank],
              "rank %d did not train as trainer%d" % (rank, rank))


def main():
    modes = {"trains": test_trains, "no-data": test_no_data,
             "launcher": test_launcher}
    if len(sys.argv) != 5 or sys.argv[1] not in modes:
        fail("usage: ps_mnist_test.py trains|no-data|launcher BINARY PROTO "
             "SCRATCH")
    mode, binary, proto, scratch = sys.argv[1:]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    modes[mode](binary, proto, scratch)
    print("PASS")


if __name__ == "__main__":
    main()

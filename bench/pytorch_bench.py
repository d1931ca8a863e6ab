#!/usr/bin/python3
"""PyTorch RPC baseline benchmark: runs ONE workload on torch.distributed.rpc.

Two worker processes ("worker0", "worker1"; three with "worker2" for
dist_optimizer_step and ps_steps_per_s_vs_local) are spawned on loopback with the default TensorPipe
backend options (only MASTER_ADDR/MASTER_PORT are set, as a user would).
worker0 drives the workload, the others serve. The parent process
collects the result and prints exactly one JSON line on stdout:

  {"workload": W, "metric": M, "unit": U, "value": x, "better": "lower"|"higher"}

Diagnostics go to stderr. On failure the JSON line carries "value": null and an
"error" field, and the exit status is 1.

Usage: /usr/bin/python3 bench/pytorch_bench.py --workload NAME [--quick]

See bench/README.md for the exact definition of every workload; the C++ side
(torchrpc_bench) mirrors those definitions.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

# ---------------------------------------------------------------------------
# Workload table: name -> (metric, unit, better)
# ---------------------------------------------------------------------------
WORKLOADS = {
    "call_rtt_1elem": ("median_rtt", "us", "lower"),
    "calls_per_s_64_outstanding": ("throughput", "calls/s", "higher"),
    "bandwidth_4MiB": ("bandwidth", "GB/s", "higher"),
    "bandwidth_64MiB": ("bandwidth", "GB/s", "higher"),
    "idle_cpu_cores": ("idle_cpu", "cores", "lower"),
    "remote_to_here_rtt": ("median_rtt", "us", "lower"),
    "rref_create_delete_per_s": ("rate", "rrefs/s", "higher"),
    "dist_autograd_overhead": ("overhead_per_iter", "us", "lower"),
    "dist_optimizer_step": ("median_step", "us", "lower"),
    "ps_steps_per_s_vs_local": ("steps_per_s_ratio", "ratio", "higher"),
}

# Workers per workload (worker0 drives); 2 unless listed.
WORLD_SIZE = {
    "dist_optimizer_step": 3,  # worker1 and worker2 own the parameters
    "ps_steps_per_s_vs_local": 3,  # worker0 the server, worker1 and worker2 trainers
}

# Iteration counts: (normal, quick). Documented in bench/README.md.
ITERS = {
    "call_rtt_1elem": {"warmup": (500, 100), "n": (5000, 1000)},
    "calls_per_s_64_outstanding": {"warmup": (2000, 500), "n": (20000, 3000)},
    "bandwidth_4MiB": {"warmup": (5, 3), "n": (50, 10)},
    "bandwidth_64MiB": {"warmup": (2, 1), "n": (20, 5)},
    "idle_cpu_cores": {"idle_s": (5.0, 2.0)},
    "remote_to_here_rtt": {"warmup": (200, 50), "n": (2000, 500)},
    "rref_create_delete_per_s": {"warmup": (640, 128), "n": (6400, 1280)},
    "dist_autograd_overhead": {"warmup": (20, 5), "n": (200, 40)},
    # n timed steps, or fewer once the timed iterations took max_s seconds.
    "dist_optimizer_step": {"warmup": (20, 5), "n": (500, 100), "max_s": (30.0, 8.0)},
    # After warm-up: n steps, or fewer once window_s seconds have passed.
    "ps_steps_per_s_vs_local": {"warmup": (20, 5), "n": (20000, 2000), "window_s": (10.0, 3.0)},
}
WINDOW = 64  # outstanding calls / RRef batch size
OPTIM_OWNERS = ("worker1", "worker2")  # dist_optimizer_step
OPTIM_PARAMS_PER_OWNER = 50
OPTIM_PARAM_NUMEL = 1024
PS_TRAINERS = ("worker1", "worker2")  # ps_steps_per_s_vs_local
PS_BATCH = 64

MiB = 1 << 20


def world_size(workload):
    return WORLD_SIZE.get(workload, 2)


def _it(workload, key, quick):
    normal, q = ITERS[workload][key]
    return q if quick else normal


def log(*a):
    print("[pytorch_bench]", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Remote functions (run on worker1). Module-level so they pickle by name.
# ---------------------------------------------------------------------------
def add_one(x):
    """call_rtt_1elem / calls_per_s / remote_to_here: return x + 1."""
    return x + 1


def sink(t):
    """bandwidth_*: receive a big tensor, return a 1-element tensor."""
    return torch.zeros(1)


def owner_rref_count():
    """Number of OwnerRRefs alive on this worker (rref_create_delete_per_s)."""
    from torch.distributed.rpc import _rref_context_get_debug_info
    return int(_rref_context_get_debug_info()["num_owner_rrefs"])


def make_model():
    """dist_autograd_overhead: 4 x nn.Linear(1024, 1024), no activation."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])


def model_param_rrefs(model_rref):
    return [torch.distributed.rpc.RRef(p) for p in model_rref.local_value().parameters()]


def model_forward(model_rref, x):
    return model_rref.local_value()(x)


def noop():
    return None


_OWNED_PARAMS = []  # dist_optimizer_step: the parameter RRefs this worker owns


def make_param():
    """dist_optimizer_step: one parameter (1024 float32), owned here."""
    rref = torch.distributed.rpc.RRef(torch.randn(OPTIM_PARAM_NUMEL, requires_grad=True))
    _OWNED_PARAMS.append(rref)
    return rref


def sum_params():
    """dist_optimizer_step forward: the sum of every parameter this worker owns."""
    return torch.stack([rref.local_value() for rref in _OWNED_PARAMS]).sum()


# ---------------------------------------------------------------------------
# Workload drivers (run on worker0); each returns the value.
# ---------------------------------------------------------------------------
def _ns():
    return time.perf_counter_ns()


def run_call_rtt(quick, ctx):
    rpc = torch.distributed.rpc
    x = torch.ones(1)
    warm = _it("call_rtt_1elem", "warmup", quick)
    n = _it("call_rtt_1elem", "n", quick)
    for _ in range(warm):
        rpc.rpc_sync("worker1", add_one, args=(x,))
    samples = []
    for _ in range(n):
        t0 = _ns()
        rpc.rpc_sync("worker1", add_one, args=(x,))
        samples.append(_ns() - t0)
    _log_dist("rtt", samples)
    return statistics.median(samples) / 1e3


def run_calls_per_s(quick, ctx):
    rpc = torch.distributed.rpc
    x = torch.ones(1)
    wl = "calls_per_s_64_outstanding"

    def phase(total):
        window = []  # FIFO of futures
        issued = 0
        head = 0
        while issued < min(WINDOW, total):
            window.append(rpc.rpc_async("worker1", add_one, args=(x,)))
            issued += 1
        while head < len(window):
            window[head].wait()
            window[head] = None
            head += 1
            if issued < total:
                window.append(rpc.rpc_async("worker1", add_one, args=(x,)))
                issued += 1

    phase(_it(wl, "warmup", quick))
    n = _it(wl, "n", quick)
    t0 = _ns()
    phase(n)
    dt = (_ns() - t0) / 1e9
    log(f"{n} calls in {dt:.3f} s")
    return n / dt


def _run_bandwidth(wl, nbytes, quick):
    rpc = torch.distributed.rpc
    t = torch.rand(nbytes // 4, dtype=torch.float32)
    assert t.numel() * t.element_size() == nbytes
    for _ in range(_it(wl, "warmup", quick)):
        rpc.rpc_sync("worker1", sink, args=(t,))
    samples = []
    for _ in range(_it(wl, "n", quick)):
        t0 = _ns()
        rpc.rpc_sync("worker1", sink, args=(t,))
        samples.append(_ns() - t0)
    _log_dist("call", samples)
    total = sum(samples) / 1e9
    log(f"aggregate (total bytes / total time): {nbytes * len(samples) / total / 1e9:.3f} GB/s")
    return nbytes / (statistics.median(samples) / 1e9) / 1e9


def run_bw4(quick, ctx):
    return _run_bandwidth("bandwidth_4MiB", 4 * MiB, quick)


def run_bw64(quick, ctx):
    return _run_bandwidth("bandwidth_64MiB", 64 * MiB, quick)


def run_idle(quick, ctx):
    # One rpc so the pipe worker0 -> worker1 exists, then tell the parent we
    # are ready; the parent measures /proc CPU time of both workers while both
    # block (without CPU) on a multiprocessing.Event.
    torch.distributed.rpc.rpc_sync("worker1", add_one, args=(torch.ones(1),))
    return None  # value computed by the parent


def run_remote_to_here(quick, ctx):
    rpc = torch.distributed.rpc
    x = torch.ones(1)
    wl = "remote_to_here_rtt"
    for _ in range(_it(wl, "warmup", quick)):
        rpc.remote("worker1", add_one, args=(x,)).to_here()
    samples = []
    for _ in range(_it(wl, "n", quick)):
        t0 = _ns()
        rref = rpc.remote("worker1", add_one, args=(x,))
        rref.to_here()
        samples.append(_ns() - t0)
        del rref
    _log_dist("remote+to_here", samples)
    return statistics.median(samples) / 1e3


def run_rref_churn(quick, ctx):
    rpc = torch.distributed.rpc
    x = torch.ones(1)
    wl = "rref_create_delete_per_s"

    def wait_owner_empty(deadline_s=20.0):
        end = time.monotonic() + deadline_s
        polls = 0
        while True:
            c = rpc.rpc_sync("worker1", owner_rref_count)
            polls += 1
            if c == 0:
                return polls
            if time.monotonic() > end:
                raise RuntimeError(f"owner still holds {c} RRefs after {deadline_s}s")
            time.sleep(0.0005)

    def phase(total):
        done = 0
        while done < total:
            k = min(WINDOW, total - done)
            batch = [rpc.remote("worker1", add_one, args=(x,)) for _ in range(k)]
            for r in batch:
                r._get_future().wait()  # owner has created the value
            del batch, r  # user RRefs dropped -> delete messages to owner
            done += k
        return wait_owner_empty()

    phase(_it(wl, "warmup", quick))
    n = _it(wl, "n", quick)
    t0 = _ns()
    polls = phase(n)
    dt = (_ns() - t0) / 1e9
    log(f"{n} RRefs created+deleted in {dt:.3f} s ({polls} owner polls at end)")
    return n / dt


def _local_iter(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    opt.step()


def run_dist_autograd(quick, ctx):
    """Local and distributed iterations alternate (TensorPipe's threads run
    during both); the value is the median of the differences of neighbouring
    pairs, which cancels the machine's slow drifts."""
    rpc = torch.distributed.rpc
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    wl = "dist_autograd_overhead"
    local_model = make_model()
    local_opt = torch.optim.SGD(local_model.parameters(), lr=0.01)
    model_rref = rpc.remote("worker1", make_model)
    param_rrefs = rpc.rpc_sync("worker1", model_param_rrefs, args=(model_rref,))
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.01)
    x = torch.rand(1, 1024)

    def it():
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("worker1", model_forward, args=(model_rref, x))
            loss = out.sum()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)

    for _ in range(_it(wl, "warmup", quick)):
        _local_iter(local_model, local_opt, x)
        it()
    local, dist = [], []
    for _ in range(_it(wl, "n", quick)):
        t0 = _ns()
        _local_iter(local_model, local_opt, x)
        local.append(_ns() - t0)
        t0 = _ns()
        it()
        dist.append(_ns() - t0)
    _log_dist("local iter", local)
    _log_dist("distributed iter", dist)
    l, d = statistics.median(local), statistics.median(dist)
    log(f"difference of medians: {d / 1e3:.1f} - {l / 1e3:.1f} = {(d - l) / 1e3:.1f} us")
    return statistics.median(b - a for a, b in zip(local, dist)) / 1e3


def run_dist_optimizer_step(quick, ctx):
    """Adam over 2 owners x 50 parameters; only opt.step(cid) is timed."""
    rpc = torch.distributed.rpc
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    wl = "dist_optimizer_step"
    params = [rpc.rpc_sync(owner, make_param)
              for owner in OPTIM_OWNERS for _ in range(OPTIM_PARAMS_PER_OWNER)]
    # PyTorch swaps in its TorchScript functional Adam on the owners.
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=1e-3)
    log(f"functional optimizer on the owners: {opt.is_functional_optim}")

    def it():
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync(OPTIM_OWNERS[0], sum_params)
            for owner in OPTIM_OWNERS[1:]:
                loss = loss + rpc.rpc_sync(owner, sum_params)
            dist_autograd.backward(cid, [loss])
            t0 = _ns()
            opt.step(cid)
            return _ns() - t0

    for _ in range(_it(wl, "warmup", quick)):
        it()
    n = _it(wl, "n", quick)
    end = time.monotonic() + _it(wl, "max_s", quick)
    samples = []
    while len(samples) < n and (not samples or time.monotonic() < end):
        samples.append(it())
    _log_dist("step", samples)
    return statistics.median(samples) / 1e3


# ---------------------------------------------------------------------------
# ps_steps_per_s_vs_local: PyTorch's RPC parameter-server tutorial, reduced to
# its loop. worker0 holds the ParameterServer (and drives); worker1 and
# worker2 are trainers.
# ---------------------------------------------------------------------------
def make_ps_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def ps_batch(seed):
    """One fixed batch, generated once: the loop's speed is the point."""
    torch.manual_seed(seed)
    return torch.randn(PS_BATCH, 784), torch.randint(0, 10, (PS_BATCH,))


class ParameterServer:
    """As in the tutorial: the model on the server, forward and param RRefs."""

    def __init__(self):
        self.model = make_ps_model()

    def forward(self, inp):
        return self.model(inp)

    def get_param_rrefs(self):
        return [torch.distributed.rpc.RRef(p) for p in self.model.parameters()]


_PS = {"server": None, "reports": []}
_PS_LOCK = None  # threading.Condition, made on worker0


def get_parameter_server():
    """Runs on worker0; blocks until the driver has measured the local loop."""
    with _PS_LOCK:
        if not _PS_LOCK.wait_for(lambda: _PS["server"] is not None, timeout=120):
            raise RuntimeError("the parameter server never appeared")
        return _PS["server"]


def ps_forward(ps_rref, x):
    return ps_rref.local_value().forward(x)


def ps_param_rrefs(ps_rref):
    return ps_rref.local_value().get_param_rrefs()


def ps_report(rank, steps, seconds, error):
    with _PS_LOCK:
        _PS["reports"].append((rank, steps, seconds, error))
        _PS_LOCK.notify_all()


def _timed_steps(wl, quick, step, progress):
    """Warm-up, then steps until n or window_s (at least one); progress[0] counts
    every step taken (warm-up included), progress[1] the timed ones."""
    for _ in range(_it(wl, "warmup", quick)):
        step()
        progress[0] += 1
    n = _it(wl, "n", quick)
    t0 = time.perf_counter()
    end = t0 + _it(wl, "window_s", quick)
    while progress[1] < n and (progress[1] == 0 or time.perf_counter() < end):
        step()
        progress[0] += 1
        progress[1] += 1
    return progress[1], time.perf_counter() - t0


def ps_trainer(rank, quick):
    """On worker1/worker2: the tutorial's training loop, reporting its timed
    steps (or the steps it took until it failed) to worker0."""
    rpc = torch.distributed.rpc
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    wl = "ps_steps_per_s_vs_local"
    progress = [0, 0]
    t0 = time.perf_counter()
    try:
        ps_rref = rpc.remote("worker0", get_parameter_server)
        param_rrefs = rpc.rpc_sync("worker0", ps_param_rrefs, args=(ps_rref,))
        opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.01)
        x, y = ps_batch(rank)

        def step():
            with dist_autograd.context() as cid:
                out = rpc.rpc_sync("worker0", ps_forward, args=(ps_rref, x))
                loss = torch.nn.functional.cross_entropy(out, y)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)

        t0 = time.perf_counter()
        steps, seconds = _timed_steps(wl, quick, step, progress)
        log(f"worker{rank}: {steps} steps in {seconds:.3f} s")
        rpc.rpc_sync("worker0", ps_report, args=(rank, steps, seconds, None))
    except Exception as e:
        import traceback
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        error = (f"worker{rank} failed after {progress[0]} steps ({progress[1]} timed, "
                 f"{time.perf_counter() - t0:.2f} s): {type(e).__name__}: {first[:300]}")
        log(error)
        rpc.rpc_sync("worker0", ps_report, args=(rank, progress[1], None, error))


def run_ps_steps_vs_local(quick, ctx):
    """Local steps/s (plain PyTorch, in worker0, before the trainers start),
    then the trainers' aggregate steps/s; value = aggregate / local."""
    wl = "ps_steps_per_s_vs_local"
    local = make_ps_model()
    opt = torch.optim.SGD(local.parameters(), lr=0.01)
    x, y = ps_batch(0)

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(local(x), y).backward()
        opt.step()

    steps, seconds = _timed_steps(wl, quick, step, [0, 0])
    local_rate = steps / seconds
    log(f"local: {steps} steps in {seconds:.3f} s = {local_rate:.1f} steps/s")
    with _PS_LOCK:
        _PS["server"] = ParameterServer()
        _PS_LOCK.notify_all()
        limit = _it(wl, "window_s", quick) * 4 + 60
        if not _PS_LOCK.wait_for(lambda: len(_PS["reports"]) == len(PS_TRAINERS), timeout=limit):
            raise RuntimeError("the trainers did not report")
        reports = sorted(_PS["reports"])
    errors = [r[3] for r in reports if r[3] is not None]
    if errors:
        # No figure from a loop that crashed: the reason goes to the error field.
        done = [f"worker{r}: {steps} timed steps in {seconds:.2f} s"
                for r, steps, seconds, e in reports if e is None]
        ctx["error"] = ("; ".join(errors) + f" [completed: {', '.join(done) or 'none'}; "
                        f"local {local_rate:.1f} steps/s; no ratio reported]")
        return None
    aggregate = sum(steps / seconds for _, steps, seconds, _ in reports)
    log(f"parameter server: aggregate {aggregate:.1f} steps/s over {len(reports)} trainers; "
        f"local {local_rate:.1f} steps/s")
    return aggregate / local_rate


DRIVERS = {
    "call_rtt_1elem": run_call_rtt,
    "calls_per_s_64_outstanding": run_calls_per_s,
    "bandwidth_4MiB": run_bw4,
    "bandwidth_64MiB": run_bw64,
    "idle_cpu_cores": run_idle,
    "remote_to_here_rtt": run_remote_to_here,
    "rref_create_delete_per_s": run_rref_churn,
    "dist_autograd_overhead": run_dist_autograd,
    "dist_optimizer_step": run_dist_optimizer_step,
    "ps_steps_per_s_vs_local": run_ps_steps_vs_local,
}


def _log_dist(what, samples_ns):
    s = sorted(samples_ns)
    n = len(s)

    def p(q):
        return s[min(n - 1, int(q * n))] / 1e3

    log(f"{what}: n={n} min={s[0] / 1e3:.1f} p10={p(0.1):.1f} median={statistics.median(s) / 1e3:.1f} "
        f"p90={p(0.9):.1f} p99={p(0.99):.1f} max={s[-1] / 1e3:.1f} (us)")


# ---------------------------------------------------------------------------
# Worker process entry point
# ---------------------------------------------------------------------------
torch = None  # imported lazily in workers (parent never needs torch)


def worker_main(rank, workload, quick, result_q, ready_q, release_ev):
    global torch, _PS_LOCK
    # Keep stdout clean for the single JSON line printed by the parent.
    os.dup2(2, 1)
    import torch as _torch
    torch = _torch
    import torch.distributed.rpc as rpc

    ctx = {}
    if workload == "ps_steps_per_s_vs_local":
        import threading
        _PS_LOCK = threading.Condition()
    try:
        opts = None  # default TensorPipe options unless --tp-transports (experiments only)
        if os.environ.get("PYTORCH_BENCH_TP_TRANSPORTS"):
            opts = rpc.TensorPipeRpcBackendOptions(
                _transports=os.environ["PYTORCH_BENCH_TP_TRANSPORTS"].split(","))
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size(workload),
                     rpc_backend_options=opts)
        if rank == 0:
            value = DRIVERS[workload](quick, ctx)
        elif workload == "ps_steps_per_s_vs_local":
            ps_trainer(rank, quick)
        if workload == "idle_cpu_cores":
            ready_q.put(rank)
            if not release_ev.wait(120):
                raise RuntimeError("timed out waiting for the parent")
        rpc.shutdown()
        if rank == 0:
            if ctx.get("error"):
                result_q.put(("error", ctx["error"]))
            else:
                result_q.put(("ok", value))
    except BaseException as e:  # report, then die
        import traceback
        traceback.print_exc()
        result_q.put(("error", f"worker{rank}: {type(e).__name__}: {e}"))
        sys.stderr.flush()
        os._exit(1)


# ---------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------
def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid):
    """user+sys CPU seconds of the whole process (all threads), /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()
    # fields[0] is field 3 (state); utime is field 14, stime field 15
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_runtimes(pid):
    """{tid: (comm, ns on cpu)} from /proc/<pid>/task/*/schedstat."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            out[tid] = (comm, ns)
        except OSError:
            pass
    return out


def emit(workload, value, error=None):
    metric, unit, better = WORKLOADS[workload]
    d = {"workload": workload, "metric": metric, "unit": unit, "value": value, "better": better}
    if error is not None:
        d["error"] = error
    print(json.dumps(d), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="kill everything after this many seconds (default 60 quick / 150 normal)")
    ap.add_argument("--tp-transports", default=None,
                    help="experiments only: TensorPipe transports, e.g. 'uv' (default: PyTorch's defaults)")
    args = ap.parse_args()
    wl = args.workload
    if args.tp_transports:
        os.environ["PYTORCH_BENCH_TP_TRANSPORTS"] = args.tp_transports
    timeout = args.timeout or (60.0 if args.quick else 150.0)

    import multiprocessing as mp
    import queue

    port = free_port()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Keep TensorPipe's uv (TCP) transport and Gloo on loopback.
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    mpc = mp.get_context("spawn")
    result_q = mpc.Queue()
    ready_q = mpc.Queue()
    release_ev = mpc.Event()
    procs = [mpc.Process(target=worker_main, name=f"worker{r}",
                         args=(r, wl, args.quick, result_q, ready_q, release_ev))
             for r in range(world_size(wl))]
    deadline = time.monotonic() + timeout
    value = None
    error = None
    try:
        for p in procs:
            p.start()
        log(f"workload={wl} quick={args.quick} port={port} pids={[p.pid for p in procs]}")

        if wl == "idle_cpu_cores":
            got = set()
            while len(got) < len(procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("workers never became ready")
                try:
                    got.add(ready_q.get(timeout=min(left, 1.0)))
                except queue.Empty:
                    if any(p.exitcode is not None for p in procs):
                        break
                    continue
            if len(got) == len(procs):
                idle_s = _it(wl, "idle_s", args.quick)
                pids = [p.pid for p in procs]
                th0 = {pid: thread_runtimes(pid) for pid in pids}
                c0 = sum(proc_cpu_s(pid) for pid in pids)
                w0 = time.monotonic()
                time.sleep(idle_s)
                c1 = sum(proc_cpu_s(pid) for pid in pids)
                w1 = time.monotonic()
                th1 = {pid: thread_runtimes(pid) for pid in pids}
                value = (c1 - c0) / (w1 - w0)
                for r, pid in enumerate(pids):
                    busy = []
                    for tid, (comm, ns) in th1[pid].items():
                        ns0 = th0[pid].get(tid, (comm, 0))[1]
                        if ns - ns0 > 1e6:
                            busy.append(f"{comm}:{(ns - ns0) / 1e9 / (w1 - w0):.3f}")
                    log(f"worker{r} threads={len(th1[pid])} busy threads (cores): {', '.join(busy) or 'none'}")
            release_ev.set()

        status = None
        while status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result within {timeout:.0f}s")
            try:
                status, payload = result_q.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) or any(p.exitcode not in (None, 0) for p in procs):
                    # give a late error message a chance
                    try:
                        status, payload = result_q.get(timeout=1.0)
                    except queue.Empty:
                        raise RuntimeError("worker exited without a result: exit codes "
                                           f"{[p.exitcode for p in procs]}")
        if status == "error":
            raise RuntimeError(payload)
        if wl != "idle_cpu_cores":
            value = payload
        for p in procs:
            p.join(max(0.1, min(20.0, deadline - time.monotonic())))
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        value = None
    finally:
        release_ev.set()
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.join(5)
    if error is None and value is None:
        error = "no value measured"
    emit(wl, value, error)
    sys.exit(0 if error is None else 1)


if __name__ == "__main__":
    main()

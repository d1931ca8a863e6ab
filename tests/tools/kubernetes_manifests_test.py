#!/usr/bin/python3
"""Checks that the Kubernetes manifests in examples/kubernetes/ give each pod
the variables the worker reads (README, "Kubernetes").

No cluster runs here: for each manifest this computes the environment every
pod would get, then checks that
  (a) the variables the worker requires under torchrun's contract (Note
      [Launch environment]: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are
      set, with ranks 0..WORLD_SIZE-1 once each and every pod listening on
      its own address (TORCHRPC_LISTEN_ADDR) rather than loopback;
  (b) every variable a manifest sets is one the library or the example
      reads, found by reading their sources, so a misspelled name fails;
and that the check itself rejects a misspelled variable.

Usage: kubernetes_manifests_test.py SOURCE_DIR
Needs Debian's python3-yaml.
"""

import copy
import glob
import os
import re
import sys

import yaml

# What a worker under torchrun's contract cannot start without (Note [Launch
# environment] in rpc/launch_environment.h; MASTER_* through env://).
REQUIRED = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]

# What Kubeflow's training-operator puts in every container of a PyTorchJob
# with a Master replica (pkg/controller.v1/pytorch/envvar.go, setPodEnv, and
# its master variables generator), besides what the manifest sets.
OPERATOR_CONTAINER = "pytorch"
OPERATOR_PORT_NAME = "pytorchjob-port"

# Sources whose getenv-style calls name what a worker reads.
READER_SOURCES = [
    "rpc/options.cpp",
    "rpc/launch_environment.cpp",
    "rpc/detail/rendezvous.cpp",
    "examples/parameter_server/*.cpp",
    "examples/parameter_server/*.h",
]
# env("X"), envInt("X", ...), std::getenv("X"), reader.require("X"),
# reader.optional("X", ...), requireEnv("X", ...), also split over lines.
READ_CALL = re.compile(
    r'\b(?:getenv|env|envInt|require|optional|requireEnv)\(\s*"([A-Z][A-Z0-9_]*)"')
# Names listed on their own line as arguments, e.g. envInt(\n "NAME",.
LISTED_NAME = re.compile(r'^\s*"([A-Z][A-Z0-9_]*)",?\s*$', re.M)


def names_read(source_dir):
    names = set()
    for pattern in READER_SOURCES:
        for path in glob.glob(os.path.join(source_dir, pattern)):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            names.update(READ_CALL.findall(text))
            names.update(LISTED_NAME.findall(text))
    return names


def sample_field(path, index):
    """A value for a fieldRef, as pod `index` of its group would see it."""
    if path == "status.podIP":
        return "10.244.0.%d" % (10 + index)
    if path == "metadata.annotations['batch.kubernetes.io/job-completion-index']":
        return str(index)
    raise AssertionError("no sample value for fieldRef %r" % path)


def container_env(container, index):
    """(name -> value) a container's `env` gives pod `index`."""
    env = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = str(entry["value"])
        else:
            field = entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            assert field, "%s: only value and fieldRef are understood" % name
            env[name] = sample_field(field, index)
    return env


def pytorchjob_pods(job):
    """[(pod, manifest env, full env)] for a PyTorchJob."""
    name = job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    errors = []
    if "Master" not in specs:
        return [], ["PyTorchJob %s: no Master replica, so the operator sets "
                    "no MASTER_ADDR, RANK or WORLD_SIZE" % name]
    world = sum(int(spec.get("replicas", 1)) for spec in specs.values())
    # The operator takes MASTER_PORT from the Master's port of that name.
    port = None
    for c in specs["Master"]["template"]["spec"]["containers"]:
        if c["name"] == OPERATOR_CONTAINER:
            for p in c.get("ports", []):
                if p.get("name") == OPERATOR_PORT_NAME:
                    port = str(p["containerPort"])
    if port is None:
        errors.append("PyTorchJob %s: the Master has no container %r with a "
                      "port named %r (the operator's MASTER_PORT)"
                      % (name, OPERATOR_CONTAINER, OPERATOR_PORT_NAME))
        port = "<none>"
    pods = []
    for rtype, offset in (("Master", 0), ("Worker", 1)):
        spec = specs.get(rtype)
        if spec is None:
            continue
        for i in range(int(spec.get("replicas", 1))):
            pod = "%s-%s-%d" % (name, rtype.lower(), i)
            containers = spec["template"]["spec"]["containers"]
            mine = [c for c in containers if c["name"] == OPERATOR_CONTAINER]
            if not mine:
                errors.append("%s: no container named %r" % (pod, OPERATOR_CONTAINER))
                continue
            manifest = container_env(mine[0], offset + i)
            full = dict(manifest)
            full.update({
                "PYTHONUNBUFFERED": "0",
                "MASTER_ADDR": "%s-master-0" % name,
                "MASTER_PORT": port,
                "WORLD_SIZE": str(world),
                "RANK": str(offset + i),
            })
            pods.append((pod, manifest, full))
    return pods, errors


def indexed_job_pods(job, services):
    """[(pod, manifest env, full env)] for an Indexed Job, and checks that
    MASTER_ADDR names pod 0 through a headless Service."""
    name = job["metadata"]["name"]
    spec = job["spec"]
    errors = []
    if spec.get("completionMode") != "Indexed":
        errors.append("Job %s: completionMode is not Indexed" % name)
    completions = int(spec.get("completions", 1))
    if int(spec.get("parallelism", 1)) != completions:
        errors.append("Job %s: parallelism != completions: the workers of one "
                      "group must all run at once" % name)
    podspec = spec["template"]["spec"]
    subdomain = podspec.get("subdomain")
    service = services.get(subdomain)
    if service is None:
        errors.append("Job %s: subdomain %r names no Service in the file"
                      % (name, subdomain))
    else:
        if service["spec"].get("clusterIP") != "None":
            errors.append("Service %s is not headless" % subdomain)
        selector = service["spec"].get("selector", {})
        if selector.get("job-name", selector.get("batch.kubernetes.io/job-name")) != name:
            errors.append("Service %s does not select the pods of Job %s"
                          % (subdomain, name))
    pods = []
    for i in range(completions):
        manifest = {}
        for c in podspec["containers"]:
            manifest.update(container_env(c, i))
        pods.append(("%s-%d" % (name, i), manifest, dict(manifest)))
    master = "%s-0.%s" % (name, subdomain)
    for pod, _, env in pods:
        if env.get("MASTER_ADDR") not in (None, master):
            errors.append("%s: MASTER_ADDR=%s, but pod 0 is %s"
                          % (pod, env.get("MASTER_ADDR"), master))
        if env.get("WORLD_SIZE") not in (None, str(completions)):
            errors.append("%s: WORLD_SIZE=%s, but the job has %d pods"
                          % (pod, env.get("WORLD_SIZE"), completions))
    return pods, errors


def check(documents, read, show=True):
    """Everything wrong with one manifest file's documents."""
    services = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Service"}
    pods, errors = [], []
    for d in documents:
        if d["kind"] == "PyTorchJob":
            p, e = pytorchjob_pods(d)
        elif d["kind"] == "Job":
            p, e = indexed_job_pods(d, services)
        else:
            continue
        pods += p
        errors += e
    if not pods:
        errors.append("no pods: neither a PyTorchJob nor a Job")
    for pod, manifest, env in pods:
        for var in REQUIRED:
            if not env.get(var):
                errors.append("%s: %s is not set (the worker requires it)" % (pod, var))
        for var in sorted(manifest):
            if var not in read:
                errors.append("%s: the manifest sets %s, which neither the "
                              "library nor the example reads" % (pod, var))
        listen = env.get("TORCHRPC_LISTEN_ADDR", "127.0.0.1")
        if listen.startswith("127.") or listen == "localhost":
            errors.append("%s: listens on %s; other pods cannot reach it "
                          "(set TORCHRPC_LISTEN_ADDR from status.podIP)" % (pod, listen))
    ranks = sorted(int(env["RANK"]) for _, _, env in pods if env.get("RANK", "").isdigit())
    if pods and ranks != list(range(len(pods))):
        errors.append("ranks %s are not 0..%d once each" % (ranks, len(pods) - 1))
    for pod, _, env in pods if show else []:
        print("  %s: %s" % (pod, " ".join(
            "%s=%s" % kv for kv in sorted(env.items()) if kv[0] != "PYTHONUNBUFFERED")))
    return errors


def misspell(documents):
    """A copy in which the first variable set by value is misspelled."""
    broken = copy.deepcopy(documents)
    for d in broken:
        for c in _containers(d):
            for entry in c.get("env", []):
                entry["name"] += "S"  # e.g. TORCHRPC_LISTEN_ADDRS
                return broken, entry["name"]
    raise AssertionError("no env entry to misspell")


def _containers(d):
    if d["kind"] == "PyTorchJob":
        for spec in d["spec"]["pytorchReplicaSpecs"].values():
            yield from spec["template"]["spec"]["containers"]
    elif d["kind"] == "Job":
        yield from d["spec"]["template"]["spec"]["containers"]


def main():
    source_dir = sys.argv[1]
    read = names_read(source_dir)
    missing = [v for v in REQUIRED if v not in read]
    assert not missing, "the sources no longer read %s: update this test" % missing
    print("variables read (from the sources): %s" % " ".join(sorted(read)))
    manifests = sorted(glob.glob(os.path.join(source_dir, "examples/kubernetes/*.yaml")))
    assert manifests, "no manifests in examples/kubernetes/"
    failed = False
    for path in manifests:
        with open(path, encoding="utf-8") as f:
            documents = [d for d in yaml.safe_load_all(f) if d]
        print("%s:" % os.path.relpath(path, source_dir))
        errors = check(documents, read)
        for e in errors:
            print("FAIL %s" % e)
        failed |= bool(errors)
        # The check must catch a misspelled variable in this very file.
        broken, wrong = misspell(documents)
        if not any(wrong in e for e in check(broken, read, show=False)):
            print("FAIL the check accepts the misspelled %s" % wrong)
            failed = True
        else:
            print("  (rejects the same file with %s instead)" % wrong)
    if failed:
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

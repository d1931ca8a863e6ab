#pragma once

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "torchrpc/rpc/launch_environment.h"

namespace torchrpc {
namespace rpc {

class InProcessNetwork;

// Which transport carries messages between workers.
enum class TransportKind {
  // kTcp unless an in-process network is given (then in-process). TCP is
  // the default on one host and across hosts: it meets every target of
  // bench/RESULTS.md and survives hostile peers; see README "Transports".
  kAuto,
  // TensorPipe over TCP (its "uv" transport), optionally shared memory.
  kTensorPipe,
  // Workers in one process, through Options::inProcessNetwork (tests).
  kInProcess,
  // torchrpc's own TCP transport on Boost.Asio: validated frames, a
  // handshake, an optional shared secret, heartbeats.
  kTcp,
};

// Orders devices for DeviceMap: c10::Device has no operator<.
struct DeviceLess {
  bool operator()(const c10::Device& a, const c10::Device& b) const {
    return a.type() != b.type() ? a.type() < b.type() : a.index() < b.index();
  }
};

// Maps a device on the sending worker to the device a tensor lands on at the
// receiving worker. Responses use the inverse map.
using DeviceMap = std::map<c10::Device, c10::Device, DeviceLess>;

// Everything a Runtime can be told. Every field has a default that works on
// one host; README.md has the table. Options::fromEnvironment() fills rank,
// world size and the rendezvous from the variables torchrun, Open MPI or
// Slurm set (see Note [Launch environment]).
struct Options {
  // This worker's rank in [0, worldSize).
  int64_t rank = 0;
  int64_t worldSize = 1;

  // Where workers meet: "env://" (MASTER_ADDR, MASTER_PORT; rank 0 hosts the
  // store unless TORCHELASTIC_USE_AGENT_STORE=True), "tcp://host:port"
  // (rank 0 hosts), or "file://path". Ignored when `store` is set.
  std::string initMethod = "env://";
  // A store to rendezvous through instead of initMethod (e.g. a HashStore
  // shared by several runtimes of one process).
  c10::intrusive_ptr<c10d::Store> store;
  // Who started this worker and where it sits (local rank, node, restart
  // generation); filled by fromEnvironment(). With env://, a non-empty
  // launch.masterAddr / non-zero launch.masterPort stand in for MASTER_ADDR
  // / MASTER_PORT, and the rendezvous keys of each launch.restartCount are
  // kept apart, so a restarted group meets again on a reused store.
  LaunchEnvironment launch;
  // How long start() waits for every worker to appear (it logs the ranks
  // still missing every 10 s meanwhile).
  std::chrono::milliseconds rendezvousTimeout{std::chrono::minutes(5)};
  // Where rank 0's rendezvous store listens (env:// and tcp://; see Note
  // [Rendezvous store]): a host or IP, on the rendezvous port. Empty: the
  // rendezvous host's own address (MASTER_ADDR's, the tcp:// host), so
  // that a job on loopback is reachable on loopback only. "0.0.0.0" for
  // every interface. It honours sharedSecret whatever the transport.
  std::string storeListenAddress;

  // Threads that run handlers and continuations.
  size_t numWorkerThreads = 4;
  // After finishing work, one of those threads polls for more for this long
  // before it sleeps, so a conversation's next message finds it awake (on
  // virtual machines a wake-up costs far more than a round trip). Idle
  // workers use no CPU. Zero turns it off. See Note [Adaptive spin].
  std::chrono::microseconds spinAfterWork{200};
  // Deadline of a call that does not set its own; zero means none.
  std::chrono::milliseconds defaultTimeout{std::chrono::seconds(60)};
  // How long a graceful shutdown waits for the other workers before it
  // gives up and shuts down immediately.
  std::chrono::milliseconds shutdownTimeout{std::chrono::seconds(60)};

  // The address this worker listens on. Loopback unless set (or unless
  // TORCHRPC_LISTEN_ADDR is set in fromEnvironment()).
  std::string listenAddress = "127.0.0.1";

  TransportKind transport = TransportKind::kAuto;
  // TensorPipe transports to register, by name: "uv" (TCP) and "shm" (shared
  // memory; lower latency on one host, but it busy-polls a core per worker).
  std::vector<std::string> tensorpipeTransports = {"uv"};
  // TensorPipe channels for tensor payloads, by name: "cma" (one-copy on one
  // host), "mpt" (several TCP lanes), "basic" (through the connection).
  // "basic" is always added: without a usable channel TensorPipe aborts.
  std::vector<std::string> tensorpipeChannels = {"cma", "basic"};
  // Used when transport is kInProcess (or kAuto): every runtime of the job
  // must be given the same network.
  std::shared_ptr<InProcessNetwork> inProcessNetwork;

  // kTcp only. When set, every peer must prove it knows this secret
  // (challenge-response, HMAC-SHA256; the secret never travels) before any
  // of its messages is read. The TensorPipe and in-process transports cannot
  // check it: a Runtime for either refuses to start with a secret (c10::Error
  // naming this option and the transport) rather than ignore it.
  std::string sharedSecret;
  // Idle connections carry a heartbeat this often (kTcp's own, the agent's
  // on other transports); a peer from which nothing arrived for
  // peerTimeout is lost (Note [Lost workers]) and the calls waiting on it
  // fail with kWorkerUnavailable.
  std::chrono::milliseconds heartbeatInterval{std::chrono::seconds(1)};
  std::chrono::milliseconds peerTimeout{std::chrono::seconds(4)};
  // kTcp only. After a message goes out or comes in, the transport's io
  // thread polls the sockets instead of sleeping, so the next message finds
  // it awake: for ioPollAfterTraffic, and for up to ioPollWhileAwaiting while
  // this worker awaits replies (its callers are blocked anyway). On virtual
  // machines a sleeping thread's wake-up costs more than a round trip; this
  // spends up to a core while messages flow to avoid it. Idle workers sleep
  // either way (heartbeats do not count). Zero turns either off. See
  // Note [Polling after traffic].
  std::chrono::microseconds ioPollAfterTraffic{1000};
  std::chrono::microseconds ioPollWhileAwaiting{20000};
  // kTcp only. Between workers on one host, tensors of 256 KiB or more skip
  // the socket: the sender copies them into shared memory segments that the
  // receiver maps as the received tensors' storage, up to
  // sharedMemoryMaxBytes of segments per worker (0: none); past that budget
  // the receiver reads them from the sender's memory (process_vm_readv).
  // Copies of at least copyHelperMinBytes into a segment are shared with a
  // helper thread, which sleeps between copies (0: the sender copies
  // alone, say when every core is busy with compute). sameHostTransfers
  // false sends every byte through the socket, as between hosts. A
  // connection takes either same-host path only if both its workers allow
  // it (shared memory: a budget above 0 on both). See Note [TCP same-host
  // shared memory] in rpc/transport/tcp/shared_segments.h.
  bool sameHostTransfers = true;
  size_t sharedMemoryMaxBytes = size_t(1) << 30;
  size_t copyHelperMinBytes = size_t(1) << 20;
  // kTcp only, with shared memory on both sides: a worker whose io thread
  // polls (ioPollAfterTraffic or ioPollWhileAwaiting above 0) gives each
  // connection from a worker of its host a ring of sharedRingBytes (a
  // power of two from 4096 to 16 MiB; 0: none) in shared memory, counted
  // in its sharedMemoryMaxBytes, and the peer writes its messages of up to
  // a quarter of that (and 32 tensors) there instead of to the socket:
  // while this worker polls, they arrive without a system call on either
  // side. See Note [Shared rings for small frames] in
  // rpc/transport/tcp/shared_ring.h.
  size_t sharedRingBytes = size_t(256) << 10;

  // Per destination worker name: where tensors land there.
  std::map<std::string, DeviceMap> deviceMaps;

  // Caps on what a worker sends or accepts; larger messages fail with
  // kTooLarge (sending) or close the connection (receiving).
  size_t maxMessageBytes = size_t(16) << 30;
  size_t maxHeaderBytes = size_t(64) << 20;
  size_t maxTensorsPerMessage = 1 << 16;

  // Let callers run dispatcher operators by schema name ("aten::add.Tensor").
  bool allowBuiltinOperators = true;

  // ---- seeing inside a running job (README "Observing a job") ----------
  // When set, the worker traces (Note [Tracing] in rpc/tracing.h) and
  // writes <traceDirectory>/<worker name>.trace.json when it shuts down;
  // tools/trace merges the workers' files. Empty: no tracing unless the
  // program starts it (Runtime::tracer()).
  std::string traceDirectory;
  // With traceDirectory: trace only the steps [first, first + count) of the
  // workers that count steps (Runtime::step()), and on the others what
  // those steps' requests cause. Count 0: the whole run.
  int64_t traceFirstStep = 0;
  int64_t traceStepCount = 0;
  // Events a worker's trace keeps; later ones are counted as dropped.
  size_t traceMaxEvents = 1000000;
  // When set, the worker serves its metrics in Prometheus' text format at
  // http://<metricsAddress>/metrics: "host:port", port 0 for any free one
  // (Runtime::metricsAddress() says which). Empty: no endpoint. Bind it
  // where only the monitoring can reach: it does not ask for the secret.
  std::string metricsAddress;
  // When set (SIGUSR1 or SIGUSR2), the worker prints the job's hang report
  // (Runtime::gatherHangReport(), 5 s at most) to stderr each time it
  // receives that signal: `kill -USR1 <pid>` asks a stuck job what it waits
  // for. The runtime owns the signal's handler while it runs; like any
  // handler, it makes a system call that the signal interrupts on another
  // thread (poll(), sleeps) fail with EINTR. 0: off.
  int hangReportSignal = 0;

  // Reads the launcher's identity variables into `launch`, rank and
  // worldSize (torchrun's, else Open MPI's, else Slurm's; see Note [Launch
  // environment]), then TORCHRPC_INIT_METHOD, TORCHRPC_LISTEN_ADDR,
  // TORCHRPC_NUM_THREADS, TORCHRPC_TIMEOUT_MS, TORCHRPC_SPIN_US,
  // TORCHRPC_IO_POLL_US, TORCHRPC_IO_POLL_AWAIT_US, TORCHRPC_SAME_HOST
  // ("1" or "0"), TORCHRPC_SHARED_MEMORY_MAX_BYTES,
  // TORCHRPC_COPY_HELPER_MIN_BYTES,
  // TORCHRPC_TRANSPORT ("tcp", "tensorpipe", "tensorpipe-shm"),
  // TORCHRPC_SHARED_SECRET, TORCHRPC_PEER_TIMEOUT_MS,
  // TORCHRPC_RENDEZVOUS_TIMEOUT_MS, TORCHRPC_STORE_LISTEN_ADDR,
  // TORCHRPC_TRACE_DIR, TORCHRPC_TRACE_STEPS ("first:count"),
  // TORCHRPC_TRACE_MAX_EVENTS, TORCHRPC_METRICS_ADDR and
  // TORCHRPC_HANG_REPORT_SIGNAL ("USR1", "USR2", or empty). With no
  // launcher's variables, rank 0 of 1. Throws c10::Error naming the variable
  // (and launcher) that is missing or malformed.
  static Options fromEnvironment();
};

} // namespace rpc
} // namespace torchrpc

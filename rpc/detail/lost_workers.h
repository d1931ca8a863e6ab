#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace torchrpc {
namespace rpc {
namespace detail {

// Note [Lost workers]
// ~~~~~~~~~~~~~~~~~~~
// A worker is lost, for this one, when a connection this worker opened to
// it fails as unavailable (the peer closed or reset it, refused a new one,
// failed the handshake, or sent nothing, not even a heartbeat, for
// peerTimeout) while this agent is not closing it itself. Only connections
// this worker opened count: it dialled the address the rendezvous
// published, so an outsider cannot make it believe a member died. When a
// connection a peer opened fails, the agent probes that peer through a
// connection of its own instead.
//
// Losing is final for this runtime: calls to the worker fail at once with
// kWorkerUnavailable naming the cause, requests from it are refused, and a
// restarted group meets again as new runtimes. Every layer's
// RuntimeLayer::workerLost, then the application's callbacks, run once, on
// the agent's pool; during shutdown (after refuseNewCalls) a loss is only
// recorded, for the barriers, and nobody is told. From the moment this
// worker arrives at the last barrier ("closing"), a peer that passes it may
// leave and close its connections while this one still waits or closes:
// such an end is kept apart as a departure (Agent::goneCause), which the
// remaining waits do not wait for. After the barrier, a departed peer that
// had arrived there left; one that had not (or that the store cannot
// vouch for) is recorded as lost. Without that, a worker would list the
// peers that finished first as lost.
//
// Who finds out: every worker that has a connection to the lost one (TCP
// heartbeats find a hung peer within peerTimeout + heartbeatInterval, a
// dead one at once). A worker with none finds out at its next call, or in
// shutdown, whose barriers probe the ranks they still wait for.
class LostWorkers {
 public:
  // Records `worker` as lost; true the first time only.
  bool add(int64_t worker, std::string cause);
  // Why `worker` was lost, or nullopt. One atomic load while none is lost.
  std::optional<std::string> causeOf(int64_t worker) const;
  std::map<int64_t, std::string> all() const;

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, std::string> causes_;
  std::atomic<size_t> count_{0};
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc

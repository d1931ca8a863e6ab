// libFuzzer target: the rendezvous store's request handling (Note
// [Rendezvous store]) through StoreSession, the code the server runs for
// each connection, over a StoreState with small caps so that the fuzzer
// reaches them. Two clients share the store, so that one's set completes
// the other's wait. Checks that every reply parses and answers a request,
// that the store never holds more than its caps allow, and that a client
// going away leaves none of its waits behind.
//
// Input: records of u8 control (bit 0: which client; bit 1: that client
// disconnects first and a new one takes its place), u16 length
// (little-endian), then that many bytes of request.

#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "proto/rpc/store.pb.h"
#include "torchrpc/rpc/detail/store_server.h"
#include "torchrpc/rpc/detail/store_session.h"

using namespace torchrpc::rpc::detail;

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "store_request_fuzzer: %s\n", what);
  std::abort();
}

StoreLimits smallLimits() {
  StoreLimits limits;
  limits.maxKeyBytes = 8;
  limits.maxValueBytes = 32;
  limits.maxKeysPerRequest = 4;
  limits.maxStoredBytes = 128;
  limits.maxWaitingBytes = 24;
  return limits;
}

std::shared_ptr<StoreSession> newSession(
    const std::shared_ptr<StoreState>& state) {
  return std::make_shared<StoreSession>(state, [](std::string bytes) {
    torchrpc::rpc::store::StoreReply reply;
    if (!reply.ParseFromString(bytes)) {
      finding("a reply that does not parse");
    }
  });
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const StoreLimits limits = smallLimits();
  auto state = std::make_shared<StoreState>(limits);
  std::shared_ptr<StoreSession> clients[2] = {
      newSession(state),
      newSession(state)};
  size_t at = 0;
  while (size - at >= 3) {
    const uint8_t control = data[at];
    size_t length = data[at + 1] | (size_t(data[at + 2]) << 8);
    at += 3;
    if (length > size - at) {
      length = size - at;
    }
    auto& client = clients[control & 1];
    if (control & 2) {
      client->close();
      client = newSession(state);
    }
    const std::string request(reinterpret_cast<const char*>(data) + at, length);
    at += length;
    if (!client->handle(request).empty()) {
      // The server closes that connection.
      client->close();
      client = newSession(state);
    }
    if (state->storedBytes() > limits.maxStoredBytes) {
      finding("the store holds more than maxStoredBytes");
    }
  }
  for (auto& client : clients) {
    client->close();
  }
  if (state->pendingWaits() != 0) {
    finding("waits outlive the clients that made them");
  }
  return 0;
}

#pragma once

// A raw client that passes the TCP transport's handshake and its same-host
// negotiation by hand, then sends whatever bytes a test gives it: how the
// tests of shared segments and shared rings play a lying peer on this
// host.

#include <unistd.h>

#include <cstdint>
#include <string>

#include "tests/support/tcp_peers.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/handshake.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"

namespace torchrpc {
namespace rpc {
namespace harness {

// A hand-driven client in this process: it completes the handshake with a
// host section, proves it can be read, asks for segments, and then sends
// whatever frame the test gives it.
class NegotiatedRawPeer {
 public:
  explicit NegotiatedRawPeer(int port) : peer_(port) {}

  bool negotiate() {
    using namespace detail::tcp;
    if (!peer_.connected()) {
      return false;
    }
    HostIdentity host = localHostIdentity();
    if (host.bootId.empty()) {
      return false;
    }
    Greeting hello;
    hello.name = "liar";
    HostSection section;
    section.bootId = host.bootId;
    section.pidNamespace = host.pidNamespace;
    section.pid = static_cast<uint64_t>(::getpid());
    section.challenge = std::string(kChallengeBytes, 'c');
    hello.host = section;
    std::string body = encodeGreeting(FrameType::kHello, hello);
    if (!peer_.write(
            encodeFrameHeader(
                FrameType::kHello,
                static_cast<uint32_t>(body.size()),
                0) +
            body)) {
      return false;
    }
    std::string header = peer_.read(kFrameHeaderBytes);
    if (header.size() != kFrameHeaderBytes) {
      return false;
    }
    FrameHeader welcomeHeader = decodeFrameHeader(
        reinterpret_cast<const unsigned char*>(header.data()));
    std::string welcomeBody = peer_.read(welcomeHeader.bodyBytes);
    Greeting welcome;
    if (welcomeHeader.type != FrameType::kWelcome ||
        !decodeGreeting(FrameType::kWelcome, welcomeBody, false, welcome)
             .empty() ||
        !welcome.host) {
      return false;
    }
    // Where the server finds its own challenge in our memory.
    serverChallenge_ = welcome.host->challenge;
    std::string probe = encodeCmaProbe(
        true,
        true,
        reinterpret_cast<uintptr_t>(serverChallenge_.data()));
    if (!peer_.write(
            encodeFrameHeader(FrameType::kCmaProbe, probe.size(), 0) + probe)) {
      return false;
    }
    std::string result = peer_.read(kFrameHeaderBytes + 1);
    // kCmaResult {flags}: the server reads us and maps our segments.
    return result.size() == kFrameHeaderBytes + 1 &&
        decodeFrameHeader(reinterpret_cast<const unsigned char*>(result.data()))
            .type == FrameType::kCmaResult &&
        result.back() == '\3';
  }

  RawPeer& raw() {
    return peer_;
  }

 private:
  RawPeer peer_;
  std::string serverChallenge_;
};

} // namespace harness
} // namespace rpc
} // namespace torchrpc

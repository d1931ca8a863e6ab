// libFuzzer target: the bodies of the TCP transport's handshake frames
// (Note [TCP transport handshake]): kHello and kWelcome greetings, with and
// without a shared secret, and kProof. Whatever is accepted must be what the
// encoder writes for the decoded fields (nothing is skipped or read twice),
// and a proof must have its exact size.
//
// Input: u8 flags (bit 0: kWelcome rather than kHello, bit 1: this side has
// a secret, bit 2: a kProof body), then the body, at most 4 KiB as the
// receiver allows.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "torchrpc/rpc/transport/tcp/handshake.h"

using namespace torchrpc::rpc::detail::tcp;

namespace {

void require(bool condition) {
  if (!condition) {
    std::abort();
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size - 1 > kMaxHandshakeBodyBytes) {
    return 0; // the receiver refuses a longer body before reading it
  }
  const uint8_t flags = data[0];
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);

  if (flags & 4) {
    std::string proof;
    if (decodeProof(body, proof).empty()) {
      require(proof.size() == kProofBytes && proof == body);
    }
    return 0;
  }
  const FrameType type = (flags & 1) ? FrameType::kWelcome : FrameType::kHello;
  const bool authenticates = (flags & 2) != 0;
  Greeting greeting;
  const std::string refusal =
      decodeGreeting(type, body, authenticates, greeting);
  if (!refusal.empty()) {
    return 0;
  }
  require(greeting.auth == authenticates);
  require(greeting.nonce.size() == (authenticates ? kNonceBytes : 0));
  require(
      greeting.proof.size() ==
      (authenticates && type == FrameType::kWelcome ? kProofBytes : 0));
  if (greeting.host) {
    require(greeting.host->challenge.size() == kChallengeBytes);
  }
  // The encoder truncates names over 1 KiB; below that, decoding is exact.
  const bool truncates = greeting.name.size() > 1024 ||
      (greeting.host && greeting.host->bootId.size() > 1024);
  if (!truncates) {
    require(encodeGreeting(type, greeting) == body);
  }
  return 0;
}

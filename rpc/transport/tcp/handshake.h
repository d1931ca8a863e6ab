#pragma once

// The TCP transport's handshake as pure functions: kHello, kWelcome and
// kProof bodies built and parsed, nonces, HMAC proofs and their
// constant-time comparison. The only file of the transport that includes
// OpenSSL (in the .cpp). The connection runs the steps on its strand.

#include <cstddef>
#include <optional>
#include <string>

#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [TCP transport handshake]
//
// Before any data frame (Note [TCP transport wire format]):
//   1. client -> kHello   {auth, client nonce, client name}
//   2. server -> kWelcome {auth, server nonce, server name, server proof}
//   3. client -> kProof   {client proof}                (only with a secret)
// Byte by byte, a kHello body is {u8 auth | client nonce (with auth) |
// short string name | optional host section}, a kWelcome body {u8 auth |
// server nonce and server proof (with auth) | short string name | optional
// host section}, a kProof body the proof alone; a short string is a u16
// length and its bytes. The host section is Note [TCP same-host zero copy].
// With a secret, nonces are 32 random bytes (RAND_bytes) and a proof is
// HMAC-SHA256(secret, role label | 0 | client nonce | server nonce),
// compared in constant time; the role label keeps one side's proof from
// being replayed as the other's. Without a secret, auth is 0 and there are
// no nonces or proofs; the two sides must agree on whether a secret is
// used.
//
// Guarantees:
//   1. No data frame from a peer is read before its handshake passed, and a
//      server hands a connection to onAccept only then.
//   2. A peer that sends anything invalid, or does not finish within
//      handshakeTimeout, is dropped and logged; at most
//      kMaxHandshakingConnections (64) connections may be in their
//      handshake, the oldest is dropped for a new one. The listener keeps
//      accepting whatever peers do.

constexpr size_t kMaxHandshakeBodyBytes = 4096;
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kMaxHandshakingConnections = 64;

enum class Role { kClient, kServer };

// Where one side stands in its handshake.
struct HandshakeState {
  explicit HandshakeState(Role r) : role(r) {}

  const Role role;
  std::string clientNonce;
  std::string serverNonce;
  bool awaitingProof = false; // server: sent kWelcome with auth
  bool done = false;
};

// The frame type `state` accepts next (it is still in its handshake).
FrameType expectedHandshakeFrame(const HandshakeState& state);

// `bytes` random bytes (RAND_bytes); throws c10::Error if it fails.
std::string randomBytes(size_t bytes);

// HMAC-SHA256(secret, label of `prover` | 0 | client nonce | server nonce).
// Throws c10::Error if OpenSSL fails.
std::string proofOf(
    const std::string& secret,
    Role prover,
    const std::string& clientNonce,
    const std::string& serverNonce);

bool equalInConstantTime(const std::string& a, const std::string& b);

// A kHello or kWelcome body.
struct Greeting {
  bool auth = false;
  std::string nonce; // kNonceBytes with auth, else empty
  std::string proof; // kWelcome with auth: the server's proof
  std::string name;
  // Same-host zero copy; kWelcome's carries an address.
  std::optional<HostSection> host;
};

// `type`: kHello or kWelcome.
std::string encodeGreeting(FrameType type, const Greeting& greeting);

// Parses a kHello or kWelcome body. `authenticates`: whether this side has
// a shared secret (the peer must agree). Returns an empty string, or why
// the body is refused (the reason the handshake fails with).
std::string decodeGreeting(
    FrameType type,
    const std::string& body,
    bool authenticates,
    Greeting& greeting);

// Parses a kProof body. Returns an empty string or why it is refused.
std::string decodeProof(const std::string& body, std::string& proof);

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc

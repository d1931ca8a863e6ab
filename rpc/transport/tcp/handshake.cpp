#include "torchrpc/rpc/transport/tcp/handshake.h"

#include <c10/util/Exception.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

const char* const kClientRole = "torchrpc-tcp-v1 client";
const char* const kServerRole = "torchrpc-tcp-v1 server";

const char* const kMalformed = "malformed handshake";

} // namespace

FrameType expectedHandshakeFrame(const HandshakeState& state) {
  if (state.role == Role::kClient) {
    return FrameType::kWelcome;
  }
  return state.awaitingProof ? FrameType::kProof : FrameType::kHello;
}

std::string randomBytes(size_t bytes) {
  std::string out(bytes, '\0');
  TORCH_CHECK(
      RAND_bytes(
          reinterpret_cast<unsigned char*>(&out[0]),
          static_cast<int>(out.size())) == 1,
      "TcpTransport: RAND_bytes failed");
  return out;
}

std::string proofOf(
    const std::string& secret,
    Role prover,
    const std::string& clientNonce,
    const std::string& serverNonce) {
  const char* role = prover == Role::kClient ? kClientRole : kServerRole;
  std::string data = std::string(role) + '\0' + clientNonce + serverNonce;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  const unsigned char* result = HMAC(
      EVP_sha256(),
      secret.data(),
      static_cast<int>(secret.size()),
      reinterpret_cast<const unsigned char*>(data.data()),
      data.size(),
      out,
      &length);
  TORCH_CHECK(
      result != nullptr && length == kProofBytes,
      "TcpTransport: HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), length);
}

bool equalInConstantTime(const std::string& a, const std::string& b) {
  return a.size() == b.size() &&
      CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string encodeGreeting(FrameType type, const Greeting& greeting) {
  std::string body(1, greeting.auth ? '\1' : '\0');
  if (greeting.auth) {
    body += greeting.nonce;
    if (type == FrameType::kWelcome) {
      body += greeting.proof;
    }
  }
  appendShortString(body, greeting.name);
  if (greeting.host) {
    appendHostSection(
        body,
        *greeting.host,
        /*withAddress=*/type == FrameType::kWelcome);
  }
  return body;
}

std::string decodeGreeting(
    FrameType type,
    const std::string& body,
    bool authenticates,
    Greeting& greeting) {
  BodyReader reader(body);
  uint8_t auth = 0;
  if (!reader.u8(auth) || auth > 1) {
    return kMalformed;
  }
  greeting.auth = auth == 1;
  if (greeting.auth != authenticates) {
    return authenticates ? "the peer has no shared secret"
                         : "the peer requires a shared secret";
  }
  if (greeting.auth && !reader.bytes(kNonceBytes, greeting.nonce)) {
    return kMalformed;
  }
  const bool welcome = type == FrameType::kWelcome;
  if (welcome && greeting.auth && !reader.bytes(kProofBytes, greeting.proof)) {
    return kMalformed;
  }
  if (!reader.shortString(greeting.name)) {
    return kMalformed;
  }
  if (!reader.atEnd()) {
    HostSection host;
    if (!readHostSection(reader, /*withAddress=*/welcome, host)) {
      return kMalformed;
    }
    greeting.host = std::move(host);
  }
  if (!reader.atEnd()) {
    return kMalformed;
  }
  return std::string();
}

std::string decodeProof(const std::string& body, std::string& proof) {
  BodyReader reader(body);
  if (!reader.bytes(kProofBytes, proof) || !reader.atEnd()) {
    return "malformed proof";
  }
  return std::string();
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc

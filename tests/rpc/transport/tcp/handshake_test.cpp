// The TCP handshake (Note [TCP transport handshake],
// rpc/transport/tcp/handshake.h): bodies and proofs as values, then a
// listener with a shared secret refusing wrong, missing and skipped proofs.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/handshake.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;

// ---- Bodies and proofs as values ----

using detail::tcp::decodeGreeting;
using detail::tcp::decodeProof;
using detail::tcp::encodeGreeting;
using detail::tcp::equalInConstantTime;
using detail::tcp::expectedHandshakeFrame;
using detail::tcp::FrameType;
using detail::tcp::Greeting;
using detail::tcp::HandshakeState;
using detail::tcp::HostSection;
using detail::tcp::kNonceBytes;
using detail::tcp::proofOf;
using detail::tcp::Role;

HostSection someHost() {
  HostSection host;
  host.bootId = "boot-id";
  host.pidNamespace = 4026531836;
  host.pid = 4242;
  host.challenge = std::string(16, 'c');
  host.address = 0x7fff0000;
  return host;
}

TEST(TcpHandshakeBody, HelloWithoutSecretIsFlagNameAndHost) {
  Greeting hello;
  hello.name = "worker1";
  EXPECT_EQ(
      encodeGreeting(FrameType::kHello, hello),
      std::string("\0\7\0worker1", 10));
  hello.host = someHost();
  std::string body = encodeGreeting(FrameType::kHello, hello);
  Greeting got;
  ASSERT_EQ(decodeGreeting(FrameType::kHello, body, false, got), "");
  EXPECT_FALSE(got.auth);
  EXPECT_EQ(got.name, "worker1");
  ASSERT_TRUE(got.host.has_value());
  EXPECT_EQ(got.host->bootId, "boot-id");
  EXPECT_EQ(got.host->pidNamespace, 4026531836u);
  EXPECT_EQ(got.host->pid, 4242u);
  EXPECT_EQ(got.host->challenge, std::string(16, 'c'));
  EXPECT_EQ(got.host->address, 0u) << "only kWelcome carries the address";
}

TEST(TcpHandshakeBody, WelcomeWithSecretRoundTrips) {
  Greeting welcome;
  welcome.auth = true;
  welcome.nonce = std::string(kNonceBytes, 'n');
  welcome.proof = proofOf("s", Role::kServer, "client", welcome.nonce);
  welcome.name = "server";
  welcome.host = someHost();
  std::string body = encodeGreeting(FrameType::kWelcome, welcome);
  Greeting got;
  ASSERT_EQ(decodeGreeting(FrameType::kWelcome, body, true, got), "");
  EXPECT_TRUE(got.auth);
  EXPECT_EQ(got.nonce, welcome.nonce);
  EXPECT_EQ(got.proof, welcome.proof);
  EXPECT_EQ(got.name, "server");
  ASSERT_TRUE(got.host.has_value());
  EXPECT_EQ(got.host->address, 0x7fff0000u);
}

TEST(TcpHandshakeBody, RefusalsSayWhy) {
  Greeting hello;
  hello.name = "x";
  std::string plain = encodeGreeting(FrameType::kHello, hello);
  Greeting got;
  EXPECT_EQ(
      decodeGreeting(FrameType::kHello, plain, true, got),
      "the peer has no shared secret");
  hello.auth = true;
  hello.nonce = std::string(kNonceBytes, 'n');
  std::string authed = encodeGreeting(FrameType::kHello, hello);
  EXPECT_EQ(
      decodeGreeting(FrameType::kHello, authed, false, got),
      "the peer requires a shared secret");
  for (const std::string& bad :
       {std::string(),
        std::string("\2", 1),
        authed.substr(0, 20),
        plain + "trailing",
        plain + std::string("\2", 1)}) {
    SCOPED_TRACE(bad.size());
    Greeting ignored;
    EXPECT_EQ(
        decodeGreeting(
            FrameType::kHello,
            bad,
            bad == authed.substr(0, 20),
            ignored),
        "malformed handshake");
  }
  std::string proof;
  EXPECT_EQ(decodeProof(std::string(31, 'p'), proof), "malformed proof");
  EXPECT_EQ(decodeProof(std::string(33, 'p'), proof), "malformed proof");
  EXPECT_EQ(decodeProof(std::string(32, 'p'), proof), "");
  EXPECT_EQ(proof, std::string(32, 'p'));
}

TEST(TcpHandshakeBody, ProofsBindSecretRoleAndNonces) {
  std::string c(kNonceBytes, 'c');
  std::string s(kNonceBytes, 's');
  std::string proof = proofOf("secret", Role::kClient, c, s);
  EXPECT_EQ(proof.size(), 32u);
  EXPECT_TRUE(
      equalInConstantTime(proof, proofOf("secret", Role::kClient, c, s)));
  EXPECT_FALSE(
      equalInConstantTime(proof, proofOf("secret", Role::kServer, c, s)));
  EXPECT_FALSE(
      equalInConstantTime(proof, proofOf("other", Role::kClient, c, s)));
  EXPECT_FALSE(
      equalInConstantTime(proof, proofOf("secret", Role::kClient, s, c)));
  EXPECT_FALSE(equalInConstantTime(proof, proof.substr(0, 31)));
}

TEST(TcpHandshakeBody, EachSideExpectsItsNextFrame) {
  HandshakeState client(Role::kClient);
  EXPECT_EQ(expectedHandshakeFrame(client), FrameType::kWelcome);
  HandshakeState server(Role::kServer);
  EXPECT_EQ(expectedHandshakeFrame(server), FrameType::kHello);
  server.awaitingProof = true;
  EXPECT_EQ(expectedHandshakeFrame(server), FrameType::kProof);
}

// ---- A listener with a shared secret ----

class TcpSecretTest : public TcpListenerFixture {
 protected:
  detail::TcpTransportOptions serverOptions() override {
    auto options = testOptions("server");
    options.sharedSecret = "correct horse battery staple";
    return options;
  }
  detail::TcpTransportOptions clientOptions() override {
    return serverOptions();
  }

  // A client with `secret` must fail with kWorkerUnavailable and never be
  // handed to the server's onAccept.
  void expectRefused(const std::string& secret) {
    auto options = testOptions("intruder");
    options.sharedSecret = secret;
    detail::TcpTransport intruder(options);
    size_t before = acceptor_->count();
    auto connection = intruder.connect(server_->address());
    auto inbox = startWithInbox(connection);
    std::atomic<int> sendErrors{0};
    connection->send(makeMessage("let me in"), [&](const TransportError* e) {
      if (e != nullptr) {
        ++sendErrors;
      }
    });
    ASSERT_TRUE(inbox->waitForError());
    EXPECT_EQ(inbox->errors()[0].code, ErrorCode::kWorkerUnavailable);
    EXPECT_TRUE(inbox->messages().empty());
    intruder.close();
    intruder.join();
    EXPECT_EQ(sendErrors.load(), 1);
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(acceptor_->count(), before);
  }
};

TEST_F(TcpSecretTest, WrongSecretIsRefused) {
  expectRefused("wrong");
  expectListenerHealthy();
}

TEST_F(TcpSecretTest, MissingSecretIsRefused) {
  expectRefused("");
  expectListenerHealthy();
}

TEST_F(TcpSecretTest, CorrectSecretIsAccepted) {
  // SetUp's connection used it already; and a fresh one.
  expectListenerHealthy();
}

TEST_F(TcpSecretTest, DataBeforeTheProofIsDropped) {
  RawPeer peer(port_);
  ASSERT_TRUE(peer.connected());
  ASSERT_TRUE(peer.write(rawHello("raw", true)));
  std::string welcome = peer.read(16);
  ASSERT_EQ(welcome.size(), 16u);
  size_t before = acceptor_->count();
  // Skip the proof and go straight to data.
  peer.write(rawFrameHeader(kData, 5, 0) + "hello");
  EXPECT_TRUE(peer.waitClosedByServer());
  EXPECT_EQ(acceptor_->count(), before);
  expectListenerHealthy();
}

} // namespace
} // namespace rpc
} // namespace torchrpc

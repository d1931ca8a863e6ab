// Same-host zero copy (Note [TCP same-host zero copy],
// rpc/transport/tcp/same_host.h): the kCmaProbe/kCmaResult/kAck bodies as
// values, and large tensors read with process_vm_readv within a process and
// between processes, byte-exact, and a peer dying mid-transfer.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/patterned_bytes.h"
#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;

// ---- Bodies as values ----

using detail::tcp::cmaBodyBytes;
using detail::tcp::decodeAck;
using detail::tcp::decodeCmaProbe;
using detail::tcp::decodeCmaResult;
using detail::tcp::encodeAck;
using detail::tcp::encodeCmaProbe;
using detail::tcp::encodeCmaResult;
using detail::tcp::FrameType;
using detail::tcp::HostIdentity;
using detail::tcp::HostSection;
using detail::tcp::onSameHost;
using detail::tcp::SameHostState;

TEST(TcpSameHostBody, ControlBodiesRoundTripAndRefuseBadFlags) {
  std::string probe = encodeCmaProbe(true, false, 0x1122334455667788ull);
  EXPECT_EQ(probe.size(), cmaBodyBytes(FrameType::kCmaProbe));
  EXPECT_EQ(probe, std::string("\1\x88\x77\x66\x55\x44\x33\x22\x11", 9));
  bool canRead = false;
  bool sendSegments = true;
  uint64_t address = 0;
  ASSERT_TRUE(decodeCmaProbe(probe, canRead, sendSegments, address));
  EXPECT_TRUE(canRead);
  EXPECT_FALSE(sendSegments);
  EXPECT_EQ(address, 0x1122334455667788ull);
  // Bit 1, "send me shared segments", goes with bit 0 only.
  probe = encodeCmaProbe(true, true, 5);
  EXPECT_EQ(probe[0], '\3');
  ASSERT_TRUE(decodeCmaProbe(probe, canRead, sendSegments, address));
  EXPECT_TRUE(canRead);
  EXPECT_TRUE(sendSegments);
  EXPECT_EQ(encodeCmaProbe(false, true, 5)[0], '\0');
  for (char bad : {'\2', '\4', '\7', '\x81'}) {
    probe[0] = bad;
    EXPECT_FALSE(decodeCmaProbe(probe, canRead, sendSegments, address))
        << int(bad);
  }

  EXPECT_EQ(encodeCmaResult(false, false), std::string("\0", 1));
  EXPECT_EQ(encodeCmaResult(true, true), std::string("\3", 1));
  EXPECT_EQ(cmaBodyBytes(FrameType::kCmaResult), 1u);
  ASSERT_TRUE(
      decodeCmaResult(encodeCmaResult(true, false), canRead, sendSegments));
  EXPECT_TRUE(canRead);
  EXPECT_FALSE(sendSegments);
  ASSERT_TRUE(decodeCmaResult(std::string("\3", 1), canRead, sendSegments));
  EXPECT_TRUE(sendSegments);
  EXPECT_FALSE(decodeCmaResult(std::string("\2", 1), canRead, sendSegments));
  EXPECT_FALSE(decodeCmaResult(std::string("\4", 1), canRead, sendSegments));

  uint64_t id = 0;
  EXPECT_EQ(cmaBodyBytes(FrameType::kAck), 8u);
  ASSERT_TRUE(decodeAck(encodeAck(77), id));
  EXPECT_EQ(id, 77u);
  EXPECT_EQ(cmaBodyBytes(FrameType::kData), 0u);
}

TEST(TcpSameHostBody, OnlyThisHostAndPidNamespaceCount) {
  HostIdentity ours{"boot", 12};
  HostSection theirs;
  theirs.bootId = "boot";
  theirs.pidNamespace = 12;
  theirs.pid = 100;
  EXPECT_TRUE(onSameHost(ours, theirs));
  theirs.pid = 0;
  EXPECT_FALSE(onSameHost(ours, theirs));
  theirs.pid = uint64_t(1) << 40;
  EXPECT_FALSE(onSameHost(ours, theirs)) << "not a pid_t";
  theirs.pid = 100;
  theirs.pidNamespace = 13;
  EXPECT_FALSE(onSameHost(ours, theirs));
  theirs.pidNamespace = 12;
  theirs.bootId = "other";
  EXPECT_FALSE(onSameHost(ours, theirs));
  EXPECT_FALSE(onSameHost(HostIdentity{}, HostSection{})) << "unknown host";
}

TEST(TcpSameHostBody, ProbeReadsOwnChallengeOnlyFromTheAnnouncedAddress) {
  // Both sides in this process: the "peer" keeps our challenge in its probe.
  HostIdentity host{"boot", 12};
  SameHostState us;
  SameHostState peer;
  auto ourSection = us.ourSection(host);
  ASSERT_TRUE(ourSection.has_value());
  EXPECT_EQ(ourSection->challenge.size(), detail::tcp::kChallengeBytes);
  EXPECT_EQ(ourSection->pid, static_cast<uint64_t>(::getpid()));
  peer.notePeerSection(host, *ourSection);
  ASSERT_TRUE(peer.peerOnHost);
  HostSection peerSection = *peer.ourSection(host);
  us.notePeerSection(host, peerSection);
  EXPECT_TRUE(us.probePeer(peer.probeAddress()));
  EXPECT_FALSE(us.probePeer(0));
  // Memory that holds something else is not a proof.
  std::string decoy(detail::tcp::kChallengeBytes, 'd');
  EXPECT_FALSE(us.probePeer(reinterpret_cast<uintptr_t>(decoy.data())));
  EXPECT_FALSE(SameHostState().ourSection(HostIdentity{}).has_value());
}

// ---- Zero copy over connections ----

// Shared memory segments off, so large tensors go by address (the segments
// have their own tests, shared_memory_test.cpp).
detail::TcpTransportOptions cmaOptions(std::string name) {
  auto options = testOptions(std::move(name));
  options.sharedMemoryMaxBytes = 0;
  return options;
}

constexpr size_t kZeroCopyMin = size_t(256) << 10;

std::vector<size_t> zeroCopySizes() {
  return {
      kZeroCopyMin - 1,
      kZeroCopyMin,
      kZeroCopyMin + 1,
      size_t(1) << 20,
      size_t(4) << 20,
      size_t(64) << 20};
}

// Each message mixes small and large tensors; the sender keeps only a
// clone, so the transport alone keeps the sent tensors alive until acked.
void sendMixed(Connection& connection, std::vector<Message>& expected) {
  int seed = 0;
  for (size_t size : zeroCopySizes()) {
    std::vector<at::Tensor> tensors = {
        patterned(100, ++seed),
        patterned(size, ++seed),
        patterned(3, ++seed)};
    Message want = makeMessage("m" + std::to_string(seed));
    for (const at::Tensor& tensor : tensors) {
      want.tensors.push_back(tensor.clone());
    }
    expected.push_back(std::move(want));
    connection.send(
        makeMessage("m" + std::to_string(seed), std::move(tensors)),
        [](const TransportError* error) { EXPECT_EQ(error, nullptr); });
    // A small message between large ones must keep its place.
    expected.push_back(makeMessage("small" + std::to_string(seed)));
    connection.send(
        makeMessage("small" + std::to_string(seed)),
        [](const TransportError*) {});
  }
}

void expectMessages(Inbox& inbox, const std::vector<Message>& expected) {
  ASSERT_TRUE(inbox.waitForMessages(expected.size(), kTimeout));
  auto got = inbox.messages();
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(got[i].header, expected[i].header);
    ASSERT_EQ(got[i].tensors.size(), expected[i].tensors.size());
    for (size_t t = 0; t < expected[i].tensors.size(); ++t) {
      EXPECT_TRUE(sameBytes(got[i].tensors[t], expected[i].tensors[t]))
          << "message " << i << " tensor " << t;
    }
  }
  EXPECT_TRUE(inbox.errors().empty());
}

TEST(TcpZeroCopy, LargeTensorsArriveByteExactWithinAProcess) {
  detail::TcpTransport server(cmaOptions("server"));
  detail::TcpTransport client(cmaOptions("client"));
  Acceptor acceptor(server);
  auto connection = client.connect(server.address());
  auto clientInbox = startWithInbox(connection);
  // One round trip first, so the zero-copy probe has completed.
  connection->send(makeMessage("hello"), [](const TransportError*) {});
  auto accepted = acceptor.waitFor(0);
  ASSERT_TRUE(accepted.connection);
  ASSERT_TRUE(accepted.inbox->waitForMessages(1, kTimeout));
  accepted.connection->send(makeMessage("hi"), [](const TransportError*) {});
  ASSERT_TRUE(clientInbox->waitForMessages(1, kTimeout));

  std::vector<Message> expected = {makeMessage("hello")};
  sendMixed(*connection, expected);
  expectMessages(*accepted.inbox, expected);
  // And the other way.
  std::vector<Message> back = {makeMessage("hi")};
  sendMixed(*accepted.connection, back);
  expectMessages(*clientInbox, back);
}

TEST(TcpZeroCopy, LargeTensorsRoundTripByteExactBetweenProcesses) {
  ChildServer child(ChildServer::Kind::kTcp, cmaOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(cmaOptions("client"));
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  // The child echoes: each large tensor crosses twice, by address.
  std::vector<Message> expected = {makeMessage("hello")};
  sendMixed(*connection, expected);
  expectMessages(*inbox, expected);
}

TEST(TcpZeroCopy, DisabledZeroCopyStillCarriesTheBytes) {
  auto options = cmaOptions("client");
  options.sameHostZeroCopy = false;
  ChildServer child(ChildServer::Kind::kTcp, cmaOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(options);
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  std::vector<Message> expected = {makeMessage("hello")};
  sendMixed(*connection, expected);
  expectMessages(*inbox, expected);
}

TEST(TcpZeroCopy, PeerDyingMidTransferFailsTheConnection) {
  ChildServer child(ChildServer::Kind::kTcp, cmaOptions("child"));
  ASSERT_FALSE(child.address().empty());
  detail::TcpTransport client(cmaOptions("client"));
  std::shared_ptr<Connection> connection;
  auto inbox = connectAndEcho(client, child.address(), connection);
  for (int i = 0; i < 4; ++i) {
    connection->send(
        makeMessage("big", {patterned(size_t(64) << 20, i)}),
        [](const TransportError*) {});
  }
  child.kill(SIGKILL);
  child.reap();
  auto start = Clock::now();
  EXPECT_TRUE(inbox->waitForError(kTimeout));
  EXPECT_LT(Clock::now() - start, kTimeout);
  auto errors = inbox->errors();
  ASSERT_FALSE(errors.empty());
  EXPECT_EQ(errors[0].code, ErrorCode::kWorkerUnavailable);
}

} // namespace
} // namespace rpc
} // namespace torchrpc

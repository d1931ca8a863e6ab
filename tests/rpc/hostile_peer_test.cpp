// Whatever arrives on a worker's listening port, the worker lives and keeps
// serving both the peers it already talks to and new ones. This is the
// worker's level: a whole Runtime over the TCP transport, agent included.

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>

#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using testing::LocalCluster;

// "tcp://127.0.0.1:port" of a worker, from the rendezvous store.
std::string addressOf(LocalCluster& cluster, int rank) {
  auto bytes =
      cluster.store()->get("torchrpc/1/address/" + std::to_string(rank));
  return std::string(bytes.begin(), bytes.end());
}

int portOf(const std::string& address) {
  return std::stoi(address.substr(address.rfind(':') + 1));
}

// A raw TCP client that does whatever it is told, nothing more.
class RawSocket {
 public:
  explicit RawSocket(int port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ =
        ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawSocket() {
    ::close(fd_);
  }
  bool connected() const {
    return connected_;
  }
  void send(const std::string& bytes) {
    (void)!::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }

 private:
  int fd_;
  bool connected_ = false;
};

std::string randomBytes(size_t n, uint32_t seed) {
  std::mt19937 random(seed);
  std::string out(n, '\0');
  for (auto& c : out) {
    c = static_cast<char>(random());
  }
  return out;
}

void registerAdd(int, rpc::Runtime& rt) {
  rt.functions().add("add", [](int64_t a, int64_t b) { return a + b; });
}

// worker0 already talks to worker2; worker1 will be worker2's new peer.
class WorkerUnderHostilePeer : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<LocalCluster>(
        rpc::TransportKind::kTcp,
        3,
        [](int, rpc::Options& o) {
          o.sharedSecret = "job secret";
          o.defaultTimeout = 10s;
        },
        registerAdd);
    ASSERT_EQ((*cluster_)[0].rpcSync<int64_t>("worker2", "add", 1, 1), 2);
    port_ = portOf(addressOf(*cluster_, 2));
  }

  void expectWorker2StillServes() {
    EXPECT_EQ((*cluster_)[0].rpcSync<int64_t>("worker2", "add", 2, 3), 5)
        << "an existing peer lost its service";
    EXPECT_EQ((*cluster_)[1].rpcSync<int64_t>("worker2", "add", 4, 5), 9)
        << "a new peer was not served";
  }

  std::unique_ptr<LocalCluster> cluster_;
  int port_ = 0;
};

TEST_F(WorkerUnderHostilePeer, RandomBytesLeaveTheWorkerServing) {
  RawSocket attacker(port_);
  ASSERT_TRUE(attacker.connected());
  attacker.send(randomBytes(1024, 1));
  expectWorker2StillServes();
}

TEST_F(WorkerUnderHostilePeer, HugeAnnouncedLengthsLeaveTheWorkerServing) {
  // A plausible-looking header whose length fields are all 0xff.
  RawSocket attacker(port_);
  ASSERT_TRUE(attacker.connected());
  attacker.send(std::string(64, '\xff'));
  expectWorker2StillServes();
}

TEST_F(WorkerUnderHostilePeer, FiftyConnectThenCloseLeaveTheWorkerServing) {
  for (int i = 0; i < 50; ++i) {
    RawSocket scanner(port_);
    ASSERT_TRUE(scanner.connected());
  }
  expectWorker2StillServes();
}

TEST_F(WorkerUnderHostilePeer, SilentConnectionsHeldOpenLeaveTheWorkerServing) {
  std::vector<std::unique_ptr<RawSocket>> silent;
  for (int i = 0; i < 20; ++i) {
    silent.push_back(std::make_unique<RawSocket>(port_));
  }
  expectWorker2StillServes();
  std::this_thread::sleep_for(2500ms); // past the handshake deadline
  expectWorker2StillServes();
}

TEST_F(WorkerUnderHostilePeer, WrongSharedSecretIsRefused) {
  rpc::detail::TcpTransportOptions options;
  options.name = "intruder";
  options.sharedSecret = "guessed secret";
  rpc::detail::TcpTransport intruder(options);
  auto connection = intruder.connect(addressOf(*cluster_, 2));
  std::promise<rpc::TransportError> failed;
  connection->start(
      [](rpc::Message&&) { ADD_FAILURE() << "the intruder got a message"; },
      [&failed](const rpc::TransportError& e) { failed.set_value(e); });
  rpc::Message call;
  call.header = "anything";
  connection->send(std::move(call), [](const rpc::TransportError*) {});
  auto outcome = failed.get_future();
  ASSERT_EQ(outcome.wait_for(10s), std::future_status::ready)
      << "the intruder's connection was never refused";
  EXPECT_EQ((*cluster_)[2].agent().counters().requestsServed, 1u)
      << "something the intruder sent was served";
  intruder.close();
  intruder.join();
  expectWorker2StillServes();
}

} // namespace
} // namespace torchrpc

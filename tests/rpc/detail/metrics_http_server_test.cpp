// The metrics endpoint (Note [Metrics endpoint]): what a scraper gets from
// it, and what an outsider cannot do to it: crash it, make it allocate
// without a cap, wedge it, stretch close(), or keep a scrape from being
// served for longer than a timeout.

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/eventually.h"
#include "tests/support/http_client.h"
#include "torchrpc/rpc/detail/logging.h"
#include "torchrpc/rpc/detail/metrics_http_server.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace std::chrono_literals;
using detail::MetricsHttpServer;
using detail::MetricsHttpServerOptions;
using torchrpc::testing::eventually;
using torchrpc::testing::HttpConnection;
using torchrpc::testing::httpGet;
using torchrpc::testing::HttpResponse;
using Clock = std::chrono::steady_clock;

const char* const kMetricsType = "text/plain; version=0.0.4; charset=utf-8";
const char* const kTextType = "text/plain; charset=utf-8";
const char* const kHalfRequest = "GET /metrics HTTP/1.1\r\nHost: x\r\n";

// Short timeouts, so that the tests that wait for them stay short.
MetricsHttpServerOptions testOptions(const std::string& name = "worker0") {
  MetricsHttpServerOptions options;
  options.name = name;
  options.requestTimeout = 300ms;
  options.writeTimeout = 300ms;
  options.idleTimeout = 2000ms;
  return options;
}

// What render() returns; tests change it between scrapes.
class Exposition {
 public:
  explicit Exposition(std::string text) : text_(std::move(text)) {}
  void set(std::string text) {
    std::lock_guard<std::mutex> lock(mutex_);
    text_ = std::move(text);
  }
  MetricsHttpServer::Render render() {
    return [this]() {
      std::lock_guard<std::mutex> lock(mutex_);
      return text_;
    };
  }

 private:
  std::mutex mutex_;
  std::string text_;
};

const std::string kBody =
    "# HELP torchrpc_calls_total Calls made.\n"
    "# TYPE torchrpc_calls_total counter\n"
    "torchrpc_calls_total{worker=\"worker0\"} 1\n";

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

void expectContains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos)
      << "'" << part << "' not in: " << text;
}

// A legitimate scrape: 200 and exactly `body`.
void expectScrape(const MetricsHttpServer& server, const std::string& body) {
  HttpResponse response = httpGet(server.port(), "/metrics");
  EXPECT_EQ(response.status, 200) << response.error;
  EXPECT_EQ(response.header("Content-Type"), kMetricsType);
  EXPECT_EQ(response.body, body);
}

std::string randomBytes(size_t count, uint32_t seed) {
  std::mt19937 random(seed);
  std::string out(count, '\0');
  for (char& c : out) {
    c = static_cast<char>(random());
  }
  return out;
}

size_t residentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      return std::stoull(line.substr(6)) * 1024;
    }
  }
  return 0;
}

size_t countLines(const std::string& text, const std::string& part) {
  std::istringstream lines(text);
  std::string line;
  size_t count = 0;
  while (std::getline(lines, line)) {
    count += line.find(part) != std::string::npos ? 1 : 0;
  }
  return count;
}

// ---- What a scraper gets ----

TEST(MetricsHttpServer, ScrapeReturnsTheRenderedBodyExactlyEachTime) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  EXPECT_EQ(server.address(), "127.0.0.1:" + std::to_string(server.port()));

  HttpResponse first = httpGet(server.port(), "/metrics");
  ASSERT_EQ(first.status, 200) << first.error;
  EXPECT_EQ(first.reason, "OK");
  EXPECT_EQ(first.header("Content-Type"), kMetricsType);
  EXPECT_EQ(first.header("Content-Length"), std::to_string(kBody.size()));
  EXPECT_EQ(first.body, kBody);

  exposition.set("torchrpc_calls_total 2\n");
  expectScrape(server, "torchrpc_calls_total 2\n");
  // Prometheus may add query parameters; the path is what counts.
  HttpResponse withQuery = httpGet(server.port(), "/metrics?format=text");
  EXPECT_EQ(withQuery.status, 200);
  EXPECT_EQ(withQuery.body, "torchrpc_calls_total 2\n");
  // An empty exposition is a valid one.
  exposition.set("");
  expectScrape(server, "");
  EXPECT_TRUE(eventually([&] { return server.scrapesServed() == 4; }));
  EXPECT_EQ(server.requestsRejected(), 0u);
}

TEST(MetricsHttpServer, IndexPointsAtMetrics) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  HttpResponse index = httpGet(server.port(), "/");
  EXPECT_EQ(index.status, 200);
  EXPECT_EQ(index.header("Content-Type"), kTextType);
  EXPECT_EQ(index.body, "torchrpc worker metrics of worker0: GET /metrics\n");
  EXPECT_EQ(server.scrapesServed(), 0u);
}

TEST(MetricsHttpServer, KeepAliveServesRequestsOnOneConnectionUpToItsCap) {
  Exposition exposition(kBody);
  auto options = testOptions();
  options.maxRequestsPerConnection = 4;
  MetricsHttpServer server(options, exposition.render());
  HttpConnection connection(server.port());
  ASSERT_TRUE(connection.connected()) << connection.error();

  HttpResponse first = connection.request("GET", "/metrics");
  EXPECT_EQ(first.status, 200);
  EXPECT_EQ(first.body, kBody);
  EXPECT_FALSE(first.hasHeader("Connection"));
  exposition.set("changed 1\n");
  HttpResponse second = connection.request("GET", "/metrics");
  EXPECT_EQ(second.status, 200);
  EXPECT_EQ(second.body, "changed 1\n");
  EXPECT_EQ(server.openConnections(), 1u);

  // Two requests in one write (pipelined): two responses, in order.
  ASSERT_TRUE(connection.sendRaw(
      "GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  HttpResponse third = connection.readResponse();
  EXPECT_EQ(third.status, 200);
  EXPECT_EQ(third.body, "torchrpc worker metrics of worker0: GET /metrics\n");
  HttpResponse fourth = connection.readResponse();
  EXPECT_EQ(fourth.status, 200);
  EXPECT_EQ(fourth.body, "changed 1\n");
  // The fourth was the connection's last.
  EXPECT_EQ(fourth.header("Connection"), "close");
  EXPECT_TRUE(connection.waitClosedByServer(2s));

  // A client asking to close gets its response, then the close.
  HttpConnection closing(server.port());
  HttpResponse once =
      closing.request("GET", "/metrics", "Connection: close\r\n");
  EXPECT_EQ(once.status, 200);
  EXPECT_EQ(once.header("Connection"), "close");
  EXPECT_TRUE(closing.waitClosedByServer(2s));
  EXPECT_TRUE(eventually([&] { return server.scrapesServed() == 4; }));
}

TEST(MetricsHttpServer, AnIdleKeptAliveConnectionIsClosedAfterIdleTimeout) {
  Exposition exposition(kBody);
  auto options = testOptions();
  options.idleTimeout = 200ms;
  MetricsHttpServer server(options, exposition.render());
  HttpConnection connection(server.port());
  EXPECT_EQ(connection.request("GET", "/metrics").status, 200);
  auto start = Clock::now();
  EXPECT_TRUE(connection.waitClosedByServer(3s));
  EXPECT_GE(Clock::now() - start, 150ms);
  // Idling is not a rejection.
  EXPECT_EQ(server.requestsRejected(), 0u);
}

TEST(MetricsHttpServer, HeadHasTheGetHeadersAndNoBody) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  HttpConnection connection(server.port());
  HttpResponse head = connection.request("HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.header("Content-Type"), kMetricsType);
  EXPECT_EQ(head.header("Content-Length"), std::to_string(kBody.size()));
  EXPECT_EQ(head.body, "");
  HttpResponse headIndex = connection.request("HEAD", "/");
  EXPECT_EQ(headIndex.status, 200);
  EXPECT_EQ(headIndex.body, "");
  // Had a body followed either HEAD, this GET would read it instead.
  HttpResponse get = connection.request("GET", "/metrics");
  EXPECT_EQ(get.status, 200);
  EXPECT_EQ(get.body, kBody);
  // A HEAD is not a scrape.
  EXPECT_TRUE(eventually([&] { return server.scrapesServed() == 1; }));
}

TEST(MetricsHttpServer, OtherPathsAre404AndOtherMethods405) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  HttpConnection connection(server.port());

  HttpResponse missing = connection.request("GET", "/metricz");
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(missing.header("Content-Type"), kTextType);
  EXPECT_EQ(missing.body, "not found; try /metrics\n");
  EXPECT_EQ(connection.request("PUT", "/nope").status, 404);

  for (const char* method : {"POST", "DELETE", "OPTIONS"}) {
    HttpResponse refused =
        connection.request(method, "/metrics", "Content-Length: 0\r\n");
    EXPECT_EQ(refused.status, 405) << method;
    EXPECT_EQ(refused.header("Allow"), "GET, HEAD") << method;
    EXPECT_EQ(refused.body, "method not allowed; use GET or HEAD\n");
  }
  EXPECT_EQ(connection.request("DELETE", "/").status, 405);
  // All answered on one connection, which still serves: none was rejected.
  EXPECT_EQ(connection.request("GET", "/metrics").body, kBody);
  EXPECT_EQ(server.requestsRejected(), 0u);
  EXPECT_EQ(server.openConnections(), 1u);
}

TEST(MetricsHttpServer, RenderThrowingAnswers500NamingTheCause) {
  std::atomic<int> mode{0};
  MetricsHttpServer server(testOptions(), [&mode]() -> std::string {
    if (mode == 0) {
      throw std::runtime_error("registry locked\nby the trainer");
    }
    if (mode == 1) {
      TORCH_CHECK(false, "no such metric family");
    }
    return kBody;
  });
  HttpConnection connection(server.port());
  HttpResponse failed = connection.request("GET", "/metrics");
  EXPECT_EQ(failed.status, 500);
  EXPECT_EQ(failed.header("Content-Type"), kTextType);
  // One line, the cause's newline flattened.
  EXPECT_EQ(
      failed.body,
      "metrics render failed: registry locked by the trainer\n");

  mode = 1;
  HttpResponse torchError = connection.request("GET", "/metrics");
  EXPECT_EQ(torchError.status, 500);
  // A c10::Error's message, without its backtrace.
  EXPECT_EQ(torchError.body, "metrics render failed: no such metric family\n");

  mode = 2;
  // The connection survived both; render() works again.
  EXPECT_EQ(connection.request("GET", "/metrics").body, kBody);
  EXPECT_EQ(server.renderFailures(), 2u);
  EXPECT_TRUE(eventually([&] { return server.scrapesServed() == 1; }));
}

// ---- Caps ----

TEST(MetricsHttpServerHostile, RequestsWithABodyAreRefusedWithoutReadingIt) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  const std::string someBody(16 * 1024, 'b');
  const std::string moreBody(256 * 1024, 'b');
  size_t before = residentBytes();
  for (int i = 0; i < 20; ++i) {
    HttpConnection connection(server.port());
    // A petabyte announced, 16 KiB sent with it and 256 KiB after.
    ASSERT_TRUE(connection.sendRaw(
        "POST /metrics HTTP/1.1\r\nHost: x\r\n"
        "Content-Length: 1000000000000000\r\n\r\n" +
        someBody));
    HttpResponse refused = connection.readResponse();
    ASSERT_EQ(refused.status, 413) << refused.error;
    EXPECT_EQ(refused.header("Connection"), "close");
    EXPECT_EQ(
        refused.body,
        "a request with a body (this endpoint takes none)\n");
    connection.sendRaw(moreBody, 1s); // may fail: the server closes
    EXPECT_TRUE(connection.waitClosedByServer(3s));
  }
  size_t after = residentBytes();
  EXPECT_LT(after, before + (size_t(32) << 20))
      << "resident memory grew from " << before << " to " << after;

  // A small body on a GET is refused the same way, and so is a chunked one.
  HttpConnection small(server.port());
  HttpResponse withBody =
      small.request("GET", "/metrics", "Content-Length: 5\r\n");
  EXPECT_EQ(withBody.status, 413);
  HttpConnection chunked(server.port());
  HttpResponse withChunks =
      chunked.request("POST", "/metrics", "Transfer-Encoding: chunked\r\n");
  EXPECT_EQ(withChunks.status, 413);
  EXPECT_EQ(
      withChunks.body,
      "a request with a chunked body (this endpoint takes none)\n");
  EXPECT_EQ(server.requestsRejected(), 22u);

  // "Content-Length: 0" is no body.
  HttpConnection empty(server.port());
  EXPECT_EQ(
      empty.request("GET", "/metrics", "Content-Length: 0\r\n").status,
      200);
  expectScrape(server, kBody);
}

// After a response that ends the connection the server drains what the
// peer still sends, so that the peer reads the response rather than a reset;
// but for 1 s and 64 KiB at most.
TEST(MetricsHttpServerHostile, TheLingeringCloseIsBoundedInTimeAndBytes) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  const std::string withBody =
      "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n";

  // A peer that stays silent after the response.
  HttpConnection silent(server.port());
  ASSERT_TRUE(silent.sendRaw(withBody));
  auto start = Clock::now();
  EXPECT_EQ(silent.readResponse().status, 413);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(server.openConnections(), 1u); // still draining
  EXPECT_EQ(server.idleConnections(), 1u);
  ASSERT_TRUE(eventually([&] { return server.openConnections() == 0; }, 3s));
  EXPECT_GE(Clock::now() - start, 900ms);

  // A peer that keeps sending: cut off after 64 KiB, long before 1 s.
  HttpConnection talker(server.port());
  ASSERT_TRUE(talker.sendRaw(withBody));
  EXPECT_EQ(talker.readResponse().status, 413);
  start = Clock::now();
  talker.sendRaw(std::string(1 << 20, 'x'), 2s); // fails once it is cut off
  ASSERT_TRUE(eventually([&] { return server.openConnections() == 0; }, 3s));
  EXPECT_LT(Clock::now() - start, 700ms);
  EXPECT_EQ(server.requestsRejected(), 2u);
}

TEST(MetricsHttpServerHostile, AHeaderOverTheCapIs431) {
  Exposition exposition(kBody);
  auto options = testOptions();
  options.maxRequestHeaderBytes = 1024;
  MetricsHttpServer server(options, exposition.render());

  // Just under the cap: served.
  HttpConnection fits(server.port());
  HttpResponse served = fits.request(
      "GET",
      "/metrics",
      "X-Pad: " + std::string(900, 'p') + "\r\n");
  EXPECT_EQ(served.status, 200);
  EXPECT_EQ(served.body, kBody);

  // Over it, whether or not the header ever ends.
  for (bool ends : {true, false}) {
    HttpConnection connection(server.port());
    std::string request =
        "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(4096, 'p') +
        (ends ? "\r\n\r\n" : "");
    ASSERT_TRUE(connection.sendRaw(request));
    HttpResponse refused = connection.readResponse();
    EXPECT_EQ(refused.status, 431) << refused.error;
    EXPECT_EQ(refused.header("Connection"), "close");
    EXPECT_EQ(refused.body, "request header over 1024 bytes\n");
    EXPECT_TRUE(connection.waitClosedByServer(3s));
  }
  EXPECT_EQ(server.requestsRejected(), 2u);
  expectScrape(server, kBody);
}

TEST(MetricsHttpServerHostile, RandomBytesAre400AndTheServerKeepsServing) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  for (uint32_t seed = 1; seed <= 50; ++seed) {
    HttpConnection connection(server.port());
    ASSERT_TRUE(connection.sendRaw(randomBytes(2048, seed)));
    HttpResponse refused = connection.readResponse();
    EXPECT_EQ(refused.status, 400) << "seed " << seed << ": " << refused.error;
    expectContains(refused.body, "malformed request: ");
    EXPECT_TRUE(connection.waitClosedByServer(3s));
  }
  // Garbage after a good request on a kept-alive connection.
  HttpConnection connection(server.port());
  EXPECT_EQ(connection.request("GET", "/metrics").body, kBody);
  ASSERT_TRUE(connection.sendRaw(randomBytes(512, 99)));
  EXPECT_EQ(connection.readResponse().status, 400);
  EXPECT_EQ(server.requestsRejected(), 51u);
  expectScrape(server, kBody);
}

TEST(MetricsHttpServerHostile, RejectionsAreLoggedOncePerKindNotPerConnection) {
  detail::initLoggingOnce(); // logs go to stderr, as in a worker
  Exposition exposition(kBody);
  ::testing::internal::CaptureStderr();
  {
    MetricsHttpServer server(testOptions("noisy"), exposition.render());
    for (uint32_t seed = 1; seed <= 100; ++seed) {
      HttpConnection connection(server.port());
      connection.sendRaw(randomBytes(256, seed));
      EXPECT_EQ(connection.readResponse().status, 400);
    }
    EXPECT_EQ(server.requestsRejected(), 100u);
  }
  std::string logs = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(countLines(logs, "metrics endpoint of noisy"), 2u) << logs;
  EXPECT_EQ(countLines(logs, "answered 400 and closed the connection"), 1u)
      << logs;
  EXPECT_EQ(countLines(logs, "closed; warnings not logged: 99 "), 1u) << logs;
}

// ---- Timeouts ----

TEST(
    MetricsHttpServerHostile,
    SlowlorisIsClosedAtRequestTimeoutAndScrapesGoOn) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  HttpConnection slow(server.port());
  auto start = Clock::now();
  ASSERT_TRUE(slow.sendRaw(kHalfRequest));
  // Meanwhile a scrape is served at once.
  expectScrape(server, kBody);
  // Well before the slow request's deadline: nothing waited for it.
  EXPECT_LT(Clock::now() - start, 250ms);

  // A header line every 50 ms does not extend the deadline.
  bool closed = false;
  for (int i = 0; i < 60 && !closed; ++i) {
    closed = !slow.sendRaw("X-Slow: " + std::to_string(i) + "\r\n") ||
        slow.waitClosedByServer(50ms);
  }
  auto elapsed = Clock::now() - start;
  EXPECT_TRUE(closed);
  EXPECT_GE(elapsed, 250ms);
  EXPECT_LT(elapsed, 1500ms);
  EXPECT_EQ(server.requestsRejected(), 1u);
  expectScrape(server, kBody);
}

TEST(
    MetricsHttpServerHostile,
    AConnectionThatSendsNothingIsClosedAtRequestTimeout) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  HttpConnection silent(server.port());
  auto start = Clock::now();
  EXPECT_TRUE(silent.waitClosedByServer(3s));
  EXPECT_GE(Clock::now() - start, 250ms);
  EXPECT_EQ(server.requestsRejected(), 1u);
}

TEST(MetricsHttpServerHostile, APeerThatNeverReadsIsClosedAtWriteTimeout) {
  // More than the socket buffers on both sides hold.
  const std::string big(16 << 20, 'm');
  auto options = testOptions();
  // Time for a reader to take all of it under ThreadSanitizer (300 ms was
  // not, once); the stuck peer is still closed well within the waits below.
  options.writeTimeout = 2s;
  MetricsHttpServer server(options, [&big]() { return big; });
  HttpConnection stuck(server.port(), "127.0.0.1", 5s, 4096);
  ASSERT_TRUE(stuck.sendRaw("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_TRUE(eventually([&] { return server.requestsRejected() == 1; }, 5s));
  EXPECT_TRUE(eventually([&] { return server.openConnections() == 0; }, 2s));
  // The rest of the response never comes: the server closed.
  EXPECT_TRUE(stuck.waitClosedByServer(5s));
  EXPECT_EQ(server.scrapesServed(), 0u);
  // A reader gets all of it.
  HttpResponse whole = httpGet(server.port(), "/metrics", "127.0.0.1", 10s);
  EXPECT_EQ(whole.status, 200) << whole.error;
  EXPECT_EQ(whole.body.size(), big.size());
  EXPECT_TRUE(eventually([&] { return server.scrapesServed() == 1; }));
}

// ---- Connection storms and the connection cap ----

TEST(MetricsHttpServerHostile, ConnectCloseStormLeavesTheServerServing) {
  Exposition exposition(kBody);
  MetricsHttpServer server(testOptions(), exposition.render());
  for (uint32_t i = 0; i < 200; ++i) {
    HttpConnection peer(server.port());
    ASSERT_TRUE(peer.connected()) << i << ": " << peer.error();
    if (i % 3 == 1) {
      peer.sendRaw(kHalfRequest);
    } else if (i % 3 == 2) {
      peer.sendRaw(randomBytes(64, i));
    }
  }
  expectScrape(server, kBody);
  EXPECT_TRUE(eventually([&] { return server.openConnections() == 0; }, 5s));
  EXPECT_EQ(server.idleConnections(), 0u);
  expectScrape(server, kBody);
}

TEST(MetricsHttpServerLimits, IdleConnectionsAtTheCapMakeRoomForAScrape) {
  Exposition exposition(kBody);
  auto options = testOptions();
  options.maxConnections = 4;
  // Nothing times out during the test: room comes from eviction alone.
  options.requestTimeout = 30s;
  options.idleTimeout = 30s;
  MetricsHttpServer server(options, exposition.render());

  // Fresh connections that have sent nothing yet.
  std::vector<std::unique_ptr<HttpConnection>> fresh;
  for (int i = 0; i < 4; ++i) {
    fresh.push_back(std::make_unique<HttpConnection>(server.port()));
    ASSERT_TRUE(
        eventually([&] { return server.openConnections() == size_t(i) + 1; }));
  }
  EXPECT_EQ(server.idleConnections(), 4u);
  expectScrape(server, kBody);
  EXPECT_EQ(server.connectionsEvicted(), 1u);
  EXPECT_EQ(server.connectionsRefused(), 0u);
  // The oldest made room; the others are still open.
  EXPECT_TRUE(fresh[0]->waitClosedByServer(2s));
  for (int i = 1; i < 4; ++i) {
    EXPECT_FALSE(fresh[i]->waitClosedByServer(50ms)) << i;
  }
  fresh.clear();
  ASSERT_TRUE(eventually([&] { return server.openConnections() == 0; }));

  // Kept-alive connections between requests.
  std::vector<std::unique_ptr<HttpConnection>> kept;
  for (int i = 0; i < 4; ++i) {
    kept.push_back(std::make_unique<HttpConnection>(server.port()));
    EXPECT_EQ(kept.back()->request("GET", "/").status, 200);
  }
  ASSERT_TRUE(eventually([&] { return server.idleConnections() == 4; }));
  expectScrape(server, kBody);
  EXPECT_EQ(server.connectionsEvicted(), 2u);
  EXPECT_TRUE(kept[0]->waitClosedByServer(2s));
  // The others still serve.
  EXPECT_EQ(kept[3]->request("GET", "/metrics").body, kBody);
}

TEST(
    MetricsHttpServerLimits,
    BusyConnectionsAtTheCapRefuseOthersUntilTheyTimeOut) {
  Exposition exposition(kBody);
  auto options = testOptions();
  options.maxConnections = 4;
  options.requestTimeout = 1000ms;
  MetricsHttpServer server(options, exposition.render());

  std::vector<std::unique_ptr<HttpConnection>> slow;
  for (int i = 0; i < 4; ++i) {
    slow.push_back(std::make_unique<HttpConnection>(server.port()));
    ASSERT_TRUE(slow.back()->sendRaw(kHalfRequest));
  }
  ASSERT_TRUE(eventually([&] {
    return server.openConnections() == 4 && server.idleConnections() == 0;
  }));
  // Nothing idle to close: the newcomer is answered 503 and closed at once,
  // not left waiting.
  HttpConnection newcomer(server.port());
  HttpResponse refused = newcomer.readResponse(false, 2s);
  EXPECT_EQ(refused.status, 503) << refused.error;
  EXPECT_EQ(refused.header("Retry-After"), "1");
  EXPECT_EQ(refused.header("Connection"), "close");
  EXPECT_EQ(refused.body, "too many connections to the metrics endpoint\n");
  EXPECT_EQ(server.connectionsRefused(), 1u);
  EXPECT_EQ(server.openConnections(), 4u);

  // The busy ones are bounded by requestTimeout; then scrapes get in.
  for (auto& connection : slow) {
    EXPECT_TRUE(connection->waitClosedByServer(3s));
  }
  EXPECT_TRUE(eventually([&] { return server.openConnections() == 0; }, 2s));
  expectScrape(server, kBody);
  EXPECT_EQ(server.requestsRejected(), 4u);
}

// ---- close() ----

TEST(MetricsHttpServerHostile, CloseIsBoundedWhileHostileConnectionsAreOpen) {
  // The defaults: long timeouts, so that only close() ends the connections.
  MetricsHttpServerOptions options;
  options.name = "worker0";
  const std::string big(16 << 20, 'm');
  auto server =
      std::make_unique<MetricsHttpServer>(options, [&big]() { return big; });
  std::vector<std::unique_ptr<HttpConnection>> peers;
  for (int i = 0; i < 8; ++i) { // slowloris
    peers.push_back(std::make_unique<HttpConnection>(server->port()));
    ASSERT_TRUE(peers.back()->sendRaw(kHalfRequest));
  }
  for (int i = 0; i < 4; ++i) { // silent
    peers.push_back(std::make_unique<HttpConnection>(server->port()));
  }
  // One that never reads its response.
  peers.push_back(
      std::make_unique<HttpConnection>(server->port(), "127.0.0.1", 5s, 4096));
  ASSERT_TRUE(
      peers.back()->sendRaw("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_TRUE(eventually([&] { return server->openConnections() == 13; }));
  std::this_thread::sleep_for(100ms); // the big response is stuck by now

  auto start = Clock::now();
  server->close();
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ(server->openConnections(), 0u);
  for (auto& peer : peers) {
    EXPECT_TRUE(peer->waitClosedByServer(2s));
  }
  // Idempotent, and the destructor after it is quick too.
  start = Clock::now();
  server->close();
  server.reset();
  EXPECT_LT(Clock::now() - start, 500ms);
}

TEST(MetricsHttpServer, CloseIsSafeFromOtherThreadsAndFromRender) {
  Exposition exposition(kBody);
  {
    MetricsHttpServer server(testOptions(), exposition.render());
    const int port = server.port();
    std::vector<std::thread> closers;
    auto start = Clock::now();
    for (int i = 0; i < 4; ++i) {
      closers.emplace_back([&server]() { server.close(); });
    }
    for (auto& closer : closers) {
      closer.join();
    }
    EXPECT_LT(Clock::now() - start, 2s);
    // Closed: nothing listens any more.
    HttpConnection late(port);
    EXPECT_FALSE(late.connected() && late.request("GET", "/").status == 200);
  }

  MetricsHttpServer* self = nullptr;
  std::atomic<int> renders{0};
  auto server =
      std::make_unique<MetricsHttpServer>(testOptions(), [&self, &renders]() {
        ++renders;
        self->close(); // must not wait for its own thread
        return kBody;
      });
  self = server.get();
  HttpResponse response = httpGet(server->port(), "/metrics", "127.0.0.1", 3s);
  // The response may or may not have left before the close: either way the
  // scrape ends, and so does the server.
  EXPECT_TRUE(response.status == 200 || response.status == 0);
  EXPECT_EQ(renders.load(), 1);
  auto start = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - start, 2s);
}

// ---- Binding ----

TEST(MetricsHttpServer, BindingAnAddressInUseThrowsNamingIt) {
  Exposition exposition(kBody);
  MetricsHttpServer first(testOptions(), exposition.render());
  auto options = testOptions();
  options.port = first.port();
  std::string error =
      errorOf([&] { MetricsHttpServer second(options, exposition.render()); });
  expectContains(error, "127.0.0.1:" + std::to_string(first.port()));
  expectContains(error, "in use");
  expectContains(error, "worker0");
  // The first one still serves.
  expectScrape(first, kBody);
}

TEST(MetricsHttpServer, HostNamesResolveAndUnresolvableOnesThrow) {
  Exposition exposition(kBody);
  auto options = testOptions();
  options.host = "localhost";
  MetricsHttpServer server(options, exposition.render());
  const std::string address = server.address();
  const std::string port = std::to_string(server.port());
  ASSERT_TRUE(address == "127.0.0.1:" + port || address == "[::1]:" + port)
      << address;
  std::string literal = address[0] == '[' ? "::1" : "127.0.0.1";
  HttpResponse response = httpGet(server.port(), "/metrics", literal);
  EXPECT_EQ(response.status, 200) << response.error;
  EXPECT_EQ(response.body, kBody);

  options.host = "no-such-host.invalid";
  std::string error =
      errorOf([&] { MetricsHttpServer nowhere(options, exposition.render()); });
  expectContains(error, "no-such-host.invalid:0");
  expectContains(error, "cannot resolve");
}

TEST(MetricsHttpServer, OptionsOutOfRangeThrow) {
  Exposition exposition(kBody);
  auto options = testOptions();
  options.maxConnections = 0;
  expectContains(
      errorOf([&] { MetricsHttpServer s(options, exposition.render()); }),
      "maxConnections");
  options = testOptions();
  options.maxRequestHeaderBytes = 10;
  expectContains(
      errorOf([&] { MetricsHttpServer s(options, exposition.render()); }),
      "maxRequestHeaderBytes");
  options = testOptions();
  options.host = "";
  expectContains(
      errorOf([&] { MetricsHttpServer s(options, exposition.render()); }),
      "host");
  expectContains(
      errorOf([&] { MetricsHttpServer s(testOptions(), nullptr); }),
      "render");
}

} // namespace
} // namespace rpc
} // namespace torchrpc

// The renderings of rpc::Metrics (tier 1): Prometheus' text format as a
// scraper parses it, the text dump, and histogram quantiles.

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "torchrpc/rpc/metrics.h"

namespace torchrpc {
namespace {

using rpc::ErrorCode;
using rpc::LatencyHistogram;

LatencyHistogram histogramOf(const std::vector<double>& observationsUs) {
  const auto& bounds = LatencyHistogram::boundsUs();
  LatencyHistogram h;
  h.buckets.assign(bounds.size() + 1, 0);
  for (double us : observationsUs) {
    size_t i = 0;
    while (i < bounds.size() && us > bounds[i]) {
      ++i;
    }
    ++h.buckets[i];
    ++h.count;
    h.sumUs += us;
  }
  return h;
}

rpc::Metrics sample() {
  rpc::Metrics m;
  m.worker = "ps\"0\n";
  m.rank = 2;
  m.requestsSent = 7;
  rpc::CallMetrics call;
  call.function = "fetch";
  call.started = 3;
  call.succeeded = 2;
  call.failed = {{ErrorCode::kTimeout, 1}};
  call.latency = histogramOf({5, 30, 2e6});
  m.calls.push_back(call);
  rpc::ServedMetrics served;
  served.function = "aten::add.Tensor";
  served.received = 1;
  served.succeeded = 1;
  served.queueing = histogramOf({12});
  served.handling = histogramOf({80});
  m.served.push_back(served);
  rpc::PeerMetrics peer;
  peer.worker = "trainer1";
  peer.id = 1;
  peer.bytesSent = 123456789012ull;
  peer.lostCause = "connection reset";
  m.peers.push_back(peer);
  m.transport.name = "tcp";
  rpc::LayerMetrics layer;
  layer.layer = "my-layer";
  layer.values.push_back(
      {"odd name!", "Help text.", rpc::LayerValue::Kind::kCounter, 4});
  m.layers.push_back(layer);
  return m;
}

TEST(MetricsFormatTest, HistogramQuantilesInterpolateInsideBuckets) {
  LatencyHistogram empty;
  EXPECT_EQ(empty.quantileUs(0.5), 0);
  // Ten observations in (10, 25] µs: the median is halfway through it.
  LatencyHistogram h = histogramOf(std::vector<double>(10, 20));
  EXPECT_DOUBLE_EQ(h.quantileUs(0.5), 17.5);
  EXPECT_DOUBLE_EQ(h.quantileUs(1.0), 25);
  // Past the last bound, only its lower edge is known.
  LatencyHistogram slow = histogramOf({1e9});
  EXPECT_DOUBLE_EQ(slow.quantileUs(0.99), LatencyHistogram::boundsUs().back());
  EXPECT_EQ(LatencyHistogram::boundsUs().front(), 10);
  EXPECT_EQ(LatencyHistogram::boundsUs().back(), 6e7);
}

// Parses the exposition as a scraper would: every family announced by HELP
// and TYPE before its samples, every sample line well formed, histogram
// buckets cumulative and ending in +Inf equal to _count.
TEST(MetricsFormatTest, PrometheusExpositionParses) {
  std::string text = rpc::formatPrometheus(sample());
  std::istringstream lines(text);
  std::string line;
  const std::regex help("^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+$");
  const std::regex type(
      "^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram)$");
  const std::regex sampleLine(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*",?)*\})? (-?[0-9.e+-]+|\+Inf|NaN)$)");
  std::map<std::string, std::string> types;
  std::string announced;
  int samples = 0;
  while (std::getline(lines, line)) {
    std::smatch m;
    if (std::regex_match(line, m, help)) {
      announced = m[1];
      continue;
    }
    if (std::regex_match(line, m, type)) {
      EXPECT_EQ(m[1], announced) << line;
      EXPECT_EQ(types.count(m[1]), 0u) << "family announced twice: " << line;
      types[m[1]] = m[2];
      continue;
    }
    ASSERT_TRUE(std::regex_match(line, m, sampleLine)) << line;
    std::string name = m[1];
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      std::string s = suffix;
      if (family.size() > s.size() &&
          family.compare(family.size() - s.size(), s.size(), s) == 0 &&
          types.count(family.substr(0, family.size() - s.size())) &&
          types[family.substr(0, family.size() - s.size())] == "histogram") {
        family = family.substr(0, family.size() - s.size());
      }
    }
    EXPECT_EQ(family, announced) << "sample outside its family: " << line;
    ++samples;
  }
  EXPECT_GT(samples, 40);
  // Labels escaped: the worker's quote and newline.
  EXPECT_NE(
      text.find("torchrpc_requests_sent_total{worker=\"ps\\\"0\\n\"} 7\n"),
      std::string::npos)
      << text;
  // Cumulative buckets in seconds.
  EXPECT_NE(
      text.find("torchrpc_call_latency_seconds_bucket{worker=\"ps\\\"0\\n\","
                "function=\"fetch\",le=\"1e-05\"} 1\n"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find("torchrpc_call_latency_seconds_bucket{worker=\"ps\\\"0\\n\","
                "function=\"fetch\",le=\"5e-05\"} 2\n"),
      std::string::npos);
  EXPECT_NE(
      text.find("torchrpc_call_latency_seconds_bucket{worker=\"ps\\\"0\\n\","
                "function=\"fetch\",le=\"+Inf\"} 3\n"),
      std::string::npos);
  EXPECT_NE(
      text.find("torchrpc_calls_failed_total{worker=\"ps\\\"0\\n\","
                "function=\"fetch\",code=\"timeout\"} 1\n"),
      std::string::npos);
  EXPECT_NE(
      text.find("torchrpc_peer_bytes_sent_total{worker=\"ps\\\"0\\n\","
                "peer=\"trainer1\"} 123456789012\n"),
      std::string::npos);
  EXPECT_NE(
      text.find(
          "torchrpc_peer_lost{worker=\"ps\\\"0\\n\",peer=\"trainer1\"} 1\n"),
      std::string::npos);
  // A layer's names become metric names.
  EXPECT_NE(
      text.find("# TYPE torchrpc_my_layer_odd_name__total counter\n"),
      std::string::npos)
      << text;
}

TEST(MetricsFormatTest, TextDumpNamesEveryTable) {
  std::string text = rpc::formatMetricsText(sample());
  for (const char* expected :
       {"calls made:",
        "fetch",
        "timeout 1",
        "requests served:",
        "aten::add.Tensor",
        "peers:",
        "lost: connection reset",
        "transport tcp:",
        "my-layer:",
        "odd name!"}) {
    EXPECT_NE(text.find(expected), std::string::npos)
        << "'" << expected << "' not in:\n"
        << text;
  }
}

} // namespace
} // namespace torchrpc

#include "torchrpc/rpc/detail/slurm_hostlist.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdlib>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

// Slurm caps a job's hosts far below this; the cap keeps a hostile or
// mistyped range ("[0-999999999]") from exhausting memory.
constexpr size_t kMaxHosts = 1 << 20;

bool allDigits(const std::string& text) {
  if (text.empty()) {
    return false;
  }
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) {
      return false;
    }
  }
  return true;
}

// Splits at commas outside brackets.
std::vector<std::string> splitTopLevel(const std::string& text) {
  std::vector<std::string> parts;
  std::string current;
  int depth = 0;
  for (char c : text) {
    if (c == '[') {
      ++depth;
    } else if (c == ']') {
      --depth;
    }
    if (c == ',' && depth == 0) {
      parts.push_back(current);
      current.clear();
    } else {
      current.push_back(c);
    }
  }
  parts.push_back(current);
  return parts;
}

// The values one bracket stands for, as text with their padding.
std::vector<std::string> expandBracket(
    const std::string& body,
    const std::string& hostlist) {
  std::vector<std::string> values;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    std::string item = body.substr(
        start,
        comma == std::string::npos ? std::string::npos : comma - start);
    auto dash = item.find('-');
    std::string low = dash == std::string::npos ? item : item.substr(0, dash);
    std::string high = dash == std::string::npos ? item : item.substr(dash + 1);
    TORCH_CHECK(
        allDigits(low) && allDigits(high),
        "malformed Slurm host list '",
        hostlist,
        "': '[",
        body,
        "]' must hold numbers and ranges like 01-03");
    uint64_t from = std::strtoull(low.c_str(), nullptr, 10);
    uint64_t to = std::strtoull(high.c_str(), nullptr, 10);
    TORCH_CHECK(
        from <= to && to - from < kMaxHosts,
        "malformed Slurm host list '",
        hostlist,
        "': range ",
        item,
        " is reversed or too large");
    for (uint64_t value = from; value <= to; ++value) {
      std::string digits = std::to_string(value);
      if (digits.size() < low.size()) {
        digits.insert(0, low.size() - digits.size(), '0');
      }
      values.push_back(std::move(digits));
      TORCH_CHECK(
          values.size() <= kMaxHosts,
          "Slurm host list '",
          hostlist,
          "' names too many hosts");
    }
    if (comma == std::string::npos) {
      break;
    }
    start = comma + 1;
  }
  return values;
}

} // namespace

std::vector<std::string> expandSlurmHostlist(const std::string& hostlist) {
  std::vector<std::string> hosts;
  for (const std::string& part : splitTopLevel(hostlist)) {
    TORCH_CHECK(
        !part.empty(),
        "malformed Slurm host list '",
        hostlist,
        "': empty host name");
    // Names built so far, multiplied out bracket by bracket.
    std::vector<std::string> names = {""};
    size_t pos = 0;
    while (pos < part.size()) {
      size_t open = part.find('[', pos);
      size_t close = part.find(']', pos);
      if (open == std::string::npos) {
        TORCH_CHECK(
            close == std::string::npos,
            "malformed Slurm host list '",
            hostlist,
            "': ']' without '['");
        for (auto& name : names) {
          name += part.substr(pos);
        }
        break;
      }
      TORCH_CHECK(
          close != std::string::npos && close > open,
          "malformed Slurm host list '",
          hostlist,
          "': unclosed '['");
      std::string literal = part.substr(pos, open - pos);
      std::string body = part.substr(open + 1, close - open - 1);
      TORCH_CHECK(
          body.find('[') == std::string::npos,
          "malformed Slurm host list '",
          hostlist,
          "': nested '['");
      auto values = expandBracket(body, hostlist);
      std::vector<std::string> next;
      for (const auto& name : names) {
        for (const auto& value : values) {
          next.push_back(name + literal + value);
        }
      }
      TORCH_CHECK(
          next.size() <= kMaxHosts,
          "Slurm host list '",
          hostlist,
          "' names too many hosts");
      names = std::move(next);
      pos = close + 1;
    }
    hosts.insert(hosts.end(), names.begin(), names.end());
  }
  return hosts;
}

std::vector<int64_t> expandSlurmTasksPerNode(const std::string& tasksPerNode) {
  std::vector<int64_t> counts;
  for (const std::string& part : splitTopLevel(tasksPerNode)) {
    std::string count = part;
    std::string repeat = "1";
    auto paren = part.find("(x");
    if (paren != std::string::npos) {
      TORCH_CHECK(
          part.back() == ')',
          "malformed Slurm tasks per node '",
          tasksPerNode,
          "'");
      count = part.substr(0, paren);
      repeat = part.substr(paren + 2, part.size() - paren - 3);
    }
    TORCH_CHECK(
        allDigits(count) && allDigits(repeat) && repeat.size() < 8,
        "malformed Slurm tasks per node '",
        tasksPerNode,
        "': expected counts like 2(x3),1");
    int64_t value = std::strtoll(count.c_str(), nullptr, 10);
    int64_t times = std::strtoll(repeat.c_str(), nullptr, 10);
    TORCH_CHECK(
        counts.size() + static_cast<size_t>(times) <= kMaxHosts,
        "Slurm tasks per node '",
        tasksPerNode,
        "' names too many nodes");
    counts.insert(counts.end(), static_cast<size_t>(times), value);
  }
  return counts;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc

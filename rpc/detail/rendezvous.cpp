#include "torchrpc/rpc/detail/rendezvous.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <sstream>
#include <unordered_map>

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

std::string requireEnv(const char* name, Launcher launcher) {
  const char* value = std::getenv(name);
  TORCH_CHECK(
      value != nullptr && *value != '\0',
      "init method env:// needs the environment variable ",
      name,
      launcher == Launcher::kNone
          ? std::string()
          : std::string(" (launcher: ") + launcherName(launcher) +
              ", which does not set it for a job on several nodes)");
  return value;
}

uint16_t parsePort(const std::string& text, const std::string& what) {
  char* end = nullptr;
  long port = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK(
      end != text.c_str() && *end == '\0' && port >= 0 && port <= 65535,
      what,
      " is not a valid port: '",
      text,
      "'");
  return static_cast<uint16_t>(port);
}

c10::intrusive_ptr<c10d::Store> openTcpStore(
    const std::string& host,
    uint16_t port,
    bool isServer,
    const Options& options) {
  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = port;
  storeOptions.isServer = isServer;
  storeOptions.numWorkers = c10::nullopt;
  storeOptions.waitWorkers = false;
  storeOptions.timeout = options.rendezvousTimeout;
  return c10::make_intrusive<c10d::TCPStore>(host, storeOptions);
}

std::vector<uint8_t> bytesOf(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

// Device maps travel as lines "destination<TAB>from<TAB>to".
std::string encodeDeviceMaps(const std::map<std::string, DeviceMap>& maps) {
  std::ostringstream out;
  for (const auto& destination : maps) {
    for (const auto& pair : destination.second) {
      out << destination.first << '\t' << pair.first.str() << '\t'
          << pair.second.str() << '\n';
    }
  }
  return out.str();
}

DeviceMap decodeDeviceMapTowards(
    const std::string& encoded,
    const std::string& destination) {
  DeviceMap map;
  std::istringstream in(encoded);
  std::string line;
  while (std::getline(in, line)) {
    auto first = line.find('\t');
    auto second = line.find('\t', first + 1);
    TORCH_CHECK(
        first != std::string::npos && second != std::string::npos,
        "corrupt device map in the store");
    if (line.substr(0, first) != destination) {
      continue;
    }
    map.emplace(
        c10::Device(line.substr(first + 1, second - first - 1)),
        c10::Device(line.substr(second + 1)));
  }
  return map;
}

} // namespace

void validateWorkerName(const std::string& name) {
  TORCH_CHECK(
      !name.empty() && name.size() <= 128,
      "a worker name must have 1 to 128 characters, got '",
      name,
      "'");
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
        (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.' || c == ':';
    TORCH_CHECK(
        ok,
        "worker name '",
        name,
        "' may only contain letters, digits and _ - . :");
  }
}

c10::intrusive_ptr<c10d::Store> openStore(const Options& options) {
  if (options.store) {
    return options.store;
  }
  const std::string& method = options.initMethod;
  if (method == "env://") {
    // What the launcher said (see Note [Launch environment]) comes first.
    const LaunchEnvironment& launch = options.launch;
    std::string host = !launch.masterAddr.empty()
        ? launch.masterAddr
        : requireEnv("MASTER_ADDR", launch.launcher);
    uint16_t port = launch.masterPort != 0
        ? static_cast<uint16_t>(launch.masterPort)
        : parsePort(requireEnv("MASTER_PORT", launch.launcher), "MASTER_PORT");
    // Under torchrun's elastic agent the store already exists and rank 0
    // must join it as a client.
    const char* agentStore = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    bool useAgentStore =
        agentStore != nullptr && std::string(agentStore) == "True";
    return openTcpStore(
        host,
        port,
        options.rank == 0 && !useAgentStore,
        options);
  }
  const std::string tcp = "tcp://";
  if (method.compare(0, tcp.size(), tcp) == 0) {
    std::string rest = method.substr(tcp.size());
    auto colon = rest.rfind(':');
    TORCH_CHECK(
        colon != std::string::npos && colon > 0,
        "init method must be tcp://host:port, got '",
        method,
        "'");
    std::string host = rest.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    uint16_t port = parsePort(rest.substr(colon + 1), "init method port");
    return openTcpStore(host, port, options.rank == 0, options);
  }
  const std::string file = "file://";
  if (method.compare(0, file.size(), file) == 0) {
    std::string path = method.substr(file.size());
    TORCH_CHECK(!path.empty(), "init method file:// needs a path");
    auto store = c10::make_intrusive<c10d::FileStore>(
        path,
        static_cast<int>(options.worldSize));
    store->setTimeout(options.rendezvousTimeout);
    return store;
  }
  TORCH_CHECK(
      false,
      "unknown init method '",
      method,
      "' (expected env://, tcp://host:port or file://path)");
}

Rendezvous::Rendezvous(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t worldSize,
    std::chrono::milliseconds timeout,
    int64_t restartCount)
    : store_(std::move(store)),
      rank_(rank),
      worldSize_(worldSize),
      timeout_(timeout) {
  // See Note [Rendezvous keys]. Within a restart generation every start of a
  // rank takes the next start number, so a reused store never shows this
  // start the keys of an earlier one; ranks of one generation start the
  // same number of times, so they agree on it.
  // Generation 0 keeps the layout from before restarts were numbered, which
  // tests and tools that inspect a store rely on.
  std::string restart = restartCount == 0
      ? std::string("torchrpc")
      : "torchrpc/restart" + std::to_string(restartCount);
  int64_t generation =
      store_->add(restart + "/generation/" + std::to_string(rank_), 1);
  prefix_ = restart + "/" + std::to_string(generation) + "/";
}

std::string Rendezvous::key(const std::string& suffix) const {
  return prefix_ + suffix;
}

bool Rendezvous::waitForKeys(
    const std::vector<std::string>& keys,
    Clock::time_point deadline,
    std::vector<int64_t>* missingRanks) {
  auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - Clock::now());
  try {
    store_->wait(keys, std::max(remaining, std::chrono::milliseconds(1)));
    return true;
  } catch (const std::exception&) {
  }
  if (missingRanks != nullptr) {
    for (size_t rank = 0; rank < keys.size(); ++rank) {
      try {
        if (!store_->check({keys[rank]})) {
          missingRanks->push_back(static_cast<int64_t>(rank));
        }
      } catch (const std::exception&) {
        missingRanks->push_back(static_cast<int64_t>(rank));
      }
    }
  }
  return false;
}

JobLayout Rendezvous::join(
    const std::string& name,
    const std::string& address,
    const std::map<std::string, DeviceMap>& deviceMaps) {
  validateWorkerName(name);
  store_->set(key("name/" + std::to_string(rank_)), bytesOf(name));
  store_->set(key("address/" + std::to_string(rank_)), bytesOf(address));
  store_->set(
      key("devicemaps/" + std::to_string(rank_)),
      bytesOf(encodeDeviceMaps(deviceMaps)));
  // Written last: its presence says the others are there.
  std::vector<std::string> readyKeys;
  for (int64_t rank = 0; rank < worldSize_; ++rank) {
    readyKeys.push_back(key("ready/" + std::to_string(rank)));
  }
  store_->set(readyKeys[rank_], bytesOf("1"));

  std::vector<int64_t> missing;
  if (!waitForKeys(readyKeys, Clock::now() + timeout_, &missing)) {
    std::ostringstream ranks;
    for (size_t i = 0; i < missing.size(); ++i) {
      ranks << (i ? ", " : "") << missing[i];
    }
    TORCH_CHECK(
        false,
        "rendezvous timed out after ",
        timeout_.count(),
        " ms: rank(s) ",
        ranks.str(),
        " of ",
        worldSize_,
        " never arrived");
  }

  JobLayout layout;
  std::unordered_map<std::string, int64_t> seen;
  for (int64_t rank = 0; rank < worldSize_; ++rank) {
    auto nameBytes = store_->get(key("name/" + std::to_string(rank)));
    auto addressBytes = store_->get(key("address/" + std::to_string(rank)));
    auto mapsBytes = store_->get(key("devicemaps/" + std::to_string(rank)));
    std::string workerName(nameBytes.begin(), nameBytes.end());
    auto inserted = seen.emplace(workerName, rank);
    TORCH_CHECK(
        inserted.second,
        "worker name '",
        workerName,
        "' is used by ranks ",
        inserted.first->second,
        " and ",
        rank,
        "; names must be unique");
    layout.workers.push_back(WorkerInfo{workerName, rank});
    layout.addresses.emplace_back(addressBytes.begin(), addressBytes.end());
    if (rank != rank_) {
      auto map = decodeDeviceMapTowards(
          std::string(mapsBytes.begin(), mapsBytes.end()),
          name);
      if (!map.empty()) {
        layout.peerMapsTowardsUs.emplace(rank, std::move(map));
      }
    }
  }
  return layout;
}

bool Rendezvous::barrier(const std::string& phase, Clock::time_point deadline) {
  std::vector<std::string> keys;
  for (int64_t rank = 0; rank < worldSize_; ++rank) {
    keys.push_back(key(phase + "/" + std::to_string(rank)));
  }
  try {
    store_->set(keys[rank_], bytesOf("1"));
  } catch (const std::exception&) {
    return false;
  }
  return waitForKeys(keys, deadline, nullptr);
}

bool Rendezvous::leave(Clock::time_point deadline) {
  if (rank_ != 0) {
    try {
      store_->set(key("left/" + std::to_string(rank_)), bytesOf("1"));
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }
  std::vector<std::string> keys;
  for (int64_t rank = 1; rank < worldSize_; ++rank) {
    keys.push_back(key("left/" + std::to_string(rank)));
  }
  return keys.empty() || waitForKeys(keys, deadline, nullptr);
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc

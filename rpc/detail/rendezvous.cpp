#include "torchrpc/rpc/detail/rendezvous.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <unordered_map>

#include "torchrpc/rpc/detail/store_client.h"
#include "torchrpc/rpc/log_level.h"

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

// torchrun's agent store is a c10d TCPStore that torchrun hosts: workers
// join it as clients.
c10::intrusive_ptr<c10d::Store> openAgentStore(
    const std::string& host,
    uint16_t port,
    const Options& options) {
  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = port;
  storeOptions.isServer = false;
  storeOptions.numWorkers = c10::nullopt;
  storeOptions.waitWorkers = false;
  storeOptions.timeout = options.rendezvousTimeout;
  return c10::make_intrusive<c10d::TCPStore>(host, storeOptions);
}

// `host` as a numeric IP ("localhost" -> "127.0.0.1"); IPv4 first.
std::string numericAddress(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  TORCH_CHECK(
      rc == 0 && found != nullptr,
      "cannot resolve the rendezvous host '",
      host,
      "': ",
      rc == 0 ? "no address" : gai_strerror(rc));
  std::string best;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {0};
    if (a->ai_family == AF_INET) {
      ::inet_ntop(
          AF_INET,
          &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr,
          text,
          sizeof(text));
      best = text;
      break;
    }
    if (a->ai_family == AF_INET6 && best.empty()) {
      ::inet_ntop(
          AF_INET6,
          &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr,
          text,
          sizeof(text));
      best = text;
    }
  }
  ::freeaddrinfo(found);
  TORCH_CHECK(!best.empty(), "the rendezvous host '", host, "' has no IP");
  return best;
}

std::string withPort(const std::string& ip, uint16_t port) {
  bool ipv6 = ip.find(':') != std::string::npos;
  return (ipv6 ? "[" + ip + "]" : ip) + ":" + std::to_string(port);
}

// torchrpc's own store (Note [Rendezvous store]) at host:port: rank 0
// serves it and reads it in process, the others connect.
OpenedStore openOwnStore(
    const std::string& host,
    uint16_t port,
    const Options& options) {
  std::string ip = numericAddress(host);
  OpenedStore opened;
  if (options.rank == 0) {
    StoreServerOptions serverOptions;
    serverOptions.listenAddress = withPort(
        options.storeListenAddress.empty()
            ? ip
            : numericAddress(options.storeListenAddress),
        port);
    serverOptions.sharedSecret = options.sharedSecret;
    opened.server = std::make_unique<StoreServer>(std::move(serverOptions));
    opened.store = localStore(
        opened.server->state(),
        "the rendezvous store this worker hosts at " +
            opened.server->address());
    return opened;
  }
  StoreClientOptions clientOptions;
  clientOptions.address = "tcp://" + withPort(ip, port);
  clientOptions.sharedSecret = options.sharedSecret;
  clientOptions.timeout = options.rendezvousTimeout;
  opened.store = connectToStore(std::move(clientOptions));
  return opened;
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

OpenedStore openStore(const Options& options) {
  if (options.store) {
    OpenedStore opened;
    opened.store = wrapC10dStore(options.store, "the store given in Options");
    return opened;
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
    // Under torchrun's elastic agent the store already exists (torchrun's
    // own TCPStore) and every rank joins it as a client.
    const char* agentStore = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agentStore != nullptr && std::string(agentStore) == "True") {
      OpenedStore opened;
      opened.store = wrapC10dStore(
          openAgentStore(host, port, options),
          "torchrun's agent store at " + host + ":" + std::to_string(port));
      return opened;
    }
    return openOwnStore(host, port, options);
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
    return openOwnStore(host, port, options);
  }
  const std::string file = "file://";
  if (method.compare(0, file.size(), file) == 0) {
    std::string path = method.substr(file.size());
    TORCH_CHECK(!path.empty(), "init method file:// needs a path");
    auto store = c10::make_intrusive<c10d::FileStore>(
        path,
        static_cast<int>(options.worldSize));
    store->setTimeout(options.rendezvousTimeout);
    OpenedStore opened;
    opened.store = wrapC10dStore(store, "the file store " + path);
    return opened;
  }
  TORCH_CHECK(
      false,
      "unknown init method '",
      method,
      "' (expected env://, tcp://host:port or file://path)");
}

Rendezvous::Rendezvous(
    std::shared_ptr<RendezvousStore> store,
    int64_t rank,
    int64_t worldSize,
    std::chrono::milliseconds timeout,
    int64_t restartCount,
    std::chrono::milliseconds progressInterval)
    : store_(std::move(store)),
      rank_(rank),
      worldSize_(worldSize),
      timeout_(timeout),
      progressInterval_(progressInterval) {
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
    Clock::time_point deadline) {
  auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - Clock::now());
  try {
    return store_->wait(
        keys,
        std::max(remaining, std::chrono::milliseconds(1)));
  } catch (const std::exception&) {
    return false;
  }
}

std::vector<int64_t> Rendezvous::missingRanks(
    const std::vector<std::string>& keys) {
  std::vector<int64_t> missing;
  for (size_t rank = 0; rank < keys.size(); ++rank) {
    if (!store_->check({keys[rank]})) {
      missing.push_back(static_cast<int64_t>(rank));
    }
  }
  return missing;
}

JobLayout Rendezvous::join(
    const std::string& name,
    const std::string& address,
    const std::map<std::string, DeviceMap>& deviceMaps) {
  validateWorkerName(name);
  store_->set(key("name/" + std::to_string(rank_)), name);
  store_->set(key("address/" + std::to_string(rank_)), address);
  store_->set(
      key("devicemaps/" + std::to_string(rank_)),
      encodeDeviceMaps(deviceMaps));
  // Written last: its presence says the others are there.
  std::vector<std::string> readyKeys;
  for (int64_t rank = 0; rank < worldSize_; ++rank) {
    readyKeys.push_back(key("ready/" + std::to_string(rank)));
  }
  store_->set(readyKeys[rank_], "1");

  // In slices, to say who is missing meanwhile. Store errors propagate:
  // they are the store's, not ranks that did not arrive.
  const auto start = Clock::now();
  const auto deadline = start + timeout_;
  auto ranksText = [](const std::vector<int64_t>& ranks) {
    std::ostringstream text;
    for (size_t i = 0; i < ranks.size(); ++i) {
      text << (i ? ", " : "") << ranks[i];
    }
    return text.str();
  };
  std::vector<int64_t> missing;
  while (true) {
    auto sliceEnd = std::min(deadline, Clock::now() + progressInterval_);
    auto slice = std::chrono::duration_cast<std::chrono::milliseconds>(
        sliceEnd - Clock::now());
    try {
      if (store_->wait(
              readyKeys,
              std::max(slice, std::chrono::milliseconds(1)))) {
        break;
      }
      missing = missingRanks(readyKeys);
    } catch (const c10::Error& e) {
      TORCH_CHECK(
          false,
          "rendezvous of worker '",
          name,
          "' (rank ",
          rank_,
          ") failed: ",
          e.what_without_backtrace(),
          missing.empty()
              ? std::string()
              : " (rank(s) " + ranksText(missing) + " had not arrived yet)");
    }
    if (missing.empty()) {
      break;
    }
    auto seconds = [](Clock::duration d) {
      std::ostringstream text;
      text.precision(1);
      text << std::fixed << std::chrono::duration<double>(d).count() << " s";
      return text.str();
    };
    std::string waited = seconds(Clock::now() - start);
    TORCH_CHECK(
        Clock::now() < deadline,
        "rendezvous timed out after ",
        timeout_.count(),
        " ms: rank(s) ",
        ranksText(missing),
        " of ",
        worldSize_,
        " never arrived at ",
        store_->describe(),
        " (TORCHRPC_RENDEZVOUS_TIMEOUT_MS sets the time limit)");
    TORCHRPC_LOG(kWarning) << "worker '" << name << "' (rank " << rank_
                           << "): waiting for rank(s) " << ranksText(missing)
                           << " of " << worldSize_ << " at "
                           << store_->describe() << " (" << waited << " of "
                           << seconds(timeout_) << ")";
  }

  JobLayout layout;
  std::unordered_map<std::string, int64_t> seen;
  for (int64_t rank = 0; rank < worldSize_; ++rank) {
    std::string workerName = store_->get(key("name/" + std::to_string(rank)));
    std::string workerAddress =
        store_->get(key("address/" + std::to_string(rank)));
    std::string maps = store_->get(key("devicemaps/" + std::to_string(rank)));
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
    layout.addresses.push_back(std::move(workerAddress));
    if (rank != rank_) {
      auto map = decodeDeviceMapTowards(maps, name);
      if (!map.empty()) {
        layout.peerMapsTowardsUs.emplace(rank, std::move(map));
      }
    }
  }
  return layout;
}

bool Rendezvous::barrier(
    const std::string& phase,
    Clock::time_point deadline,
    const IsLost& isLost) {
  std::vector<std::string> keys;
  for (int64_t rank = 0; rank < worldSize_; ++rank) {
    keys.push_back(key(phase + "/" + std::to_string(rank)));
  }
  try {
    if (!store_->setBefore(keys[rank_], "1", deadline)) {
      return false; // the store has gone: the others cannot meet here
    }
  } catch (const std::exception&) {
    return false;
  }
  return waitForLiveRanks(keys, 0, deadline, isLost);
}

bool Rendezvous::arrived(const std::string& phase, int64_t rank) {
  return store_->check({key(phase + "/" + std::to_string(rank))});
}

bool Rendezvous::leave(Clock::time_point deadline, const IsLost& isLost) {
  if (rank_ != 0) {
    // Rank 0 closes the store once every "left" key is there, possibly
    // before this set's reply is on its way: a store gone by now has seen
    // the key or given up on it, and either way rank 0 needs nothing more.
    try {
      store_->setBefore(key("left/" + std::to_string(rank_)), "1", deadline);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }
  std::vector<std::string> keys;
  for (int64_t rank = 1; rank < worldSize_; ++rank) {
    keys.push_back(key("left/" + std::to_string(rank)));
  }
  return keys.empty() || waitForLiveRanks(keys, 1, deadline, isLost);
}

bool Rendezvous::waitForLiveRanks(
    const std::vector<std::string>& keys,
    int64_t firstRank,
    Clock::time_point deadline,
    const IsLost& isLost) {
  if (!isLost) {
    return waitForKeys(keys, deadline);
  }
  // Waits in slices; after each, only for the ranks still missing that are
  // not lost (asking probes them, so only those are asked).
  constexpr auto kSlice = std::chrono::milliseconds(250);
  std::vector<std::string> live = keys;
  while (true) {
    if (live.empty() ||
        waitForKeys(live, std::min(deadline, Clock::now() + kSlice))) {
      return true;
    }
    if (Clock::now() >= deadline) {
      return false;
    }
    live.clear();
    for (size_t i = 0; i < keys.size(); ++i) {
      int64_t rank = firstRank + static_cast<int64_t>(i);
      try {
        if (rank != rank_ && !store_->check({keys[i]}) && !isLost(rank)) {
          live.push_back(keys[i]);
        }
      } catch (const std::exception&) {
        return false; // the store is gone
      }
    }
  }
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc

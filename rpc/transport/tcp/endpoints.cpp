#include "torchrpc/rpc/transport/tcp/endpoints.h"

#include <boost/asio/ip/address.hpp>
#include <boost/asio/local/stream_protocol.hpp>

#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "torchrpc/rpc/transport/tcp/handshake.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace asio = boost::asio;
namespace ip = boost::asio::ip;

namespace {

constexpr char kLocalSuffix[] = "?local=";
constexpr char kAbstractPrefix[] = "torchrpc.";
constexpr size_t kNameHexDigits = 32;
// A boot id is a UUID (36 characters); an inode fits 20 digits.
constexpr char kBootIdChars[] = "0123456789abcdef-";
constexpr size_t kMaxBootIdChars = 64;
constexpr size_t kMaxInodeDigits = 20;

bool allOf(const std::string& text, const char* allowed) {
  return text.find_first_not_of(allowed) == std::string::npos;
}

} // namespace

bool parseHostPort(
    const std::string& text,
    bool portRequired,
    ip::tcp::endpoint& endpoint) {
  std::string host = text;
  std::string port;
  if (!text.empty() && text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos) {
      return false;
    }
    host = text.substr(1, close - 1);
    std::string rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') {
        return false;
      }
      port = rest.substr(1);
    }
  } else if (std::count(text.begin(), text.end(), ':') == 1) {
    size_t colon = text.find(':');
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (port.empty() && portRequired) {
    return false;
  }
  unsigned long portNumber = 0;
  if (!port.empty()) {
    if (port.size() > 5 || !allOf(port, "0123456789")) {
      return false;
    }
    portNumber = std::stoul(port);
    if (portNumber > 65535) {
      return false;
    }
  }
  boost::system::error_code ec;
  ip::address address = ip::make_address(host, ec);
  if (ec) {
    return false;
  }
  endpoint = ip::tcp::endpoint(address, static_cast<uint16_t>(portNumber));
  return true;
}

std::string endpointString(const ip::tcp::endpoint& endpoint) {
  const ip::address address = endpoint.address();
  std::string host = address.to_string();
  if (address.is_v6()) {
    host = "[" + host + "]";
  }
  return host + ":" + std::to_string(endpoint.port());
}

std::string localNetwork(const HostIdentity& host) {
  if (host.bootId.empty() || host.bootId.size() > kMaxBootIdChars ||
      !allOf(host.bootId, kBootIdChars) || host.networkNamespace == 0) {
    return "";
  }
  return host.bootId + "." + std::to_string(host.networkNamespace);
}

std::string newLocalSocketName() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name;
  for (unsigned char byte : randomBytes(kNameHexDigits / 2)) {
    name += kHex[byte >> 4];
    name += kHex[byte & 15];
  }
  return name;
}

Endpoint localSocketEndpoint(const std::string& name) {
  // A leading NUL puts the name in the abstract namespace.
  std::string path(1, '\0');
  path += kAbstractPrefix;
  path += name;
  return Endpoint(asio::local::stream_protocol::endpoint(path));
}

std::string withLocalSocket(
    const std::string& tcpAddress,
    const std::string& network,
    const std::string& name) {
  return tcpAddress + kLocalSuffix + network + "." + name;
}

bool splitAddress(const std::string& address, SplitAddress& out) {
  out = SplitAddress{};
  const size_t suffix = address.find(kLocalSuffix);
  if (suffix == std::string::npos) {
    out.tcp = address;
    return true;
  }
  out.tcp = address.substr(0, suffix);
  const std::string rest = address.substr(suffix + sizeof(kLocalSuffix) - 1);
  // <boot id>.<inode>.<name>: the boot id has no dot.
  const size_t firstDot = rest.find('.');
  const size_t lastDot = rest.rfind('.');
  if (firstDot == std::string::npos || firstDot == lastDot) {
    return false;
  }
  const std::string bootId = rest.substr(0, firstDot);
  const std::string inode = rest.substr(firstDot + 1, lastDot - firstDot - 1);
  const std::string name = rest.substr(lastDot + 1);
  if (bootId.empty() || bootId.size() > kMaxBootIdChars ||
      !allOf(bootId, kBootIdChars) || inode.empty() ||
      inode.size() > kMaxInodeDigits || !allOf(inode, "0123456789") ||
      name.size() != kNameHexDigits || !allOf(name, "0123456789abcdef")) {
    return false;
  }
  out.network = bootId + "." + inode;
  out.name = name;
  return true;
}

bool isLocal(const Endpoint& endpoint) {
  return endpoint.protocol().family() == AF_UNIX;
}

std::optional<ip::tcp::endpoint> ipEndpointOf(const Endpoint& endpoint) {
  const int family = endpoint.protocol().family();
  ip::tcp::endpoint out;
  if ((family != AF_INET && family != AF_INET6) ||
      endpoint.size() > out.capacity()) {
    return std::nullopt;
  }
  std::memcpy(out.data(), endpoint.data(), endpoint.size());
  out.resize(endpoint.size());
  return out;
}

std::string describeEndpoint(const Endpoint& endpoint, int fd) {
  if (isLocal(endpoint)) {
    struct ucred credentials {};
    socklen_t length = sizeof(credentials);
    if (fd >= 0 &&
        ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0 &&
        credentials.pid > 0) {
      return "local peer (pid " + std::to_string(credentials.pid) + ")";
    }
    return "local peer";
  }
  const auto ip = ipEndpointOf(endpoint);
  return ip ? endpointString(*ip) : "peer";
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc

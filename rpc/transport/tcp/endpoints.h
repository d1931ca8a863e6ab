#pragma once

// What the TCP transport listens on and connects to: TCP endpoints, the
// Unix-domain socket a listener opens beside its TCP port for peers in its
// own network namespace, and the address that names both. No sockets are
// opened here and no threads run: tcp_transport.cpp listens, connection.cpp
// connects.

#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <optional>
#include <string>

#include "torchrpc/rpc/transport/tcp/same_host.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [Local sockets for peers on this host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Why: over loopback every message runs the whole TCP stack twice (the
// sender's sendmsg also runs the receiver's TCP input path). A busy-polled
// ping-pong of 128 bytes takes about 9 µs over TCP loopback on the
// project's VM and about 4.5 µs over a Unix-domain stream socket; a
// blocking one 21 against 13 µs. The frames, the handshake (with its
// secret), the caps, heartbeats and the same-host tensor paths are those
// of TCP: only the socket under them differs.
//
// How: with TcpTransportOptions::localSockets, listen() also binds a Unix
// stream socket in Linux's abstract namespace, "\0torchrpc." followed by
// 32 random hex digits (no file to clean up; it goes with its last
// descriptor), and address() names it after the TCP address:
//
//   tcp://127.0.0.1:4567?local=<boot id>.<network namespace inode>.<name>
//
// An abstract name is visible only inside its network namespace, so the
// boot id and the namespace's inode say where it is reachable. connect()
// tries the local socket first when both match its own and localSockets is
// on, then TCP if the local connect fails; any other address connects over
// TCP alone, and a peer that knows nothing of the suffix can still use the
// TCP part.
//
// Safety: the name is random and published only after it is bound, so a
// process that guesses names cannot take it first; a peer only tries a
// name that the address it was given (from the job's rendezvous) carries,
// and only within the namespace the address says it lives in. A local
// socket accepts anyone in the namespace, as the TCP port accepts anyone
// who can reach it; the handshake, its optional secret and every cap on
// frames apply alike (the listener's handshake limit counts both
// acceptors' connections together).

using Endpoint = boost::asio::generic::stream_protocol::endpoint;

// Parses "ip", "ip:port", "[ip6]" or "[ip6]:port". False if it does not.
bool parseHostPort(
    const std::string& text,
    bool portRequired,
    boost::asio::ip::tcp::endpoint& endpoint);

// "ip:port", IPv6 in brackets.
std::string endpointString(const boost::asio::ip::tcp::endpoint& endpoint);

// Where the abstract sockets of a process with identity `host` are
// reachable: "<boot id>.<network namespace inode>"; empty when the identity
// does not say (then no local socket is offered or tried).
std::string localNetwork(const HostIdentity& host);

// A new random name (32 hex digits) and its abstract endpoint.
std::string newLocalSocketName();
Endpoint localSocketEndpoint(const std::string& name);

// "<tcpAddress>?local=<network>.<name>".
std::string withLocalSocket(
    const std::string& tcpAddress,
    const std::string& network,
    const std::string& name);

// An address split into its TCP part and its local socket, if it names one.
struct SplitAddress {
  std::string tcp;
  // Set when the suffix is well formed.
  std::optional<std::string> network;
  std::optional<std::string> name;
};
// False for a suffix that is not "?local=<network>.<name>" with a boot id
// of hex digits and dashes, a decimal inode and a 32-hex-digit name.
bool splitAddress(const std::string& address, SplitAddress& out);

// "ip:port" (IPv6 in brackets) for an IP endpoint; "local peer (pid N)"
// for a Unix socket whose peer the kernel names (`fd` connected), else
// "local peer".
std::string describeEndpoint(const Endpoint& endpoint, int fd);

// Whether the endpoint is a Unix-domain one.
bool isLocal(const Endpoint& endpoint);

// The IP endpoint a generic one holds; nullopt for any other family.
std::optional<boost::asio::ip::tcp::endpoint> ipEndpointOf(
    const Endpoint& endpoint);

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc

// Writes the fuzzers' seed corpora: valid inputs of each target, built with
// the encoders the senders use, so that the fuzzers start past the first
// checks. Run by `tools/fuzz.sh --write-corpus`; the output is committed in
// tests/fuzz/corpus/<target>/.
//
//   torchrpc_fuzz_corpus <corpus directory>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <sys/stat.h>
#include <vector>

#include "proto/rpc/envelope.pb.h"
#include "proto/rpc/store.pb.h"
#include "tests/fuzz/fuzz_message.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/handshake.h"
#include "torchrpc/rpc/wire/envelope.h"

using namespace torchrpc::rpc;
using namespace torchrpc::rpc::detail::tcp;

namespace {

std::string root;

void write(
    const std::string& target,
    const std::string& name,
    const std::string& bytes) {
  const std::string dir = root + "/" + target;
  ::mkdir(root.c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out.good(), "cannot write ", dir, "/", name);
}

// Selector 0: a worker's default limits; 2: the rendezvous store's.
void frameHeaders() {
  const std::string t = "frame_header_fuzzer";
  write(t, "data_two_tensors", '\0' + encodeDataPrefix(100, {16, 8}, 0, {}));
  write(
      t,
      "data_no_tensor_store",
      '\2' + encodeFrameHeader(FrameType::kData, 40, 0));
  write(
      t,
      "data_cma",
      '\1' + encodeDataPrefix(10, {4096}, 7, {0x7f0000001000}));
  write(t, "heartbeat", '\0' + encodeFrameHeader(FrameType::kHeartbeat, 0, 0));
  write(t, "hello", '\0' + encodeFrameHeader(FrameType::kHello, 12, 0));
  write(
      t,
      "cma_probe",
      '\0' + encodeFrameHeader(FrameType::kCmaProbe, 9, 0) +
          encodeCmaProbe(true, true, 0x7f0000002000));
  write(
      t,
      "cma_result",
      '\0' + encodeFrameHeader(FrameType::kCmaResult, 1, 0) +
          encodeCmaResult(true, true));
  write(
      t,
      "ack",
      '\0' + encodeFrameHeader(FrameType::kAck, 8, 0) + encodeAck(3));
}

// Flags: bit 0 kWelcome, bit 1 with a secret, bit 2 kProof.
void handshakes() {
  const std::string t = "handshake_fuzzer";
  Greeting hello;
  hello.name = "worker0";
  write(t, "hello", '\0' + encodeGreeting(FrameType::kHello, hello));
  Greeting authHello = hello;
  authHello.auth = true;
  authHello.nonce = std::string(kNonceBytes, 'n');
  write(t, "hello_secret", '\2' + encodeGreeting(FrameType::kHello, authHello));
  HostSection host;
  host.bootId = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
  host.pidNamespace = 4026531836;
  host.pid = 4242;
  host.challenge = std::string(kChallengeBytes, 'c');
  host.address = 0x7f0000003000;
  Greeting hostHello = hello;
  hostHello.host = host;
  write(t, "hello_host", '\0' + encodeGreeting(FrameType::kHello, hostHello));
  Greeting welcome = authHello;
  welcome.name = "worker1";
  welcome.proof = std::string(kProofBytes, 'p');
  welcome.host = host;
  write(
      t,
      "welcome_secret_host",
      '\3' + encodeGreeting(FrameType::kWelcome, welcome));
  write(t, "proof", '\4' + std::string(kProofBytes, 'p'));
}

std::string asInput(const Message& message) {
  return fuzz::bytesFromMessage(message.header, message.tensors);
}

// Requests and responses as a worker writes them; the value target reads
// the same bytes (it decodes an envelope's values).
void envelopes() {
  const torchrpc::rpc::detail::MessageCodec codec(
      WorkerInfo{"worker0", 0},
      Options());
  const WorkerInfo to{"worker1", 1};
  std::vector<std::pair<std::string, std::vector<c10::IValue>>> requests;
  requests.push_back(
      {"scalars",
       {c10::IValue(),
        true,
        int64_t(-5),
        2.5,
        std::string("s"),
        c10::complex<double>(1, 2),
        c10::Device(c10::kCPU)}});
  requests.push_back(
      {"tensors",
       {at::arange(6, at::kFloat).reshape({2, 3}).requires_grad_(true),
        at::arange(3, at::kLong),
        at::empty({0, 4}, at::kDouble)}});
  requests.push_back({"sparse", {at::eye(3).to_sparse()}});
  // Every value kind a compact envelope carries (Note [Compact envelopes]).
  requests.push_back(
      {"flat",
       {c10::IValue(),
        false,
        int64_t(1) << 40,
        -0.5,
        std::string("bytes"),
        at::arange(4, at::kInt)}});
  c10::Dict<std::string, at::Tensor> named;
  named.insert("w", at::ones({2, 2}));
  requests.push_back(
      {"containers",
       {c10::List<int64_t>({1, 2, 3}),
        named,
        c10::ivalue::Tuple::create({int64_t(1), std::string("x")}),
        c10::List<c10::optional<at::Tensor>>({c10::nullopt, at::ones({2})})}});
  uint64_t id = 1;
  for (const auto& request : requests) {
    OutgoingRequest outgoing;
    outgoing.body = "fn";
    outgoing.what = "fn";
    outgoing.values = request.second;
    const std::string bytes =
        asInput(codec.encodeRequest(to, id++, outgoing, nullptr));
    write("envelope_fuzzer", "request_" + request.first, bytes);
    write("value_fuzzer", request.first, bytes);
  }
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  done->markCompleted(at::ones({3}));
  write(
      "envelope_fuzzer",
      "response_tensor",
      asInput(codec.encodeResponse(
          to,
          9,
          kCallMessageKind,
          *done,
          "fn",
          nullptr,
          nullptr)));
  write(
      "envelope_fuzzer",
      "response_error",
      asInput(codec.encodeError(
          10,
          kCallMessageKind,
          makeRpcError(ErrorCode::kTimeout, "worker0", "fn", 10, "too slow"),
          "fn")));
}

// Records: u8 client, u16 length, request bytes.
void storeRequests() {
  using namespace torchrpc::rpc::store;
  auto record = [](int client, const StoreRequest& request) {
    std::string bytes = request.SerializeAsString();
    std::string out(1, static_cast<char>(client));
    out += static_cast<char>(bytes.size() & 0xff);
    out += static_cast<char>((bytes.size() >> 8) & 0xff);
    return out + bytes;
  };
  StoreRequest set;
  set.set_id(1);
  set.mutable_set()->set_key("k");
  set.mutable_set()->set_value("v");
  StoreRequest get;
  get.set_id(2);
  get.mutable_get()->set_key("k");
  StoreRequest add;
  add.set_id(3);
  add.mutable_add()->set_key("n");
  add.mutable_add()->set_delta(5);
  StoreRequest check;
  check.set_id(4);
  check.mutable_check()->add_keys("k");
  check.mutable_check()->add_keys("n");
  StoreRequest wait;
  wait.set_id(5);
  wait.mutable_wait()->add_keys("w");
  StoreRequest setW;
  setW.set_id(6);
  setW.mutable_set()->set_key("w");
  setW.mutable_set()->set_value("1");
  StoreRequest cancel;
  cancel.set_id(7);
  cancel.mutable_cancel_wait()->set_wait_id(5);
  const std::string t = "store_request_fuzzer";
  write(t, "set_get", record(0, set) + record(1, get));
  write(t, "add_check", record(0, add) + record(0, add) + record(1, check));
  write(t, "wait_then_set", record(0, wait) + record(1, setW));
  write(t, "wait_cancel", record(0, wait) + record(0, cancel));
  write(t, "wait_disconnect", record(1, wait) + record(3, get));
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus directory>\n", argv[0]);
    return 2;
  }
  root = argv[1];
  frameHeaders();
  handshakes();
  envelopes();
  storeRequests();
  return 0;
}

#include "tfevents_writer.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>

#include "crc32c.h"
#include "examples/parameter_server/proto/tfevents.pb.h"

namespace ps {
namespace {

double now() {
  return std::chrono::duration<double>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void appendLittleEndian(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out.push_back(char((value >> (8 * i)) & 0xFF));
  }
}

} // namespace

TfEventsWriter::TfEventsWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  path_ = (std::filesystem::path(dir) /
           ("events.out.tfevents." + std::to_string(int64_t(now())) + "." +
            host + "." + std::to_string(::getpid()) + ".0"))
              .string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out_, "cannot create the TensorBoard event file ", path_);
  tfevents::Event first;
  first.set_wall_time(now());
  first.set_file_version("brain.Event:2");
  writeRecord(first.SerializeAsString());
  flush();
}

void TfEventsWriter::addScalar(
    const std::string& tag,
    double value,
    int64_t step) {
  tfevents::Event event;
  event.set_wall_time(now());
  event.set_step(step);
  auto* scalar = event.mutable_summary()->add_value();
  scalar->set_tag(tag);
  scalar->set_simple_value(float(value));
  writeRecord(event.SerializeAsString());
}

void TfEventsWriter::flush() {
  out_.flush();
}

void TfEventsWriter::writeRecord(const std::string& bytes) {
  std::string header;
  appendLittleEndian(header, bytes.size(), 8);
  std::string record = header;
  appendLittleEndian(record, maskedCrc32c(header.data(), header.size()), 4);
  record += bytes;
  appendLittleEndian(record, maskedCrc32c(bytes.data(), bytes.size()), 4);
  out_.write(record.data(), std::streamsize(record.size()));
  TORCH_CHECK(out_, "cannot write to ", path_);
}

} // namespace ps

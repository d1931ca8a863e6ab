#pragma once

// Writes scalar curves as TensorBoard event files, the format PyTorch's
// SummaryWriter writes: a file events.out.tfevents.<time>.<host>.<pid>.0 of
// records [uint64 length][masked crc32c of length][Event bytes][masked
// crc32c of the bytes], little-endian, the first Event carrying
// file_version "brain.Event:2". `tensorboard --logdir DIR` opens them.
//
// Not thread-safe: one thread writes (the server holds it under a lock).

#include <cstdint>
#include <fstream>
#include <string>

namespace ps {

class TfEventsWriter {
 public:
  // Creates `dir` if needed and a new event file in it.
  explicit TfEventsWriter(const std::string& dir);

  void addScalar(const std::string& tag, double value, int64_t step);
  // Makes what was written visible to readers (TensorBoard reads live).
  void flush();

  const std::string& path() const {
    return path_;
  }

 private:
  void writeRecord(const std::string& bytes);

  std::string path_;
  std::ofstream out_;
};

} // namespace ps

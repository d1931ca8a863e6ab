#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace torchrpc {
namespace trace {
namespace testing {

// A fresh directory, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "trace_merge_XXXXXX")
            .string();
    if (::mkdtemp(pattern.data()) != nullptr) {
      path_ = pattern;
    }
  }

  ~TempDir() {
    if (!path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }

  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const {
    return path_;
  }

 private:
  std::string path_;
};

} // namespace testing
} // namespace trace
} // namespace torchrpc

#pragma once

#include <cstdint>
#include <string>

namespace torchrpc {
namespace rpc {

// A worker of the job: its unique name and its id (its rank).
struct WorkerInfo {
  std::string name;
  int64_t id = -1;

  bool operator==(const WorkerInfo& other) const {
    return id == other.id && name == other.name;
  }
  bool operator!=(const WorkerInfo& other) const {
    return !(*this == other);
  }
};

// Names a destination by name, by id, or by WorkerInfo; every call accepts
// any of the three. Resolved against the runtime's worker table at call time.
class WorkerRef {
 public:
  WorkerRef(const char* name) : name_(name) {}
  WorkerRef(std::string name) : name_(std::move(name)) {}
  WorkerRef(int64_t id) : id_(id) {}
  WorkerRef(int id) : id_(id) {}
  WorkerRef(const WorkerInfo& info) : name_(info.name), id_(info.id) {}

  bool byName() const {
    return id_ < 0;
  }
  const std::string& name() const {
    return name_;
  }
  int64_t id() const {
    return id_;
  }
  std::string describe() const {
    return byName() ? name_ : "#" + std::to_string(id_);
  }

 private:
  std::string name_;
  int64_t id_ = -1;
};

} // namespace rpc
} // namespace torchrpc

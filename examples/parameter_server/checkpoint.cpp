#include "checkpoint.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace ps {

namespace fs = std::filesystem;

std::string modelPath(const std::string& dir, int64_t step) {
  return (fs::path(dir) / ("model-step" + std::to_string(step) + ".pt"))
      .string();
}

std::string optimizerPrefix(const std::string& dir, int64_t step, int trainer) {
  return (fs::path(dir) /
          ("optimizer-step" + std::to_string(step) + "-trainer" +
           std::to_string(trainer) + "-"))
      .string();
}

std::optional<CheckpointInfo> readCheckpoint(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "checkpoint.txt");
  if (!in) {
    return std::nullopt;
  }
  CheckpointInfo info;
  std::string key;
  while (in >> key) {
    if (key == "step") {
      in >> info.step;
    } else if (key == "trainers") {
      in >> info.trainers;
    } else if (key == "batch_size") {
      in >> info.batchSize;
    } else if (key == "hidden") {
      in >> info.hidden;
    } else if (key == "optimizer") {
      in >> info.optimizer;
    } else {
      TORCH_CHECK(false, "unknown key '", key, "' in ", dir, "/checkpoint.txt");
    }
  }
  return info;
}

void writeCheckpoint(
    const std::string& dir,
    const CheckpointInfo& info,
    std::optional<int64_t> previous) {
  fs::path file = fs::path(dir) / "checkpoint.txt";
  fs::path partial = file.string() + ".partial." + std::to_string(::getpid());
  {
    std::ofstream out(partial, std::ios::trunc);
    out << "step " << info.step << "\ntrainers " << info.trainers
        << "\nbatch_size " << info.batchSize << "\nhidden " << info.hidden
        << "\noptimizer " << info.optimizer << "\n";
    out.flush();
    TORCH_CHECK(out, "cannot write ", partial.string());
  }
  fs::rename(partial, file);
  if (!previous || *previous == info.step) {
    return;
  }
  std::string stale = "-step" + std::to_string(*previous);
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::string name = entry.path().filename().string();
    if (name == "model" + stale + ".pt" ||
        name.rfind("optimizer" + stale + "-", 0) == 0) {
      std::error_code ignored;
      fs::remove(entry.path(), ignored);
    }
  }
}

void checkResumable(const CheckpointInfo& info, const Config& config) {
  auto differs = [&info](const char* what, auto then, auto now) {
    TORCH_CHECK(
        then == now,
        "cannot resume: the checkpoint at step ",
        info.step,
        " was made with ",
        what,
        " ",
        then,
        ", this run has ",
        now,
        "; use the same setting, or start afresh without --resume");
  };
  differs("--trainers", info.trainers, config.trainers);
  differs("--batch-size", info.batchSize, config.batchSize);
  differs("hidden size", info.hidden, config.hidden);
  differs("--optimizer", info.optimizer, config.optimizer);
}

} // namespace ps

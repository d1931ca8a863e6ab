#pragma once

// Note [Checkpoints]
// ~~~~~~~~~~~~~~~~~~
// A checkpoint is taken when every trainer has reached the same step (the
// end of an epoch, or the last step; shards are equal, so are the steps per
// epoch): each trainer saves its own DistributedOptimizer's state on the
// server and waits; the server then saves the model, whose parameters no
// one is stepping, and records the step. A resumed run starts every trainer
// at that step, with the same data order (seeded by epoch and trainer).
//
// The files, all on the server's file system:
//
//   <dir>/checkpoint.txt                         the last complete checkpoint
//   <dir>/model-step<N>.pt                       the model (RemoteModule::save)
//   <dir>/optimizer-step<N>-trainer<K>-<owner>.pt  trainer K's optimizer
//                                      (DistributedOptimizer::saveOnOwners)
//
// checkpoint.txt is written last and renamed into place, so it always names
// files that are complete; files of older steps are removed after it.

#include <cstdint>
#include <optional>
#include <string>

#include "config.h"

namespace ps {

struct CheckpointInfo {
  int64_t step = 0; // steps every trainer had taken
  int trainers = 0;
  int64_t batchSize = 0;
  int64_t hidden = 0;
  std::string optimizer;
};

std::string modelPath(const std::string& dir, int64_t step);
std::string optimizerPrefix(const std::string& dir, int64_t step, int trainer);

// The last checkpoint in `dir`, if any.
std::optional<CheckpointInfo> readCheckpoint(const std::string& dir);
// Records `info` as the last checkpoint and removes the files of `previous`.
void writeCheckpoint(
    const std::string& dir,
    const CheckpointInfo& info,
    std::optional<int64_t> previous);
// Throws c10::Error naming what differs when `config` cannot continue the
// run that wrote `info`.
void checkResumable(const CheckpointInfo& info, const Config& config);

} // namespace ps

#pragma once

// The parameter server (rank 0): owns the model as a RemoteModule, hands it
// to the trainers, takes a checkpoint whenever every trainer has reached
// one (the end of each epoch, and the last step), collects the trainers'
// curves into TensorBoard event files and a PNG, and evaluates the trained
// parameters on the test set.
//
// Functions the trainers call (all on worker0):
//   ps.ready() -> bool                  the model exists
//   ps.model() -> RemoteModule<Mlp>
//   ps.start_step() -> int              0, or the step of the checkpoint
//   resumed ps.checkpoint_dir() -> string       absolute, on the server's file
//   system ps.report(trainer, step, loss, accuracy) ps.checkpoint(trainer,
//   step)        trainer saved its optimizer; waits ps.checkpointed() -> int
//   the step of the last checkpoint ps.done(trainer), ps.failed(trainer, what)

#include <memory>

#include "config.h"

namespace torchrpc {
class Runtime;
} // namespace torchrpc

namespace ps {

class ParameterServer {
 public:
  // Registers the model and the functions above; call before rt.start().
  ParameterServer(torchrpc::Runtime& runtime, Config config);
  ~ParameterServer();

  // After rt.start(): serves until every trainer is done; returns the exit
  // code (non-zero when a trainer failed).
  int run();

  struct State;

 private:
  torchrpc::Runtime& runtime_;
  std::shared_ptr<State> state_;
};

} // namespace ps

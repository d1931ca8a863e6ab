#include "server.h"

#include <torchrpc/torchrpc.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>

#include "checkpoint.h"
#include "curves.h"
#include "fashion_mnist.h"
#include "model.h"
#include "progress.h"
#include "tfevents_writer.h"

namespace ps {

using MlpModule = torchrpc::nn::RemoteModule<Mlp>;

struct ParameterServer::State {
  explicit State(Config config) : config(std::move(config)) {}

  const Config config;
  std::mutex mutex;
  std::condition_variable changed;
  // Set once by run() before `ready`.
  std::optional<MlpModule> model;
  int64_t startStep = 0;
  std::string checkpointDir;
  bool ready = false;
  // trainer -> step it waits at, for the checkpoint being gathered.
  std::map<int64_t, int64_t> waiting;
  int64_t checkpointed = 0;
  int done = 0;
  std::string failure;
  std::unique_ptr<TfEventsWriter> events;
  std::unique_ptr<Curves> curves;
};

ParameterServer::ParameterServer(torchrpc::Runtime& runtime, Config config)
    : runtime_(runtime),
      state_(std::make_shared<State>(std::move(config))) {
  registerModel(runtime);
  auto& functions = runtime.functions();
  std::weak_ptr<State> weak = state_;
  // Each handler runs on the pool while run() may be waiting: lock, record,
  // notify, and never block.
  auto locked = [weak]() {
    auto state = weak.lock();
    TORCH_CHECK(state, "the parameter server is shutting down");
    return state;
  };
  functions.add("ps.ready", [locked]() {
    auto state = locked();
    std::lock_guard<std::mutex> guard(state->mutex);
    return state->ready;
  });
  functions.add("ps.model", [locked]() {
    auto state = locked();
    std::lock_guard<std::mutex> guard(state->mutex);
    TORCH_CHECK(state->ready, "the model does not exist yet");
    return *state->model;
  });
  functions.add("ps.start_step", [locked]() {
    auto state = locked();
    std::lock_guard<std::mutex> guard(state->mutex);
    return state->startStep;
  });
  functions.add("ps.checkpoint_dir", [locked]() {
    auto state = locked();
    std::lock_guard<std::mutex> guard(state->mutex);
    return state->checkpointDir;
  });
  functions.add(
      "ps.report",
      [locked](int64_t trainer, int64_t step, double loss, double accuracy) {
        auto state = locked();
        std::lock_guard<std::mutex> guard(state->mutex);
        std::string who = "trainer" + std::to_string(trainer);
        state->events->addScalar("loss/" + who, loss, step);
        state->events->addScalar("accuracy/" + who, accuracy, step);
        state->events->flush();
        state->curves->addTrain(int(trainer), step, loss, accuracy);
      });
  functions.add("ps.checkpoint", [locked](int64_t trainer, int64_t step) {
    auto state = locked();
    {
      std::lock_guard<std::mutex> guard(state->mutex);
      state->waiting[trainer] = step;
    }
    state->changed.notify_all();
  });
  functions.add("ps.checkpointed", [locked]() {
    auto state = locked();
    std::lock_guard<std::mutex> guard(state->mutex);
    return state->checkpointed;
  });
  functions.add("ps.done", [locked](int64_t trainer) {
    auto state = locked();
    {
      std::lock_guard<std::mutex> guard(state->mutex);
      ++state->done;
    }
    state->changed.notify_all();
  });
  functions.add("ps.failed", [locked](int64_t trainer, std::string what) {
    auto state = locked();
    {
      std::lock_guard<std::mutex> guard(state->mutex);
      state->failure = "trainer" + std::to_string(trainer) + ": " + what;
    }
    state->changed.notify_all();
  });
}

ParameterServer::~ParameterServer() = default;

namespace {

// Accuracy of the module's current parameters, evaluated here (the owner)
// on a local copy.
double testAccuracy(
    const MlpModule& module,
    const Config& config,
    const Examples& test) {
  Mlp local(config.hidden, config.seed);
  auto state = module.stateDict();
  at::NoGradGuard noGrad;
  for (auto& item : local.named_parameters()) {
    item.value().copy_(state.at(item.key()));
  }
  return accuracy(local, test);
}

} // namespace

int ParameterServer::run() {
  const Config& config = state_->config;
  auto started = std::chrono::steady_clock::now();
  std::string dir = std::filesystem::absolute(config.checkpointDir).string();
  std::filesystem::create_directories(dir);
  Examples test = loadFashionMnist(config.cacheDir, /*train=*/false);

  MlpModule model = MlpModule::withTypeName(
      runtime_,
      "worker0/cpu",
      kMlpType,
      config.hidden,
      config.seed);
  std::optional<CheckpointInfo> resumed;
  if (config.resume) {
    resumed = readCheckpoint(dir);
    if (resumed) {
      checkResumable(*resumed, config);
      model.load(modelPath(dir, resumed->step));
      std::cout << "server: resuming from the checkpoint at step "
                << resumed->step << " in " << dir << std::endl;
    } else {
      std::cout << "server: no checkpoint in " << dir
                << "; starting from the beginning" << std::endl;
    }
  }
  int64_t startStep = resumed ? resumed->step : 0;
  {
    std::lock_guard<std::mutex> guard(state_->mutex);
    state_->curves = std::make_unique<Curves>(
        config.logDir,
        config.trainers,
        /*fresh=*/!resumed);
    // After Curves, which clears an earlier run's event files.
    state_->events = std::make_unique<TfEventsWriter>(config.logDir);
    state_->model = model;
    state_->startStep = startStep;
    state_->checkpointed = startStep;
    state_->checkpointDir = dir;
    state_->ready = true;
  }
  std::cout << "server: " << config.trainers << " trainers, MLP 784-"
            << config.hidden << "-10, " << config.optimizer << " lr "
            << config.lr << ", batch " << config.batchSize << "; curves in "
            << state_->events->path() << std::endl;

  std::optional<int64_t> previous =
      resumed ? std::optional<int64_t>(resumed->step) : std::nullopt;
  while (true) {
    int64_t step = 0;
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      state_->changed.wait(lock, [this]() {
        return !state_->failure.empty() ||
            state_->done == state_->config.trainers ||
            int(state_->waiting.size()) == state_->config.trainers;
      });
      if (!state_->failure.empty()) {
        std::cerr << "server: stopping: " << state_->failure << std::endl;
        return 1;
      }
      if (state_->done == config.trainers) {
        break;
      }
      for (const auto& entry : state_->waiting) {
        step = std::max(step, entry.second);
      }
    }
    // Every trainer waits, its optimizer state saved: the model is the one
    // their optimizer states belong to.
    model.save(modelPath(dir, step));
    CheckpointInfo info{
        step,
        config.trainers,
        config.batchSize,
        config.hidden,
        config.optimizer};
    writeCheckpoint(dir, info, previous);
    previous = step;
    double accuracy = testAccuracy(model, config, test);
    {
      std::lock_guard<std::mutex> guard(state_->mutex);
      state_->events->addScalar("test/accuracy", accuracy, step);
      state_->events->flush();
      state_->curves->addTest(step, accuracy);
      state_->waiting.clear();
      state_->checkpointed = step;
    }
    std::cout << "server: checkpoint at step " << step << ", test accuracy "
              << std::fixed << std::setprecision(2) << 100 * accuracy << "%"
              << std::defaultfloat << std::endl;
  }

  double accuracy = testAccuracy(model, config, test);
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started)
          .count();
  std::string png;
  try {
    std::lock_guard<std::mutex> guard(state_->mutex);
    png = state_->curves->plot();
  } catch (const c10::Error& e) {
    std::cerr << "server: no PNG: " << e.what_without_backtrace() << std::endl;
  }
  std::cout << "test accuracy: " << std::fixed << std::setprecision(2)
            << 100 * accuracy << "% on 10000 Fashion-MNIST test images, after "
            << formatDuration(seconds) << " of training" << std::defaultfloat
            << std::endl;
  std::cout << "curves: " << state_->events->path()
            << (png.empty() ? "" : " and ") << png << std::endl;
  return 0;
}

} // namespace ps

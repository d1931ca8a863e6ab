#pragma once

// What a trainer prints while it trains: a line every few seconds with its
// epoch, step, loss, running accuracy, speed and time left.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace ps {

// Loss and accuracy over some steps.
struct Window {
  double lossSum = 0;
  int64_t steps = 0;
  int64_t correct = 0;
  int64_t examples = 0;

  void add(double loss, int64_t rightAnswers, int64_t batch) {
    lossSum += loss;
    ++steps;
    correct += rightAnswers;
    examples += batch;
  }
  double meanLoss() const {
    return steps == 0 ? 0.0 : lossSum / steps;
  }
  double accuracy() const {
    return examples == 0 ? 0.0 : double(correct) / examples;
  }
};

class Progress {
 public:
  using Clock = std::chrono::steady_clock;

  // Steps count from 0 across epochs; this run trains steps
  // [firstStep, lastStep).
  Progress(
      std::string who,
      int64_t stepsPerEpoch,
      int64_t firstStep,
      int64_t lastStep,
      double intervalSeconds);

  // After step `step` (0-based) of this trainer.
  void add(int64_t step, double loss, int64_t rightAnswers, int64_t batch);
  // A line when the interval has passed since the last one.
  std::optional<std::string> lineIfDue();
  // The line now.
  std::string line();

 private:
  std::string who_;
  int64_t stepsPerEpoch_;
  int64_t firstStep_;
  int64_t lastStep_;
  std::chrono::duration<double> interval_;
  Clock::time_point start_ = Clock::now();
  Clock::time_point lastLine_ = start_;
  int64_t done_ = 0; // steps taken so far, this run
  int64_t step_ = -1; // the last step taken
  Window sinceLine_; // loss since the last line
  Window epoch_; // accuracy over the current epoch
};

// "1:05", "12:00:03".
std::string formatDuration(double seconds);

} // namespace ps

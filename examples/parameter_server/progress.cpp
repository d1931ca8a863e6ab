#include "progress.h"

#include <cmath>
#include <cstdio>
#include <utility>

namespace ps {

std::string formatDuration(double seconds) {
  auto total = int64_t(std::llround(std::max(0.0, seconds)));
  char text[32];
  if (total >= 3600) {
    std::snprintf(
        text,
        sizeof(text),
        "%lld:%02lld:%02lld",
        (long long)(total / 3600),
        (long long)(total / 60 % 60),
        (long long)(total % 60));
  } else {
    std::snprintf(
        text,
        sizeof(text),
        "%lld:%02lld",
        (long long)(total / 60),
        (long long)(total % 60));
  }
  return text;
}

Progress::Progress(
    std::string who,
    int64_t stepsPerEpoch,
    int64_t firstStep,
    int64_t lastStep,
    double intervalSeconds)
    : who_(std::move(who)),
      stepsPerEpoch_(stepsPerEpoch),
      firstStep_(firstStep),
      lastStep_(lastStep),
      interval_(intervalSeconds) {}

void Progress::add(
    int64_t step,
    double loss,
    int64_t rightAnswers,
    int64_t batch) {
  if (step % stepsPerEpoch_ == 0) {
    epoch_ = Window();
  }
  step_ = step;
  ++done_;
  sinceLine_.add(loss, rightAnswers, batch);
  epoch_.add(loss, rightAnswers, batch);
}

std::optional<std::string> Progress::lineIfDue() {
  if (Clock::now() - lastLine_ < interval_) {
    return std::nullopt;
  }
  return line();
}

std::string Progress::line() {
  auto now = Clock::now();
  double elapsed = std::chrono::duration<double>(now - start_).count();
  double rate = elapsed > 0 ? done_ / elapsed : 0.0;
  int64_t left = lastStep_ - (step_ + 1);
  int64_t epochs = (lastStep_ + stepsPerEpoch_ - 1) / stepsPerEpoch_;
  int64_t step = std::max<int64_t>(step_, 0);
  char text[256];
  std::snprintf(
      text,
      sizeof(text),
      "%s epoch %lld/%lld step %lld/%lld (%lld/%lld of the epoch) "
      "loss %.4f acc %.1f%% %.1f steps/s ETA %s",
      who_.c_str(),
      (long long)(step / stepsPerEpoch_ + 1),
      (long long)epochs,
      (long long)(step_ + 1),
      (long long)lastStep_,
      (long long)(step % stepsPerEpoch_ + 1),
      (long long)stepsPerEpoch_,
      sinceLine_.meanLoss(),
      100 * epoch_.accuracy(),
      rate,
      rate > 0 ? formatDuration(left / rate).c_str() : "?");
  lastLine_ = now;
  sinceLine_ = Window();
  return text;
}

} // namespace ps

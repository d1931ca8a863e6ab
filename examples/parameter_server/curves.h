#pragma once

// The training curves as tab-separated series in the log directory, and
// their plot as a PNG drawn by gnuplot (Debian's gnuplot-nox).
//
//   <logDir>/train-<trainer>.tsv   step, loss, accuracy (one line a report)
//   <logDir>/test.tsv              step, test accuracy (one line a checkpoint)
//   <logDir>/curves.png
//
// Series are appended to, so a resumed run continues its curves. Not
// thread-safe.

#include <cstdint>
#include <string>

namespace ps {

class Curves {
 public:
  // A fresh run (not resumed) starts its series, and its TensorBoard
  // events, from nothing: it removes those of an earlier run in `logDir`.
  Curves(std::string logDir, int trainers, bool fresh);

  void addTrain(int trainer, int64_t step, double loss, double accuracy);
  void addTest(int64_t step, double accuracy);

  // Draws <logDir>/curves.png and returns its path; throws c10::Error
  // saying why when gnuplot is missing or fails.
  std::string plot() const;

 private:
  std::string logDir_;
  int trainers_;
};

} // namespace ps

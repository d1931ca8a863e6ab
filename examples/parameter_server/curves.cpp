#include "curves.h"

#include <c10/util/Exception.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace ps {
namespace {

namespace fs = std::filesystem;

void appendLine(const fs::path& file, const std::string& line) {
  std::ofstream out(file, std::ios::app);
  out << line << '\n';
  TORCH_CHECK(out, "cannot write ", file.string());
}

} // namespace

Curves::Curves(std::string logDir, int trainers, bool fresh)
    : logDir_(std::move(logDir)),
      trainers_(trainers) {
  fs::create_directories(logDir_);
  if (!fresh) {
    return;
  }
  for (const auto& entry : fs::directory_iterator(logDir_)) {
    std::string name = entry.path().filename().string();
    bool ours = name.rfind("events.out.tfevents.", 0) == 0 ||
        name.rfind("train-", 0) == 0 || name == "test.tsv" ||
        name == "curves.png";
    if (ours && entry.is_regular_file()) {
      fs::remove(entry.path());
    }
  }
}

void Curves::addTrain(int trainer, int64_t step, double loss, double accuracy) {
  std::ostringstream line;
  line << step << '\t' << loss << '\t' << accuracy;
  appendLine(
      fs::path(logDir_) / ("train-" + std::to_string(trainer) + ".tsv"),
      line.str());
}

void Curves::addTest(int64_t step, double accuracy) {
  std::ostringstream line;
  line << step << '\t' << accuracy;
  appendLine(fs::path(logDir_) / "test.tsv", line.str());
}

std::string Curves::plot() const {
  fs::path dir = fs::absolute(logDir_);
  fs::path png = dir / "curves.png";
  bool haveTest = fs::exists(dir / "test.tsv");
  std::ostringstream script;
  script << "set terminal pngcairo size 1200,500\n"
         << "set output '" << png.string() << "'\n"
         << "set datafile separator '\\t'\n"
         << "set multiplot layout 1,2 title 'Fashion-MNIST, parameter server "
            "and "
         << trainers_ << " trainers'\n"
         << "set xlabel 'step'\nset grid\n"
         << "set title 'training loss'\n"
         << "plot for [i=1:" << trainers_ << "] '" << dir.string()
         << "/train-'.i.'.tsv' using 1:2 with lines title 'trainer '.i\n"
         << "set title 'accuracy'\nset yrange [0:1]\nset key bottom right\n"
         << "plot for [i=1:" << trainers_ << "] '" << dir.string()
         << "/train-'.i.'.tsv' using 1:3 with lines title 'trainer '.i";
  if (haveTest) {
    script << ", '" << dir.string()
           << "/test.tsv' using 1:2 with linespoints lw 2 title 'test'";
  }
  script << "\nunset multiplot\n";
  // gnuplot reads the script from its standard input; -e 'exit' is not
  // needed: end of input ends it.
  FILE* gnuplot = ::popen("gnuplot 2>&1", "w");
  TORCH_CHECK(
      gnuplot != nullptr,
      "cannot run gnuplot to draw ",
      png.string(),
      " (install Debian's gnuplot-nox)");
  std::string text = script.str();
  std::fwrite(text.data(), 1, text.size(), gnuplot);
  int status = ::pclose(gnuplot);
  TORCH_CHECK(
      status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
          fs::exists(png),
      "gnuplot could not draw ",
      png.string(),
      WIFEXITED(status) && WEXITSTATUS(status) == 127
          ? ": gnuplot is not installed (Debian's gnuplot-nox)"
          : "");
  return png.string();
}

} // namespace ps

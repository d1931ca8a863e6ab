// torchrpc-trace-merge: one timeline from the per-worker trace files of a
// job. See tools/trace/README.md and `torchrpc-trace-merge --help`.

#include <iostream>

#include "merge_cli.h"

int main(int argc, char** argv) {
  return torchrpc::trace::runTraceMerge(argc, argv, std::cout, std::cerr);
}

#pragma once

// How many CPUs this process may run on (its affinity mask, which taskset
// and cpusets narrow): the copy helper needs a second one (Note [Copies
// into shared memory on two cores]), so its tests expect less with one.

#include <sched.h>

namespace torchrpc {
namespace testing {

// 0 where the mask cannot be read.
inline int allowedCpuCount() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  return sched_getaffinity(0, sizeof(allowed), &allowed) == 0
      ? CPU_COUNT(&allowed)
      : 0;
}

} // namespace testing
} // namespace torchrpc

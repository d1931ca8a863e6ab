#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace detail {

// Expands Slurm's compressed host list ("node[01-03,07],gpu5",
// "rack[1-2]-n[1-2]") into host names, in order. A bracket holds ranges
// "a-b" and single numbers separated by commas; a range keeps the zero
// padding of its lower bound ("[08-10]" gives 08, 09, 10); several brackets
// in one name multiply out, the last varying fastest, as Slurm does. Throws
// c10::Error saying what is wrong (an unclosed bracket, a reversed or empty
// range, an empty list).
std::vector<std::string> expandSlurmHostlist(const std::string& hostlist);

// Expands Slurm's tasks-per-node list ("2(x3),1" = 2, 2, 2, 1) into one
// count per node. Throws c10::Error when it does not parse.
std::vector<int64_t> expandSlurmTasksPerNode(const std::string& tasksPerNode);

} // namespace detail
} // namespace rpc
} // namespace torchrpc

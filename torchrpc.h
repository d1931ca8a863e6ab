#pragma once

// The umbrella header: everything a torchrpc program needs.
//
//   #include <torchrpc/torchrpc.h>
//
// Link the CMake target torchrpc::torchrpc.

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "rpc/errors.h"
#include "rpc/function_registry.h"
#include "rpc/future.h"
#include "rpc/inprocess_transport.h"
#include "rpc/options.h"
#include "rpc/runtime.h"
#include "rpc/worker_info.h"

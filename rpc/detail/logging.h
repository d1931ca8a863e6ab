#pragma once

namespace torchrpc {
namespace rpc {
namespace detail {

// Initialises libtorch's logging backend (glog, when libtorch was built with
// it) once per process, unless the application already did. Uninitialised
// glog prefixes the first message with a "Logging before
// InitGoogleLogging()" banner that means nothing to a torchrpc user; once
// initialised here, messages keep going to stderr as before unless the
// GLOG_logtostderr or GLOG_log_dir variables say otherwise. An application
// that initialises glog itself must do so before it constructs a Runtime:
// glog refuses a second initialisation.
void initLoggingOnce();

} // namespace detail
} // namespace rpc
} // namespace torchrpc

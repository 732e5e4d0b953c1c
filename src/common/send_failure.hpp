#pragma once

// Why a send returned FAILED: recorded for netio3::last_send_failure() (per thread) and logged.

#include <string>

#include <netio3/types.hpp>

#include "common/log.hpp"

namespace netio3::detail {

// Records `message` as the reason of this thread's last FAILED send and logs it as a warning
// (`warn` false: not logged - a send on a closing connection is expected, not noteworthy).
// Returns NetioStatus::FAILED.
NetioStatus send_failed(SendFailureCause cause, std::string message, bool warn = true);

}  // namespace netio3::detail

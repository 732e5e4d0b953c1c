#pragma once

// The guard against UCX 1.13's tcp wire-up crash (tcp_wireup_guard.cpp, docs/ucx.md).

#include <cstdint>

namespace netio3::ucx {

// Whether the guard acts in this process: UCX 1.13, and NETIO3_UCX_TCP_WIREUP_GUARD is not 0.
[[nodiscard]] bool tcp_wireup_guard_wanted() noexcept;
// How many times UCP's wire-up handler of a tcp interface was put behind the guard (0 where
// UCX's own uct_iface_set_am_handler was called instead of netio3's: the guard did not take).
[[nodiscard]] std::uint64_t tcp_wireup_guarded_interfaces() noexcept;

}  // namespace netio3::ucx

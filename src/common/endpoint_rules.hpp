#pragma once

// Checks every backend applies before touching the network, so that the same bad request
// fails the same way on every transport.

#include <string_view>

#include <netio3/types.hpp>

namespace netio3::detail {

// Throws InvalidEndpointAddress unless address is a numeric IPv4/IPv6 address. `action`
// names the API call for the message.
void check_address(const EndPointAddress& address, std::string_view action);

// Throws InvalidConfiguration for global settings that cannot work.
void check_config(const NetworkConfig& config);

// Throws InvalidConnectionParameters for inconsistent parameters or ones that conflict
// with the global shared-buffer settings.
void check_connection_parameters(const ConnectionParameters& params, const NetworkConfig& config,
                                 bool listen_endpoint);

}  // namespace netio3::detail

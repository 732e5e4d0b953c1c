#pragma once

// One exception hierarchy: everything netio3 throws for a reason of its own derives from
// NetioException, so `catch (const netio3::NetioException&)` catches all of it. The
// message always says what was attempted, on which endpoint, and why it failed.

#include <stdexcept>
#include <string>

#include <netio3/export.hpp>

namespace netio3 {

/// The base of every exception netio3 throws for a reason of its own; what() says what
/// was attempted, on which endpoint, and why it failed.
class NETIO3_API NetioException : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

#define NETIO3_DETAIL_EXCEPTION(Name)             \
  class NETIO3_API Name : public NetioException { \
   public:                                        \
    using NetioException::NetioException;         \
  };

/// An address that is not a numeric IPv4/IPv6 address with a port.
NETIO3_DETAIL_EXCEPTION(InvalidEndpointAddress)
/// open_listen_endpoint on an address already listened on.
NETIO3_DETAIL_EXCEPTION(ListenEndpointAlreadyExists)
/// The transport could not listen (address in use, not local, out of descriptors...).
NETIO3_DETAIL_EXCEPTION(FailedOpenListenEndpoint)
/// Connection parameters that cannot work (e.g. buffers of size 0, a null zero-copy region
/// of non-zero size).
NETIO3_DETAIL_EXCEPTION(InvalidConnectionParameters)
/// open_active_endpoint to a peer the backend is connected to or connecting to.
NETIO3_DETAIL_EXCEPTION(ActiveEndpointAlreadyExists)
/// The transport could not start connecting (e.g. out of descriptors).
NETIO3_DETAIL_EXCEPTION(FailedOpenActiveEndpoint)
/// No connection with this peer (never opened, or closed).
NETIO3_DETAIL_EXCEPTION(UnknownActiveEndpoint)
/// No listen endpoint on this address.
NETIO3_DETAIL_EXCEPTION(UnknownListenEndpoint)
/// get_buffer on a connection that has no send buffers (none were requested).
NETIO3_DETAIL_EXCEPTION(NoBuffersAllocated)
/// The operation does not exist for this backend or connection.
NETIO3_DETAIL_EXCEPTION(NotSupported)
/// The transport failed to close the connection.
NETIO3_DETAIL_EXCEPTION(FailedCloseActiveEndpoint)
/// The transport failed to close the listen endpoint.
NETIO3_DETAIL_EXCEPTION(FailedCloseListenEndpoint)
/// Not in the documented list: NetworkBuffer::write past the buffer's capacity.
NETIO3_DETAIL_EXCEPTION(BufferOverflow)
/// Not in the documented list: a backend type that was not compiled in, or a
/// configuration the factory rejects before any endpoint exists.
NETIO3_DETAIL_EXCEPTION(InvalidConfiguration)

#undef NETIO3_DETAIL_EXCEPTION

}  // namespace netio3

#pragma once

// One exception hierarchy: everything netio3 throws for a reason of its own derives from
// NetioException, so `catch (const netio3::NetioException&)` catches all of it. The
// message always says what was attempted, on which endpoint, and why it failed.

#include <stdexcept>
#include <string>

namespace netio3 {

class NetioException : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

#define NETIO3_DETAIL_EXCEPTION(Name)     \
  class Name : public NetioException {    \
   public:                                \
    using NetioException::NetioException; \
  };

NETIO3_DETAIL_EXCEPTION(InvalidEndpointAddress)
NETIO3_DETAIL_EXCEPTION(ListenEndpointAlreadyExists)
NETIO3_DETAIL_EXCEPTION(FailedOpenListenEndpoint)
NETIO3_DETAIL_EXCEPTION(InvalidConnectionParameters)
NETIO3_DETAIL_EXCEPTION(ActiveEndpointAlreadyExists)
NETIO3_DETAIL_EXCEPTION(FailedOpenActiveEndpoint)
NETIO3_DETAIL_EXCEPTION(UnknownActiveEndpoint)
NETIO3_DETAIL_EXCEPTION(UnknownListenEndpoint)
NETIO3_DETAIL_EXCEPTION(NoBuffersAllocated)
NETIO3_DETAIL_EXCEPTION(NotSupported)
NETIO3_DETAIL_EXCEPTION(FailedCloseActiveEndpoint)
NETIO3_DETAIL_EXCEPTION(FailedCloseListenEndpoint)
// Not in the documented list: NetworkBuffer::write past the buffer's capacity.
NETIO3_DETAIL_EXCEPTION(BufferOverflow)
// Not in the documented list: a backend type that was not compiled in, or a
// configuration the factory rejects before any endpoint exists.
NETIO3_DETAIL_EXCEPTION(InvalidConfiguration)

#undef NETIO3_DETAIL_EXCEPTION

}  // namespace netio3

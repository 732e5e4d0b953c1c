#pragma once

// NETIO3_API marks what libnetio3 exports. The library is compiled with hidden visibility
// (and linked with cmake/netio3.map): only declarations carrying this macro, and what the
// compiler must export for them (vtables, type_info of exported classes), are part of its
// ABI; everything else, netio3::detail included, stays inside the library. For a program
// that uses the library the macro changes nothing.

#if defined(__GNUC__) || defined(__clang__)
#define NETIO3_API __attribute__((visibility("default")))
// The private parts of an exported class (e.g. a pimpl) that must stay inside the library.
#define NETIO3_LOCAL __attribute__((visibility("hidden")))
#else
#define NETIO3_API
#define NETIO3_LOCAL
#endif

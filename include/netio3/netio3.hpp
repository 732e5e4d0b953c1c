#pragma once

// Umbrella header of the netio3 public API.

#include <netio3/event_loop.hpp>
#include <netio3/exceptions.hpp>
#include <netio3/log.hpp>
#include <netio3/network_backend.hpp>
#include <netio3/network_buffer.hpp>
#include <netio3/statistics.hpp>
#include <netio3/types.hpp>
#include <netio3/version.hpp>

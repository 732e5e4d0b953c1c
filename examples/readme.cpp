// The program of README.md ("Using it"), word for word (tests/examples checks that the two
// agree, and runs it on every backend): one process listens, connects to itself, sends one
// message, prints it when it arrives, closes and stops its loop.
//
// Run: example_readme [asyncmsg|libfabric|ucx]

// [readme]
#include <cstdio>
#include <memory>
#include <span>

#include <netio3/netio3.hpp>

int main(int argc, char** argv) {
  using namespace netio3;
  const auto type = parse_backend_type(argc > 1 ? argv[1] : "asyncmsg");
  if (!type || !Netio3Backend::is_available(*type)) {
    std::fprintf(stderr, "usage: %s [asyncmsg|libfabric|ucx]\n", argv[0]);
    return 2;
  }
  auto loop = std::make_shared<EpollEventLoop>();
  std::unique_ptr<NetworkBackend> backend;
  EndPointAddress server;  // where we listen, with the port the OS chose
  int exit_status = 1;
  // Every callback runs on the loop thread, and may call the backend.
  backend = Netio3Backend::create(
      *type,
      {.mode = NetworkMode::TCP,  // libfabric and UCX over TCP; RDMA for an RDMA network
       .on_data_cb =
           [&](std::span<const std::uint8_t> data) {  // valid during the call only
             std::printf("received \"%.*s\"\n", static_cast<int>(data.size()),
                         reinterpret_cast<const char*>(data.data()));
             exit_status = 0;
             backend->close_active_endpoint(server);  // the connection we opened
           },
       .on_connection_established_cb =
           [&](const EndPointAddress& remote, EndpointCapabilities) {
             if (remote != server) return;  // the accepted side of the connection
             NetworkBuffer* buffer = backend->get_buffer(server);  // nullptr: none is free
             if (buffer != nullptr) {
               buffer->write(std::span{reinterpret_cast<const std::uint8_t*>("hello"), 5});
               if (backend->send_buffer(server, buffer) == NetioStatus::OK) return;
             }
             loop->stop();  // could not send: give up
           },
       .on_connection_closed_cb =
           [&](const EndPointAddress& remote, const std::vector<std::uint64_t>&) {
             if (remote == server) loop->stop();  // run() returns
           },
       .on_connection_refused_reason_cb =
           [&](const EndPointAddress& remote, const RefusalReason& reason) {
             std::fprintf(stderr, "%s refused: %s\n", to_string(remote).c_str(),
                          reason.message.c_str());
             loop->stop();
           }},
      loop);
  // libfabric receives into buffers given here: 16 of 4 KiB for each accepted connection.
  server = backend->open_listen_endpoint({"127.0.0.1", 0},
                                         {.recv_params = {.buf_size = 4096, .num_buf = 16}});
  backend->open_active_endpoint(server,
                                {.send_buffered_params = {.buf_size = 4096, .num_buf = 16}});
  loop->run();  // handles events until loop->stop()
  return exit_status;
}
// [readme]

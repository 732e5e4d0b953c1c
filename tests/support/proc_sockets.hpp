#pragma once

// The TCP sockets a process listens on, as an operator would find them (ss -ltnp): from
// /proc/<pid>/fd and /proc/<pid>/net/tcp{,6}. Header-only and without netio3, so that helper
// programs of the tests (a stranger's process) can use it too.

#include <arpa/inet.h>
#include <array>
#include <cstdint>
#include <dirent.h>
#include <fstream>
#include <netinet/in.h>
#include <set>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace netio3::test {

struct ListeningSocket {
  std::string ip;  // dotted IPv4, or "[v6]" and the kernel's hex text for IPv6
  std::uint16_t port{0};
};

// `pid`: a process id, or "self".
inline std::vector<ListeningSocket> listening_sockets(const std::string& pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + pid + "/fd";
  if (DIR* dir = ::opendir(fd_dir.c_str())) {
    while (const dirent* entry = ::readdir(dir)) {
      std::array<char, 128> target{};
      const std::string link = fd_dir + "/" + entry->d_name;
      const ssize_t n = ::readlink(link.c_str(), target.data(), target.size() - 1);
      if (n <= 0) continue;
      const std::string text{target.data(), static_cast<std::size_t>(n)};
      if (text.rfind("socket:[", 0) == 0) inodes.insert(text.substr(8, text.size() - 9));
    }
    ::closedir(dir);
  }
  std::vector<ListeningSocket> out;
  for (const bool v6 : {false, true}) {
    std::ifstream table{"/proc/" + pid + (v6 ? "/net/tcp6" : "/net/tcp")};
    std::string line;
    std::getline(table, line);  // header
    while (std::getline(table, line)) {
      std::istringstream fields{line};
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state != "0A" || !inodes.contains(inode)) continue;
      const auto colon = local.find(':');
      ListeningSocket socket;
      socket.port = static_cast<std::uint16_t>(std::stoul(local.substr(colon + 1), nullptr, 16));
      if (!v6) {
        in_addr a{};
        a.s_addr = static_cast<in_addr_t>(std::stoul(local.substr(0, colon), nullptr, 16));
        std::array<char, INET_ADDRSTRLEN> text{};
        ::inet_ntop(AF_INET, &a, text.data(), text.size());
        socket.ip = text.data();
      } else {
        socket.ip = "[v6]" + local.substr(0, colon);
      }
      out.push_back(socket);
    }
  }
  return out;
}

// Just the ports.
inline std::set<std::uint16_t> listening_ports(const std::string& pid) {
  std::set<std::uint16_t> ports;
  for (const auto& s : listening_sockets(pid)) ports.insert(s.port);
  return ports;
}

}  // namespace netio3::test

// Gloo's listening address (see bind_address.h).
#include "parallel/launch/bind_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/common.h"

namespace trainer {
namespace {

std::string ipv4_text(const sockaddr_in& a) {
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
    return text;
}

std::string interfaces_text() {
    std::vector<std::string> items;
    for (const Ipv4Interface& i : local_ipv4_interfaces()) items.push_back(i.name + " " + i.address);
    return items.empty() ? "none with an IPv4 address" : fmt::format("{}", fmt::join(items, ", "));
}

// The IPv4 address `host` names (a dotted address or a host name); "" where it names none.
std::string resolve_ipv4(const std::string& host, std::string* why) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    addrinfo* found = nullptr;
    const int gai = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (gai != 0 || found == nullptr) {
        *why = gai != 0 ? gai_strerror(gai) : "no IPv4 address";
        return "";
    }
    const std::string text = ipv4_text(*reinterpret_cast<const sockaddr_in*>(found->ai_addr));
    ::freeaddrinfo(found);
    return text;
}

// The source address of this machine's route to `host`:`port`: a UDP socket connected to it (no packet sent).
std::string route_source(const std::string& host, int port, std::string* why) {
    const std::string to = resolve_ipv4(host, why);
    if (to.empty()) return "";
    const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        *why = std::strerror(errno);
        return "";
    }
    sockaddr_in dest{};
    dest.sin_family = AF_INET;
    dest.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, to.c_str(), &dest.sin_addr);
    std::string source;
    sockaddr_in local{};
    socklen_t len = sizeof local;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&dest), sizeof dest) != 0) {
        *why = std::strerror(errno);
    } else if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
        *why = std::strerror(errno);
    } else {
        source = ipv4_text(local);
    }
    ::close(fd);
    return source;
}

}  // namespace

std::vector<Ipv4Interface> local_ipv4_interfaces() {
    std::vector<Ipv4Interface> out;
    ifaddrs* list = nullptr;
    if (::getifaddrs(&list) != 0) return out;
    for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
        if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_UP) == 0) continue;
        out.push_back({i->ifa_name, ipv4_text(*reinterpret_cast<const sockaddr_in*>(i->ifa_addr))});
    }
    ::freeifaddrs(list);
    return out;
}

std::string gloo_bind_host(const RankEnv& env, const std::function<const char*(const char*)>& getenv) {
    const auto is_local = [](const std::string& address) {
        for (const Ipv4Interface& i : local_ipv4_interfaces()) {
            if (i.address == address) return true;
        }
        return false;
    };
    if (const char* host = getenv("TRAINER_GLOO_HOST"); host != nullptr && *host != '\0') {
        std::string why;
        const std::string address = resolve_ipv4(host, &why);
        if (address.empty()) {
            user_error("rank {}: TRAINER_GLOO_HOST \"{}\" names no IPv4 address ({}); this machine's interfaces: {}",
                       env.rank, host, why, interfaces_text());
        }
        if (!is_local(address)) {
            user_error(
                "rank {}: TRAINER_GLOO_HOST \"{}\" ({}) is not an address of this machine, so Gloo cannot listen "
                "on it; this machine's interfaces: {}",
                env.rank, host, address, interfaces_text());
        }
        return address;
    }
    if (const char* names = getenv("GLOO_SOCKET_IFNAME"); names != nullptr && *names != '\0') {
        const std::string list = names;
        const std::string name = list.substr(0, list.find(','));
        for (const Ipv4Interface& i : local_ipv4_interfaces()) {
            if (i.name == name) return i.address;
        }
        user_error(
            "rank {}: GLOO_SOCKET_IFNAME \"{}\": this machine has no interface {} that is up with an IPv4 "
            "address; this machine's interfaces: {}",
            env.rank, list, name, interfaces_text());
    }
    if (env.num_nodes() == 1) return "127.0.0.1";
    std::string why;
    const std::string source = route_source(env.master_addr, env.master_port, &why);
    if (source.empty()) {
        user_error(
            "rank {}: no route from this machine to MASTER_ADDR \"{}\" ({}), so no address to listen on for the "
            "other nodes; set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on (this machine's: "
            "{})",
            env.rank, env.master_addr, why, interfaces_text());
    }
    return source;
}

}  // namespace trainer

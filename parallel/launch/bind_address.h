// Which of this machine's addresses a rank's Gloo pairs listen on, and the other ranks connect to.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "parallel/launch/rank_env.h"

namespace trainer {

// This machine's IPv4 addresses on interfaces that are up, loopback included, as getifaddrs lists them.
struct Ipv4Interface {
    std::string name, address;
};
std::vector<Ipv4Interface> local_ipv4_interfaces();

// Where this rank's Gloo pairs listen, the first that applies:
//   TRAINER_GLOO_HOST: an address or host name of this machine;
//   GLOO_SOCKET_IFNAME (PyTorch's setting, which torchrun users know): that interface's IPv4 address (of a
//     comma-separated list, the first: a rank listens on one);
//   one node: loopback;
//   several: the address this machine sends to MASTER_ADDR from (the kernel's route to it, looked up by
//     connecting a UDP socket, which sends nothing). On a node with one address besides loopback that is the
//     address; on node 0 it is MASTER_ADDR itself.
// A setting naming no address or interface of this machine, or a MASTER_ADDR this machine has no route to, is a
// UserError naming the setting and listing the interfaces.
std::string gloo_bind_host(const RankEnv& env, const std::function<const char*(const char*)>& getenv);

}  // namespace trainer

// The rendezvous store's wire protocol (parallel/tcp_store.h): each input, its runs expanded (fuzz_common.h), is
// sent to one store of this process as a stranger would send it (before any handshake: the first byte chooses) or
// as a job's client would after proving the secret, and the connection is left to the store. Whatever the bytes,
// the store must neither crash nor grow past libFuzzer's memory limit, and a job's client must still be served
// after each input.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>

#include "fuzz_common.h"
#include "parallel/launch/store_secret.h"
#include "parallel/launch/tcp_store.h"

namespace {

const std::string kSecret = "fuzz-job";

trainer::TcpStoreServer& server() {
    static auto* s = new trainer::TcpStoreServer(0, kSecret);  // for the whole run
    return *s;
}

int connect_raw() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server().port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(fd);
        return -1;
    }
    timeval tv{0, 200000};  // a request that waits (G, W) is not waited for here
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

// The client's side of the handshake (as TcpStore does it); false where the store did not accept it.
bool prove(int fd) {
    char hello[17];
    if (::recv(fd, hello, sizeof hello, MSG_WAITALL) != 17 || hello[0] != 'H') return false;
    const std::string server_nonce(hello + 1, 16), client_nonce(16, '\x5a');
    const std::string msg = "client" + server_nonce + client_nonce;
    const trainer::Digest mac = trainer::hmac_sha256(kSecret, msg.data(), msg.size());
    const std::string reply = "A" + client_nonce + std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
    if (::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(reply.size())) return false;
    char ok[33];
    return ::recv(fd, ok, sizeof ok, MSG_WAITALL) == 33 && ok[0] == 'O';
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    const bool as_client = (data[0] & 1) != 0;  // after the handshake, or as a stranger
    const std::string bytes = fuzz::expand(data + 1, size - 1);
    const int fd = connect_raw();
    if (fd < 0) __builtin_trap();  // the store stopped listening
    if (!as_client || prove(fd)) (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    char sink[4096];
    while (::recv(fd, sink, sizeof sink, 0) > 0) {
    }
    ::close(fd);
    // A job's client is still served.
    trainer::TcpStore client("127.0.0.1", server().port(), std::chrono::milliseconds(5000), kSecret);
    client.set("fuzz/alive", {1});
    if (client.get("fuzz/alive").size() != 1) __builtin_trap();
    return 0;
}

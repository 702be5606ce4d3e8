// TCP key-value store for the rendezvous (see tcp_store.h).
//
// Wire format, one request at a time per connection (little-endian):
//   'S' key value            -> 'O'
//   'G' key timeout_ms(u64)  -> 'O' value | 'T'        (waits for the key)
//   'W' n key... timeout_ms  -> 'O' | 'T'              (waits for all keys)
//   'C' n key...             -> n bytes of 0/1         (which keys exist)
// where key and value are a u32 length and the bytes.
#include "parallel/tcp_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/common.h"

namespace trainer {
namespace {

bool write_full(int fd, const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
        const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w;
        n -= static_cast<size_t>(w);
    }
    return true;
}

bool read_full(int fd, void* data, size_t n) {
    char* p = static_cast<char*>(data);
    while (n > 0) {
        const ssize_t r = ::recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        p += r;
        n -= static_cast<size_t>(r);
    }
    return true;
}

bool read_bytes(int fd, std::string& out) {
    uint32_t len = 0;
    if (!read_full(fd, &len, 4)) return false;
    out.resize(len);
    return len == 0 || read_full(fd, &out[0], len);
}

bool write_bytes(int fd, const void* data, uint32_t len) {
    return write_full(fd, &len, 4) && write_full(fd, data, len);
}

}  // namespace

TcpStoreServer::TcpStoreServer(int port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (listen_fd_ < 0) user_error("rendezvous store: cannot create a socket ({})", std::strerror(errno));
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, 1024) != 0) {
        const int err = errno;
        ::close(listen_fd_);
        user_error("rendezvous store: cannot listen on port {} ({}); is another run using MASTER_PORT {}?", port,
                   std::strerror(err), port);
    }
    socklen_t len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
}

TcpStoreServer::~TcpStoreServer() {
    stopping_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    if (acceptor_.joinable()) acceptor_.join();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (int fd : client_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    changed_.notify_all();
    for (auto& t : clients_) t.join();
    for (int fd : client_fds_) ::close(fd);
}

void TcpStoreServer::accept_loop() {
    while (!stopping_) {
        const int fd = ::accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) {
            if (errno == EINTR) continue;
            return;  // the listening socket was closed
        }
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        std::lock_guard<std::mutex> lock(mutex_);
        client_fds_.push_back(fd);
        clients_.emplace_back([this, fd] { serve(fd); });
    }
}

void TcpStoreServer::serve(int fd) {
    for (;;) {
        char op = 0;
        if (!read_full(fd, &op, 1)) return;
        if (op == 'S') {
            std::string key, value;
            if (!read_bytes(fd, key) || !read_bytes(fd, value)) return;
            {
                std::lock_guard<std::mutex> lock(mutex_);
                data_[key] = std::vector<char>(value.begin(), value.end());
            }
            changed_.notify_all();
            if (!write_full(fd, "O", 1)) return;
        } else if (op == 'G' || op == 'W' || op == 'C') {
            std::vector<std::string> keys;
            uint32_t n = 1;
            if (op != 'G' && !read_full(fd, &n, 4)) return;
            keys.resize(n);
            for (auto& k : keys) {
                if (!read_bytes(fd, k)) return;
            }
            uint64_t timeout_ms = 0;
            if (op != 'C' && !read_full(fd, &timeout_ms, 8)) return;
            std::unique_lock<std::mutex> lock(mutex_);
            if (op == 'C') {
                std::string present(keys.size(), '\0');
                for (size_t i = 0; i < keys.size(); ++i) present[i] = data_.count(keys[i]) ? 1 : 0;
                lock.unlock();
                if (!write_full(fd, present.data(), present.size())) return;
                continue;
            }
            const auto all_there = [&] {
                if (stopping_) return true;
                for (const auto& k : keys) {
                    if (!data_.count(k)) return false;
                }
                return true;
            };
            const bool ok = changed_.wait_for(lock, std::chrono::milliseconds(timeout_ms), all_there) && !stopping_;
            if (!ok) {
                lock.unlock();
                if (!write_full(fd, "T", 1)) return;
                continue;
            }
            if (op == 'G') {
                const std::vector<char> value = data_[keys[0]];
                lock.unlock();
                if (!write_full(fd, "O", 1) || !write_bytes(fd, value.data(), static_cast<uint32_t>(value.size()))) {
                    return;
                }
            } else {
                lock.unlock();
                if (!write_full(fd, "O", 1)) return;
            }
        } else {
            return;  // not our protocol: drop the connection
        }
    }
}

TcpStore::TcpStore(const std::string& host, int port, std::chrono::milliseconds timeout)
    : host_(host), port_(port), timeout_(timeout), io_timeout_(timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const std::string error = connect_once(std::chrono::milliseconds(0));
        if (error.empty()) break;
        if (std::chrono::steady_clock::now() >= deadline) {
            user_error(
                "rendezvous store: could not reach {} within {} s ({}); is rank 0 running, and are "
                "MASTER_ADDR/MASTER_PORT the same on every rank?",
                address(), timeout.count() / 1000.0, error);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

std::string TcpStore::connect_once(std::chrono::milliseconds limit) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
    if (gai != 0) user_error("rendezvous store: cannot resolve MASTER_ADDR \"{}\" ({})", host_, gai_strerror(gai));
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (limit.count() > 0) {  // connect(2) gives up after the send timeout
        timeval tv{};
        tv.tv_sec = static_cast<time_t>(limit.count() / 1000);
        tv.tv_usec = static_cast<suseconds_t>((limit.count() % 1000) * 1000);
        ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    const int rc = ::connect(fd_, res->ai_addr, res->ai_addrlen);
    const int err = errno;
    ::freeaddrinfo(res);
    if (rc != 0) {
        ::close(fd_);
        fd_ = -1;
        return std::strerror(err);
    }
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return "";
}

TcpStore::~TcpStore() {
    if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::address() const { return fmt::format("{}:{}", host_, port_); }

std::unique_ptr<TcpStore> TcpStore::another_connection() const {
    auto other = std::make_unique<TcpStore>(host_, port_, timeout_);
    other->set_key_prefix(key_prefix_);
    return other;
}

void TcpStore::arm(std::chrono::milliseconds wait) {
    if (fd_ < 0 && reconnect_) {
        const std::string error = connect_once(io_timeout_);
        if (!error.empty()) user_error("rendezvous store {}: cannot connect again ({})", address(), error);
    }
    if (fd_ < 0) user_error("rendezvous store {}: the connection was closed after an earlier failure", address());
    auto as_timeval = [](std::chrono::milliseconds t) {
        timeval tv{};
        tv.tv_sec = static_cast<time_t>(t.count() / 1000);
        tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
        return tv;
    };
    const timeval send = as_timeval(io_timeout_), recv = as_timeval(wait + io_timeout_);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &send, sizeof send);
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &recv, sizeof recv);
}

void TcpStore::fail(const char* what) {
    const bool timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
    ::close(fd_);
    fd_ = -1;
    if (timed_out) {
        user_error("rendezvous store {}: no answer {} within {} s (its host unreachable?)", address(), what,
                   io_timeout_.count() / 1000.0);
    }
    user_error("rendezvous store {}: connection lost {} (the process hosting it exited?)", address(), what);
}

void TcpStore::send_all(const void* data, size_t n) {
    if (!write_full(fd_, data, n)) fail("sending");
}

void TcpStore::recv_all(void* data, size_t n) {
    errno = 0;
    if (!read_full(fd_, data, n)) fail("receiving");
}

void TcpStore::send_string(const std::string& s) {
    const uint32_t len = static_cast<uint32_t>(s.size());
    send_all(&len, 4);
    send_all(s.data(), s.size());
}

std::string TcpStore::recv_string() {
    uint32_t len = 0;
    recv_all(&len, 4);
    std::string s(len, '\0');
    if (len) recv_all(&s[0], len);
    return s;
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
    std::lock_guard<std::mutex> lock(mutex_);
    arm(std::chrono::milliseconds(0));
    send_all("S", 1);
    send_string(key_prefix_ + key);
    send_string(std::string(data.begin(), data.end()));
    char ok = 0;
    recv_all(&ok, 1);
}

std::vector<char> TcpStore::get(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    arm(timeout_);
    send_all("G", 1);
    send_string(key_prefix_ + key);
    const uint64_t ms = static_cast<uint64_t>(timeout_.count());
    send_all(&ms, 8);
    char status = 0;
    recv_all(&status, 1);
    if (status != 'O') {
        user_error("rendezvous store {}: key \"{}\" did not appear within {} s", address(), key, ms / 1000.0);
    }
    const std::string v = recv_string();
    return std::vector<char>(v.begin(), v.end());
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
    std::lock_guard<std::mutex> lock(mutex_);
    arm(timeout);
    send_all("W", 1);
    const uint32_t n = static_cast<uint32_t>(keys.size());
    send_all(&n, 4);
    for (const auto& k : keys) send_string(key_prefix_ + k);
    const uint64_t ms = static_cast<uint64_t>(timeout.count());
    send_all(&ms, 8);
    char status = 0;
    recv_all(&status, 1);
    if (status != 'O') {
        user_error("rendezvous store {}: {} key(s) starting with \"{}\" did not appear within {} s", address(),
                   keys.size(), keys.empty() ? "" : keys[0], ms / 1000.0);
    }
}

std::vector<bool> TcpStore::check(const std::vector<std::string>& keys) {
    std::lock_guard<std::mutex> lock(mutex_);
    arm(std::chrono::milliseconds(0));
    send_all("C", 1);
    const uint32_t n = static_cast<uint32_t>(keys.size());
    send_all(&n, 4);
    for (const auto& k : keys) send_string(key_prefix_ + k);
    std::string present(keys.size(), '\0');
    if (!keys.empty()) recv_all(&present[0], keys.size());
    std::vector<bool> out(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) out[i] = present[i] != 0;
    return out;
}

void rendezvous_barrier(TcpStore& store, const std::string& prefix, int rank, int world) {
    store.set(fmt::format("{}/arrived/{}", prefix, rank), {1});
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back(fmt::format("{}/arrived/{}", prefix, r));
    try {
        store.wait(keys);
    } catch (const UserError&) {
        const std::vector<bool> present = store.check(keys);
        std::string missing;
        int n_missing = 0;
        for (int r = 0; r < world; ++r) {
            if (present[r]) continue;
            if (n_missing < 16) missing += (n_missing ? ", " : "") + std::to_string(r);
            ++n_missing;
        }
        user_error("rendezvous at {} timed out after {} s: rank(s) {} of {} never arrived (rank {} waited)",
                   store.address(), store.timeout().count() / 1000.0, missing + (n_missing > 16 ? ", ..." : ""), world,
                   rank);
    }
}

}  // namespace trainer

// TCP key-value store for the rendezvous (see tcp_store.h).
//
// Wire format (little-endian). First the handshake, each side proving the job's secret (HMAC-SHA256 of the two
// random nonces, so the secret never travels and an answer cannot be replayed):
//   server: 'H' nonce_s[16]
//   client: 'A' nonce_c[16] hmac(secret, "client" nonce_s nonce_c)
//   server: 'O' hmac(secret, "server" nonce_s nonce_c)  | 'R' (refused; the connection closes)
// then one request at a time:
//   'S' key value            -> 'O'
//   'G' key timeout_ms(u64)  -> 'O' value | 'T'        (waits for the key)
//   'W' n key... timeout_ms  -> 'O' | 'T'              (waits for all keys)
//   'C' n key...             -> n bytes of 0/1         (which keys exist)
// where key and value are a u32 length and the bytes. A length past its bound, an unknown request or a closed
// socket ends the connection.
#include "parallel/launch/tcp_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <random>

#include "base/common.h"
#include "parallel/launch/store_secret.h"

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

bool read_bytes(int fd, std::string& out, uint32_t max) {
    uint32_t len = 0;
    if (!read_full(fd, &len, 4) || len > max) return false;
    out.resize(len);
    return len == 0 || read_full(fd, &out[0], len);
}

bool write_bytes(int fd, const void* data, uint32_t len) {
    return write_full(fd, &len, 4) && write_full(fd, data, len);
}

constexpr size_t kNonceBytes = 16;
using Nonce = std::array<uint8_t, kNonceBytes>;

Nonce random_nonce() {
    static thread_local std::random_device rd("/dev/urandom");
    Nonce n;
    for (size_t i = 0; i < n.size(); i += 4) {
        const uint32_t r = rd();
        std::memcpy(n.data() + i, &r, 4);
    }
    return n;
}

// What one side answers: HMAC-SHA256 over its role and both nonces.
Digest answer(const std::string& secret, const char* role, const Nonce& server, const Nonce& client) {
    std::string msg(role);
    msg.append(reinterpret_cast<const char*>(server.data()), server.size());
    msg.append(reinterpret_cast<const char*>(client.data()), client.size());
    return hmac_sha256(secret, msg.data(), msg.size());
}

void set_timeouts(int fd, std::chrono::milliseconds t) {
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(t.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

}  // namespace

TcpStoreServer::TcpStoreServer(int port, std::string secret) : secret_(std::move(secret)) {
    TRAINER_CHECK(!secret_.empty(), "the rendezvous store needs the job's secret");
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

// Stopping answers what the connections are being served first: their reading side is shut, so each thread ends at
// its next request, but a request already read (a set being acknowledged, a wait, answered 'X') is answered before
// its connection closes. Without this, a launcher that exits as soon as it sees another node's last key could cut
// that node off before its set was acknowledged, and fail a run that had ended well. A client that does not read
// its answers has kStopDrainSeconds before its connection is cut both ways.
TcpStoreServer::~TcpStoreServer() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    if (acceptor_.joinable()) acceptor_.join();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (const auto& c : clients_) ::shutdown(c->fd, SHUT_RD);
    }
    changed_.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kStopDrainSeconds);
    const auto all_done = [&] {
        for (const auto& c : clients_)
            if (!c->done) return false;
        return true;
    };
    while (!all_done() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    for (const auto& c : clients_) {
        if (!c->done) ::shutdown(c->fd, SHUT_RDWR);
    }
    for (const auto& c : clients_) c->thread.join();
    for (const auto& c : clients_) ::close(c->fd);
}

int TcpStoreServer::connections() {
    std::lock_guard<std::mutex> lock(mutex_);
    reap();
    return static_cast<int>(clients_.size());
}

void TcpStoreServer::reap() {
    for (auto it = clients_.begin(); it != clients_.end();) {
        if (!(*it)->done) {
            ++it;
            continue;
        }
        (*it)->thread.join();
        ::close((*it)->fd);
        it = clients_.erase(it);
    }
}

void TcpStoreServer::accept_loop() {
    while (!stopping_) {
        const int fd = ::accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) {
            if (errno == EINTR) continue;
            return;  // the listening socket was closed
        }
        std::lock_guard<std::mutex> lock(mutex_);
        reap();
        if (pending_ >= kMaxPendingConnections) {  // a flood of strangers: refused before a thread is spent
            ::close(fd);
            continue;
        }
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        ++pending_;
        auto client = std::make_unique<Client>();
        Client* c = client.get();
        c->fd = fd;
        c->thread = std::thread([this, c] {
            const bool ok = handshake(c->fd);
            --pending_;
            if (ok) {
                try {
                    serve(c->fd);
                } catch (const std::exception&) {
                    // A request this connection could not be served (memory): it ends, the store goes on.
                }
            }
            ::shutdown(c->fd, SHUT_RDWR);
            c->done = true;
        });
        clients_.push_back(std::move(client));
    }
}

bool TcpStoreServer::handshake(int fd) {
    set_timeouts(fd, std::chrono::seconds(kHandshakeSeconds));
    const Nonce server = random_nonce();
    char hello[1 + kNonceBytes] = {'H'};
    std::memcpy(hello + 1, server.data(), kNonceBytes);
    if (!write_full(fd, hello, sizeof hello)) return false;
    char op = 0;
    Nonce client;
    Digest theirs;
    if (!read_full(fd, &op, 1) || op != 'A' || !read_full(fd, client.data(), client.size()) ||
        !read_full(fd, theirs.data(), theirs.size())) {
        return false;
    }
    if (!same_digest(theirs, answer(secret_, "client", server, client))) {
        (void)write_full(fd, "R", 1);
        return false;
    }
    const Digest ours = answer(secret_, "server", server, client);
    if (!write_full(fd, "O", 1) || !write_full(fd, ours.data(), ours.size())) return false;
    set_timeouts(fd, std::chrono::milliseconds(0));  // a served rank may wait long between requests
    return true;
}

void TcpStoreServer::serve(int fd) {
    for (;;) {
        char op = 0;
        if (!read_full(fd, &op, 1)) return;
        if (op == 'S') {
            std::string key, value;
            if (!read_bytes(fd, key, kMaxKeyBytes) || !read_bytes(fd, value, kMaxValueBytes)) return;
            {
                std::lock_guard<std::mutex> lock(mutex_);
                data_[key] = std::vector<char>(value.begin(), value.end());
            }
            changed_.notify_all();
            if (!write_full(fd, "O", 1)) return;
        } else if (op == 'G' || op == 'W' || op == 'C') {
            std::vector<std::string> keys;
            uint32_t n = 1;
            if (op != 'G' && (!read_full(fd, &n, 4) || n > kMaxKeysPerRequest)) return;
            keys.resize(n);
            for (auto& k : keys) {
                if (!read_bytes(fd, k, kMaxKeyBytes)) return;
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
            const auto present = [&] {
                for (const auto& k : keys) {
                    if (!data_.count(k)) return false;
                }
                return true;
            };
            const auto all_there = [&] { return stopping_ || present(); };
            // Waited in slices of a second, so a client that went away (its socket closed) frees this thread within
            // one, whatever timeout it asked for.
            const auto deadline = std::chrono::steady_clock::now() +
                                  std::chrono::milliseconds(std::min<uint64_t>(timeout_ms, 1ull << 40));
            bool ok = false;
            for (;;) {
                const auto left = deadline - std::chrono::steady_clock::now();
                ok = changed_.wait_for(
                    lock, std::min<std::chrono::steady_clock::duration>(left, std::chrono::seconds(1)), all_there);
                if (ok || std::chrono::steady_clock::now() >= deadline) break;
                char peek = 0;
                if (::recv(fd, &peek, 1, MSG_PEEK | MSG_DONTWAIT) == 0) return;  // the client is gone
            }
            if (stopping_) ok = present();  // woken by the stop: the keys may be there all the same
            if (!ok) {
                lock.unlock();
                // 'X': the store is stopping (its host's run is ending), 'T': the keys did not come in time.
                if (!write_full(fd, stopping_ ? "X" : "T", 1)) return;
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

TcpStore::TcpStore(const std::string& host, int port, std::chrono::milliseconds timeout, std::string secret)
    : host_(host), port_(port), secret_(std::move(secret)), timeout_(timeout), io_timeout_(timeout) {
    TRAINER_CHECK(!secret_.empty(), "the rendezvous store needs the job's secret");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        // Each attempt (its connect(2) and the handshake) is bounded by what is left of the timeout: a host whose
        // firewall drops the packets would otherwise hold connect(2) in its SYN retries for minutes.
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        const std::string error = connect_once(std::max(left, std::chrono::milliseconds(1)));
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
        // connect(2) past its send timeout: nothing answered (the packets dropped, or the host gone).
        if (err == EINPROGRESS || err == EAGAIN) return "no answer to the connection";
        return std::strerror(err);
    }
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    const std::string error = handshake(limit.count() > 0 ? limit : io_timeout_);
    if (!error.empty()) {
        ::close(fd_);
        fd_ = -1;
    }
    return error;
}

std::string TcpStore::handshake(std::chrono::milliseconds limit) {
    set_timeouts(fd_, limit);
    char hello[1 + kNonceBytes];
    if (!read_full(fd_, hello, sizeof hello) || hello[0] != 'H') {
        return "no rendezvous store's greeting there (another service on that port, or the store is full)";
    }
    Nonce server, client = random_nonce();
    std::memcpy(server.data(), hello + 1, kNonceBytes);
    const Digest mine = answer(secret_, "client", server, client);
    char reply[1 + kNonceBytes + 32] = {'A'};
    std::memcpy(reply + 1, client.data(), kNonceBytes);
    std::memcpy(reply + 1 + kNonceBytes, mine.data(), mine.size());
    char status = 0;
    if (!write_full(fd_, reply, sizeof reply) || !read_full(fd_, &status, 1)) return "the store closed the handshake";
    if (status == 'R') {
        ::close(fd_);
        fd_ = -1;
        user_error(
            "rendezvous store {}: refused this process's secret: every process of the job needs the same {} (or {}); "
            "trainer launch sets it for its ranks, mpirun and Slurm need it given (scripts/launch_mpirun.sh)",
            address(), kStoreSecretEnv, kStoreSecretFileEnv);
    }
    Digest theirs;
    if (status != 'O' || !read_full(fd_, theirs.data(), theirs.size())) return "the store closed the handshake";
    if (!same_digest(theirs, answer(secret_, "server", server, client))) {
        ::close(fd_);
        fd_ = -1;
        user_error(
            "rendezvous store {}: the process listening there does not know this job's {}: another job's "
            "store at MASTER_ADDR:MASTER_PORT?",
            address(), kStoreSecretEnv);
    }
    return "";
}

TcpStore::~TcpStore() {
    if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::address() const { return fmt::format("{}:{}", host_, port_); }

std::unique_ptr<TcpStore> TcpStore::another_connection() const {
    auto other = std::make_unique<TcpStore>(host_, port_, timeout_, secret_);
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

void TcpStore::stopped_while(const std::string& what) {
    ::close(fd_);
    fd_ = -1;
    user_error("rendezvous store {}: the store stopped {} (the process hosting it is ending: its run ended or failed)",
               address(), what);
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
    TRAINER_CHECK(key_prefix_.size() + key.size() <= kMaxKeyBytes && data.size() <= kMaxValueBytes,
                  "rendezvous store: key {} of {} bytes with a value of {} bytes is past the store's bounds", key,
                  key_prefix_.size() + key.size(), data.size());
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
    if (status == 'X') stopped_while(fmt::format("waiting for key \"{}\"", key));
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
    if (status == 'X') {
        stopped_while(
            fmt::format("waiting for {} key(s) starting with \"{}\"", keys.size(), keys.empty() ? "" : keys[0]));
    }
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

namespace {

// `bytes` as text safe to print: printable ASCII and well-formed UTF-8 as they are, every other byte as \xNN.
std::string printable(const std::vector<char>& bytes, size_t max_bytes) {
    const size_t n = std::min(bytes.size(), max_bytes);
    const auto at = [&](size_t i) { return static_cast<unsigned char>(bytes[i]); };
    std::string out;
    for (size_t i = 0; i < n;) {
        const unsigned char c = at(i);
        if (c >= 0x20 && c < 0x7f) {
            out += static_cast<char>(c), ++i;
            continue;
        }
        // A UTF-8 sequence: its lead byte says its length; every continuation byte is 10xxxxxx.
        const size_t len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        bool whole = len > 0 && i + len <= n;
        for (size_t k = 1; whole && k < len; ++k) whole = (at(i + k) & 0xC0) == 0x80;
        if (whole) {
            out.append(bytes.data() + i, len), i += len;
        } else {
            out += fmt::format("\\x{:02x}", c), ++i;
        }
    }
    if (bytes.size() > max_bytes) out += "...";
    return out;
}

}  // namespace

std::string TcpStore::get_text(const std::string& key, size_t max_bytes) { return printable(get(key), max_bytes); }

std::vector<long> TcpStore::get_ints(const std::string& key, size_t count, long lo, long hi) {
    const std::vector<char> value = get(key);
    const std::string text(value.begin(), value.end());
    std::vector<long> out;
    size_t i = 0;
    bool ok = text.size() <= 24 * count;
    while (ok && out.size() < count) {
        if (!out.empty()) ok = i < text.size() && text[i++] == ' ';
        size_t digits = 0;
        while (ok && i + digits < text.size() && text[i + digits] >= '0' && text[i + digits] <= '9') ++digits;
        ok = ok && digits > 0 && digits <= 18;
        if (!ok) break;
        const long v = std::stol(text.substr(i, digits));
        ok = v >= lo && v <= hi;
        out.push_back(v);
        i += digits;
    }
    if (!ok || i != text.size()) {
        user_error(
            "rendezvous store {}: key {} holds \"{}\", not {} number(s) from {} to {} separated by spaces; "
            "is another job using this MASTER_ADDR and MASTER_PORT with the same secret?",
            address(), key, printable(value, 64), count, lo, hi);
    }
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

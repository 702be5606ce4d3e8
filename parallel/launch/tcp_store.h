// The rendezvous store: a TCP key-value store hosted by rank 0 at MASTER_ADDR:MASTER_PORT. Every rank
// (rank 0 included) is a client; Gloo's full-mesh connection (and later the NCCL unique id) is exchanged
// through it. Every blocking call has a timeout and fails with an error that names the address and, for
// a rendezvous, the ranks that never arrived.
//
// Whatever reaches the port is a stranger until it proves it knows the job's secret (parallel/store_secret.h):
// a connection is served only after a challenge and response both ways, within kHandshakeSeconds; lengths are
// bounded (kMaxKeyBytes, kMaxValueBytes, kMaxKeysPerRequest) and a bad request ends its connection, never the
// process; at most kMaxPendingConnections connections wait to prove themselves at once (the rest are closed at
// once), and a connection's thread is reaped when it ends.
#pragma once

#include <gloo/rendezvous/store.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace trainer {

constexpr uint32_t kMaxKeyBytes = 4096;
constexpr uint32_t kMaxValueBytes = 16u << 20;
constexpr uint32_t kMaxKeysPerRequest = 1u << 16;
constexpr int kMaxPendingConnections = 256;
constexpr int kHandshakeSeconds = 10;
constexpr int kStopDrainSeconds = 2;  // a stopping server's wait for the answers it is writing (~TcpStoreServer)

// The server side: a map of keys to bytes, served to the clients that know `secret`, one thread each.
class TcpStoreServer {
   public:
    // Listens on all interfaces at `port` (0: any free port; see port()). UserError if it cannot bind.
    TcpStoreServer(int port, std::string secret);
    // Answers the requests it is serving (a wait: "the store stopped"), then closes every connection.
    ~TcpStoreServer();
    TcpStoreServer(const TcpStoreServer&) = delete;
    TcpStoreServer& operator=(const TcpStoreServer&) = delete;
    int port() const { return port_; }

    // Connections being served or proving themselves now (for tests and reports).
    int connections();

   private:
    struct Client {
        int fd = -1;
        std::thread thread;
        std::atomic<bool> done{false};
    };
    void accept_loop();
    // The challenge and response both ways; false: not the job's (the connection is closed).
    bool handshake(int fd);
    void serve(int fd);
    // Joins the threads of ended connections and closes their sockets (mutex_ held).
    void reap();

    std::string secret_;
    int listen_fd_ = -1;
    int port_ = 0;
    std::atomic<bool> stopping_{false};
    std::atomic<int> pending_{0};  // connections that have not yet proved the secret
    std::thread acceptor_;
    std::mutex mutex_;
    std::condition_variable changed_;
    std::map<std::string, std::vector<char>> data_;
    std::list<std::unique_ptr<Client>> clients_;
};

// A client connection, usable as Gloo's rendezvous store.
class TcpStore : public gloo::rendezvous::Store {
   public:
    // Connects to host:port, retrying until `timeout` (rank 0 may start last), and proves `secret` to it (and it to
    // this: a store that does not know the secret is refused). A store that refuses the secret is a UserError at
    // once, naming TRAINER_STORE_SECRET.
    TcpStore(const std::string& host, int port, std::chrono::milliseconds timeout, std::string secret);
    ~TcpStore() override;

    void set(const std::string& key, const std::vector<char>& data) override;
    // Blocks until the key exists or the timeout passes (UserError naming the key and the address).
    std::vector<char> get(const std::string& key) override;
    void wait(const std::vector<std::string>& keys) override;
    void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
    // Which of `keys` exist now (no waiting).
    std::vector<bool> check(const std::vector<std::string>& keys);
    // What a rank reads from the store is checked before use, whoever wrote it. get_text: a value shown in a message
    // (a host name, another rank's or node's reason): at most `max_bytes` (cut, with "..."), and every byte outside
    // printable ASCII and UTF-8 shown as \xNN, so no terminal escape or NUL passes through.
    std::string get_text(const std::string& key, size_t max_bytes);
    // get_ints: `count` decimal integers separated by single spaces, each in [lo, hi]; anything else is a UserError
    // naming the key, what it holds (as get_text shows it) and what was expected.
    std::vector<long> get_ints(const std::string& key, size_t count, long lo, long hi);
    std::string address() const;
    std::chrono::milliseconds timeout() const { return timeout_; }
    // Every key this client sets, gets, waits for or checks starts with `prefix` from now on: the ranks of one
    // restart round of `trainer launch --max-restarts` meet in the launcher's store apart from the other rounds.
    void set_key_prefix(const std::string& prefix) { key_prefix_ = prefix; }
    // How long a call may wait for the server beyond what it asks the server to wait (default: the timeout). A call
    // that exceeds it, or loses the connection, fails with a UserError and closes the connection: every later call
    // fails at once (an answer that came late would be read as the next call's).
    void set_io_timeout(std::chrono::milliseconds t) { io_timeout_ = t; }
    // With `on`, a call after such a failure connects again first (one attempt, bounded by the io timeout) instead
    // of failing at once: for a connection that must outlive a link that was down for a while.
    void set_reconnect(bool on) { reconnect_ = on; }
    // A second connection to the same store, with the same timeout and key prefix: for a thread whose calls must not
    // wait behind another's (a call holds its connection until it is answered).
    std::unique_ptr<TcpStore> another_connection() const;

   private:
    // Bounds the next call's sends by the io timeout and its receives by `wait` (what the server may wait) plus it.
    void arm(std::chrono::milliseconds wait);
    // One attempt to connect, its connect(2) and then the handshake bounded by `limit` where positive (else the
    // handshake by the io timeout); the error text, "" on success. A refused secret is a UserError (retrying cannot
    // help).
    std::string connect_once(std::chrono::milliseconds limit);
    std::string handshake(std::chrono::milliseconds limit);
    void fail(const char* what);
    // The server answered 'X' (it is stopping) to a call `what` names: the connection is closed, UserError.
    [[noreturn]] void stopped_while(const std::string& what);
    void send_all(const void* data, size_t n);
    void recv_all(void* data, size_t n);
    void send_string(const std::string& s);
    std::string recv_string();

    std::string host_;
    int port_;
    std::string secret_;
    std::chrono::milliseconds timeout_, io_timeout_;
    std::string key_prefix_;
    int fd_ = -1;
    bool reconnect_ = false;
    std::mutex mutex_;
};

// Joins the rendezvous of `world` ranks: every rank announces itself under `prefix`, then waits for all
// the others. On timeout the error names the ranks that never arrived and the store's address.
void rendezvous_barrier(TcpStore& store, const std::string& prefix, int rank, int world);

}  // namespace trainer

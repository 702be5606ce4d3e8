// The rendezvous store against strangers (parallel/tcp_store.h, parallel/store_secret.h): the secret's hash against
// the published vectors, a client or a server without the job's secret refused both ways, garbage, oversized
// lengths and thousands of connections ending only their own connections with the store's memory bounded, and a
// training run finishing as usual while its store's port is flooded; `trainer launch` makes a secret for its ranks,
// and ranks started any other way without one are refused by name.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "parallel/launch/store_secret.h"
#include "parallel/launch/tcp_store.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::TempDir;

namespace {

std::string hex(const Digest& d) {
    std::string out;
    for (const uint8_t b : d) out += fmt::format("{:02x}", b);
    return out;
}

// A raw TCP connection to the store on this machine (or -1).
int raw_connect(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(fd);
        return -1;
    }
    return fd;
}

// A socket listening on loopback with `backlog` (its address in *addr), standing in for a store.
int listen_local(int backlog, sockaddr_in* addr) {
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    *addr = sockaddr_in{};
    addr->sin_family = AF_INET;
    addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(addr), sizeof *addr) == 0);
    REQUIRE(::listen(listener, backlog) == 0);
    socklen_t len = sizeof *addr;
    ::getsockname(listener, reinterpret_cast<sockaddr*>(addr), &len);
    return listener;
}

void send_raw(int fd, const std::string& bytes) { (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL); }

// Whether the peer closed `fd` within `seconds` (reads until end of stream, discarding).
bool closed_by_peer(int fd, int seconds) {
    timeval tv{seconds, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[256];
    for (;;) {
        const ssize_t r = ::recv(fd, buf, sizeof buf, 0);
        if (r == 0) return true;
        if (r < 0) return errno == ECONNRESET;
    }
}

std::string u32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }

// A raw connection that has proved `secret` to the store by hand (as TcpStore does it), ready for a request no
// TcpStore would send.
int raw_proven(int port, const std::string& secret) {
    const int fd = raw_connect(port);
    REQUIRE(fd >= 0);
    char hello[17];
    REQUIRE(::recv(fd, hello, sizeof hello, MSG_WAITALL) == 17);
    std::string nonce_s(hello + 1, 16), nonce_c(16, '\x07');
    const std::string mac_msg = "client" + nonce_s + nonce_c;
    const Digest mac = hmac_sha256(secret, mac_msg.data(), mac_msg.size());
    send_raw(fd, "A" + nonce_c + std::string(reinterpret_cast<const char*>(mac.data()), mac.size()));
    char ok[33];
    REQUIRE(::recv(fd, ok, sizeof ok, MSG_WAITALL) == 33);
    REQUIRE(ok[0] == 'O');
    return fd;
}

}  // namespace

TEST_CASE("store: SHA-256 and HMAC-SHA256 give the published test vectors") {
    CHECK(hex(sha256("", 0)) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(hex(sha256("abc", 3)) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 56 bytes: 2 blocks
    CHECK(hex(sha256(two_blocks.data(), two_blocks.size())) ==
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    const std::string million(1000000, 'a');
    CHECK(hex(sha256(million.data(), million.size())) ==
          "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    // RFC 4231 cases 1, 2 and 6 (a key longer than the block, hashed first).
    const std::string hi = "Hi There", jefe = "what do ya want for nothing?";
    CHECK(hex(hmac_sha256(std::string(20, '\x0b'), hi.data(), hi.size())) ==
          "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    CHECK(hex(hmac_sha256("Jefe", jefe.data(), jefe.size())) ==
          "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    const std::string big = "Test Using Larger Than Block-Size Key - Hash Key First";
    CHECK(hex(hmac_sha256(std::string(131, '\xaa'), big.data(), big.size())) ==
          "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    CHECK(same_digest(sha256("x", 1), sha256("x", 1)));
    CHECK_FALSE(same_digest(sha256("x", 1), sha256("y", 1)));
    CHECK(new_store_secret().size() == 64);
    CHECK(new_store_secret() != new_store_secret());
}

TEST_CASE("store: the secret comes from TRAINER_STORE_SECRET or its file and an empty one is refused by name") {
    TempDir dir;
    const std::string file = dir.path("secret");
    std::ofstream(file) << "from-a-file\n";
    const auto env = [&](std::map<std::string, std::string> vars) {
        return [vars](const char* name) -> const char* {
            const auto it = vars.find(name);
            return it == vars.end() ? nullptr : it->second.c_str();
        };
    };
    CHECK_FALSE(store_secret_from_env(env({})).has_value());
    CHECK(store_secret_from_env(env({{"TRAINER_STORE_SECRET", "abc"}})) == "abc");
    CHECK(store_secret_from_env(env({{"TRAINER_STORE_SECRET_FILE", file}})) == "from-a-file");
    CHECK(store_secret_from_env(env({{"TRAINER_STORE_SECRET", "x"}, {"TRAINER_STORE_SECRET_FILE", file}})) == "x");
    REQUIRE_THROWS_WITH(store_secret_from_env(env({{"TRAINER_STORE_SECRET", ""}})),
                        Contains("TRAINER_STORE_SECRET is set but empty"));
    REQUIRE_THROWS_WITH(store_secret_from_env(env({{"TRAINER_STORE_SECRET_FILE", dir.path("none")}})),
                        Contains("TRAINER_STORE_SECRET_FILE " + dir.path("none") + ": cannot be read"));
}

TEST_CASE("store: a client without the job's secret is refused by name and reads or writes nothing") {
    TcpStoreServer server(0, "the-job");
    TcpStore ours("127.0.0.1", server.port(), std::chrono::milliseconds(2000), "the-job");
    ours.set("rendezvous/key", {'o', 'k'});
    REQUIRE_THROWS_WITH(TcpStore("127.0.0.1", server.port(), std::chrono::milliseconds(2000), "a-stranger"),
                        Contains("refused this process's secret") && Contains("TRAINER_STORE_SECRET"));
    // A stranger that skips the handshake: its requests end its connection, and nothing changes.
    const int fd = raw_connect(server.port());
    REQUIRE(fd >= 0);
    send_raw(fd, "S" + u32(14) + "rendezvous/key" + u32(3) + "bad");
    send_raw(fd, "G" + u32(14) + "rendezvous/key" + std::string(8, '\0'));
    CHECK(closed_by_peer(fd, 15));
    ::close(fd);
    const std::vector<char> v = ours.get("rendezvous/key");
    CHECK(std::string(v.begin(), v.end()) == "ok");
}

TEST_CASE("store: a server that cannot prove the job's secret is not trusted") {
    // A listener that greets as the store does and accepts any answer, but cannot answer for the secret.
    sockaddr_in addr;
    const int listener = listen_local(4, &addr);
    std::thread impostor([listener] {
        const int fd = ::accept(listener, nullptr, nullptr);
        send_raw(fd, "H" + std::string(16, '\x42'));
        char reply[1 + 16 + 32];
        (void)!::recv(fd, reply, sizeof reply, MSG_WAITALL);
        send_raw(fd, "O" + std::string(32, '\0'));
        closed_by_peer(fd, 5);
        ::close(fd);
    });
    REQUIRE_THROWS_WITH(TcpStore("127.0.0.1", ntohs(addr.sin_port), std::chrono::milliseconds(3000), "the-job"),
                        Contains("does not know this job's TRAINER_STORE_SECRET"));
    impostor.join();
    ::close(listener);
}

TEST_CASE("store: distributed_timeout_seconds bounds the first connection where the packets are dropped") {
    // A listener whose queue is full and never accepted: the kernel drops further connection requests, as a firewall
    // that drops packets does, and connect(2) alone would wait out its retries (minutes).
    sockaddr_in addr;
    const int listener = listen_local(0, &addr);
    const int port = ntohs(addr.sin_port);
    std::vector<int> queued;
    for (int i = 0; i < 4; ++i) {
        const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        (void)!::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
        queued.push_back(fd);
    }
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE_THROWS_WITH(TcpStore("127.0.0.1", port, std::chrono::milliseconds(1500), "the-job"),
                        Contains("could not reach 127.0.0.1:" + std::to_string(port) + " within 1.5 s"));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(seconds < 3.0);
    for (const int fd : queued) ::close(fd);
    ::close(listener);
}

TEST_CASE("store: garbage oversized lengths and 5000 connections end only their own connections") {
    TcpStoreServer server(0, "the-job");
    TcpStore ours("127.0.0.1", server.port(), std::chrono::milliseconds(5000), "the-job");
    ours.set("k", {'1'});
    const long before = test_util::resident_bytes();
    // A client that proves the secret, then asks the store to hold 4 GiB, and one that asks for 2^32 keys.
    for (const std::string& request : {"S" + u32(1) + "k" + u32(0xFFFFFFFFu), "W" + u32(0xFFFFFFFFu)}) {
        const int fd = raw_proven(server.port(), "the-job");
        send_raw(fd, request);
        CHECK(closed_by_peer(fd, 15));
        ::close(fd);
    }
    // 5,000 strangers, up to 1,000 open at once, some sending garbage, none proving anything.
    for (int round = 0; round < 5; ++round) {
        std::vector<int> fds;
        for (int i = 0; i < 1000; ++i) {
            const int fd = raw_connect(server.port());
            if (fd < 0) continue;
            if (i % 3 == 0) send_raw(fd, std::string("\xff\xff\xff\xff garbage", 13));
            fds.push_back(fd);
        }
        CHECK(fds.size() > 900);
        CHECK(server.connections() <= kMaxPendingConnections + 2);  // the flood never holds more threads
        for (const int fd : fds) ::close(fd);
    }
    // The job's own clients are served as before, and the strangers' threads are gone.
    ours.set("k2", {'2'});
    const std::vector<char> v = ours.get("k");
    CHECK(std::string(v.begin(), v.end()) == "1");
    TcpStore late("127.0.0.1", server.port(), std::chrono::milliseconds(5000), "the-job");
    CHECK(late.check({"k", "k2", "nope"}) == std::vector<bool>{true, true, false});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kHandshakeSeconds + 5);
    while (server.connections() > 2 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(server.connections() == 2);
    const long grown = test_util::resident_bytes() - before;
    INFO("resident memory grown by " << grown / 1048576.0 << " MiB");
    CHECK(grown < 64L << 20);
}

TEST_CASE("store: a server that stops answers the calls it is serving and a client that reads nothing cannot hold it") {
    // A wait being served when the store stops is told so, not cut off: the same answer-before-close that lets a
    // set being acknowledged finish while the launcher hosting the store exits.
    auto server = std::make_unique<TcpStoreServer>(0, "the-job");
    TcpStore waiter("127.0.0.1", server->port(), std::chrono::milliseconds(30000), "the-job");
    TcpStore other("127.0.0.1", server->port(), std::chrono::milliseconds(5000), "the-job");
    other.set("there", {'1'});
    std::string error;
    std::atomic<bool> calling{false};
    std::thread t([&] {
        try {
            calling = true;
            waiter.wait({"never"}, std::chrono::milliseconds(30000));
        } catch (const UserError& e) {
            error = e.what();
        }
    });
    // The same wait by hand, its request sent before the stop: the server answers what it has read, whenever it
    // reads it (a stopping server's connections still deliver what they hold, and nothing more).
    const int by_hand = raw_proven(server->port(), "the-job");
    const uint64_t ms = 30000;
    send_raw(by_hand, "W" + u32(1) + u32(5) + "never" + std::string(reinterpret_cast<const char*>(&ms), 8));
    // A client that asks for 64 MiB of answers and reads none: the server's thread blocks writing them.
    other.set("big", std::vector<char>(8 << 20, 'b'));
    const int greedy = raw_proven(server->port(), "the-job");
    for (int i = 0; i < 8; ++i)
        send_raw(greedy, "G" + u32(3) + "big" + std::string(reinterpret_cast<const char*>(&ms), 8));
    while (!calling) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the waits and the writes are being served
    const auto t0 = std::chrono::steady_clock::now();
    server.reset();
    const double stop_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t.join();
    ::close(greedy);
    char answer = 0;
    CHECK(::recv(by_hand, &answer, 1, MSG_WAITALL) == 1);
    CHECK(answer == 'X');  // "the store stopped", not a timeout ('T') or a cut connection
    CHECK(closed_by_peer(by_hand, 5));
    ::close(by_hand);
    CHECK_THAT(error, Contains("the store stopped waiting for 1 key(s) starting with \"never\" (the process hosting "
                               "it is ending"));
    INFO("stopped in " << stop_seconds << " s");
    CHECK(stop_seconds >= kStopDrainSeconds - 0.5);  // the greedy client's thread was given its time
    CHECK(stop_seconds < kStopDrainSeconds + 3.0);   // and no more
    CHECK_THROWS_WITH(other.get("there"), Contains("connection lost"));
}

TEST_CASE("store: a 2-rank run trains to its end while 5000 strangers flood its store's port", "[heavy]") {
    TempDir dir;
    const std::string log = dir.path("log.txt"), metrics = dir.path("m.jsonl");
    const std::vector<std::string> argv = test_util::launch_command(
        2, {"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--strategy", "fsdp",
            "--max-duration", "1000", "--threads", "1", "--metrics-file", metrics});
    const std::string port = *(std::find(argv.begin(), argv.end(), "--master-port") + 1);
    const pid_t launcher = test_util::start_logged(argv, log);
    REQUIRE(launcher > 0);
    auto newest_step = [&] {
        long step = 0;
        for (const auto& r : test_util::read_metrics(metrics)) step = std::max(step, r.value("step", 0L));
        return step;
    };
    const bool training = test_util::wait_until([&] { return newest_step() >= 2; }, 60);
    const pid_t rank0 = test_util::launched_rank_pid(log, 0);  // it hosts the store
    if (!training || rank0 <= 0) ::kill(launcher, SIGKILL);
    INFO(test_util::read_file_if_exists(log));
    REQUIRE(training);
    REQUIRE(rank0 > 0);
    const long before = test_util::resident_bytes(rank0);
    // 5,000 strangers in batches of 500 held open together: a third send a huge length and garbage, a third send a
    // few bytes of nothing, a third send nothing; none proves the secret.
    long peak = before;
    int connected = 0;
    for (int batch = 0; batch < 10; ++batch) {
        std::vector<int> fds;
        for (int i = 0; i < 500; ++i) {
            const int fd = raw_connect(std::stoi(port));
            if (fd < 0) continue;
            ++connected;
            if (i % 3 == 0) send_raw(fd, "S" + u32(0x7FFFFFFF) + "garbage");
            if (i % 3 == 1) send_raw(fd, std::string("\x01\x02", 2));
            fds.push_back(fd);
        }
        peak = std::max(peak, test_util::resident_bytes(rank0));
        for (const int fd : fds) ::close(fd);
    }
    peak = std::max(peak, test_util::resident_bytes(rank0));
    const long during = newest_step();
    const int code = test_util::wait_exit_code(launcher);
    const std::string text = test_util::read_file(log);
    INFO(text);
    CHECK(connected > 4500);
    INFO("the flood ended at step " << during);
    CHECK(during < 1000);  // the flood came while the run trained
    INFO("rank 0's resident memory grew by " << (peak - before) / 1048576.0 << " MiB");
    CHECK(peak - before < 64L << 20);
    CHECK(code == 0);
    CHECK_THAT(text, Contains("done: 1000 steps"));
}

TEST_CASE("store: what a rank reads is checked: text is shown safely and sizes are refused by key") {
    TcpStoreServer server(0, "the-job");
    TcpStore store("127.0.0.1", server.port(), std::chrono::milliseconds(5000), "the-job");
    auto set = [&](const std::string& key, const std::string& value) {
        store.set(key, std::vector<char>(value.begin(), value.end()));
    };
    set("text", std::string("h\xc3\xa9te\x1b[2J\0\x80\xc3", 12) + std::string(5000, 'x'));
    CHECK(store.get_text("text", 12) == "h\xc3\xa9te\\x1b[2J\\x00\\x80\\xc3...");
    CHECK(store.get_text("text", 20).size() < 40);
    set("sizes", "16 8");
    CHECK(store.get_ints("sizes", 2, 1, 1 << 24) == std::vector<long>{16, 8});
    for (const char* bad : {"16", "16 8 4", "16  8", "-1 8", "16 0", "99999999999999999999 8", "16 8\n", "x 8", ""}) {
        CAPTURE(bad);
        set("sizes", bad);
        try {
            store.get_ints("sizes", 2, 1, 1 << 24);
            FAIL("accepted");
        } catch (const UserError& e) {
            CHECK_THAT(e.what(), Contains("key sizes holds \"") && Contains("not 2 number(s) from 1 to 16777216"));
        }
    }
}

TEST_CASE("store: a rank that reads a world from the store that is not two sizes is refused by key") {
    // The store a rank 1 started by hand meets holds a trainer/world that no rank 0 of this trainer writes.
    TcpStoreServer server(0, test_util::kStoreSecret);
    TcpStore store("127.0.0.1", server.port(), std::chrono::milliseconds(5000), test_util::kStoreSecret);
    const std::string world = "2 2\x1b]0;owned\x07";
    store.set("trainer/world", std::vector<char>(world.begin(), world.end()));
    const auto r = test_util::run_trainer(
        {"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--max-duration", "2",
         "--strategy", "ddp", "--threads", "1"},
        {"RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
         "MASTER_PORT=" + std::to_string(server.port()), "TRAINER_STORE_SECRET=" + test_util::kStoreSecret});
    INFO(r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("key trainer/world holds \"2 2\\x1b]0;owned\\x07\", not 2 number(s)"));
    CHECK_THAT(r.err, !Contains("\x1b"));
}

TEST_CASE("store: trainer launch makes a secret for its ranks and ranks started otherwise without one are refused") {
    // One node: the launcher makes one.
    const auto launched =
        test_util::run_trainer(test_util::launch_args(2, {"--config", "configs/tiny.json", "--data",
                                                          test_util::fixture("olmo_tiny_tokens.u16"), "--max-duration",
                                                          "2", "--strategy", "ddp", "--threads", "1"}),
                               {"-TRAINER_STORE_SECRET"});
    INFO(launched.out << launched.err);
    CHECK(launched.exit_code == 0);
    // Several launcher nodes: it must be given.
    const auto nodes = test_util::run_trainer(
        {"launch", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--", "--config", "configs/tiny.json"},
        {"-TRAINER_STORE_SECRET"});
    CHECK(nodes.exit_code != 0);
    CHECK_THAT(nodes.err, Contains("launch --nnodes 2: TRAINER_STORE_SECRET is not set"));
    // A rank started by hand (or by mpirun, or srun) of a job of two.
    const auto by_hand = test_util::run_trainer(
        {"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--max-duration", "2",
         "--strategy", "ddp"},
        {"-TRAINER_STORE_SECRET", "RANK=1", "WORLD_SIZE=2", "MASTER_PORT=" + test_util::free_port()});
    CHECK(by_hand.exit_code != 0);
    CHECK_THAT(by_hand.err, Contains("TRAINER_STORE_SECRET is not set: the 2 ranks of this job") &&
                                Contains("trainer launch sets it for its ranks on one node"));
}

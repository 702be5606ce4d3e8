// The CUDA execution model emulated on fibers: see simt.h.
#include "simt.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>
// SIMT_UCONTEXT: glibc's switch on x86-64 too (to check that path where it is the only one).
#if !defined(__x86_64__) || defined(SIMT_UCONTEXT)
#define SIMT_OWN_SWITCH 0
#include <ucontext.h>
#else
#define SIMT_OWN_SWITCH 1
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/element.h"

#if defined(__SANITIZE_ADDRESS__)
#define SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SIMT_ASAN 1
#endif
#endif
#ifdef SIMT_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// A fiber switch on x86-64: the callee-saved registers, the SSE and x87 control words pushed on the stack being left,
// its stack pointer stored at *from, and the same popped from the stack at `to`. glibc's swapcontext also saves and
// restores the signal mask, one system call each way, and the whole floating-point environment: 90% of the emulated
// kernel tests' time went there (the fibers switch at every barrier and warp collective).
#if SIMT_OWN_SWITCH
extern "C" void simt_switch_stack(void** from, void* to);
asm(R"(
    .pushsection .text
    .p2align 4
    .type simt_switch_stack, @function
simt_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch_stack, .-simt_switch_stack
    .popsection
)");
#endif

namespace simt {
namespace {

constexpr size_t kStackBytes = size_t{256} << 10;  // a thread's stack (ASan's redzones need room)
constexpr size_t kSlotBytes = 40;                  // the most a lane gives a warp collective (wgmma: 10 words)

enum class State { kRunnable, kBarrier, kWarp, kDone };
enum class Op : uint8_t { kShfl, kVote, kLdmatrix, kLdmatrixTrans, kMma, kWgmma };
const char* op_name(Op op) {
    switch (op) {
        case Op::kShfl:
            return "shfl.sync.bfly";
        case Op::kVote:
            return "vote.sync.all";
        case Op::kLdmatrix:
            return "ldmatrix.x4";
        case Op::kLdmatrixTrans:
            return "ldmatrix.x4.trans";
        case Op::kMma:
            return "mma.sync.m16n8k16";
        case Op::kWgmma:
            return "wgmma.mma_async.m64nNk16";
    }
    return "?";
}

struct Copy {
    uint8_t* dst;
    const uint8_t* src;
    bool valid;
};

// A lane's operands of a wgmma.mma_async (the same on every lane but `a`).
struct WgmmaIn {
    uint64_t desc_a, desc_b;
    uint32_t a[4];  // A from registers: this lane's fragment
    int32_t n;
    uint32_t flags;  // kRegA | kTransB | kAccumulate
};
constexpr uint32_t kRegA = 1, kTransB = 2, kAccumulate = 4;
// An issued wgmma of one lane, carried out when its group is retired: the warp's A fragments (from registers), and
// this lane's accumulators.
struct PendingWgmma {
    float* d;
    WgmmaIn in;
    uint32_t a_warp[32][4];
};

// A warpgroup-wide instruction a thread issued (wgmma.fence, wgmma.mma_async, wgmma.commit_group and
// wgmma.wait_group are all .sync.aligned over the warpgroup: its 128 threads must issue the same ones, in the same
// order, with the same operands but A's registers).
struct WarpgroupOp {
    enum Kind : uint8_t { kFence, kMma, kCommit, kWait } kind;
    uint64_t desc_a = 0, desc_b = 0;  // wgmma: A's descriptor (0 with A from registers) and B's
    int32_t n = 0;                    // wgmma: N; wait_group: its count
    uint32_t flags = 0;               // wgmma: kRegA | kTransB | kAccumulate
};
bool same(const WarpgroupOp& x, const WarpgroupOp& y) {
    return x.kind == y.kind && x.desc_a == y.desc_a && x.desc_b == y.desc_b && x.n == y.n && x.flags == y.flags;
}
std::string describe(const WarpgroupOp& op) {
    switch (op.kind) {
        case WarpgroupOp::kFence:
            return "wgmma.fence";
        case WarpgroupOp::kMma:
            return fmt::format("wgmma.mma_async n{} (A {:#x}, B {:#x}, flags {})", op.n, op.desc_a, op.desc_b,
                               op.flags);
        case WarpgroupOp::kCommit:
            return "wgmma.commit_group";
        case WarpgroupOp::kWait:
            return fmt::format("wgmma.wait_group {}", op.n);
    }
    return "?";
}

// A stack with a guard page below it: an overflow faults instead of writing over the neighbour's.
class Stack {
   public:
    Stack() {
        page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        void* p = mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::runtime_error("simt: cannot map a thread stack");
        base_ = static_cast<char*>(p);
        mprotect(base_, page_, PROT_NONE);
    }
    Stack(const Stack&) = delete;
    Stack& operator=(const Stack&) = delete;
    ~Stack() { munmap(base_, kStackBytes + page_); }
    char* bottom() const { return base_ + page_; }

   private:
    char* base_ = nullptr;
    size_t page_ = 0;
};

// Where a switch resumes a thread or the scheduler: a saved stack pointer on x86-64, a ucontext elsewhere.
#if SIMT_OWN_SWITCH
using Context = void*;
void switch_context(Context* from, Context* to) { simt_switch_stack(from, *to); }
#else
using Context = ucontext_t;
void switch_context(Context* from, Context* to) { swapcontext(from, to); }
#endif

struct Fiber {
    Context ctx{};
    Stack* stack = nullptr;  // from the emulator's pool while the thread runs (started and not yet ended)
    Dim3 tid;
    State state = State::kDone;
    unsigned collectives = 0;              // warp collectives entered: the parity of the slots it uses
    std::vector<Copy> open;                // cp.async copies issued since the last commit
    std::deque<std::vector<Copy>> groups;  // committed groups not yet retired, oldest first
    std::vector<PendingWgmma> wgmma_open;  // wgmma issued since the last wgmma.commit_group
    std::deque<std::vector<PendingWgmma>> wgmma_groups;
    std::vector<WarpgroupOp> warpgroup_ops;  // this thread's, in order
    void* asan_fake_stack = nullptr;
};

struct Slot {
    Op op;
    unsigned collective;
    alignas(8) unsigned char data[kSlotBytes];
};
using WarpSlots = std::array<std::array<Slot, 32>, 2>;  // two parities of 32 lane slots

// Thrown inside a fiber once its fault is recorded; caught where the fiber starts.
struct Fault {};

struct Emulator {
    std::vector<Fiber> fibers;
    // Thread stacks: a thread takes one when it first runs and gives it back when it ends, so the threads of a
    // kernel that never wait for one another run one after another on the same stack (in cache), and a block whose
    // threads all wait at a barrier holds one a thread.
    std::vector<std::unique_ptr<Stack>> stacks;
    std::vector<Stack*> free_stacks;
    std::vector<WarpSlots> warps;
    Context scheduler{};
    const void* scheduler_stack = nullptr;
    size_t scheduler_stack_size = 0;
    Fiber* current = nullptr;
    Dim3 block_idx, block_dim, grid_dim;
    std::vector<uint8_t> smem;
    // Per 16 bytes of smem: the thread whose landed cp.async no fence.proxy.async has covered since, or -1.
    std::vector<int32_t> unfenced;
    const std::function<void()>* body = nullptr;
    std::string error;  // the block's first fault
    std::mt19937_64 rng{1};
};
Emulator the_emulator;
Emulator& emu() { return the_emulator; }

Fiber& self() {
    Fiber* f = emu().current;
    if (!f) throw std::logic_error("simt: a CUDA built-in called outside a kernel launched by simt::launch");
    return *f;
}

std::string block_name() {
    const Dim3& b = emu().block_idx;
    const Dim3& g = emu().grid_dim;
    if (g.z > 1) return fmt::format("({}, {}, {})", b.x, b.y, b.z);
    return g.y > 1 ? fmt::format("({}, {})", b.x, b.y) : fmt::format("{}", b.x);
}

[[noreturn]] void fault(const std::string& what) {
    Emulator& e = emu();
    const Fiber& f = self();
    if (e.error.empty()) {
        e.error = fmt::format("block {} thread {} (warp {} lane {}): {}", block_name(), f.tid.x, f.tid.x / 32,
                              f.tid.x % 32, what);
    }
    throw Fault{};
}

void start_context(Fiber& f);

// A stack for f from the pool.
void take_stack(Fiber& f) {
    Emulator& e = emu();
    if (e.free_stacks.empty()) {
        e.stacks.push_back(std::make_unique<Stack>());
        e.free_stacks.push_back(e.stacks.back().get());
    }
    f.stack = e.free_stacks.back();
    e.free_stacks.pop_back();
    start_context(f);
}

// f's stack back to the pool. A thread that ended (kDone) unwound every frame but the few of its last switch
// (fiber_main's, wait_as's), which lie between its saved stack pointer and the top: under ASan only their shadow is
// cleared. One stopped on the way (a fault or a deadlock ended its block) has its whole stack cleared.
void give_back_stack(Fiber& f) {
    if (f.stack == nullptr) return;
#ifdef SIMT_ASAN
    char* low = f.stack->bottom();
#if SIMT_OWN_SWITCH
    if (f.state == State::kDone) low = std::max(low, static_cast<char*>(f.ctx) - 256);
#endif
    __asan_unpoison_memory_region(low, static_cast<size_t>(f.stack->bottom() + kStackBytes - low));
#endif
    emu().free_stacks.push_back(f.stack);
    f.stack = nullptr;
}

// The scheduler into fiber f, until f waits or ends; f takes a stack when it first runs and gives it back when it
// ends.
void resume(Fiber& f) {
    Emulator& e = emu();
    if (f.stack == nullptr) take_stack(f);
    e.current = &f;
    detail::current_thread = &f.tid;
#ifdef SIMT_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack->bottom(), kStackBytes);
#endif
    switch_context(&e.scheduler, &f.ctx);
#ifdef SIMT_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    e.current = nullptr;
    detail::current_thread = nullptr;
    if (f.state == State::kDone) give_back_stack(f);
}

// The current fiber back to the scheduler, in state s; returns when the scheduler resumes it (never for kDone).
void wait_as(State s) {
    Emulator& e = emu();
    Fiber& f = self();
    f.state = s;
#ifdef SIMT_ASAN
    __sanitizer_start_switch_fiber(s == State::kDone ? nullptr : &f.asan_fake_stack, e.scheduler_stack,
                                   e.scheduler_stack_size);
#endif
    switch_context(&f.ctx, &e.scheduler);
#ifdef SIMT_ASAN
    __sanitizer_finish_switch_fiber(f.asan_fake_stack, nullptr, nullptr);
#endif
}

void fiber_main() {
    Emulator& e = emu();
#ifdef SIMT_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &e.scheduler_stack, &e.scheduler_stack_size);
#endif
    try {
        (*e.body)();
        const Fiber& f = self();
        if (!f.open.empty() || !f.groups.empty()) fault("the thread ended with cp.async copies it never waited for");
        if (!f.wgmma_open.empty() || !f.wgmma_groups.empty()) {
            fault("the thread ended with wgmma.mma_async operations it never waited for");
        }
    } catch (const Fault&) {
    } catch (const std::exception& ex) {
        if (e.error.empty()) e.error = fmt::format("block {} thread {}: {}", block_name(), self().tid.x, ex.what());
    } catch (...) {
        if (e.error.empty()) e.error = fmt::format("block {} thread {}: an exception", block_name(), self().tid.x);
    }
    wait_as(State::kDone);
}

// f's context set to enter fiber_main on its own stack at its next switch.
void start_context(Fiber& f) {
#if SIMT_OWN_SWITCH
    // What simt_switch_stack pops, from the stack's top down: a null return address above fiber_main's (its caller:
    // none, for unwinders), fiber_main's, six zero registers (rbp null ends frame-pointer walks), then the control
    // words as this thread has them. fiber_main is entered as if called: with the stack 8 bytes past a 16-byte
    // boundary.
    auto* top = reinterpret_cast<uint64_t*>(f.stack->bottom() + kStackBytes);
    uint64_t* sp = top - 2;
    sp[1] = 0;
    sp[0] = reinterpret_cast<uint64_t>(&fiber_main);
    for (int i = 0; i < 6; ++i) *--sp = 0;
    uint32_t mxcsr = 0;
    uint16_t x87 = 0;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(x87));
    *--sp = static_cast<uint64_t>(mxcsr) | static_cast<uint64_t>(x87) << 32;
    f.ctx = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack->bottom();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

// A lane's entry into a warp collective: its input into its slot, then wait for the warp's 32 lanes; returns
// the slots of every lane.
template <class In>
const std::array<Slot, 32>& exchange(Op op, const In& in) {
    static_assert(sizeof(In) <= kSlotBytes && std::is_trivially_copyable_v<In>, "a lane's input fits its slot");
    Emulator& e = emu();
    Fiber& f = self();
    auto& slots = e.warps[f.tid.x / 32][f.collectives & 1];
    Slot& s = slots[f.tid.x % 32];
    s.op = op;
    s.collective = f.collectives++;
    std::memcpy(s.data, &in, sizeof in);
    wait_as(State::kWarp);
    return slots;
}
template <class In>
In input_of(const std::array<Slot, 32>& slots, unsigned lane) {
    In v;
    std::memcpy(&v, slots[lane].data, sizeof v);
    return v;
}

std::string states(unsigned n) {
    const Emulator& e = emu();
    std::string s;
    for (unsigned w = 0; w < n / 32; ++w) {
        int done = 0, barrier = 0, warp = 0;
        for (unsigned l = 0; l < 32; ++l) {
            const State st = e.fibers[w * 32 + l].state;
            done += st == State::kDone, barrier += st == State::kBarrier, warp += st == State::kWarp;
        }
        s += fmt::format("{}warp {}: {} ended, {} at a barrier, {} in a warp collective", w ? "; " : "", w, done,
                         barrier, warp);
    }
    return s;
}

// Every thread of a warpgroup issued the same warpgroup instructions (the first thread's); a block of threads that
// do not fill their warpgroup issued none.
void check_warpgroups(unsigned n) {
    const Emulator& e = emu();
    for (unsigned t = 0; t < n; ++t) {
        const std::vector<WarpgroupOp>& mine = e.fibers[t].warpgroup_ops;
        const unsigned first = t / 128 * 128;
        if (first + 128 > n && !mine.empty()) {
            throw std::runtime_error(
                fmt::format("simt: block {} thread {}: {} in a block of {} threads, which do not fill the thread's "
                            "warpgroup of 128",
                            block_name(), t, describe(mine[0]), n));
        }
        const std::vector<WarpgroupOp>& ref = e.fibers[first].warpgroup_ops;
        size_t i = 0;
        while (i < mine.size() && i < ref.size() && same(mine[i], ref[i])) ++i;
        if (i == mine.size() && i == ref.size()) continue;
        throw std::runtime_error(
            fmt::format("simt: block {} warpgroup {}: thread {} (warp {}) issued {} as its warpgroup instruction {}, "
                        "where thread {} (warp {}) issued {}: wgmma's instructions are .sync.aligned, the warpgroup's "
                        "128 threads must issue the same",
                        block_name(), t / 128, t, t / 32, i < mine.size() ? describe(mine[i]) : "nothing", i, first,
                        first / 32, i < ref.size() ? describe(ref[i]) : "nothing"));
    }
}

void run_block(Dim3 b, unsigned n) {
    Emulator& e = emu();
    e.block_idx = b;
    detail::current_block = b;
    e.error.clear();
    std::fill(e.smem.begin(), e.smem.end(), uint8_t{0xFF});  // bf16 NaNs
    std::fill(e.unfenced.begin(), e.unfenced.end(), -1);
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = e.fibers[t];
        f.tid = Dim3(t, 0, 0);
        f.state = State::kRunnable;
        f.collectives = 0;
        f.open.clear();
        f.groups.clear();
        f.wgmma_open.clear();
        f.wgmma_groups.clear();
        f.warpgroup_ops.clear();
        f.asan_fake_stack = nullptr;
        // A thread of the block before that never ended (a fault or a deadlock stopped it): its stack is cleared
        // whole, since code of uninstrumented libraries (fmt, libstdc++) reaches ASan's checks through its
        // interceptors from frames that set no shadow of their own.
        give_back_stack(f);
    }
    // Each warp's chance of going on in a pass where it can, drawn again at every barrier.
    std::vector<double> speed(n / 32);
    const auto draw_speeds = [&] {
        for (double& v : speed) v = std::array<double, 3>{0.25, 0.5, 1.0}[e.rng() % 3];
    };
    draw_speeds();
    std::vector<unsigned> order, waiting, going;  // reused by every pass
    order.reserve(n);
    for (;;) {
        order.clear();
        for (unsigned t = 0; t < n; ++t) {
            if (e.fibers[t].state == State::kRunnable) order.push_back(t);
        }
        std::shuffle(order.begin(), order.end(), e.rng);
        for (unsigned t : order) {
            resume(e.fibers[t]);
            if (!e.error.empty()) throw std::runtime_error("simt: " + e.error);
        }
        // A warp whose 32 lanes wait in a collective goes on, at its speed (a slow warp goes on in some passes
        // only, so warps drift apart between barriers as they do on an SM, and a missing barrier lets one warp
        // overwrite what another still reads); then a barrier that every live thread reached. Where nothing else
        // can run, every waiting warp goes on.
        waiting.clear(), going.clear();
        for (unsigned w = 0; w < n / 32; ++w) {
            const Fiber* lanes = &e.fibers[w * 32];
            if (!std::all_of(lanes, lanes + 32, [](const Fiber& f) { return f.state == State::kWarp; })) continue;
            waiting.push_back(w);
            if (std::generate_canonical<double, 32>(e.rng) < speed[w]) going.push_back(w);
        }
        if (going.empty()) going = waiting;
        for (unsigned w : going) {
            Fiber* lanes = &e.fibers[w * 32];
            const Slot& s0 = e.warps[w][(lanes[0].collectives - 1) & 1][0];
            for (unsigned l = 1; l < 32; ++l) {
                const Slot& s = e.warps[w][(lanes[l].collectives - 1) & 1][l];
                if (s.op != s0.op || s.collective != s0.collective) {
                    throw std::runtime_error(fmt::format(
                        "simt: block {} warp {}: lane 0 is at {} (its collective {}) and lane {} at {} (its {})",
                        block_name(), w, op_name(s0.op), s0.collective, l, op_name(s.op), s.collective));
                }
            }
            for (unsigned l = 0; l < 32; ++l) lanes[l].state = State::kRunnable;
        }
        if (!going.empty()) continue;
        unsigned done = 0, barrier = 0;
        for (unsigned t = 0; t < n; ++t) {
            done += e.fibers[t].state == State::kDone;
            barrier += e.fibers[t].state == State::kBarrier;
        }
        if (done == n) return check_warpgroups(n);
        if (barrier + done == n) {
            for (unsigned t = 0; t < n; ++t) {
                if (e.fibers[t].state == State::kBarrier) e.fibers[t].state = State::kRunnable;
            }
            draw_speeds();
            continue;
        }
        throw std::runtime_error(fmt::format("simt: block {} deadlocks: {}", block_name(), states(n)));
    }
}

// p as a 16-byte access of the block's dynamic shared memory (addresses compared as integers: p may point
// anywhere).
uint8_t* checked_shared(const void* p, const char* what) {
    Emulator& e = emu();
    const auto base = reinterpret_cast<uintptr_t>(e.smem.data()), at = reinterpret_cast<uintptr_t>(p);
    const long long offset = static_cast<long long>(at - base);
    if (at < base || at + 16 > base + e.smem.size()) {
        fault(fmt::format("{} at shared offset {} of {} bytes", what, offset, e.smem.size()));
    }
    if (offset % 16 != 0) fault(fmt::format("{} at shared offset {}, not 16-byte aligned", what, offset));
    return e.smem.data() + offset;
}

uint16_t half_of(uint32_t word, unsigned half) { return static_cast<uint16_t>(word >> (16 * half)); }

}  // namespace

void set_schedule_seed(uint64_t seed) { emu().rng.seed(seed); }

void launch(Dim3 grid, Dim3 block, size_t smem, const std::function<void()>& body) {
    Emulator& e = emu();
    if (e.current) throw std::logic_error("simt: a launch inside a kernel");
    if (block.x == 0 || block.x % 32 != 0 || block.x > 1024 || block.y != 1 || block.z != 1) {
        throw std::invalid_argument(
            fmt::format("simt: blocks of {} x {} x {} threads (1-D, a multiple of 32, at most "
                        "1024)",
                        block.x, block.y, block.z));
    }
    while (e.fibers.size() < block.x) e.fibers.emplace_back();
    e.warps.resize(block.x / 32);
    e.smem.assign(smem, 0);
    e.unfenced.assign((smem + 15) / 16, -1);
    e.block_dim = Dim3(block.x);
    e.grid_dim = grid;
    detail::current_block_dim = e.block_dim;
    detail::current_grid_dim = grid;
    e.body = &body;
    for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
            for (unsigned x = 0; x < grid.x; ++x) run_block(Dim3(x, y, z), block.x);
        }
    }
    e.body = nullptr;
}

namespace detail {
const Dim3* current_thread = nullptr;
Dim3 current_block, current_block_dim, current_grid_dim;
void outside_kernel() {
    throw std::logic_error("simt: a CUDA built-in called outside a kernel launched by simt::launch");
}
}  // namespace detail
uint8_t* dynamic_shared() { return emu().smem.empty() ? nullptr : emu().smem.data(); }

void syncthreads() {
    Fiber& f = self();
    if (f.state != State::kRunnable) fault("__syncthreads from a thread that is not running");
    wait_as(State::kBarrier);
}

float shfl_xor(unsigned mask, float v, int lane_mask) {
    if (mask != 0xffffffffu) fault(fmt::format("__shfl_xor_sync with mask {:#x}: only full warps are emulated", mask));
    if (lane_mask < 0 || lane_mask > 31) fault(fmt::format("__shfl_xor_sync with lane mask {}", lane_mask));
    const unsigned lane = self().tid.x % 32;
    return input_of<float>(exchange(Op::kShfl, v), lane ^ static_cast<unsigned>(lane_mask));
}

bool all_sync(unsigned mask, bool pred) {
    if (mask != 0xffffffffu) fault(fmt::format("__all_sync with mask {:#x}: only full warps are emulated", mask));
    const auto& slots = exchange(Op::kVote, static_cast<int>(pred));
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (input_of<int>(slots, lane) == 0) return false;
    }
    return true;
}

void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
    const uint8_t* p = checked_shared(row, trans ? "ldmatrix.x4.trans row" : "ldmatrix.x4 row");
    const auto& slots = exchange(trans ? Op::kLdmatrixTrans : Op::kLdmatrix, p);
    const unsigned lane = self().tid.x % 32;
    // Element (row, col) of matrix i: b16 `col` of the row lane 8i + row gave.
    auto element = [&](unsigned i, unsigned rr, unsigned c) {
        uint16_t v;
        std::memcpy(&v, input_of<const uint8_t*>(slots, 8 * i + rr) + 2 * c, sizeof v);
        return uint32_t{v};
    };
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned a = lane / 4, c = 2 * (lane % 4);
        // Lane l holds (row l/4, cols 2(l%4), +1); with .trans, of the transposed matrix.
        r[i] = trans ? element(i, c, a) | element(i, c + 1, a) << 16 : element(i, a, c) | element(i, a, c + 1) << 16;
    }
}

void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    struct In {
        uint32_t a[4], b[2];
    };
    const In mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
    const auto& slots = exchange(Op::kMma, mine);
    const unsigned lane = self().tid.x % 32, g = lane / 4, t = lane % 4;
    // A (16 x 16, row): lane 4 (row % 8) + (col % 8) / 2, register (row / 8) + 2 (col / 8), half col % 2.
    auto A = [&](unsigned row, unsigned col) {
        const In in = input_of<In>(slots, 4 * (row % 8) + (col % 8) / 2);
        return trainer::bf16_to_float(half_of(in.a[row / 8 + 2 * (col / 8)], col % 2));
    };
    // B (16 x 8, col): lane 4 n + (k % 8) / 2, register k / 8, half k % 2.
    auto B = [&](unsigned k, unsigned n) {
        const In in = input_of<In>(slots, 4 * n + (k % 8) / 2);
        return trainer::bf16_to_float(half_of(in.b[k / 8], k % 2));
    };
    for (unsigned e = 0; e < 4; ++e) {
        const unsigned row = g + 8 * (e / 2), col = 2 * t + e % 2;
        float acc = d[e];
        for (unsigned k = 0; k < 16; ++k) acc = std::fma(A(row, k), B(k, col), acc);
        d[e] = acc;
    }
}

void cp_async16(void* dst, const void* src, bool valid) {
    uint8_t* q = checked_shared(dst, "cp.async destination");
    if (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0) fault("cp.async source not 16-byte aligned");
    std::memset(q, 0xFF, 16);  // NaN until the copy lands
    self().open.push_back({q, static_cast<const uint8_t*>(src), valid});
}

void cp_async_commit() {
    Fiber& f = self();
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}

void cp_async_wait(int n) {
    Fiber& f = self();
    if (n < 0) fault("cp.async.wait_group with a negative count");
    while (f.groups.size() > static_cast<size_t>(n)) {
        for (const Copy& c : f.groups.front()) {
            if (c.valid) {
                std::memcpy(c.dst, c.src, 16);
            } else {
                std::memset(c.dst, 0, 16);
            }
            emu().unfenced[static_cast<size_t>(c.dst - emu().smem.data()) / 16] = static_cast<int32_t>(f.tid.x);
        }
        f.groups.pop_front();
    }
}

uint32_t shared_address(const void* p) {
    Emulator& e = emu();
    const auto base = reinterpret_cast<uintptr_t>(e.smem.data()), at = reinterpret_cast<uintptr_t>(p);
    if (at < base || at > base + e.smem.size()) {
        fault(fmt::format("cvta.to.shared of an address outside the block's {} bytes of shared memory", e.smem.size()));
    }
    return static_cast<uint32_t>(at - base);
}

void fence_proxy_async() {
    Emulator& e = emu();
    const auto me = static_cast<int32_t>(self().tid.x);
    for (int32_t& owner : e.unfenced) {
        if (owner == me) owner = -1;
    }
}

void wgmma_fence() { self().warpgroup_ops.push_back({WarpgroupOp::kFence}); }

void wgmma_commit() {
    Fiber& f = self();
    f.warpgroup_ops.push_back({WarpgroupOp::kCommit});
    f.wgmma_groups.push_back(std::move(f.wgmma_open));
    f.wgmma_open.clear();
}

namespace {

// A wgmma descriptor's fields (PTX ISA, "Matrix Descriptor Format"), 128-byte swizzle only.
struct Descriptor {
    uint32_t start, lbo, sbo;
};
Descriptor decode(uint64_t d, const char* which) {
    const Descriptor r{static_cast<uint32_t>(d & 0x3FFF) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
                       static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4};
    const auto swizzle = static_cast<unsigned>(d >> 62), base_offset = static_cast<unsigned>((d >> 49) & 7);
    if (swizzle != 1)
        fault(fmt::format("wgmma {} descriptor with swizzle mode {}: only the 128-byte swizzle (1) is emulated", which,
                          swizzle));
    if (base_offset != 0)
        fault(fmt::format("wgmma {} descriptor with base offset {}: only 0 is emulated", which, base_offset));
    if ((r.start >> 7) & 7) {
        fault(
            fmt::format("wgmma {} descriptor starts at shared address {}: its 128-byte swizzle pattern must start on "
                        "a 1024-byte boundary (base offset 0)",
                        which, r.start));
    }
    return r;
}
// The shared-memory byte that holds element (mn, k) (k < 16) of an operand, as the 128-byte swizzle places it:
// K-major ((8,m),(8,2)) : ((128 B, SBO), (2 B, 16 B)); MN-major ((8,8,m),(8,2)) : ((2 B, 16 B, LBO), (128 B, SBO));
// then the 16-byte chunk XORed with the 128-byte row within 1024 bytes.
uint32_t operand_byte(const Descriptor& d, bool mn_major, unsigned mn, unsigned k) {
    const uint32_t a = mn_major ? d.start + (mn / 64) * d.lbo + (mn % 64) * 2 + (k / 8) * d.sbo + (k % 8) * 128
                                : d.start + (mn / 8) * d.sbo + (mn % 8) * 128 + k * 2;
    return a ^ (((a >> 7) & 7) << 4);
}
float operand_at(uint32_t byte, const char* which) {
    Emulator& e = emu();
    if (byte + 2 > e.smem.size()) {
        fault(
            fmt::format("wgmma reads {} at shared address {}, past the block's {} bytes", which, byte, e.smem.size()));
    }
    uint16_t v;
    std::memcpy(&v, e.smem.data() + byte, sizeof v);
    return trainer::bf16_to_float(v);
}

// This lane's share of one wgmma: rows 16 w + g and + 8 of the 64 (w the warp within its warpgroup), columns
// 8 j + 2 t and + 1 of every 8; fp32 fused multiply-adds in k order.
void run_wgmma(const PendingWgmma& p) {
    const Fiber& f = self();
    const unsigned lane = f.tid.x % 32, w = (f.tid.x / 32) % 4, g = lane / 4, t = lane % 4;
    const WgmmaIn& in = p.in;
    const bool reg_a = in.flags & kRegA, trans_b = in.flags & kTransB;
    const Descriptor da = reg_a ? Descriptor{} : decode(in.desc_a, "A"), db = decode(in.desc_b, "B");
    for (int i = 0; i < in.n / 2; ++i) {
        const unsigned r = g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
        float acc = (in.flags & kAccumulate) ? p.d[i] : 0.0f;
        for (unsigned k = 0; k < 16; ++k) {
            const float a =
                reg_a ? trainer::bf16_to_float(half_of(p.a_warp[4 * (r % 8) + (k % 8) / 2][r / 8 + 2 * (k / 8)], k % 2))
                      : operand_at(operand_byte(da, false, 16 * w + r, k), "A");
            acc = std::fma(a, operand_at(operand_byte(db, trans_b, col, k), "B"), acc);
        }
        p.d[i] = acc;
    }
}

}  // namespace

void wgmma_m64k16(float* d, int n, uint64_t desc_a, const uint32_t* a, uint64_t desc_b, bool trans_b, bool accumulate) {
    if (n < 8 || n > 256 || n % 8 != 0) fault(fmt::format("wgmma with n = {} (a multiple of 8 up to 256)", n));
    WgmmaIn mine{desc_a, desc_b, {}, n, (a ? kRegA : 0u) | (trans_b ? kTransB : 0u) | (accumulate ? kAccumulate : 0u)};
    if (a) std::copy(a, a + 4, mine.a);
    const auto& slots = exchange(Op::kWgmma, mine);
    PendingWgmma p{d, mine, {}};
    for (unsigned l = 0; l < 32; ++l) {
        const WgmmaIn other = input_of<WgmmaIn>(slots, l);
        if (other.n != n || other.flags != mine.flags || other.desc_b != desc_b || (!a && other.desc_a != desc_a)) {
            fault(fmt::format("wgmma operands differ between lanes 0..31 of the warp (lane {})", l));
        }
        std::copy(other.a, other.a + 4, p.a_warp[l]);
    }
    // What this lane's share reads must be visible to the async proxy when the wgmma is issued.
    Emulator& e = emu();
    const unsigned lane = self().tid.x % 32, w = (self().tid.x / 32) % 4, g = lane / 4, t = lane % 4;
    auto check = [&](uint32_t byte, const char* which) {
        operand_at(byte, which);
        if (e.unfenced[byte / 16] >= 0) {
            fault(
                fmt::format("wgmma reads {} at shared address {}, written by thread {}'s cp.async with no "
                            "fence.proxy.async since",
                            which, byte, e.unfenced[byte / 16]));
        }
    };
    const Descriptor da = a ? Descriptor{} : decode(desc_a, "A"), db = decode(desc_b, "B");
    for (unsigned k = 0; k < 16; ++k) {
        if (!a) {
            check(operand_byte(da, false, 16 * w + g, k), "A");
            check(operand_byte(da, false, 16 * w + g + 8, k), "A");
        }
        for (int j = 0; j < n / 8; ++j) {
            for (unsigned c = 0; c < 2; ++c) check(operand_byte(db, trans_b, 8 * j + 2 * t + c, k), "B");
        }
    }
    self().wgmma_open.push_back(p);
    self().warpgroup_ops.push_back({WarpgroupOp::kMma, a ? 0 : desc_a, desc_b, n, mine.flags});
}

void wgmma_wait(int n) {
    Fiber& f = self();
    if (n < 0) fault("wgmma.wait_group with a negative count");
    f.warpgroup_ops.push_back({WarpgroupOp::kWait, 0, 0, n, 0});
    while (f.wgmma_groups.size() > static_cast<size_t>(n)) {
        for (const PendingWgmma& p : f.wgmma_groups.front()) run_wgmma(p);
        f.wgmma_groups.pop_front();
    }
}

}  // namespace simt

// The CUDA runtime emulated on the CPU: see cuda_runtime_api.h.
//
// One lock guards the whole device: the calls of every host thread, and the queued work, which runs on whichever
// thread waits for it first (a synchronisation, a query, a blocking copy, or a stream whose queued wait it is).
// Each stream keeps its queue of items not yet run; an event is a position in one stream's sequence.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "simt/cuda_runtime_api.h"

struct CUstream_st;
struct CUevent_st;

namespace {

using Clock = std::chrono::steady_clock;

// An item of a stream's queue.
struct Item {
    enum class Kind { kWork, kRecord, kWait, kFree };
    Kind kind = Kind::kWork;
    std::string what;
    std::function<void()> work;                // kWork
    std::shared_ptr<CUevent_st> event;         // kRecord
    uint64_t record = 0;                       // kRecord: which record of the event
    std::shared_ptr<CUstream_st> wait_stream;  // kWait: until that stream has run wait_seq items
    uint64_t wait_seq = 0;
    void* ptr = nullptr;  // kFree
};

struct Node {  // a captured item (kWork only)
    std::string what;
    std::function<void()> work;
};

}  // namespace

struct CUgraph_st {
    std::vector<Node> nodes;
};
struct CUgraphExec_st {
    std::vector<Node> nodes;
};
struct CUmemPoolHandle_st {
    int device = 0;
    uint64_t release_threshold = 0;
};

struct CUstream_st {
    int device = 0;
    unsigned flags = cudaStreamDefault;
    bool legacy = false;
    std::deque<Item> pending;
    uint64_t enqueued = 0, done = 0;  // items queued and run since creation
    // Stream capture: the graph being recorded, by which thread, in which mode, and whether a refused call broke it.
    std::unique_ptr<CUgraph_st> capture;
    std::thread::id capture_thread;
    cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
    bool capture_invalid = false;
};

struct CUevent_st {
    unsigned flags = cudaEventDefault;
    std::weak_ptr<CUstream_st> stream;  // of the latest record
    uint64_t seq = 0;                   // its position there (0: never recorded)
    uint64_t record = 0;                // records so far
    uint64_t completed = 0;             // the record whose time `at` is
    Clock::time_point at;
    const CUgraph_st* captured = nullptr;  // recorded into this capture (not a position of any stream)
};

namespace {

struct Allocation {
    size_t bytes = 0;
    bool pinned = false;   // cudaMallocHost's; else device memory
    bool pool = false;     // cudaMallocAsync's
    bool freeing = false;  // a cudaFreeAsync is queued
    int device = 0;
};

struct Device {
    int cc = 90;
    size_t capacity = 0;
    size_t used = 0;  // device memory allocated and not yet freed
    size_t pool_used = 0, pool_high = 0;
    std::shared_ptr<CUstream_st> legacy;
    CUmemPoolHandle_st pool;
};

constexpr unsigned char kPoison = 0xFF;  // fresh memory reads as NaN in fp32 and bf16, as uninitialised

size_t parse_bytes(const char* text, size_t fallback) {
    if (text == nullptr || *text == '\0') return fallback;
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    double scale = 1.0;
    if (*end == 'K' || *end == 'k') scale = 1024.0, ++end;
    if (*end == 'M' || *end == 'm') scale = 1024.0 * 1024.0, ++end;
    if (*end == 'G' || *end == 'g') scale = 1024.0 * 1024.0 * 1024.0, ++end;
    if (end == text || *end != '\0' || !(v >= 0)) {
        std::fprintf(stderr, "simt: TRAINER_SIMT_GPU_MEMORY=%s is not a size (bytes, or a number with K, M or G)\n",
                     text);
        std::exit(2);
    }
    return static_cast<size_t>(v * scale);
}

int parse_int(const char* name, int fallback, int lo, int hi) {
    const char* text = std::getenv(name);
    if (text == nullptr || *text == '\0') return fallback;
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || v < lo || v > hi) {
        std::fprintf(stderr, "simt: %s=%s is not an integer from %d to %d\n", name, text, lo, hi);
        std::exit(2);
    }
    return static_cast<int>(v);
}

struct Runtime {
    std::recursive_mutex m;
    int count = 0;  // reported by cudaGetDeviceCount
    std::vector<Device> devices;
    std::map<uintptr_t, Allocation> allocations;  // by base address
    std::map<CUstream_st*, std::shared_ptr<CUstream_st>> streams;
    std::map<CUevent_st*, std::shared_ptr<CUevent_st>> events;
    std::set<CUgraph_st*> graphs;
    std::set<CUgraphExec_st*> execs;
    int smem_optin_set = 0;  // the largest dynamic shared memory a kernel was allowed (cudaFuncSetAttribute)
    cudaError_t sticky = cudaSuccess;
    std::string sticky_message;

    Runtime() {
        count = parse_int("TRAINER_SIMT_GPUS", 0, 0, 8);
        const int cc = parse_int("TRAINER_SIMT_CC", 90, 50, 120);
        const size_t capacity = parse_bytes(std::getenv("TRAINER_SIMT_GPU_MEMORY"), size_t(80) << 30);
        devices.resize(static_cast<size_t>(std::max(count, 1)));
        for (size_t d = 0; d < devices.size(); ++d) {
            devices[d].cc = cc;
            devices[d].capacity = capacity;
            devices[d].legacy = std::make_shared<CUstream_st>();
            devices[d].legacy->device = static_cast<int>(d);
            devices[d].legacy->legacy = true;
            devices[d].pool.device = static_cast<int>(d);
        }
    }
};

Runtime& state() {
    static Runtime* r = new Runtime;  // never destroyed: threads may call in while the process exits
    return *r;
}

thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;

cudaError_t ret(cudaError_t e) {
    if (e != cudaSuccess) last_error = e;
    return e;
}

Device& device(int d) { return state().devices[static_cast<size_t>(d)]; }

// The allocation holding [p, p + bytes) (p may be its end where bytes is 0), or null.
std::pair<const uintptr_t, Allocation>* find_allocation(const void* p, size_t bytes) {
    Runtime& r = state();
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = r.allocations.upper_bound(a);
    if (it == r.allocations.begin()) return nullptr;
    --it;
    if (a - it->first + bytes > it->second.bytes) return nullptr;
    return &*it;
}

enum class Memory { kDevice, kPinned, kPageable };
Memory memory_of(const void* p) {
    auto* a = find_allocation(p, 0);
    if (a == nullptr) return Memory::kPageable;
    return a->second.pinned ? Memory::kPinned : Memory::kDevice;
}

CUstream_st* resolve(cudaStream_t s) { return s != nullptr ? s : device(current_device).legacy.get(); }
std::shared_ptr<CUstream_st> shared(CUstream_st* s) {
    Runtime& r = state();
    if (s->legacy) return device(s->device).legacy;
    auto it = r.streams.find(s);
    return it != r.streams.end() ? it->second : nullptr;
}
bool valid_stream(cudaStream_t s) { return s == nullptr || state().streams.count(s) != 0; }

void run_until(CUstream_st* s, uint64_t seq);

// Runs one item of s (its front).
void run_front(CUstream_st* s) {
    Runtime& r = state();
    Item it = std::move(s->pending.front());
    s->pending.pop_front();
    switch (it.kind) {
        case Item::Kind::kWait:
            run_until(it.wait_stream.get(), it.wait_seq);
            break;
        case Item::Kind::kRecord:
            if (it.record == it.event->record) {
                it.event->completed = it.record;
                it.event->at = Clock::now();
            }
            break;
        case Item::Kind::kWork:
            if (r.sticky == cudaSuccess) {
                try {
                    it.work();
                } catch (const std::exception& e) {
                    simt::rt::fail(it.what, e.what());
                }
            }
            break;
        case Item::Kind::kFree: {
            auto a = r.allocations.find(reinterpret_cast<uintptr_t>(it.ptr));
            if (a != r.allocations.end()) {
                Device& d = device(a->second.device);
                d.used -= a->second.bytes;
                if (a->second.pool) d.pool_used -= a->second.bytes;
                r.allocations.erase(a);
                std::free(it.ptr);
            }
            break;
        }
    }
    ++s->done;
}

void run_until(CUstream_st* s, uint64_t seq) {
    while (s->done < seq && !s->pending.empty()) run_front(s);
}

void run_all(int d) {
    Runtime& r = state();
    bool ran = true;
    while (ran) {
        ran = false;
        for (auto& [raw, s] : r.streams) {
            if (s->device == d && !s->pending.empty()) run_until(s.get(), s->enqueued), ran = true;
        }
        CUstream_st* legacy = device(d).legacy.get();
        if (!legacy->pending.empty()) run_until(legacy, legacy->enqueued), ran = true;
    }
}

// The capture that a call unsafe while capturing breaks: one on this thread (thread-local or global mode), or
// any in global mode.
CUstream_st* unsafe_capture() {
    Runtime& r = state();
    for (auto& [raw, s] : r.streams) {
        if (!s->capture) continue;
        if (s->capture_mode == cudaStreamCaptureModeGlobal) return s.get();
        if (s->capture_mode == cudaStreamCaptureModeThreadLocal && s->capture_thread == std::this_thread::get_id())
            return s.get();
    }
    return nullptr;
}
// cudaErrorStreamCaptureUnsupported, invalidating the capture, where `what` is unsafe now; else success.
cudaError_t refuse_if_capturing() {
    if (CUstream_st* s = unsafe_capture()) {
        s->capture_invalid = true;
        return cudaErrorStreamCaptureUnsupported;
    }
    return cudaSuccess;
}

// Appends an item to s, with the implicit waits of the legacy default stream: its work waits for the device's
// blocking streams, and theirs for it.
void push(CUstream_st* s, Item item) {
    Runtime& r = state();
    auto wait_on = [&](const std::shared_ptr<CUstream_st>& other) {
        if (other.get() == s || other->done >= other->enqueued) return;
        Item w;
        w.kind = Item::Kind::kWait;
        w.wait_stream = other;
        w.wait_seq = other->enqueued;
        s->pending.push_back(std::move(w));
        ++s->enqueued;
    };
    if (s->legacy) {
        for (auto& [raw, o] : r.streams) {
            if (o->device == s->device && !(o->flags & cudaStreamNonBlocking)) wait_on(o);
        }
    } else if (!(s->flags & cudaStreamNonBlocking)) {
        wait_on(device(s->device).legacy);
    }
    s->pending.push_back(std::move(item));
    ++s->enqueued;
}

// Queues work on stream (or records it into the stream's capture).
cudaError_t queue_work(cudaStream_t stream, std::string what, std::function<void()> work) {
    Runtime& r = state();
    if (r.sticky != cudaSuccess) return r.sticky;
    if (!valid_stream(stream)) return cudaErrorInvalidResourceHandle;
    CUstream_st* s = resolve(stream);
    if (s->capture) {
        s->capture->nodes.push_back({std::move(what), std::move(work)});
        return cudaSuccess;
    }
    Item it;
    it.what = std::move(what);
    it.work = std::move(work);
    push(s, std::move(it));
    return cudaSuccess;
}

std::string describe(const void* p) {
    auto* a = find_allocation(p, 0);
    if (a == nullptr) return fmt::format("{} (not device memory, nor pinned host memory)", p);
    return fmt::format("{} ({} bytes into {} of {} bytes)", p, reinterpret_cast<uintptr_t>(p) - a->first,
                       a->second.pinned ? "pinned host memory" : "device memory", a->second.bytes);
}

// Checks a copy's direction and ranges: the error, with what is wrong printed.
cudaError_t check_copy(const char* call, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    const Memory md = memory_of(dst), ms = memory_of(src);
    const bool dst_dev = md == Memory::kDevice, src_dev = ms == Memory::kDevice;
    bool ok = true;
    switch (kind) {
        case cudaMemcpyHostToDevice:
            ok = dst_dev && !src_dev;
            break;
        case cudaMemcpyDeviceToHost:
            ok = src_dev && !dst_dev;
            break;
        case cudaMemcpyDeviceToDevice:
            ok = dst_dev && src_dev;
            break;
        case cudaMemcpyHostToHost:
            ok = !dst_dev && !src_dev;
            break;
        case cudaMemcpyDefault:
            break;
        default:
            return cudaErrorInvalidMemcpyDirection;
    }
    if (!ok) {
        std::fprintf(stderr, "simt: %s: kind %d does not match the destination %s and the source %s\n", call,
                     static_cast<int>(kind), describe(dst).c_str(), describe(src).c_str());
        return cudaErrorInvalidMemcpyDirection;
    }
    for (auto [p, side] : {std::pair<const void*, const char*>{dst, "destination"}, {src, "source"}}) {
        if (memory_of(p) != Memory::kPageable && find_allocation(p, bytes) == nullptr) {
            std::fprintf(stderr, "simt: %s of %zu bytes: the %s %s runs past its allocation\n", call, bytes, side,
                         describe(p).c_str());
            return cudaErrorInvalidValue;
        }
    }
    return cudaSuccess;
}

// A copy queued on stream: the source taken at the call where it is pageable, and the call returning after the
// copy where the destination is pageable (CUDA's rules for pageable memory).
cudaError_t queue_copy(const char* call, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                       cudaStream_t stream, bool blocking) {
    Runtime& r = state();
    if (r.sticky != cudaSuccess) return r.sticky;
    if (!valid_stream(stream)) return cudaErrorInvalidResourceHandle;
    if (const cudaError_t e = check_copy(call, dst, src, bytes, kind)) return e;
    if (bytes == 0) return cudaSuccess;
    CUstream_st* s = resolve(stream);
    const bool pageable_src = memory_of(src) == Memory::kPageable, pageable_dst = memory_of(dst) == Memory::kPageable;
    if (s->capture && (pageable_src || pageable_dst)) {
        s->capture_invalid = true;  // a graph cannot hold a copy from or to pageable memory
        return cudaErrorStreamCaptureUnsupported;
    }
    std::function<void()> work;
    if (pageable_src) {
        auto taken = std::make_shared<std::vector<unsigned char>>(static_cast<const unsigned char*>(src),
                                                                  static_cast<const unsigned char*>(src) + bytes);
        work = [dst, taken] { std::memcpy(dst, taken->data(), taken->size()); };
    } else {
        work = [dst, src, bytes] { std::memmove(dst, src, bytes); };
    }
    if (const cudaError_t e = queue_work(stream, call, std::move(work))) return e;
    if (blocking || pageable_dst) {
        run_until(s, s->enqueued);
        if (r.sticky != cudaSuccess) return r.sticky;
    }
    return cudaSuccess;
}

cudaError_t allocate(void** ptr, size_t bytes, bool pinned, bool pool) {
    Runtime& r = state();
    if (ptr == nullptr) return cudaErrorInvalidValue;
    *ptr = nullptr;
    if (r.sticky != cudaSuccess) return r.sticky;
    Device& d = device(current_device);
    if (!pinned && bytes > d.capacity - d.used) return cudaErrorMemoryAllocation;
    void* p = nullptr;
    if (posix_memalign(&p, 256, std::max<size_t>(bytes, 1)) != 0) return cudaErrorMemoryAllocation;
    std::memset(p, kPoison, bytes);
    Allocation a;
    a.bytes = bytes;
    a.pinned = pinned;
    a.pool = pool;
    a.device = current_device;
    r.allocations[reinterpret_cast<uintptr_t>(p)] = a;
    if (!pinned) {
        d.used += bytes;
        if (pool) d.pool_used += bytes, d.pool_high = std::max(d.pool_high, d.pool_used);
    }
    *ptr = p;
    return cudaSuccess;
}

cudaError_t release(void* ptr, bool pinned) {
    Runtime& r = state();
    if (ptr == nullptr) return cudaSuccess;
    if (const cudaError_t e = refuse_if_capturing()) return e;
    auto it = r.allocations.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == r.allocations.end() || it->second.pinned != pinned || it->second.freeing) {
        std::fprintf(stderr, "simt: %s(%p): %s\n", pinned ? "cudaFreeHost" : "cudaFree", ptr,
                     it == r.allocations.end() ? "not the start of a live allocation"
                     : it->second.freeing      ? "already being freed by cudaFreeAsync"
                                               : "memory of the other kind");
        return cudaErrorInvalidValue;
    }
    run_all(it->second.device);  // both wait for the device to finish its work
    it = r.allocations.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == r.allocations.end()) return cudaErrorInvalidValue;
    Device& d = device(it->second.device);
    if (!pinned) {
        d.used -= it->second.bytes;
        if (it->second.pool) d.pool_used -= it->second.bytes;
    }
    r.allocations.erase(it);
    std::free(ptr);
    return r.sticky;
}

const char* error_name(cudaError_t e) {
    switch (e) {
        case cudaSuccess:
            return "cudaSuccess";
        case cudaErrorInvalidValue:
            return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation:
            return "cudaErrorMemoryAllocation";
        case cudaErrorInvalidConfiguration:
            return "cudaErrorInvalidConfiguration";
        case cudaErrorInvalidDevicePointer:
            return "cudaErrorInvalidDevicePointer";
        case cudaErrorInvalidMemcpyDirection:
            return "cudaErrorInvalidMemcpyDirection";
        case cudaErrorNoDevice:
            return "cudaErrorNoDevice";
        case cudaErrorInvalidDevice:
            return "cudaErrorInvalidDevice";
        case cudaErrorInvalidResourceHandle:
            return "cudaErrorInvalidResourceHandle";
        case cudaErrorNotReady:
            return "cudaErrorNotReady";
        case cudaErrorIllegalAddress:
            return "cudaErrorIllegalAddress";
        case cudaErrorLaunchFailure:
            return "cudaErrorLaunchFailure";
        case cudaErrorNotSupported:
            return "cudaErrorNotSupported";
        case cudaErrorStreamCaptureUnsupported:
            return "cudaErrorStreamCaptureUnsupported";
        case cudaErrorStreamCaptureInvalidated:
            return "cudaErrorStreamCaptureInvalidated";
        case cudaErrorStreamCaptureWrongThread:
            return "cudaErrorStreamCaptureWrongThread";
    }
    return "cudaErrorUnknown";
}

const char* error_text(cudaError_t e) {
    switch (e) {
        case cudaSuccess:
            return "no error";
        case cudaErrorInvalidValue:
            return "invalid argument";
        case cudaErrorMemoryAllocation:
            return "out of memory";
        case cudaErrorInvalidConfiguration:
            return "invalid configuration argument";
        case cudaErrorInvalidDevicePointer:
            return "invalid device pointer";
        case cudaErrorInvalidMemcpyDirection:
            return "invalid copy direction for memcpy";
        case cudaErrorNoDevice:
            return "no CUDA-capable device is detected";
        case cudaErrorInvalidDevice:
            return "invalid device ordinal";
        case cudaErrorInvalidResourceHandle:
            return "invalid resource handle";
        case cudaErrorNotReady:
            return "device not ready";
        case cudaErrorIllegalAddress:
            return "an illegal memory access was encountered";
        case cudaErrorLaunchFailure:
            return "unspecified launch failure";
        case cudaErrorNotSupported:
            return "operation not supported";
        case cudaErrorStreamCaptureUnsupported:
            return "operation not permitted when stream is capturing";
        case cudaErrorStreamCaptureInvalidated:
            return "operation failed due to a previous error during capture";
        case cudaErrorStreamCaptureWrongThread:
            return "attempt to terminate a thread-local capture sequence from another thread";
    }
    return "unknown error";
}

}  // namespace

namespace simt::rt {

cudaError_t enqueue(cudaStream_t stream, const char* what, std::function<void()> work) {
    std::lock_guard<std::recursive_mutex> lock(state().m);
    return ret(queue_work(stream, what, std::move(work)));
}

bool device_accessible(const void* p, size_t bytes) {
    std::lock_guard<std::recursive_mutex> lock(state().m);
    return find_allocation(p, bytes) != nullptr;
}

void fail(const std::string& where, const std::string& what) {
    Runtime& r = state();
    std::lock_guard<std::recursive_mutex> lock(r.m);
    if (r.sticky != cudaSuccess) return;
    r.sticky = cudaErrorLaunchFailure;
    r.sticky_message = fmt::format("unspecified launch failure (simt: {}: {})", where, what);
    std::fprintf(stderr, "simt: %s: %s\n", where.c_str(), what.c_str());
}

void launch(const char* kernel, cudaStream_t stream, Dim3 grid, Dim3 block, size_t smem,
            std::vector<const void*> pointers, std::function<void()> body) {
    Runtime& r = state();
    std::lock_guard<std::recursive_mutex> lock(r.m);
    const int optin = device(current_device).cc >= 90 ? 232448 : device(current_device).cc >= 80 ? 166912 : 101376;
    const size_t smem_limit = static_cast<size_t>(std::max(49152, std::min(r.smem_optin_set, optin)));
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 || block.x == 0 ||
        block.x * block.y * block.z > 1024 || smem > smem_limit) {
        std::fprintf(stderr,
                     "simt: launch of %s: grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of shared memory "
                     "(at most %zu)\n",
                     kernel, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem, smem_limit);
        ret(cudaErrorInvalidConfiguration);
        return;
    }
    for (size_t i = 0; i < pointers.size(); ++i) {
        const void* p = pointers[i];
        if (p != nullptr && find_allocation(p, 0) == nullptr) {
            fail(kernel, fmt::format("pointer argument {} of the launch is {}", i + 1, describe(p)));
            return;
        }
    }
    std::string name = kernel;
    ret(queue_work(stream, name, [name, grid, block, smem, pointers, body = std::move(body)] {
        // Checked again where it runs: memory freed in between would be read after its free.
        for (size_t i = 0; i < pointers.size(); ++i) {
            if (pointers[i] != nullptr && find_allocation(pointers[i], 0) == nullptr) {
                throw std::runtime_error(
                    fmt::format("pointer argument {} is {} when the kernel runs: freed after the launch was queued",
                                i + 1, describe(pointers[i])));
            }
        }
        simt::launch(grid, block, smem, body);
    }));
}

}  // namespace simt::rt

using Lock = std::lock_guard<std::recursive_mutex>;
#define SIMT_API_ENTRY() Lock lock_(state().m)

cudaError_t cudaGetDeviceCount(int* count) {
    SIMT_API_ENTRY();
    if (count == nullptr) return ret(cudaErrorInvalidValue);
    *count = state().count;
    return ret(state().count == 0 ? cudaErrorNoDevice : cudaSuccess);
}

cudaError_t cudaSetDevice(int d) {
    SIMT_API_ENTRY();
    if (d < 0 || static_cast<size_t>(d) >= state().devices.size()) return ret(cudaErrorInvalidDevice);
    current_device = d;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* d) {
    if (d == nullptr) return ret(cudaErrorInvalidValue);
    *d = current_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int d) {
    SIMT_API_ENTRY();
    if (prop == nullptr) return ret(cudaErrorInvalidValue);
    if (d < 0 || static_cast<size_t>(d) >= state().devices.size()) return ret(cudaErrorInvalidDevice);
    *prop = cudaDeviceProp{};
    const Device& dev = device(d);
    std::snprintf(prop->name, sizeof prop->name, "simt emulated GPU (sm_%d)", dev.cc);
    prop->totalGlobalMem = dev.capacity;
    prop->sharedMemPerBlock = 49152;
    prop->multiProcessorCount = 132;
    prop->major = dev.cc / 10;
    prop->minor = dev.cc % 10;
    prop->pciBusID = d;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int d) {
    SIMT_API_ENTRY();
    if (value == nullptr) return ret(cudaErrorInvalidValue);
    if (d < 0 || static_cast<size_t>(d) >= state().devices.size()) return ret(cudaErrorInvalidDevice);
    const int cc = device(d).cc;
    switch (attr) {
        case cudaDevAttrMaxSharedMemoryPerBlock:
            *value = 49152;
            break;
        case cudaDevAttrClockRate:
            *value = 1980000;  // kHz: an H100 SXM's
            break;
        case cudaDevAttrMultiProcessorCount:
            *value = 132;
            break;
        case cudaDevAttrMemoryClockRate:
            *value = 2619000;
            break;
        case cudaDevAttrGlobalMemoryBusWidth:
            *value = 5120;
            break;
        case cudaDevAttrComputeCapabilityMajor:
            *value = cc / 10;
            break;
        case cudaDevAttrComputeCapabilityMinor:
            *value = cc % 10;
            break;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin:
            *value = cc >= 90 ? 232448 : cc >= 80 ? 166912 : 101376;
            break;
        default:
            return ret(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int d) {
    SIMT_API_ENTRY();
    if (bus_id == nullptr || len <= 0) return ret(cudaErrorInvalidValue);
    if (d < 0 || static_cast<size_t>(d) >= state().devices.size()) return ret(cudaErrorInvalidDevice);
    std::snprintf(bus_id, static_cast<size_t>(len), "0000:%02x:00.0", d);
    return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
    if (least != nullptr) *least = 0;
    if (greatest != nullptr) *greatest = -5;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
    if (version == nullptr) return ret(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
    if (version == nullptr) return ret(cudaErrorInvalidValue);
    *version = state().count > 0 ? CUDART_VERSION : 0;
    return cudaSuccess;
}

cudaError_t cudaGetLastError() {
    SIMT_API_ENTRY();
    if (state().sticky != cudaSuccess) return state().sticky;
    const cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError() {
    SIMT_API_ENTRY();
    return state().sticky != cudaSuccess ? state().sticky : last_error;
}

const char* cudaGetErrorString(cudaError_t e) {
    Runtime& r = state();
    Lock lock(r.m);
    if (e == r.sticky && e != cudaSuccess) return r.sticky_message.c_str();  // kept until the process ends
    return error_text(e);
}

const char* cudaGetErrorName(cudaError_t e) { return error_name(e); }

cudaError_t cudaDeviceSynchronize() {
    SIMT_API_ENTRY();
    if (const cudaError_t e = refuse_if_capturing()) return ret(e);
    run_all(current_device);
    return ret(state().sticky);
}

cudaError_t cudaDeviceReset() {
    SIMT_API_ENTRY();
    Runtime& r = state();
    const int d = current_device;
    for (auto& [raw, s] : r.streams) {
        if (s->device == d) s->pending.clear(), s->done = s->enqueued, s->capture.reset();
    }
    Device& dev = device(d);
    dev.legacy->pending.clear();
    dev.legacy->done = dev.legacy->enqueued;
    for (auto it = r.allocations.begin(); it != r.allocations.end();) {
        if (it->second.device != d) {
            ++it;
            continue;
        }
        std::free(reinterpret_cast<void*>(it->first));
        it = r.allocations.erase(it);
    }
    dev.used = dev.pool_used = dev.pool_high = 0;
    r.sticky = cudaSuccess;
    r.sticky_message.clear();
    last_error = cudaSuccess;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    SIMT_API_ENTRY();
    const Device& d = device(current_device);
    if (free_bytes != nullptr) *free_bytes = d.capacity - d.used;
    if (total_bytes != nullptr) *total_bytes = d.capacity;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
    SIMT_API_ENTRY();
    if (const cudaError_t e = refuse_if_capturing()) return ret(e);
    return ret(allocate(ptr, bytes, false, false));
}

cudaError_t cudaFree(void* ptr) {
    SIMT_API_ENTRY();
    return ret(release(ptr, false));
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
    SIMT_API_ENTRY();
    if (const cudaError_t e = refuse_if_capturing()) return ret(e);
    return ret(allocate(ptr, bytes, true, false));
}

cudaError_t cudaFreeHost(void* ptr) {
    SIMT_API_ENTRY();
    return ret(release(ptr, true));
}

cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream) {
    SIMT_API_ENTRY();
    if (!valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    if (CUstream_st* s = resolve(stream); s->capture) {
        s->capture_invalid = true;  // a graph's allocation node: not emulated
        return ret(cudaErrorStreamCaptureUnsupported);
    }
    return ret(allocate(ptr, bytes, false, true));
}

cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    if (r.sticky != cudaSuccess) return r.sticky;
    if (!valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    if (ptr == nullptr) return cudaSuccess;
    auto it = r.allocations.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == r.allocations.end() || it->second.pinned || it->second.freeing) {
        std::fprintf(stderr, "simt: cudaFreeAsync(%p): %s\n", ptr,
                     it == r.allocations.end() ? "not the start of a live allocation of device memory"
                     : it->second.freeing      ? "already being freed"
                                               : "pinned host memory");
        return ret(cudaErrorInvalidValue);
    }
    CUstream_st* s = resolve(stream);
    if (s->capture) {
        s->capture_invalid = true;  // a graph's free node: not emulated
        return ret(cudaErrorStreamCaptureUnsupported);
    }
    it->second.freeing = true;
    Item item;
    item.kind = Item::Kind::kFree;
    item.what = "cudaFreeAsync";
    item.ptr = ptr;
    push(s, std::move(item));
    return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int d) {
    SIMT_API_ENTRY();
    if (pool == nullptr) return ret(cudaErrorInvalidValue);
    if (d < 0 || static_cast<size_t>(d) >= state().devices.size()) return ret(cudaErrorInvalidDevice);
    *pool = &device(d).pool;
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
    SIMT_API_ENTRY();
    if (pool == nullptr || value == nullptr) return ret(cudaErrorInvalidValue);
    Device& d = device(pool->device);
    switch (attr) {
        case cudaMemPoolAttrReleaseThreshold:
            pool->release_threshold = *static_cast<uint64_t*>(value);
            return cudaSuccess;
        case cudaMemPoolAttrReservedMemHigh:
        case cudaMemPoolAttrUsedMemHigh:
            if (*static_cast<uint64_t*>(value) != 0) return ret(cudaErrorInvalidValue);  // only a reset to 0
            d.pool_high = d.pool_used;
            return cudaSuccess;
        default:
            return ret(cudaErrorInvalidValue);
    }
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
    SIMT_API_ENTRY();
    if (pool == nullptr || value == nullptr) return ret(cudaErrorInvalidValue);
    const Device& d = device(pool->device);
    uint64_t v = 0;
    switch (attr) {
        case cudaMemPoolAttrReleaseThreshold:
            v = pool->release_threshold;
            break;
        case cudaMemPoolAttrReservedMemCurrent:
        case cudaMemPoolAttrUsedMemCurrent:
            v = d.pool_used;
            break;
        case cudaMemPoolAttrReservedMemHigh:
        case cudaMemPoolAttrUsedMemHigh:
            v = d.pool_high;
            break;
    }
    *static_cast<uint64_t*>(value) = v;
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
    SIMT_API_ENTRY();
    if (attributes == nullptr) return ret(cudaErrorInvalidValue);
    *attributes = cudaPointerAttributes{};
    auto* a = find_allocation(ptr, 0);
    if (a == nullptr) {
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = -2;
        attributes->hostPointer = const_cast<void*>(ptr);
        return cudaSuccess;
    }
    attributes->type = a->second.pinned ? cudaMemoryTypeHost : cudaMemoryTypeDevice;
    attributes->device = a->second.device;
    attributes->devicePointer = const_cast<void*>(ptr);
    attributes->hostPointer = a->second.pinned ? const_cast<void*>(ptr) : nullptr;
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    SIMT_API_ENTRY();
    if (const cudaError_t e = refuse_if_capturing()) return ret(e);
    return ret(queue_copy("cudaMemcpy", dst, src, bytes, kind, nullptr, true));
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    SIMT_API_ENTRY();
    return ret(queue_copy("cudaMemcpyAsync", dst, src, bytes, kind, stream, false));
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
    SIMT_API_ENTRY();
    if (width > dpitch || width > spitch) return ret(cudaErrorInvalidValue);
    for (size_t row = 0; row < height; ++row) {
        const cudaError_t e = queue_copy("cudaMemcpy2DAsync", static_cast<char*>(dst) + row * dpitch,
                                         static_cast<const char*>(src) + row * spitch, width, kind, stream, false);
        if (e != cudaSuccess) return ret(e);
    }
    return cudaSuccess;
}

namespace {
cudaError_t queue_memset(const char* call, void* ptr, int value, size_t bytes, cudaStream_t stream, bool blocking) {
    Runtime& r = state();
    if (r.sticky != cudaSuccess) return r.sticky;
    if (bytes == 0) return cudaSuccess;
    if (find_allocation(ptr, bytes) == nullptr || memory_of(ptr) != Memory::kDevice) {
        std::fprintf(stderr, "simt: %s of %zu bytes at %s\n", call, bytes, describe(ptr).c_str());
        return cudaErrorInvalidValue;
    }
    if (const cudaError_t e = queue_work(stream, call, [ptr, value, bytes] { std::memset(ptr, value, bytes); }))
        return e;
    if (blocking) {
        CUstream_st* s = resolve(stream);
        run_until(s, s->enqueued);
    }
    return r.sticky;
}
}  // namespace

cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
    SIMT_API_ENTRY();
    if (const cudaError_t e = refuse_if_capturing()) return ret(e);
    return ret(queue_memset("cudaMemset", ptr, value, bytes, nullptr, true));
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
    SIMT_API_ENTRY();
    if (!valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    return ret(queue_memset("cudaMemsetAsync", ptr, value, bytes, stream, false));
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
    return cudaStreamCreateWithPriority(stream, flags, 0);
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned flags, int) {
    SIMT_API_ENTRY();
    if (stream == nullptr || (flags & ~cudaStreamNonBlocking) != 0) return ret(cudaErrorInvalidValue);
    auto s = std::make_shared<CUstream_st>();
    s->device = current_device;
    s->flags = flags;
    state().streams[s.get()] = s;
    *stream = s.get();
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    auto it = r.streams.find(stream);
    if (it == r.streams.end()) return ret(cudaErrorInvalidResourceHandle);
    // CUDA lets the queued work finish after the call; it runs now (items of other streams that wait on it hold
    // it by its shared pointer).
    run_until(stream, stream->enqueued);
    r.streams.erase(it);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    SIMT_API_ENTRY();
    if (!valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    CUstream_st* s = resolve(stream);
    if (s->capture) {
        s->capture_invalid = true;
        return ret(cudaErrorStreamCaptureUnsupported);
    }
    if (const cudaError_t e = refuse_if_capturing()) return ret(e);
    run_until(s, s->enqueued);
    return ret(state().sticky);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    SIMT_API_ENTRY();
    if (!valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    CUstream_st* s = resolve(stream);
    if (s->capture) {
        s->capture_invalid = true;
        return ret(cudaErrorStreamCaptureUnsupported);
    }
    run_until(s, s->enqueued);  // the emulated device finishes queued work when it is asked about it
    return ret(state().sticky);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    if (!valid_stream(stream) || r.events.count(event) == 0) return ret(cudaErrorInvalidResourceHandle);
    if (r.sticky != cudaSuccess) return r.sticky;
    CUstream_st* s = resolve(stream);
    if (event->captured != nullptr) {
        // Recorded into a capture: a wait from that capturing stream is its own order; another stream joining the
        // capture (fork and join across streams) is not emulated.
        if (s->capture.get() == event->captured) return cudaSuccess;
        std::fprintf(stderr, "simt: cudaStreamWaitEvent on an event recorded into another stream's capture\n");
        for (auto& [raw, o] : r.streams) {
            if (o->capture.get() == event->captured) o->capture_invalid = true;
        }
        return ret(cudaErrorStreamCaptureUnsupported);
    }
    if (s->capture) return cudaSuccess;  // a graph replays in order on one stream: the wait is already met
    auto source = event->stream.lock();
    if (event->seq == 0 || !source || source->done >= event->seq) return cudaSuccess;
    Item w;
    w.kind = Item::Kind::kWait;
    w.wait_stream = source;
    w.wait_seq = event->seq;
    push(s, std::move(w));
    return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    SIMT_API_ENTRY();
    if (stream == nullptr) return ret(cudaErrorStreamCaptureUnsupported);  // the legacy stream cannot capture
    if (!valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    if (stream->capture) return ret(cudaErrorInvalidValue);  // already capturing
    stream->capture = std::make_unique<CUgraph_st>();
    stream->capture_thread = std::this_thread::get_id();
    stream->capture_mode = mode;
    stream->capture_invalid = false;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    if (graph == nullptr) return ret(cudaErrorInvalidValue);
    *graph = nullptr;
    if (!valid_stream(stream) || stream == nullptr) return ret(cudaErrorInvalidResourceHandle);
    if (!stream->capture) return ret(cudaErrorInvalidValue);
    if (stream->capture_mode != cudaStreamCaptureModeRelaxed && stream->capture_thread != std::this_thread::get_id())
        return ret(cudaErrorStreamCaptureWrongThread);
    std::unique_ptr<CUgraph_st> g = std::move(stream->capture);
    if (stream->capture_invalid) return ret(cudaErrorStreamCaptureInvalidated);
    r.graphs.insert(g.get());
    *graph = g.release();
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
    SIMT_API_ENTRY();
    if (event == nullptr) return ret(cudaErrorInvalidValue);
    auto e = std::make_shared<CUevent_st>();
    e->flags = flags;
    state().events[e.get()] = e;
    *event = e.get();
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    SIMT_API_ENTRY();
    if (state().events.erase(event) == 0) return ret(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    auto it = r.events.find(event);
    if (it == r.events.end() || !valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    if (r.sticky != cudaSuccess) return r.sticky;
    CUstream_st* s = resolve(stream);
    if (s->capture) {
        event->captured = s->capture.get();
        return cudaSuccess;
    }
    event->captured = nullptr;
    Item rec;
    rec.kind = Item::Kind::kRecord;
    rec.event = it->second;
    rec.record = ++event->record;
    push(s, std::move(rec));
    event->stream = shared(s);
    event->seq = s->enqueued;
    return cudaSuccess;
}

namespace {
// Runs the work before the event's latest record; cudaErrorStreamCaptureUnsupported for one in a capture.
cudaError_t finish_event(cudaEvent_t event) {
    Runtime& r = state();
    if (r.events.count(event) == 0) return cudaErrorInvalidResourceHandle;
    if (event->captured != nullptr) return cudaErrorStreamCaptureUnsupported;
    if (auto s = event->stream.lock(); s && event->seq != 0) run_until(s.get(), event->seq);
    return r.sticky;
}
}  // namespace

cudaError_t cudaEventQuery(cudaEvent_t event) {
    SIMT_API_ENTRY();
    return ret(finish_event(event));  // the emulated device finishes queued work when it is asked about it
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    SIMT_API_ENTRY();
    return ret(finish_event(event));
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    if (ms == nullptr) return ret(cudaErrorInvalidValue);
    if (r.events.count(start) == 0 || r.events.count(end) == 0) return ret(cudaErrorInvalidResourceHandle);
    if ((start->flags | end->flags) & cudaEventDisableTiming) return ret(cudaErrorInvalidResourceHandle);
    if (start->record == 0 || end->record == 0) return ret(cudaErrorInvalidResourceHandle);
    if (start->completed != start->record || end->completed != end->record) return ret(cudaErrorNotReady);
    *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
    return r.sticky;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    if (exec == nullptr || r.graphs.count(graph) == 0) return ret(cudaErrorInvalidValue);
    auto* e = new CUgraphExec_st;
    e->nodes = graph->nodes;
    r.execs.insert(e);
    *exec = e;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
    SIMT_API_ENTRY();
    Runtime& r = state();
    if (r.execs.count(exec) == 0 || !valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
    if (resolve(stream)->capture) {
        resolve(stream)->capture_invalid = true;  // a graph inside a graph: not emulated
        return ret(cudaErrorStreamCaptureUnsupported);
    }
    for (const Node& n : exec->nodes) {
        if (const cudaError_t e = queue_work(stream, n.what, n.work)) return ret(e);
    }
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    SIMT_API_ENTRY();
    if (state().graphs.erase(graph) == 0) return ret(cudaErrorInvalidValue);
    delete graph;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    SIMT_API_ENTRY();
    if (state().execs.erase(exec) == 0) return ret(cudaErrorInvalidValue);
    delete exec;  // its launches' items hold copies of its nodes
    return cudaSuccess;
}

cudaError_t simt_func_set_attribute(cudaFuncAttribute attr, int value) {
    SIMT_API_ENTRY();
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0) return ret(cudaErrorInvalidValue);
    const int cc = device(current_device).cc;
    if (value > (cc >= 90 ? 232448 : cc >= 80 ? 166912 : 101376)) return ret(cudaErrorInvalidValue);
    state().smem_optin_set = std::max(state().smem_optin_set, value);
    return cudaSuccess;
}

// cuDNN's fused causal attention (flash attention), forward and backward, through the backend graph API:
// the fast path of kernels.attention=cudnn (the native kernels in attention.cu are the reference).
//
// cuDNN 9.19's unified SDPA operation has no causal mask (it arrives with 9.21's subgraph attribute), so
// the graphs are the composite ones cudnn-frontend emits for this case, which cuDNN's runtime fusion
// engine compiles into one flash-attention kernel each (no T x T tensor exists in memory: every T x T
// tensor below is virtual):
//   forward:  S = Q K^T; Ss = S * scale; causal select (row >= col, else -inf); m = rowmax; E = exp(Ss - m);
//             l = rowsum(E); Stats = m + log(l); P = E / l (bf16); O = P V
//   backward: D = rowsum(dO * O); P = exp(select(S * scale - Stats)); dV = P^T dO; dP = dO V^T;
//             dS = (dP - D) * P * scale; dK = dS^T Q; dQ = dS K (fp32 accumulator, then bf16)
// Q, K, V are read in place from the (B, T, 3C) bf16 qkv buffer (strides, no copies); O is (B, T, C);
// Stats is the (B, NH, T) fp32 log-sum-exp of the scaled scores, the native kernels' lse. A plan is
// built once per shape (cuDNN's heuristic, first engine that finalises) and cached. cuDNN's backward
// accumulates dQ in an order that may vary run to run: this path is fast, not bitwise reproducible.
#include <cudnn.h>

#include <array>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "base/memory.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace trainer::cuda {
namespace {}  // namespace

// cuDNN's statuses for TRAINER_CUDA_CHECK (check.h), with cuDNN's last error where it has one.
inline bool succeeded(cudnnStatus_t st) { return st == CUDNN_STATUS_SUCCESS; }
inline std::string status_message(cudnnStatus_t st) {
    char last[1024] = {};
    cudnnGetLastErrorString(last, sizeof last);
    return std::string(cudnnGetErrorString(st)) + (last[0] ? std::string(" (") + last + ")" : "");
}

namespace {

// One backend descriptor, destroyed with its owner.
class Desc {
   public:
    explicit Desc(cudnnBackendDescriptorType_t type) { TRAINER_CUDA_CHECK(cudnnBackendCreateDescriptor(type, &d_)); }
    ~Desc() { cudnnBackendDestroyDescriptor(d_); }
    Desc(const Desc&) = delete;
    Desc& operator=(const Desc&) = delete;
    template <typename T>
    Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const T* values) {
        TRAINER_CUDA_CHECK(cudnnBackendSetAttribute(d_, name, type, count, values));
        return *this;
    }
    Desc& set(cudnnBackendAttributeName_t name, const Desc& other) {
        cudnnBackendDescriptor_t o = other.d_;
        return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &o);
    }
    Desc& finalize() {
        TRAINER_CUDA_CHECK(cudnnBackendFinalize(d_));
        return *this;
    }
    cudnnBackendDescriptor_t get() const { return d_; }

   private:
    cudnnBackendDescriptor_t d_ = nullptr;
};
using DescPtr = std::shared_ptr<Desc>;

using Shape = std::array<int64_t, 4>;

// Builds one operation graph: tensors by unique id, operations in emission order.
class GraphBuilder {
   public:
    DescPtr tensor(int64_t uid, cudnnDataType_t type, Shape dims, Shape strides, bool is_virtual = false,
                   bool by_value = false) {
        auto t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
        const int64_t alignment = 16;
        t->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type)
            .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data())
            .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data())
            .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid)
            .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
        const bool yes = true;
        if (is_virtual) t->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
        if (by_value) t->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
        t->finalize();
        return t;
    }
    // A virtual (never materialised) tensor with the next free unique id.
    DescPtr virt(Shape dims, Shape strides, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
        return tensor(next_virtual_++, type, dims, strides, true);
    }
    // y = mode(x[, b]) into a new virtual fp32 tensor of the given shape.
    DescPtr pw(cudnnPointwiseMode_t mode, const DescPtr& x, const DescPtr& b, Shape dims, Shape strides) {
        auto y = virt(dims, strides);
        pointwise(mode, x, b, nullptr, y);
        return y;
    }
    // A by-value fp32 scalar (the scale, 1, -inf), passed by host pointer at execution.
    DescPtr scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

    // y = mode(x[, b][, t]); GEN_INDEX takes an axis.
    void pointwise(cudnnPointwiseMode_t mode, const DescPtr& x, const DescPtr& b, const DescPtr& t, const DescPtr& y,
                   cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1) {
        auto pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
        pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode)
            .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
        if (axis >= 0) pw->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
        pw->finalize();
        auto op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
        const float one = 1.0f;
        op->set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw)
            .set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, *x)
            .set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, *y)
            .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one)
            .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
        if (b) op->set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
        if (t) op->set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
        add_op(op);
    }
    void matmul(const DescPtr& a, const DescPtr& b, const DescPtr& c) {
        auto mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
        const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
        mm->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp).finalize();
        auto op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
        op->set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, *a)
            .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, *b)
            .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, *c)
            .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm);
        add_op(op);
    }
    void reduction(cudnnReduceTensorOp_t mode, const DescPtr& x, const DescPtr& y) {
        auto r = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
        const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
        r->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode)
            .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp)
            .finalize();
        auto op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
        op->set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, *x)
            .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, *y)
            .set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *r);
        add_op(op);
    }
    void reshape(const DescPtr& x, const DescPtr& y) {
        auto op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
        op->set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, *x).set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, *y);
        add_op(op);
    }
    // The causal mask of cudnn-frontend's composite graph: keep x where row >= column, else -inf.
    DescPtr causal(const DescPtr& x, const DescPtr& neg_inf, Shape dims, Shape strides) {
        auto row = virt(dims, strides, CUDNN_DATA_INT32);
        auto col = virt(dims, strides, CUDNN_DATA_INT32);
        auto mask = virt(dims, strides, CUDNN_DATA_BOOLEAN);
        auto y = virt(dims, strides);
        pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
        pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
        pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, mask, CUDNN_DATA_BOOLEAN);
        pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, neg_inf, mask, y);
        return y;
    }

    // Finalises the graph and the first execution plan of cuDNN's heuristic (mode A) that builds.
    struct Plan {
        std::vector<DescPtr> keep;  // the graph's descriptors, alive with the plan (destroyed after it)
        DescPtr plan;
        int64_t workspace = 0;
    };
    Plan build(cudnnHandle_t handle, const char* what) {
        Plan p;
        auto graph = keep(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
        graph
            ->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
                  ops_.data())
            .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
            .finalize();
        auto heur = keep(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
        const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
        heur->set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *graph)
            .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)
            .finalize();
        int64_t count = 0;
        TRAINER_CUDA_CHECK(cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
        std::vector<DescPtr> configs;
        std::vector<cudnnBackendDescriptor_t> raw;
        for (int64_t i = 0; i < count; ++i) {
            configs.push_back(keep(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
            raw.push_back(configs.back()->get());
        }
        if (count > 0) {
            TRAINER_CUDA_CHECK(cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                        CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, raw.data()));
        }
        std::string last_error = "the heuristic returned no engine";
        for (int64_t i = 0; i < count && !p.plan; ++i) {
            auto plan = std::make_shared<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
            plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *configs[i])
                .set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
            const cudnnStatus_t st = cudnnBackendFinalize(plan->get());
            if (st != CUDNN_STATUS_SUCCESS) {
                last_error = "finalising an execution plan: " + status_message(st);
                continue;  // not supported for this graph: the next engine
            }
            int64_t ws = 0;
            TRAINER_CUDA_CHECK(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                        CUDNN_TYPE_INT64, 1, nullptr, &ws));
            p.plan = plan;
            p.workspace = ws;
        }
        if (!p.plan)
            TRAINER_CUDA_FAIL("cudnnBackendFinalize",
                              std::string("no engine for the ") + what + " graph: " + last_error);
        p.keep = std::move(keep_);
        return p;
    }

   private:
    DescPtr keep(cudnnBackendDescriptorType_t type) {
        keep_.push_back(std::make_shared<Desc>(type));
        return keep_.back();
    }
    void add_op(const DescPtr& op) {
        op->finalize();
        ops_.push_back(op->get());
    }
    std::vector<DescPtr> keep_;
    std::vector<cudnnBackendDescriptor_t> ops_;
    int64_t next_virtual_ = 1000;  // above the fixed ids of the non-virtual tensors
};

// Runs a plan with (uid, pointer) bindings and a device workspace.
void execute(cudnnHandle_t handle, const GraphBuilder::Plan& plan, const std::vector<int64_t>& uids,
             const std::vector<void*>& pointers, void* workspace) {
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data())
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(pointers.size()),
             pointers.data())
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)
        .finalize();
    TRAINER_CUDA_CHECK(cudnnBackendExecute(handle, plan.plan->get(), pack.get()));
}

// Unique ids of the non-virtual tensors.
enum : int64_t {
    kQ = 1,
    kKt,
    kV,
    kO,
    kStats,
    kScale,
    kNegInf,  // forward
    kBQ = 101,
    kBKt,
    kBVt,
    kBO,
    kBdO,
    kBStats,
    kBdQ,
    kBdK,
    kBdV,
    kBScale,
    kBOne,
    kBNegInf,
    kBSum,
    kBdQAcc  // backward
};

}  // namespace

struct CudnnAttention::State {
    cudnnHandle_t handle = nullptr;
    std::map<std::tuple<int, int, int, int>, GraphBuilder::Plan> forward, backward;
};

CudnnAttention::CudnnAttention() : s_(new State) {
    const cudnnStatus_t st = cudnnCreate(&s_->handle);
    if (st != CUDNN_STATUS_SUCCESS) {
        delete s_;  // the destructor does not run for a constructor that throws
        TRAINER_CUDA_FAIL("cudnnCreate", status_message(st));
    }
}

CudnnAttention::~CudnnAttention() {
    s_->forward.clear();
    s_->backward.clear();
    if (s_->handle != nullptr) cudnnDestroy(s_->handle);
    delete s_;
}

void CudnnAttention::forward(uint16_t* out, float* lse, const uint16_t* qkv, int B, int T, int NH, int HS,
                             const Workspace& workspace, cudaStream_t stream) {
    const auto key = std::make_tuple(B, T, NH, HS);
    auto it = s_->forward.find(key);
    const int64_t b = B, t = T, h = NH, d = HS, C = h * d;
    if (it == s_->forward.end()) {
        GraphBuilder g;
        const Shape qkv_strides = {t * 3 * C, d, 3 * C, 1};
        const Shape tt = {b, h, t, t}, tt_strides = {h * t * t, t * t, t, 1};
        const Shape row = {b, h, t, 1}, row_strides = {h * t, t, 1, 1};
        auto q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, {b, h, t, d}, qkv_strides);
        auto kt = g.tensor(kKt, CUDNN_DATA_BFLOAT16, {b, h, d, t}, {t * 3 * C, d, 1, 3 * C});
        auto v = g.tensor(kV, CUDNN_DATA_BFLOAT16, {b, h, t, d}, qkv_strides);
        auto o = g.tensor(kO, CUDNN_DATA_BFLOAT16, {b, h, t, d}, {t * C, d, C, 1});
        auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, row, row_strides);
        auto scale = g.scalar(kScale);
        auto neg_inf = g.scalar(kNegInf);
        auto s = g.virt(tt, tt_strides);
        g.matmul(q, kt, s);
        auto ss = g.pw(CUDNN_POINTWISE_MUL, s, scale, tt, tt_strides);
        auto sm = g.causal(ss, neg_inf, tt, tt_strides);
        auto mx = g.virt(row, row_strides);
        g.reduction(CUDNN_REDUCE_TENSOR_MAX, sm, mx);
        auto e = g.pw(CUDNN_POINTWISE_EXP, g.pw(CUDNN_POINTWISE_SUB, sm, mx, tt, tt_strides), nullptr, tt, tt_strides);
        auto sum = g.virt(row, row_strides);
        g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
        g.pointwise(CUDNN_POINTWISE_ADD, mx, g.pw(CUDNN_POINTWISE_LOG, sum, nullptr, row, row_strides), nullptr,
                    stats);  // Stats = max + log(sum): the log-sum-exp of the scaled scores
        auto p = g.virt(tt, tt_strides, CUDNN_DATA_BFLOAT16);
        g.pointwise(CUDNN_POINTWISE_DIV, e, sum, nullptr, p);
        g.matmul(p, v, o);
        it = s_->forward.emplace(key, g.build(s_->handle, "attention forward")).first;
    }
    TRAINER_CUDA_CHECK(cudnnSetStream(s_->handle, stream));
    float scale = 1.0f / std::sqrt(static_cast<float>(HS)), neg_inf = -INFINITY;
    auto* base = const_cast<uint16_t*>(qkv);
    void* ws = workspace(static_cast<size_t>(it->second.workspace));
    execute(s_->handle, it->second, {kQ, kKt, kV, kO, kStats, kScale, kNegInf},
            {base, base + C, base + 2 * C, out, lse, &scale, &neg_inf}, ws);
}

void CudnnAttention::backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int HS, const Workspace& workspace,
                              cudaStream_t stream) {
    const auto key = std::make_tuple(B, T, NH, HS);
    auto it = s_->backward.find(key);
    const int64_t b = B, t = T, h = NH, d = HS, C = h * d;
    if (it == s_->backward.end()) {
        GraphBuilder g;
        const Shape qkv_strides = {t * 3 * C, d, 3 * C, 1}, t_strides = {t * 3 * C, d, 1, 3 * C};
        const Shape btd = {b, h, t, d}, bdt = {b, h, d, t};
        const Shape tt = {b, h, t, t}, tt_strides = {h * t * t, t * t, t, 1}, tt_transposed = {h * t * t, t * t, 1, t};
        const Shape row = {b, h, t, 1}, row_strides = {h * t, t, 1, 1};
        auto q = g.tensor(kBQ, CUDNN_DATA_BFLOAT16, btd, qkv_strides);
        auto kt = g.tensor(kBKt, CUDNN_DATA_BFLOAT16, bdt, t_strides);
        auto vt = g.tensor(kBVt, CUDNN_DATA_BFLOAT16, bdt, t_strides);
        auto o = g.tensor(kBO, CUDNN_DATA_BFLOAT16, btd, {t * C, d, C, 1});
        auto dout_t = g.tensor(kBdO, CUDNN_DATA_BFLOAT16, btd, {t * C, d, C, 1});
        auto stats = g.tensor(kBStats, CUDNN_DATA_FLOAT, row, row_strides);
        auto dq = g.tensor(kBdQ, CUDNN_DATA_BFLOAT16, btd, qkv_strides);
        auto dk = g.tensor(kBdK, CUDNN_DATA_BFLOAT16, btd, qkv_strides);
        auto dv = g.tensor(kBdV, CUDNN_DATA_BFLOAT16, btd, qkv_strides);
        auto scale = g.scalar(kBScale);
        auto one = g.scalar(kBOne);
        auto neg_inf = g.scalar(kBNegInf);
        auto softmax_sum = g.tensor(kBSum, CUDNN_DATA_FLOAT, row, row_strides);
        auto dq_acc = g.tensor(kBdQAcc, CUDNN_DATA_FLOAT, btd, {h * t * d, t * d, d, 1});
        // D = rowsum(dO * O)
        auto do_o = g.pw(CUDNN_POINTWISE_MUL, dout_t, o, btd, {h * t * d, t * d, h * d, 1});
        auto rowsum = g.virt(row, row_strides);
        g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, rowsum);
        g.pointwise(CUDNN_POINTWISE_MUL, rowsum, one, nullptr, softmax_sum);
        // P = exp(causal(S * scale - Stats))
        auto s = g.virt(tt, tt_strides);
        g.matmul(q, kt, s);
        auto scaled = g.pw(CUDNN_POINTWISE_MUL, s, scale, tt, tt_strides);
        auto masked = g.causal(g.pw(CUDNN_POINTWISE_SUB, scaled, stats, tt, tt_strides), neg_inf, tt, tt_strides);
        auto p = g.pw(CUDNN_POINTWISE_EXP, masked, nullptr, tt, tt_strides);
        // dV = P^T dO
        auto pt = g.virt(tt, tt_transposed, CUDNN_DATA_BFLOAT16);
        g.reshape(p, pt);
        g.matmul(pt, dout_t, dv);
        // dS = (dO V^T - D) * P * scale; dK = dS^T Q
        auto dp = g.virt(tt, tt_strides);
        g.matmul(dout_t, vt, dp);
        auto dp_p =
            g.pw(CUDNN_POINTWISE_MUL, g.pw(CUDNN_POINTWISE_SUB, dp, softmax_sum, tt, tt_strides), p, tt, tt_strides);
        auto ds = g.pw(CUDNN_POINTWISE_MUL, dp_p, scale, tt, tt_strides);
        auto dst = g.virt(tt, tt_transposed, CUDNN_DATA_BFLOAT16);
        g.reshape(ds, dst);
        g.matmul(dst, q, dk);
        // dQ = dS K, accumulated in fp32, then written as bf16
        auto k_rows = g.virt(btd, qkv_strides);
        g.reshape(kt, k_rows);
        g.matmul(ds, k_rows, dq_acc);
        g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_acc, nullptr, nullptr, dq);
        it = s_->backward.emplace(key, g.build(s_->handle, "attention backward")).first;
    }
    TRAINER_CUDA_CHECK(cudnnSetStream(s_->handle, stream));
    // Workspace: the fp32 dQ accumulator, the row sums, then the plan's own (256-byte aligned pieces).
    auto round_up = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t acc_bytes = round_up(static_cast<size_t>(b * h * t * d) * sizeof(float));
    const size_t sum_bytes = round_up(static_cast<size_t>(b * h * t) * sizeof(float));
    auto* ws = static_cast<char*>(workspace(acc_bytes + sum_bytes + static_cast<size_t>(it->second.workspace)));
    TRAINER_CUDA_CHECK(cudaMemsetAsync(ws, 0, acc_bytes, stream));
    float scale = 1.0f / std::sqrt(static_cast<float>(HS)), one = 1.0f, neg_inf = -INFINITY;
    auto* base = const_cast<uint16_t*>(qkv);
    execute(s_->handle, it->second,
            {kBQ, kBKt, kBVt, kBO, kBdO, kBStats, kBdQ, kBdK, kBdV, kBScale, kBOne, kBNegInf, kBSum, kBdQAcc},
            {base, base + C, base + 2 * C, const_cast<uint16_t*>(out), const_cast<uint16_t*>(dout),
             const_cast<float*>(lse), dqkv, dqkv + C, dqkv + 2 * C, &scale, &one, &neg_inf, ws + acc_bytes, ws},
            ws + acc_bytes + sum_bytes);
}

}  // namespace trainer::cuda

// The Backend seam: every operation the model and the optimizer need, forward and backward, on views of
// device memory. The CPU backend (kernels/cpu) is the reference; the CUDA backend (kernels/cuda)
// implements the same contracts, written here once. Every member is required unless it says otherwise.
//
// Shape legend: B batch, T sequence length, C model width (d_model), NH heads, HS head size (C/NH), KVH key/value
// heads (NH, or fewer with grouped-query attention) and KV = KVH*HS their width,
// H MLP hidden width (after the activation), V vocabulary rows (embedding_size), N = B*T rows,
// M/K generic GEMM sizes. Row-major throughout; Linear weights are PyTorch's (out, in).
// Conventions (llm.c's): parameter gradients ACCUMULATE (+=) so micro-batches sum; activation gradients
// are OVERWRITTEN unless an op says otherwise. Pointers marked "nullable" may be null (the op then skips
// that output or input). Ops are deterministic: the same inputs give bitwise the same outputs on one
// backend and thread count (no floating-point atomics); an op that is not says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/choices.h"
#include "base/memory.h"

namespace trainer {

// An activation a Linear layer reads, or writes for an element-wise op to read: the norms' outputs,
// attention's output (which attention's backward also reads), the MLP activation, qkv (RoPE rotates it in
// place, attention reads it), and with SwiGLU the ff_proj output. Stored in fp32, or in bf16 where the backend keeps
// GEMM operands in bf16 (Backend::gemm_operands_bf16(): amp_bf16 on CUDA), so GEMMs read it without a cast pass and it
// takes half the memory; its producer rounds once, where the GEMM's cast rounded before (the ff_proj output: where
// PyTorch's autocast rounds it too). Converts implicitly from an fp32 pointer.
//
// amax (amp_fp8; null elsewhere): one device float, the largest |value| of the operand's elements (NaN where one is
// NaN) as a producer wrote it, so that a block Linear's FP8 cast of the operand reads it instead of taking a pass of
// its own (the cast's scale comes from it: kernels/element.h's fp8_scale). On an op's output it asks the op to write
// it, which only the producers whose contract says so do (layernorm_forward, gelu_forward and gelu_backward,
// swiglu_forward and swiglu_backward, matmul_gelu_forward's out and matmul_gelu_backward's dpre); on a GEMM's input
// it says the float holds the operand's amax as its values are now. The CPU backend holds every such amax it reads to
// the operand's own, so a model that passes a stale one fails there.
struct GemmOperand {
    void* p = nullptr;
    bool bf16 = false;
    float* amax = nullptr;
    GemmOperand() = default;
    GemmOperand(float* f) : p(f) {}                            // NOLINT(google-explicit-constructor): fp32
    GemmOperand(const float* f) : p(const_cast<float*>(f)) {}  // NOLINT(google-explicit-constructor): fp32
    static GemmOperand in_bf16(uint16_t* h) {
        GemmOperand g;
        g.p = h, g.bf16 = true;
        return g;
    }
    float* f32() const { return static_cast<float*>(p); }
    uint16_t* b16() const { return static_cast<uint16_t*>(p); }
    // The operand `elements` further on, in its own storage type (a part: no amax, which is the whole's).
    GemmOperand at(size_t elements) const {
        GemmOperand g = *this;
        g.p = static_cast<char*>(p) + elements * (bf16 ? 2 : 4);
        g.amax = nullptr;
        return g;
    }
    // The operand with its amax float (above).
    GemmOperand with_amax(float* a) const {
        GemmOperand g = *this;
        g.amax = a;
        return g;
    }
};

// The GEMM operands of the Linear layers that follow (Backend::set_linear_precision).
enum class LinearPrecision { kDefault, kFp8 };
// Whether a Linear of K inputs and N outputs computes in FP8 under kFp8: cuBLASLt's FP8 GEMMs sum over multiples of
// 16 and write rows of them (the tokens, M, are padded where a GEMM sums over them). Every backend holds to it (the
// CPU's emulation and the plan's dry backend too): another shape runs as kDefault, said once a shape.
inline bool fp8_linear_shape(int K, int N) { return K % 16 == 0 && N % 16 == 0; }

// LoRA's dropout of an adapter's input (training only): element (m, k) is kept, and scaled by 1 / (1 - p), where
// lora_dropout_keep(row_keys[m], adapter, k, threshold) (kernels/element.h): masks keyed by each row's (seed, step,
// instance, position), the adapter and the channel, so the same on every backend, thread count and world size.
// p 0: none (row_keys unused, may be null).
struct LoraDropout {
    float p = 0.0f;
    const uint64_t* row_keys = nullptr;  // M keys, device memory
    uint32_t adapter = 0;
};

// How a norm normalises a row of C channels (OLMo's layer_norm_type): LayerNorm, (x - mean) * rstd with
// rstd = 1/sqrt(var + eps) and the biased variance (torch.nn.functional.layer_norm); or RMSNorm, x * rstd
// with rstd = 1/sqrt(mean(x^2) + eps) (OLMo's RMSLayerNorm), which has no mean (mean buffers may be null).
// Either is then multiplied by its weight and added its bias where it has them.
enum class NormKind { kLayerNorm, kRms };

class Backend {
   public:
    virtual ~Backend() = default;
    // "cpu" or "cuda".
    virtual std::string name() const = 0;

    // ---- memory (device memory; on the CPU backend, host memory) ----
    // 64-byte aligned, uninitialised; throws UserError when the device is out of memory.
    virtual void* alloc(size_t bytes) = 0;
    virtual void free(void* ptr) = 0;
    virtual void copy_host_to_device(void* dst, const void* src, size_t bytes) = 0;
    virtual void copy_device_to_host(void* dst, const void* src, size_t bytes) = 0;
    virtual void copy_device_to_device(void* dst, const void* src, size_t bytes) = 0;
    virtual void fill_zero(void* ptr, size_t bytes) = 0;
    // Copies between any two of host memory and this device's memory, in order with the queued work;
    // returns once host memory involved may be used. Default: host memory only (memmove).
    virtual void copy_any(void* dst, const void* src, size_t bytes) {
        if (bytes > 0) std::memmove(dst, src, bytes);
    }
    // Waits for all queued work (a no-op on the CPU backend). Default: nothing to wait for.
    virtual void synchronize() {}
    // Host memory that the device copies to and from at full speed, beside its compute (pinned on CUDA): CPU
    // offload's master parameters, gradients and moments. 64-byte aligned, zeroed; UserError when out of
    // memory. Default: alloc, zeroed (a backend whose device memory is host memory).
    virtual void* alloc_host(size_t bytes) {
        void* p = alloc(bytes);
        if (bytes > 0) std::memset(p, 0, bytes);
        return p;
    }
    virtual void free_host(void* ptr) { free(ptr); }
    // Queues a copy between memory from alloc_host and device memory (either way), ordered after the work
    // queued so far and running beside the work queued later (a copy engine); returns a ticket for the two
    // waits below. Neither side may be written or freed (nor the destination read) until the copy is
    // waited for. Copies run one after another in the order queued: waiting for a ticket waits for every
    // earlier one too.
    // Default: copies at once (copy_any); every ticket is complete.
    virtual uint64_t copy_async(void* dst, const void* src, size_t bytes) {
        copy_any(dst, src, bytes);
        return 0;
    }
    // The host waits until copy `ticket` is done.
    virtual void host_wait(uint64_t ticket) { (void)ticket; }
    // Work queued from now on waits (on the device, not the host) until copy `ticket` is done.
    virtual void device_wait(uint64_t ticket) { (void)ticket; }
    // Dense peak FLOP/s of this device for MFU (bf16 tensor cores when `bf16`, else fp32) and the formula in
    // *how; 0 where the backend does not know it. The CPU backend's device is the cores this process computes
    // on (its OpenMP threads: a rank's share of the machine).
    virtual double peak_flops(bool bf16, std::string* how) const {
        (void)bf16, (void)how;
        return 0.0;
    }
    // Peak memory bandwidth of the device in bytes/s and its formula in *how; 0 where unknown.
    virtual double peak_bandwidth(std::string* how) const {
        (void)how;
        return 0.0;
    }
    // High-water mark of the device memory this backend holds (its allocator's pool), 0 where untracked.
    virtual int64_t device_peak_bytes() const { return 0; }
    // One line on the compute libraries in use (the CPU backend: OpenBLAS's kernel set, with a note when a
    // faster one is available); empty where there is nothing to say. Default: empty.
    virtual std::string library_description() const { return ""; }
    // Whether the model stores its GemmOperand activations in bf16 for this backend (only a backend that
    // runs its GEMMs on bf16 does; the others refuse bf16 operands). Default: fp32.
    virtual bool gemm_operands_bf16() const { return false; }

    // ---- utilisation (a training step's metrics) ----
    // Between begin_activity() and end_activity(), called on one thread with the work queued in between,
    // the backend measures how long its compute engine ran this thread's ops (busy_s: the CPU backend's ops
    // by the host clock; the CUDA backend's kernels on its compute stream, from a pair of CUDA events
    // around each op) and, where the device waits on its own (the CUDA stream's waits for collectives and
    // offload copies), how long it waited (wait_s; negative: not measured here, the host's waits are the
    // caller's to time). end_activity() waits for the window's work. With a trace recording (base/trace.h),
    // the CUDA backend also adds what its streams ran in the window as the trace's device tracks. Default:
    // nothing measured.
    struct Activity {
        bool measured = false;
        double busy_s = 0.0;
        double wait_s = -1.0;
    };
    virtual void begin_activity() {}
    virtual Activity end_activity() { return {}; }
    // The device's own counters, read now (NVML on CUDA, where the driver's library is present): name and
    // value, for the metrics file. Default: none.
    virtual std::vector<std::pair<std::string, double>> device_counters() { return {}; }

    // ---- recorded work (CUDA graphs; kernels/graph.h runs them) ----
    // Between begin_capture() and end_capture(), called on one thread, the ops queued are recorded instead of
    // run, and launch_graph(id) runs the recording, with the pointers and arguments the ops had, as one
    // launch. While capturing, an op that needs the host (alloc, free, a copy from or to host memory, a value
    // returned to the host: sum, squared_norm) is refused with an error naming it; abort_capture() then drops
    // the recording. Freeing memory while recordings exist drops them all (one may have used it) and raises
    // graph_epoch(), so their owner records again. Default: no capture (can_capture() false; the others
    // refuse).
    virtual bool can_capture() const { return false; }
    virtual void begin_capture();
    virtual int end_capture();
    virtual void abort_capture() {}
    virtual void launch_graph(int id);
    virtual uint64_t graph_epoch() const { return 0; }

    // ---- forward/backward ops (fp32 storage) ----
    // PyTorch Linear: out(M,N) = inp(M,K) @ weight(N,K)^T + bias(N); bias nullable; out overwritten.
    virtual void matmul_forward(GemmOperand out, GemmOperand inp, const float* weight, const float* bias, int M, int K,
                                int N) = 0;
    // dinp(M,K) = dout(M,N) @ weight(N,K) (+= when accumulate_dinp, fp32 only; dinp nullable: skipped);
    // dweight(N,K) += dout^T @ inp (nullable: a frozen weight, skipped); dbias(N) += the column sums of dout
    // (nullable). dout and dinp may be bf16 GemmOperands (gradients only a GEMM or a bf16 kernel reads next, as
    // PyTorch's autocast keeps them).
    virtual void matmul_backward(GemmOperand dinp, float* dweight, float* dbias, GemmOperand dout, GemmOperand inp,
                                 const float* weight, int M, int K, int N, bool accumulate_dinp) = 0;
    // out(M,N) = resid(M,N) + the Linear forward of inp: a block's sublayer output added to the residual
    // stream (out may alias resid). Default: matmul_forward into `scratch` (M x N floats) and residual_forward;
    // the CUDA backend adds resid in the GEMM's epilogue in amp_bf16 (scratch unused), saving a pass.
    virtual void matmul_residual_forward(float* out, const float* resid, GemmOperand inp, const float* weight,
                                         const float* bias, int M, int K, int N, float* scratch) {
        matmul_forward(scratch, inp, weight, bias, M, K, N);
        residual_forward(out, resid, scratch, static_cast<size_t>(M) * N);
    }
    // LoRA (PEFT's update beside a frozen Linear): out(M, n) += scale * (drop(inp) @ A^T) @ B^T, inp (M, K), A (r, K),
    // B (n, r); `out` is the adapted columns of the Linear's output, rows ld_out elements apart (out may be fp32 only
    // where inp is). work: M * (K + 2r) floats of scratch. has_lora(): the backend has these ops (default false:
    // they are internal errors, and a LoRA config is refused by name first).
    virtual bool has_lora() const { return false; }
    virtual void lora_forward(GemmOperand out, int ld_out, GemmOperand inp, const float* A, const float* B, int M,
                              int K, int r, int n, float scale, const LoraDropout& drop, float* work);
    // Its backward, given dout(M, n) (rows ld_dout apart): dA(r, K) += (scale * dout @ B)^T @ drop(inp), dB(n, r) +=
    // scale * dout^T @ (drop(inp) @ A^T), and dinp(M, K) += drop'((scale * dout @ B) @ A) (nullable: skipped), the
    // dropout's backward being the same mask and scale. Recomputes drop(inp) @ A^T (nothing kept from the forward).
    virtual void lora_backward(GemmOperand dinp, float* dA, float* dB, GemmOperand dout, int ld_dout, GemmOperand inp,
                               const float* A, const float* B, int M, int K, int r, int n, float scale,
                               const LoraDropout& drop, float* work);
    // QLoRA's frozen weights (element.h's NF4): out(n) = the values of `codes` ((n + 1) / 2 bytes) times their
    // blocks' absmax (one a kNf4Block values), in fp32, or in bf16 (the fp32 value rounded once: the words a GEMM
    // reads, packed_unit.h). Default: an internal error (a backend without it is refused first).
    virtual bool has_nf4() const { return false; }
    virtual void nf4_dequantize(GemmOperand out, const uint8_t* codes, const float* absmax, size_t n);
    // The same with double-quantized absmaxes (element.h): absmax_codes one byte a block, absmax2 one fp32 a
    // kDoubleQuantBlock of them, offset one fp32 (device memory).
    virtual void nf4_dequantize_dq(GemmOperand out, const uint8_t* codes, const uint8_t* absmax_codes,
                                   const float* absmax2, const float* offset, size_t n);
    // bench-kernels' ceiling for the Linear GEMMs: the peers' bf16 Linear (PyTorch's under autocast) at the same
    // shape, bf16 operands and results with fp32 accumulation, no bias and no epilogue. Forward: out(M,N) =
    // inp(M,K) @ weight(N,K)^T; backward: dinp(M,K) = dout(M,N) @ weight and dweight(N,K) = dout^T @ inp. Buffers
    // of bf16 words. has_linear_bf16_reference(): the backend has such GEMMs (false by default, and on the CPU;
    // the other two then return false). They return false, nothing run, where it has none for the shape (the CUDA
    // backend where cuBLASLt has no kernel for it).
    virtual bool has_linear_bf16_reference() const { return false; }
    virtual bool linear_bf16_reference_forward(uint16_t* out, const uint16_t* inp, const uint16_t* weight, int M, int K,
                                               int N);
    virtual bool linear_bf16_reference_backward(uint16_t* dinp, uint16_t* dweight, const uint16_t* dout,
                                                const uint16_t* inp, const uint16_t* weight, int M, int K, int N);
    // Which Linear layers the matmul ops that follow compute: kFp8, a block's (att_proj, attn_out, ff_proj, ff_out)
    // under precision amp_fp8, whose GEMMs read FP8 operands (e4m3 inputs and weights, e5m2 output gradients, each
    // with a per-tensor scale from its current amax: kernels/element.h); kDefault, every other GEMM (the LM head's).
    // The model sets it around its blocks (BlockLinears below). Default: kFp8 is an internal error (the config refuses
    // amp_fp8 where the backend has no FP8 GEMMs); the CPU backend emulates them.
    virtual void set_linear_precision(LinearPrecision p);
    // Until the next call, the weight at `w` does not change and may be converted once for all the GEMMs
    // that use it (the CUDA backend keeps its bf16 copy in amp_bf16: the LM head's chunks reuse one cast of
    // the (V, C) weight). nullptr ends the promise. Default: nothing kept.
    virtual void hold_weight(const float* w) { (void)w; }
    // Until the region is named again with `bf16` null, the fp32 values at [w, w + n) are exactly the bf16 words at
    // `bf16` (device memory that stays put; whoever names it keeps the words those values whenever a GEMM may read
    // them), so a GEMM reading a weight inside it may read those words instead of casting (the CUDA backend in
    // amp_bf16 and amp_fp8). A replica's frozen unit unpacked from
    // its bf16 storage names its Linear weights (parallel/strategy/packed_unit.h). Default: nothing kept (the CPU reads
    // fp32).
    virtual void alias_bf16(const float* w, const uint16_t* bf16, size_t n) { (void)w, (void)bf16, (void)n; }
    // True: every read of a Linear weight inside an alias_bf16 region is a GEMM's (the matmul ops, bf16 or FP8),
    // which reads the bf16 words, so the fp32 values there need not be written at all (a replica then skips widening
    // its frozen Linear weights). The CUDA backend in amp_bf16 and amp_fp8. Default: false (the CPU reads fp32).
    virtual bool gemms_read_aliases() const { return false; }
    // pre = the Linear forward, out = gelu(pre) (erf or tanh form). Default: the two ops; the CUDA backend
    // fuses the tanh form into the GEMM's epilogue.
    virtual void matmul_gelu_forward(GemmOperand pre, GemmOperand out, GemmOperand inp, const float* weight,
                                     const float* bias, int M, int K, int N, bool tanh_approx) {
        matmul_forward(pre, inp, weight, bias, M, K, N);
        gelu_forward(out, pre, static_cast<size_t>(M) * N, tanh_approx);
    }
    // The backward of a Linear whose input is act = gelu(pre) (the MLP's ff_out): dpre(M,K) = (dout @ weight) *
    // gelu'(pre), and dweight += dout^T act, dbias += (nullable) as matmul_backward. dact(M,K) is a scratch for
    // the input gradient of the Linear where it is stored. Default: matmul_backward into dact, then gelu_backward;
    // the CUDA backend carries the tanh form's slope in the GEMM's epilogue and never stores dact.
    virtual void matmul_gelu_backward(GemmOperand dpre, GemmOperand dact, float* dweight, float* dbias,
                                      GemmOperand dout, GemmOperand act, const float* weight, GemmOperand pre, int M,
                                      int K, int N, bool tanh_approx) {
        matmul_backward(dact, dweight, dbias, dout, act, weight, M, K, N, false);
        gelu_backward(dpre, pre, dact, static_cast<size_t>(M) * K, tanh_approx);
    }
    // out(N,C) = wte[tokens[n]] + wpe[n % T] (wpe nullable: RoPE models have no learned positions).
    virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int N, int T,
                                   int C) = 0;
    // dwte[tokens[n]] += dout[n]; dwpe[n % T] += dout[n] (nullable); deterministic without atomics.
    virtual void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int N, int T,
                                    int C) = 0;
    // The norm before a sublayer (and the final norm): out(N,C) = norm(inp) * weight + bias (NormKind); weight
    // and bias nullable (OLMo's non-parametric LayerNorm has neither; GPT-2's has both; OLMo-2's RMSNorm a
    // weight). mean(N) (LayerNorm; nullable with RMSNorm) and rstd(N) are saved for the backward. Writes out.amax
    // where it is set (GemmOperand).
    virtual void layernorm_forward(GemmOperand out, float* mean, float* rstd, const float* inp, const float* weight,
                                   const float* bias, int N, int C, float eps, NormKind kind) = 0;
    // dinp(N,C) += (ACCUMULATES: the input is the residual stream, whose gradient also flows around the
    // norm); dweight(C) += and dbias(C) += (nullable, and null when weight / bias are).
    virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                    const float* weight, const float* mean, const float* rstd, int N, int C,
                                    NormKind kind) = 0;
    // The same for a norm with neither weight nor bias (OLMo's non-parametric LayerNorm, an RMSNorm without
    // affine) from its own output `out` (the normalised input, as layernorm_forward wrote it: fp32, or a
    // bf16 GemmOperand) and rstd instead of its input and mean: dinp(N,C) += rstd * (dout - mean(dout) - out *
    // mean(dout * out)) (RMSNorm: no mean(dout) term). The model keeps the output as the next GEMM's input
    // anyway, so a block that keeps everything need not keep the residual stream for its norms.
    virtual void norm_backward_from_output(float* dinp, const float* dout, GemmOperand out, const float* rstd, int N,
                                           int C, NormKind kind) = 0;
    // The norm after a sublayer (OLMo-2's norm_after): out(N,C) = resid + norm(inp) * weight + bias, inp the
    // sublayer's output (a GEMM's); out may alias resid; mean (nullable with RMSNorm) and rstd saved.
    virtual void norm_residual_forward(float* out, const float* resid, float* mean, float* rstd, GemmOperand inp,
                                       const float* weight, const float* bias, int N, int C, float eps,
                                       NormKind kind) = 0;
    // dinp(N,C) OVERWRITTEN with the gradient of the norm's input from dout (the residual stream's gradient,
    // which also flows on around the norm unchanged); dweight and dbias += (nullable).
    virtual void norm_residual_backward(GemmOperand dinp, float* dweight, float* dbias, const float* dout,
                                        GemmOperand inp, const float* weight, const float* mean, const float* rstd,
                                        int N, int C, NormKind kind) = 0;
    // QK-norm (OLMo's attention_layer_norm): q and k of qkv(N, C+2KV) = q | k | v (q C channels, k and v KV each:
    // KV = C with every head its own k and v, fewer with grouped-query attention), each row's q and each row's k
    // normalised as a whole (all heads together, as OLMo and HF's Olmo2 norm them: q over C channels, k over KV),
    // in place with their own weight and bias (nullable); their inputs are saved in qk(N, C+KV) = q | k, and mean
    // (nullable with RMSNorm) and rstd, (2,N) each: q's rows, then k's. v untouched.
    virtual void qk_norm_forward(GemmOperand qkv, GemmOperand qk, float* mean, float* rstd, const float* q_weight,
                                 const float* q_bias, const float* k_weight, const float* k_bias, int N, int C, int KV,
                                 float eps, NormKind kind) = 0;
    // In place on dqkv(N, C+2KV): its dq and dk parts become the gradients of the norms' inputs (dv untouched);
    // the weights' and biases' gradients += (nullable).
    virtual void qk_norm_backward(GemmOperand dqkv, float* dq_weight, float* dq_bias, float* dk_weight, float* dk_bias,
                                  GemmOperand qk, const float* q_weight, const float* k_weight, const float* mean,
                                  const float* rstd, int N, int C, int KV, NormKind kind) = 0;
    // Grouped-query attention (KVH key/value heads shared by NH query heads, NH/KVH each): out(N,3C) = q | k | v with
    // every query head's own k and v, from inp(N, C+2KV), KV = KVH*HS: q copied, and query head h's k and v the
    // inp's k and v of head h / (NH/KVH) (the order of HF's repeat_kv). The attention kernels then run as with
    // NH heads of their own.
    virtual void kv_heads_expand(GemmOperand out, GemmOperand inp, int N, int NH, int KVH, int HS) = 0;
    // Its transpose: dinp(N, C+2KV) overwritten with dq, and each shared head's dk and dv the sum of its NH/KVH
    // query heads' parts of dout(N,3C).
    virtual void kv_heads_reduce(GemmOperand dinp, GemmOperand dout, int N, int NH, int KVH, int HS) = 0;
    // Rotary embeddings, non-interleaved ("rotate_half", as OLMo and HF Llama), in place on qkv(B,T,3C)
    // = q | k | v, each (NH,HS): q and k rotated at positions t = 0..T-1 by angle t / theta^(2i/HS) (i <
    // HS/2), y[i] = x[i] cos - x[i+HS/2] sin, y[i+HS/2] = x[i+HS/2] cos + x[i] sin, the tables in fp32 as
    // OLMo computes them; v untouched.
    virtual void rope_forward(GemmOperand qkv, int B, int T, int NH, int HS, float theta) = 0;
    // In place on dqkv: the transpose (inverse) rotation of the dq and dk parts; dv untouched.
    virtual void rope_backward(GemmOperand dqkv, int B, int T, int NH, int HS, float theta) = 0;
    // Causal scaled-dot-product attention (scale 1/sqrt(HS)) of qkv(B,T,3C): out(B,T,C) with head h at
    // channels [h*HS, (h+1)*HS); lse(B,NH,T) the log-sum-exp of each query's scaled scores, saved so the
    // backward recomputes the probabilities without a T x T matrix (nothing of size T x T is stored).
    virtual void attention_forward(GemmOperand out, float* lse, GemmOperand qkv, int B, int T, int NH, int HS) = 0;
    // dqkv(B,T,3C) overwritten with d(q|k|v), from the forward's out and lse.
    virtual void attention_backward(GemmOperand dqkv, GemmOperand dout, GemmOperand qkv, GemmOperand out,
                                    const float* lse, int B, int T, int NH, int HS) = 0;
    // ---- generation with a KV cache (core/generate.h), fp32 ----
    // qkv rows here are (NH + 2 KVH) heads of HS: q | k | v, KVH = NH without grouped-query attention.
    // RoPE of rows at positions of their own: q and k of row n of qkv rotated as rope_forward rotates position
    // positions[n] (int32, device memory, each below S), by the same fp32 angles; v untouched.
    virtual void rope_forward_at(float* qkv, const int32_t* positions, int N, int NH, int KVH, int HS, float theta,
                                 int S) = 0;
    // Attention of rows against a KV cache: first the k and v of every row n of qkv are written into the caches
    // (sequences, KVH, S, HS) at sequence seqs[n] and position positions[n] (device int32, positions < S); then
    // each row's query head h attends to its sequence's cache of head h / (NH/KVH) at positions 0..positions[n]
    // (scale 1/sqrt(HS)): out(N, NH*HS). Rows of one sequence at several positions (a prompt) see each other's
    // keys as causal attention does.
    virtual void attention_with_cache(float* out, const float* qkv, float* kcache, float* vcache, const int32_t* seqs,
                                      const int32_t* positions, int N, int NH, int KVH, int HS, int S) = 0;
    // The MLP's activations write the amax of their output (out.amax, dinp.amax) where it is set (GemmOperand).
    // out(n) = gelu(inp), the exact erf form or the tanh approximation; out == inp allowed (fp32).
    virtual void gelu_forward(GemmOperand out, GemmOperand inp, size_t n, bool tanh_approx) = 0;
    // dinp(n) = dout * gelu'(inp), overwritten; dinp == dout allowed (same storage type).
    virtual void gelu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, size_t n, bool tanh_approx) = 0;
    // inp(N,2H): columns [0,H) are x, [H,2H) the gate g (OLMo's ff_proj(x).chunk(2)); out(N,H) = silu(g) * x.
    virtual void swiglu_forward(GemmOperand out, GemmOperand inp, int N, int H) = 0;
    // dinp(N,2H) overwritten from dout(N,H).
    virtual void swiglu_backward(GemmOperand dinp, GemmOperand inp, GemmOperand dout, int N, int H) = 0;
    // out(n) = a + b; out may alias a or b.
    virtual void residual_forward(float* out, const float* a, const float* b, size_t n) = 0;
    // x(n) *= s.
    virtual void scale_inplace(float* x, size_t n, float s) = 0;
    // Fused softmax + cross-entropy (+ dlogits), one pass over each row of logits(N,V): losses(N) =
    // logsumexp(row) - row[target] (natural log); when compute_grad the row is overwritten with dlogits =
    // (softmax(row) - onehot(target)) * dloss_scale, dloss_scale being d(total loss)/d(this row's loss).
    // A target < 0 is ignored (loss 0, zero gradient row). The softmax spans all V columns (OLMo computes
    // the cross-entropy over the padded embedding_size). bf16 logits (amp_bf16, as autocast's LM head writes
    // them) are read in fp32 math and the dlogits rounded back to bf16; the losses are fp32. With
    // z_loss_multiplier z > 0 (PaLM's z-loss, OLMo's softmax_auxiliary_loss) each counted row's objective also has
    // z * logsumexp(row)^2: z_losses(N) receives it (0 for an ignored row) and the dlogits include its gradient,
    // 2 z logsumexp * softmax * dloss_scale. z = 0: z_losses may be null.
    virtual void classifier_forward_backward(GemmOperand logits, float* losses, const int32_t* targets, int N, int V,
                                             float dloss_scale, bool compute_grad, float z_loss_multiplier,
                                             float* z_losses) = 0;

    // ---- optimizer ----
    // One AdamW step over a flat range (PyTorch semantics, kernels/element.h adamw_element) on
    // grad * grad_scale (grad_scale carries the clipping coefficient); step is 1-based. param_bf16
    // (nullable) receives the updated parameters rounded to bf16 in the same pass (the copy a
    // mixed-precision strategy gathers).
    virtual void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1,
                              float beta2, float eps, float weight_decay, long step, float grad_scale,
                              uint16_t* param_bf16 = nullptr) = 0;
    // adamw_update over many ranges with the step's common arguments (one launch on the CUDA backend);
    // each range's own weight decay. Default: adamw_update per range, in order.
    struct AdamwRange {
        float* param;
        const float* grad;
        float* m;
        float* v;
        uint16_t* param_bf16;  // nullable
        size_t n;
        float weight_decay;
    };
    virtual void adamw_update_multi(const std::vector<AdamwRange>& ranges, float lr, float beta1, float beta2,
                                    float eps, long step, float grad_scale) {
        for (const AdamwRange& r : ranges) {
            adamw_update(r.param, r.grad, r.m, r.v, r.n, lr, beta1, beta2, eps, r.weight_decay, step, grad_scale,
                         r.param_bf16);
        }
    }
    // Sum of squares of x, accumulated in double over a fixed partition; the result is returned to the host.
    virtual double squared_norm(const float* x, size_t n) = 0;
    // Sum of squares over many ranges (x, n), returned to the host once; deterministic for given ranges.
    // Default: squared_norm per range, summed in order.
    virtual double squared_norm_multi(const std::vector<std::pair<const float*, size_t>>& ranges) {
        double total = 0.0;
        for (const auto& [x, n] : ranges) total += squared_norm(x, n);
        return total;
    }
    // Sum of x returned to the host, accumulated in double.
    virtual double sum(const float* x, size_t n) = 0;

    // ---- casts ----
    // Round to nearest even (NaN stays NaN), and the exact widening back (kernels/element.h).
    virtual void cast_float_to_bf16(uint16_t* out, const float* in, size_t n) = 0;
    virtual void cast_bf16_to_float(float* out, const uint16_t* in, size_t n) = 0;
    // out = in rounded to bf16 and widened back (the values a bf16 copy holds, in fp32), in one pass; out
    // may alias in.
    virtual void round_to_bf16(float* out, const float* in, size_t n) = 0;
};

// A model's blocks under precision amp_fp8: their Linear layers' GEMMs read FP8 operands while this lives (nothing
// changes where `fp8` is false).
class BlockLinears {
   public:
    BlockLinears(Backend* backend, bool fp8) : backend_(fp8 ? backend : nullptr) {
        if (backend_ != nullptr) backend_->set_linear_precision(LinearPrecision::kFp8);
    }
    ~BlockLinears() {
        if (backend_ != nullptr) backend_->set_linear_precision(LinearPrecision::kDefault);
    }
    BlockLinears(const BlockLinears&) = delete;
    BlockLinears& operator=(const BlockLinears&) = delete;

   private:
    Backend* backend_;
};

// How a backend computes (the CPU backend has one way and ignores these).
struct BackendOptions {
    bool bf16_matmuls = false;   // precision amp_bf16 (and amp_fp8): GEMMs on bf16, fp32 accumulation
    bool fp8_linears = false;    // precision amp_fp8: the blocks' Linear layers on FP8 (set_linear_precision)
    bool bf16_operands = false;  // with bf16_matmuls: GemmOperand activations stored in bf16 (kernels.bf16_activations)
    AttentionKernel attention = AttentionKernel::kNative;  // kernels.attention, resolved (never kAuto)
    int device_index = 0;                                  // which GPU (the rank's LOCAL_RANK modulo the GPUs present)
    bool classifier_one_read = false;  // kernels.classifier_one_read: a logits row read from device memory once
};

// Builds the backend for a device: kCpu (always available) or kCuda (kAuto is resolved first). Refuses a
// device this build or machine does not have, naming it and what is available.
std::unique_ptr<Backend> make_backend(Device device, const BackendOptions& options = {});

// The libraries the kernels compute with, a line each ("OpenBLAS: ...", "CUDA: ...", "cuDNN: ..."): the versions
// this build was built with and those found at run time (a build without CUDA says so). NCCL's is
// parallel/comm/communicator.h's.
std::vector<std::string> library_versions();

// GPUs this process can use: 0 in a build without CUDA, without a driver or without a device.
int cuda_device_count();
// GPU `index` as the driver names it, and its memory in bytes; nullopt where there is no such GPU (or no CUDA).
struct CudaDeviceInfo {
    std::string name;
    uint64_t memory_bytes = 0;
};
std::optional<CudaDeviceInfo> cuda_device_info(int index);
// GPU `index`'s free memory in bytes now (cudaMemGetInfo, which opens this process's context on it); nullopt
// where there is no such GPU (or no CUDA).
std::optional<uint64_t> cuda_free_memory(int index);
// kAuto -> kCuda where a GPU is present, else kCpu; the others unchanged.
Device resolve_device(Device device);

// The native CUDA attention kernels' largest head (kernels/cuda/attention.cu).
constexpr int kCudaNativeAttentionMaxHeadSize = 256;

// Whether this build has cuDNN's fused attention: every CUDA build but the emulated one (TRAINER_CUDA=EMULATED,
// tests/simt), where kernels.attention auto picks the native kernels and "cudnn" is refused.
#ifdef TRAINER_SIMT_DEVICE
constexpr bool kCudnnAttentionBuilt = false;
#else
constexpr bool kCudnnAttentionBuilt = true;
#endif

// Empty when cuDNN's fused attention (kernels.attention=cudnn) runs a sequence of T positions with
// heads of HS channels; else what it cannot run (cuDNN needs HS a multiple of 8 and at most 128 on every
// GPU generation, and T >= 2 for its backward).
inline std::string cudnn_attention_unsupported(int T, int HS) {
    if (HS % 8 != 0 || HS > 128) {
        return "head size of " + std::to_string(HS) +
               " (model.d_model / model.n_heads; cuDNN needs a multiple of 8, "
               "at most 128)";
    }
    if (T < 2) return "sequence of " + std::to_string(T) + " positions (cuDNN's backward needs at least 2)";
    return "";
}

// The shared-head ops' precondition (kv_heads_*, rope_forward_at, attention_with_cache): NH query heads share KVH
// key/value heads evenly; an internal error otherwise (the config refuses such a model first).
void check_shared_heads(int NH, int KVH);

// Empty when our flash attention (kernels.attention=flash) runs heads of HS channels; else why not.
inline std::string flash_attention_unsupported(int HS) {
    if (HS != 64 && HS != 128) {
        return "head size of " + std::to_string(HS) + " (model.d_model / model.n_heads; it takes 64 or 128)";
    }
    return "";
}

// The CPU backend (kernels/cpu/cpu_backend.cpp): the reference every other backend is tested against.
std::unique_ptr<Backend> make_cpu_backend();

// One op of a dry run: its name, floating-point operations and bytes of memory read and written. The
// asynchronous copies and their waits are reported too: "copy_async" (bytes, and the ticket it returned),
// "host_wait" and "device_wait" (the ticket waited for; no work).
struct OpCost {
    const char* op;
    double flops;
    double bytes;
    uint64_t ticket = 0;
};
// A backend that computes nothing and allocates nothing (kernels/dry_backend.cpp), for dry runs of a step
// (core/plan/dry_run.h): alloc and alloc_host hand out distinct addresses that are never dereferenced, while the
// DeviceBuffers that own them are counted by the memory accounting as in a real run; every op is reported
// to `observer` (when set) with its cost for fp32 storage (2 bytes an element of a bf16 GemmOperand), and
// so is every copy_async (with distinct tickets from 1) and every wait on one; host values (sums, norms)
// are 0. `gemm_operands_bf16`: what the backend it stands for answers (see
// gemm_operands_bf16_for, parallel/setup.h).
// `gemms_read_aliases` likewise (gemms_read_aliases_for).
std::unique_ptr<Backend> make_dry_backend(std::function<void(const OpCost&)> observer = {},
                                          bool gemm_operands_bf16 = false, bool gemms_read_aliases = false);
#ifdef TRAINER_HAVE_CUDA
// The CUDA backend (kernels/cuda/cuda_backend.cu); refuses when no GPU is usable, naming why.
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options);
#endif

// Owning view of one allocation, counted in the memory accounting under its category: device memory
// (Backend::alloc), or host memory (Backend::alloc_host) for the host categories.
class DeviceBuffer {
   public:
    DeviceBuffer() = default;
    DeviceBuffer(Backend* backend, size_t bytes, MemCategory category);
    ~DeviceBuffer();
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& o) noexcept;
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;

    void* data() const { return ptr_; }
    float* f32() const { return static_cast<float*>(ptr_); }
    int32_t* i32() const { return static_cast<int32_t*>(ptr_); }
    uint16_t* bf16() const { return static_cast<uint16_t*>(ptr_); }
    size_t bytes() const { return bytes_; }
    void reset();
    // Counts the buffer under another category from now on (e.g. gradients handed to a reduction).
    void recategorize(MemCategory category);

   private:
    Backend* backend_ = nullptr;
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
    MemCategory category_ = MemCategory::kOther;
};

}  // namespace trainer

// The CUDA backend's kernels as its host code calls them (native/src/cuda/backend_cuda.cu). Every
// launcher enqueues on `stream` and returns at once; pointers are device pointers unless a comment
// says otherwise. Launch errors are reported by cuda_check() after the launch.
//
// The products are one warp per output row (values dequantized in registers, or 8-bit integer dot
// products), for up to three matrices sharing an input per launch, with the bias and the residual add
// in their epilogue; the input stage makes and converts what they read in one kernel. Not yet tuned for
// the speed goals of issue #43 (weights streamed near the memory's rate, tiled prompt kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// kernel<<<grid, block, 0, stream>>>(args...), written so that the CPU emulator (emu/cuda_runtime.h, which
// defines its own) can run the same sources as C++.
#if !defined(OPTIML_LAUNCH)
#define OPTIML_LAUNCH(kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif

namespace optiml {

struct HParams;

// Throws optiml::Error naming `what` when `err` (or, for cudaSuccess, the last launch) failed.
void cuda_check(cudaError_t err, const char* what);

// ---- what a step launches and moves ----------------------------------------------------------------
// Every launcher below counts each kernel it enqueues (cuda_count): its kind, and the bytes of device
// memory the kernel has to move at least, each byte once (a model of the traffic from the arguments, not
// a measurement: re-reads that the caches serve are not counted; a product's weights are counted once per
// slice of tokens that reads them again): weights (matrices, norm and bias vectors), activations (the
// step's floats, 8-bit codes and their scales, positions), and the KV cache (keys and values written and
// read). Reads of the cache depend on the tokens' positions, which the launchers see only on the device:
// they report the bytes per visible position (kv_per_position) and the sliding window, and the log that
// receives the count multiplies them out with the batch's positions. The backend keeps the counts per
// layer (CudaBackend::count); the copies it enqueues itself it counts as Copy* kinds.
enum class CudaKernel : uint8_t {
    RmsNorm,
    RmsNormAdd,    // x += rms_norm(y) (Gemma 3's post-norms into the residual stream)
    Quantize,      // activations to 8-bit codes (the integer products' input)
    Round,         // activations rounded as the CPU rounds them (the float products' input)
    NormQuantize,  // RMSNorm and the 8-bit codes in one kernel (cuda_input_stage)
    NormRound,     // RMSNorm and the rounding
    ActQuantize,   // the FFN's act(gate) * up and the 8-bit codes
    ActRound,      // act(gate) * up and the rounding
    Matmul,        // float products (dequantized weights), of one to three matrices per launch
    MatmulQ8x,     // integer products (Q4_0, Q4_1, Q8_0 weights with 8-bit activations), likewise
    MatmulTiles,   // the same products for 32 tokens and more, as tiles on tensor cores
    DownNeuronMajor,
    AttnPrepare,  // per-head norms, RoPE, q's scale, the new keys and values into the cache
    AttnScores,   // softmax(q.K) V over the cache (and the output's conversion for the next product)
    AttnSplit,    // the same split over the positions: each split's softmax sums, then its partial output
    AddBias,
    Add,
    ActMul,
    Softcap,
    Gather,      // a mixture of experts' rows gathered by expert
    Sigmoid,     // the shared expert's gate
    MoECombine,  // each token's experts weighted and summed
    MoERoute,    // the router's top k, on the GPU
    CopyIn,   // host to device (the backend's copies)
    CopyOut,  // device to host
    Copy,     // device to device
    kCount
};
const char* cuda_kernel_name(CudaKernel k);
constexpr bool cuda_kernel_is_copy(CudaKernel k) {
    return k == CudaKernel::CopyIn || k == CudaKernel::CopyOut || k == CudaKernel::Copy;
}
struct CudaTraffic {
    int64_t weights = 0, activations = 0, kv = 0;
    int64_t kv_per_position = 0;  // KV bytes read per visible position of each token (attention)
    int32_t n_swa = 0;            // with a sliding window of this many positions (0: every earlier one)
};
// Where this thread's launchers count (the backend whose ops are being enqueued sets itself: use()).
class CudaLaunchLog {
public:
    virtual void count(CudaKernel k, const CudaTraffic& t) = 0;

protected:
    ~CudaLaunchLog() = default;
};
void cuda_set_launch_log(CudaLaunchLog* log);
CudaLaunchLog* cuda_launch_log();
// One launch of a kernel of kind k moving t (nothing when no log is set).
void cuda_count(CudaKernel k, const CudaTraffic& t);

// y[t][r] (+)= sum_c W[r][c] * x[t][c] for t < n, r < rows; W holds `rows` rows of `cols` values of
// `type`, row_bytes apart. UnsupportedModelError for a type the CUDA backend does not read.
void cuda_matmul(cudaStream_t s, int32_t type, const uint8_t* w, int64_t rows, int64_t cols, size_t row_bytes,
                 const float* x, int32_t n, float* y, bool accumulate);

// One matrix of a product launch: y[t][r] = (y[t][r] +) (W[r] . x[x_row + t] + bias[r]), W of `rows` rows
// row_bytes apart (bias may be nullptr; accumulate: y + (W x + bias), the residual add in the epilogue),
// for the launch's tokens t, or n of them from input row x_row on (a mixture of experts: each expert's
// matrix over its rows of one gathered input).
struct CudaMatrix {
    const uint8_t* w = nullptr;
    int64_t rows = 0;
    size_t row_bytes = 0;
    float* y = nullptr;
    const float* bias = nullptr;
    bool accumulate = false;
    int32_t x_row = 0;
    int32_t n = -1;  // -1: the launch's n
    // Experts chosen on the GPU (a mixture of experts' decode step): n slots, slot j through the matrix at
    // w + ids[j] * id_stride (expert ids[j] of a 3-D tensor), over input row j / x_group, into y's row j.
    const int32_t* ids = nullptr;
    size_t id_stride = 0;
    int32_t x_group = 1;
};
constexpr int kCudaMaxMatrices = 16;
// Up to kCudaMaxMatrices matrices of one type and width that read the same input (q, k and v; gate and
// up; experts' gate and up) in one launch: the grid's blocks cover the first matrix's rows, then the
// second's, ...
void cuda_matmul_many(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols, const float* x,
                      int32_t n);

// The integer path for a few tokens: x's rows as 8-bit codes per 32 values, as the CPU's Q8_0/Q8_1
// activations (quant_legacy.cpp's q8_activation_codes), with per block the scale d (f16-rounded), Q8_1's
// s = d * sum(codes) (from the unrounded d, f16-rounded) and the codes' sum. codes: [n][cols],
// meta: [n][cols / 32].
struct CudaQ8Meta {
    float d, s;
    int32_t sum, unused;
};
void cuda_quantize_q8x(cudaStream_t s, const float* x, int32_t n, int64_t cols, int8_t* codes, CudaQ8Meta* meta);
// The products' input stage: the values a group of products reads, made and converted in one kernel.
// make: x as it is (Copy), the RMSNorm of x's rows by `norm` (Norm: as cuda_rms_norm, bit for bit), or
// act(x) * up (ActMul: the FFN's hidden values, act a cuda_act_code; the products added the biases);
// then converted for the products: to 8-bit codes and block scales as cuda_quantize_q8x (convert
// kCudaCodes, into codes/meta), rounded as cuda_round_activations rounds for a vec_dot type (Q8_0, Q8_1,
// Q8_K, F16, BF16, into `rounded`), or not at all (-1). values (optional): the float values before the
// conversion. A Norm stage cannot write its rows in place (several blocks read each row).
constexpr int32_t kCudaCodes = -2;
// Q8_K's codes (convert kCudaCodesK, for the K-quants' tiled products): per 256 values the CPU's
// quantize_row_q8_K scale, stored in each of the group's 32-value blocks' meta.d, with each block's sum of
// codes in meta.sum (Q8_K's bsums, two at a time); meta.s is 0.
constexpr int32_t kCudaCodesK = -3;
struct CudaInputStage {
    enum Make : int32_t { Copy = 0, Norm = 1, ActMul = 2 };
    Make make = Copy;
    const float* x = nullptr;  // n rows of cols values (ActMul: the gate's)
    const float* norm = nullptr;
    float eps = 0.0f;
    const float* up = nullptr;
    int32_t act = 0;
    float* values = nullptr;
    int32_t convert = -1;
    float* rounded = nullptr;
    int8_t* codes = nullptr;
    CudaQ8Meta* meta = nullptr;
};
void cuda_input_stage(cudaStream_t s, const CudaInputStage& st, int32_t n, int64_t cols);
// The activation code cuda_act_mul and ActMul stages take for an FFNActivation (GELU through f16 when
// gelu_f16, as the CPU's table).
int32_t cuda_act_code(int act, bool gelu_f16);
// True when cuda_matmul_q8x handles these weights: Q4_0, Q4_1 or Q8_0 rows, 16-byte aligned.
bool cuda_matmul_q8x_reads(int32_t type, int64_t cols, size_t row_bytes, const void* w);
// y[t][r] (+)= the CPU's block dot products of W's row r with x's codes (integer sums per block, scaled).
void cuda_matmul_q8x(cudaStream_t s, int32_t type, const uint8_t* w, int64_t rows, int64_t cols, size_t row_bytes,
                     const int8_t* codes, const CudaQ8Meta* meta, int32_t n, float* y, bool accumulate);
// The same for up to kCudaMaxMatrices matrices sharing the codes, in one launch (as cuda_matmul_many).
void cuda_matmul_q8x_many(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols,
                          const int8_t* codes, const CudaQ8Meta* meta, int32_t n);
// The same products with each row's value the CPU's bit for bit (matmul_exact.cu: the CPU's order of the
// block terms; any row alignment); Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights, every matrix
// over all n rows of codes converted as cuda_matmul_exact_codes says (kCudaCodes, or kCudaCodesK for the
// K-quants). For a split's device share, so that the split gives the CPU-only run's bits. _reads: rows of
// `cols` values of `type` (whole blocks: 32 values, 256 for the K-quants) have them.
bool cuda_matmul_exact_reads(int32_t type, int64_t cols);
int32_t cuda_matmul_exact_codes(int32_t type);
void cuda_matmul_exact_many(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols,
                            const int8_t* codes, const CudaQ8Meta* meta, int32_t n);
// The same products for a prompt or a batch (32 tokens and more: matmul_tiles.cu; Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, IQ4_NL, and Q2_K-Q6_K, IQ4_XS with codes converted as kCudaCodesK), as 64 x 64 tiles of
// rows and tokens on the tensor cores, each weight read once per 64 tokens. Every matrix reads all n
// rows of the codes (no experts' slots or parts of the input). Needs compute capability 8.0.
bool cuda_matmul_tiles_reads(int32_t type);
// The codes the tiles of `type` read: kCudaCodes (32-value blocks) or kCudaCodesK (the K-quants: Q8_K's).
int32_t cuda_tile_codes(int32_t type);
void cuda_matmul_q8x_tiles(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols,
                           const int8_t* codes, const CudaQ8Meta* meta, int32_t n);
// F16 and BF16 weights as the same tiles (m16n8k16 with float sums), over x's rows already rounded to the
// weights' type (the float path's input); every matrix over all n rows. Needs compute capability 8.0.
bool cuda_matmul_tiles_f_reads(int32_t type);
void cuda_matmul_f_tiles(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols, const float* x,
                         int32_t n);

// y[t][d] = dim_scale[d] * sum_j h[t][j] * down[j][d]: a share's down product over its neuron-major Q8_0
// rows (optiml/sparse.h's NeuronMajor: row j is neuron j's down column), for n_neurons neurons and dim
// outputs, as the CPU's axpy_rows computes it.
void cuda_down_neuron_major_q8(cudaStream_t s, const uint8_t* rows, size_t row_bytes, const float* dim_scale,
                               const float* h, int64_t n_neurons, int64_t dim, int32_t n, float* y);
// out[t] = rms_norm(x[t]) * w (w may be nullptr: no scale), n rows of dim values; out may be x.
void cuda_rms_norm(cudaStream_t s, const float* x, const float* w, float* out, int32_t n, int64_t dim, float eps);
// x[t] += rms_norm(y[t]) * w: the same bits as cuda_rms_norm into a buffer and cuda_add.
void cuda_rms_norm_add(cudaStream_t s, const float* y, const float* w, float* x, int32_t n, int64_t dim, float eps);
// rows[t][i] += bias[i] for t < n, i < dim.
void cuda_add_bias(cudaStream_t s, float* rows, const float* bias, int32_t n, int64_t dim);
// x[i] += y[i] (+ y2[i] when y2) for i < count.
void cuda_add(cudaStream_t s, float* x, const float* y, const float* y2, int64_t count);
// out = x rounded as the CPU rounds activations for a product with weights whose vec_dot_type is
// `type` (optiml/ggml_types.h): 8-bit blocks (Q8_0, Q8_1, Q8_K) or F16/BF16, back in float; F32 copies.
// The product kernels then see the CPU's activations, so the two devices differ only in summation
// order. out may be x.
void cuda_round_activations(cudaStream_t s, int32_t type, const float* x, float* out, int32_t n, int64_t cols);
// x = tanh(x / cap) * cap over count values (the final logits' soft cap).
void cuda_softcap(cudaStream_t s, float* x, int64_t count, float cap);
// g = act(g) * u elementwise over count values; act as FFNActivation (GELU: the tanh form, through
// f16 as the CPU's table when gelu_f16: the CPU does so where the gate's input is 8-bit anyway).
void cuda_act_mul(cudaStream_t s, int act, bool gelu_f16, float* g, const float* u, int64_t count);

// Mixtures of experts (native/src/cuda/moe.cu). The router's choice for n tokens from their logits
// ([n][n_expert]), as the host's moe_route: softmax, the k most probable best first (ties: the lower index),
// renormalized when norm, times scale (softmax_chosen: weighed by the softmax of the k chosen logits
// instead): chosen[t * k + j], weight[t * k + j].
void cuda_moe_route(cudaStream_t s, const float* logits, int32_t n, int32_t n_expert, int32_t k, bool norm,
                    float scale, bool softmax_chosen, int32_t* chosen, float* weight);
// y[r] += bias[expert[r]] for n_rows rows of cols floats (the experts' biases, gpt-oss); nothing when bias
// is nullptr.
void cuda_add_expert_bias(cudaStream_t s, float* y, const float* bias, const int32_t* expert, int64_t n_rows,
                          int64_t cols);
// x[i] = value for count values.
void cuda_fill(cudaStream_t s, float* x, int64_t count, float value);
// dst[r] = src[idx[r]] for n_rows rows of cols floats.
void cuda_gather_rows(cudaStream_t s, const float* src, const int32_t* idx, int64_t n_rows, int64_t cols, float* dst);
// x = 1 / (1 + exp(-x)) over count values.
void cuda_sigmoid(cudaStream_t s, float* x, int64_t count);
// y[t] = sum over j < k, in order, of weight[t * k + j] * d[slot[t * k + j]] (slot nullptr: row t * k + j),
// then + sgate[t] * sy[t] when sy (rows of cols floats): the CPU's moe_combine.
void cuda_moe_combine(cudaStream_t s, int32_t n, int32_t k, int64_t cols, const float* weight, const int32_t* slot,
                      const float* d, const float* sy, const float* sgate, float* y);

// The per-token part of attention before the scores: biases already added, per-head q/k RMSNorm
// (q_norm/k_norm may be nullptr), RoPE, q scaled by hp.attn_q_scale, and the keys and values written
// into the cache in the layout of optiml/backend.h's KVLayerView: keys of k_type (F16, F32, Q8_0, Q4_0)
// as rows, values of v_type transposed (F16, F32) or as rows (Q8_0, Q4_0; v_row their bytes). A
// quantized side is rotated first in stripes of rot_k / rot_v values (q with the keys), as the CPU's
// kv_rotation_block sets them (0: no rotation). seq/pos: device copies of the batch's.
struct CudaAttnArgs {
    int32_t n_head, n_head_kv, head_dim, n_rot;
    bool neox;
    float rope_base, rope_scale, q_scale, kq_scale, rms_eps;
    float softcap = 0.0f;  // > 0: scores soft-capped, softcap * tanh(score / softcap) (Gemma 2)
    // YaRN (optiml/rope_yarn.h; yarn_ext 0: none): the pairs' ramp and the factor on cos and sin (1 without)
    float yarn_ext = 0.0f, yarn_low = 0.0f, yarn_high = 0.0f, rope_mscale = 1.0f;
    int32_t n_swa;  // 0: attend to every earlier position
    const float* sinks = nullptr;  // or [n_head]: a logit per head counted in its softmax, with a zero value
    const float* freq_factors;  // nullptr or [n_rot / 2]
    const float* q_norm;
    const float* k_norm;
    int32_t k_type, v_type, n_ctx;
    int32_t rot_k, rot_v;
    uint8_t* k_cache;
    uint8_t* v_cache;
    size_t k_row, k_seq, v_row, v_seq;
};
void cuda_attn_prepare(cudaStream_t s, const CudaAttnArgs& a, float* q, float* k, const float* v, const int32_t* seq,
                       const int32_t* pos, int32_t n);
// out[t][h] = softmax(q[t][h] . K / scale) V over positions [first, pos[t]] of sequence seq[t]. convert: the
// output as the next product (the output projection) reads it, made by the same kernel (each head is
// whole 32-value blocks: head_dim a multiple of 32): -1 as floats into out; TYPE_Q8_0 / TYPE_Q8_1 rounded
// into out as cuda_round_activations; kCudaCodes as cuda_quantize_q8x into codes and meta (out unwritten).
// splits > 1: the visible positions split into that many ranges, each a thread block (flash-decoding: a few
// tokens over a long context fill the GPU), in three launches (AttnSplit twice, then AttnScores) that write
// and read `part`: cuda_attn_partial_floats(n, n_head, head_dim, splits) floats.
constexpr int32_t kCudaMaxAttnSplits = 64;
inline int64_t cuda_attn_partial_floats(int32_t n, int32_t n_head, int32_t head_dim, int32_t splits) {
    return (int64_t)n * n_head * splits * (head_dim + 2);
}
void cuda_attn_scores(cudaStream_t s, const CudaAttnArgs& a, const float* q, const int32_t* seq, const int32_t* pos,
                      int32_t n, float* out, int32_t convert = -1, int8_t* codes = nullptr,
                      CudaQ8Meta* meta = nullptr, int32_t splits = 1, float* part = nullptr);

}  // namespace optiml

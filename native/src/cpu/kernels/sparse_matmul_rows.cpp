// Row-sparse matrix-vector (and small batch) product: gate/up for the active neurons only.
// It follows matmul_many step for step (same activation conversion, same kernels: vec_dot_rows for
// one token, the batched gemm for several), so a listed row gets exactly the bits the dense product
// would give it.
#include <atomic>

#include "optiml/common.h"
#include "optiml/matmul.h"
#include "optiml/sparse.h"

namespace optiml {

namespace {
constexpr int64_t kGemmTokens = 64;  // tokens per batch kernel call, as in matmul.cpp

// Asks for a whole weight row ahead of its use. Listed rows are scattered, so the hardware
// prefetcher, which follows sequential streams, starts cold on every one of them; fetching the next
// row while this one is multiplied hides most of that latency.
inline void prefetch_row(const uint8_t* p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}
}  // namespace

void matmul_rows(ThreadPool& pool, const KernelTable& kt, const WeightMatrix& W, const int32_t* rows,
                 int64_t n_rows, const float* X, int64_t n_tokens, float* Y) {
    matmul_rows_many(pool, kt, &W, &Y, 1, rows, n_rows, X, n_tokens);
}

void matmul_rows_gate_up(ThreadPool& pool, const KernelTable& kt, const WeightMatrix& gate, float* y_gate,
                         const WeightMatrix& up, float* y_up, const int32_t* rows, int64_t n_rows, const float* X,
                         int64_t n_tokens) {
    if (gate.cols == up.cols && gate.rows == up.rows && type_is_known(gate.type) && type_is_known(up.type) &&
        type_traits(gate.type).vec_dot_type == type_traits(up.type).vec_dot_type) {
        const WeightMatrix ws[2] = {gate, up};
        float* ys[2] = {y_gate, y_up};
        matmul_rows_many(pool, kt, ws, ys, 2, rows, n_rows, X, n_tokens);
        return;
    }
    matmul_rows(pool, kt, gate, rows, n_rows, X, n_tokens, y_gate);
    matmul_rows(pool, kt, up, rows, n_rows, X, n_tokens, y_up);
}

void matmul_rows_many(ThreadPool& pool, const KernelTable& kt, const WeightMatrix* Ws, float* const* Ys, int n_mats,
                      const int32_t* rows, int64_t n_rows, const float* X, int64_t n_tokens) {
    if (n_mats < 1) throw ArgumentError("matmul_rows_many: no matrix");
    for (int m = 0; m < n_mats; m++)
        if (Ws[m].rows16) throw Error("internal: the row-sparse product takes plain rows, not the rows16 layout");
    for (int m = 0; m < n_mats; m++) check_matmul_args(Ws[m].type, Ws[m].cols);
    const int64_t cols = Ws[0].cols;
    const int32_t xtype = type_traits(Ws[0].type).vec_dot_type;
    for (int m = 1; m < n_mats; m++)
        if (Ws[m].cols != cols || type_traits(Ws[m].type).vec_dot_type != xtype || Ws[m].rows != Ws[0].rows)
            throw ArgumentError("matmul_rows_many: the matrices need the same shape and vec_dot_type");
    if (n_rows < 0 || n_tokens < 0) throw ArgumentError("matmul_rows: negative row or token count");
    // A bad index would read outside the weights and write outside Y: check them all up front
    // (one compare per row, nothing next to a dot product of a whole row).
    for (int64_t i = 0; i < n_rows; i++)
        if (rows[i] < 0 || rows[i] >= Ws[0].rows)
            throw ArgumentError(format("matmul_rows: row index %d at position %lld is outside [0, %lld)", rows[i],
                                       (long long)i, (long long)Ws[0].rows));
    if (n_rows == 0 || n_tokens == 0) return;

    const size_t x_row = row_size(xtype, cols);

    // Chunks of the row list of every matrix from one shared counter (as matmul_many): the listed rows
    // are scattered, so a static split could leave one thread with all the slow cache misses, and one
    // job for all the matrices (gate and up) waits for its slowest thread once. Chunks are whole
    // multiples of 8 rows, the one-token kernel's tile.
    const int nth = pool.size();
    int64_t chunk = n_mats * n_rows / (nth * 8);
    chunk = chunk < 16 ? 16 : (chunk + 7) / 8 * 8;
    if (n_tokens > 1 && chunk > 64) chunk = 64;  // the batch path below holds 64 rows at most
    const int64_t per_mat = (n_rows + chunk - 1) / chunk;
    const int64_t n_chunks = per_mat * n_mats;
    std::atomic<int64_t> next{0};

    // Activations converted once per call, as matmul_many does.
    const uint8_t* xbase = activations_for(pool, kt, xtype, X, cols, n_tokens);
    pool.run([&](int, int) {
        for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
            const WeightMatrix& W = Ws[c / per_mat];
            float* Y = Ys[c / per_mat];
            const size_t w_row = row_size(W.type, cols);
            const uint8_t* wbase = (const uint8_t*)W.data;
            const vec_dot_fn dot = kt.vec_dot[W.type];
            const vec_dot4_fn dot4 = kt.vec_dot4[W.type];
            const vec_dot_rows_fn dot_rows = kt.vec_dot_rows[W.type];
            const gemm_fn gemm = kt.gemm[W.type];
            const int64_t i0 = (c % per_mat) * chunk, i1 = i0 + chunk < n_rows ? i0 + chunk : n_rows;
            if (n_tokens == 1 && dot_rows) {
                // One token: the multi-row kernel over the listed rows, 64 at a time (the same bits).
                float s[64];
                const void* ptrs[64 + kRowsAhead];
                for (int64_t ib = i0; ib < i1; ib += 64) {
                    const int64_t nr = i1 - ib < 64 ? i1 - ib : 64;
                    for (int64_t k = 0; k < nr + kRowsAhead; k++)
                        ptrs[k] = wbase + (int64_t)rows[ib + k < n_rows ? ib + k : n_rows - 1] * w_row;
                    dot_rows(cols, s, ptrs, xbase, nr);
                    for (int64_t k = 0; k < nr; k++) Y[rows[ib + k]] = s[k];
                }
                continue;
            }
            if (n_tokens > 1 && gemm) {
                // A batch: the tiled product over the listed rows, as matmul_many does it (the same
                // bits per (row, token)), the listed rows' weights staying in cache across the batch.
                const void* ptrs[64];
                float s[64 * kGemmTokens];
                const int64_t nr = i1 - i0;
                for (int64_t k = 0; k < nr; k++) ptrs[k] = wbase + (int64_t)rows[i0 + k] * w_row;
                for (int64_t t0 = 0; t0 < n_tokens; t0 += kGemmTokens) {
                    const int64_t nt = n_tokens - t0 < kGemmTokens ? n_tokens - t0 : kGemmTokens;
                    gemm(cols, s, ptrs, nr, xbase + t0 * x_row, x_row, nt);
                    for (int64_t t = 0; t < nt; t++) {
                        float* out = Y + (t0 + t) * W.rows;
                        for (int64_t k = 0; k < nr; k++) out[rows[i0 + k]] = s[t * nr + k];
                    }
                }
                continue;
            }
            int64_t t = 0;
            if (dot4) {
                for (; t + 4 <= n_tokens; t += 4) {
                    float* out = Y + t * W.rows;
                    for (int64_t i = i0; i < i1; i++) {
                        const int64_t r = rows[i];
                        if (i + 1 < n_rows) prefetch_row(wbase + rows[i + 1] * w_row, w_row);
                        float s[4];
                        dot4(cols, s, wbase + r * w_row, xbase + t * x_row, x_row);
                        for (int k = 0; k < 4; k++) out[k * W.rows + r] = s[k];
                    }
                }
            }
            for (; t < n_tokens; t++) {
                const uint8_t* x = xbase + t * x_row;
                float* out = Y + t * W.rows;
                for (int64_t i = i0; i < i1; i++) {
                    const int64_t r = rows[i];
                    if (i + 1 < n_rows) prefetch_row(wbase + rows[i + 1] * w_row, w_row);
                    dot(cols, &out[r], wbase + r * w_row, x);
                }
            }
        }
    });
}

}  // namespace optiml

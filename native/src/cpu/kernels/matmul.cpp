#include "optiml/matmul.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "optiml/common.h"

namespace optiml {

// Tokens per call of a batch kernel (gemm): their activations (a few KiB each) stay in the L2 cache
// while a chunk's rows go through them.
constexpr int64_t kGemmTokens = 64;

void check_matmul_args(int32_t wtype, int64_t cols) {
    if (!type_is_known(wtype)) throw ArgumentError(format("unknown tensor type id %d", wtype));
    const TypeTraits& wt = type_traits(wtype);
    const KernelTable& scalar = kernel_table(SIMD_SCALAR);
    if (!scalar.vec_dot[wtype] || !scalar.from_float[wt.vec_dot_type])
        throw ArgumentError(format("no dot-product kernel for weight type %s", wt.name));
    const int64_t bs = type_traits(wt.vec_dot_type).block_size;
    const int64_t need = wt.block_size > bs ? wt.block_size : bs;
    if (cols <= 0 || cols % need != 0)
        throw ArgumentError(format("row length %lld is not a positive multiple of %lld, the block size of %s",
                                   (long long)cols, (long long)need, wt.name));
}

void convert_activations(ThreadPool& pool, from_float_fn convert, const float* X, int64_t cols, int64_t n_tokens,
                         uint8_t* xq, size_t x_row) {
    if (n_tokens * cols <= 16384) {  // a few microseconds: less than handing it to the pool and back
        for (int64_t t = 0; t < n_tokens; t++) convert(X + t * cols, xq + t * x_row, cols);
        return;
    }
    pool.run([&](int ith, int nth) {
        int64_t t0, t1;
        split_range(n_tokens, ith, nth, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) convert(X + t * cols, xq + t * x_row, cols);
    });
}

const uint8_t* activations_for(ThreadPool& pool, const KernelTable& kt, int32_t xtype, const float* X, int64_t cols,
                               int64_t n_tokens) {
    if (xtype == TYPE_F32) return (const uint8_t*)X;
    static thread_local std::vector<uint8_t> xq_buf;
    const size_t x_row = row_size(xtype, cols);
    if (xq_buf.size() < x_row * n_tokens) xq_buf.resize(x_row * n_tokens);
    convert_activations(pool, kt.from_float[xtype], X, cols, n_tokens, xq_buf.data(), x_row);
    return xq_buf.data();
}

const uint8_t* gemm_x_for(ThreadPool& pool, const KernelTable& kt, const uint8_t* x, size_t x_row, int64_t cols,
                          int64_t n_tokens) {
    // Whole aligned blocks: the layout exists so that every 32-byte load of the codes is aligned.
    struct alignas(64) Block {
        uint8_t bytes[kGemmXBlock];
    };
    static thread_local std::vector<Block> xa_buf;
    const size_t xa_row = gemm_x_row(cols);
    if (xa_buf.size() * kGemmXBlock < xa_row * n_tokens) xa_buf.resize(xa_row * n_tokens / kGemmXBlock);
    uint8_t* xa = xa_buf.data()->bytes;
    if (n_tokens * cols <= 65536) {
        kt.gemm_x(cols, x, x_row, n_tokens, xa);
        return xa;
    }
    pool.run([&](int ith, int nth) {
        int64_t t0, t1;
        split_range(n_tokens, ith, nth, &t0, &t1);
        kt.gemm_x(cols, x + t0 * x_row, x_row, t1 - t0, xa + t0 * xa_row);
    });
    return xa;
}

Rows16Terms& rows16_gemm_terms(int64_t n_tok, int64_t nb) {
    static thread_local Rows16Terms terms;
    rows16_terms_size(n_tok, nb, terms);
    return terms;
}

namespace {

// One chunk of a product: rows r0 .. r1 of W against every token, into y (W.rows floats a token), written
// or added (accumulate). Every path gives each (row, token) the bits of the level's vec_dot.
struct Chunk {
    const KernelTable& kt;
    const WeightMatrix& W;
    float* y;
    int64_t r0, r1;
    const uint8_t* x;  // the activations in W's vec_dot_type, x_row bytes a token
    size_t x_row;
    const uint8_t* xa;  // or laid out for gemm_pre (gemm_x_for), when not null
    int64_t n_tokens;
    bool accumulate;
    size_t w_row;  // bytes of a row of W
    const uint8_t* row(int64_t r) const { return (const uint8_t*)W.data + r * w_row; }
};

// rows16 panels (r0 is a multiple of 16, so the chunk starts at row r0's bytes), written straight into
// the output unless they are added to it.
void chunk_rows16(const Chunk& c, const Rows16Terms& terms) {
    const gemm_rows16_fn gemm16 = c.kt.gemm_rows16[c.W.type];
    const int64_t cols = c.W.cols, rows = c.W.rows;
    if (!c.accumulate) {
        for (int64_t t0 = 0; t0 < c.n_tokens; t0 += kGemmTokens) {
            const int64_t nt = std::min(c.n_tokens - t0, kGemmTokens);
            gemm16(cols, c.y + t0 * rows + c.r0, rows, c.row(c.r0), c.r1 - c.r0, terms, t0, nt);
        }
        return;
    }
    float s[64 * kGemmTokens];  // 64 rows (4 panels) at a time: a one-token chunk may be longer
    for (int64_t rb = c.r0; rb < c.r1; rb += 64) {
        const int64_t nrb = std::min<int64_t>(c.r1 - rb, 64);
        for (int64_t t0 = 0; t0 < c.n_tokens; t0 += kGemmTokens) {
            const int64_t nt = std::min(c.n_tokens - t0, kGemmTokens);
            gemm16(cols, s, nrb, c.row(rb), nrb, terms, t0, nt);
            for (int64_t t = 0; t < nt; t++) {
                float* out = c.y + (t0 + t) * rows + rb;
                const float* st = s + t * nrb;
                for (int64_t k = 0; k < nrb; k++) out[k] += st[k];
            }
        }
    }
}

// One token: a kernel that shares each activation block across several rows.
void chunk_one_token(const Chunk& c) {
    float s[64];
    const void* rows[64 + kRowsAhead];
    for (int64_t rb = c.r0; rb < c.r1; rb += 64) {
        const int64_t nr = std::min<int64_t>(c.r1 - rb, 64);
        for (int64_t k = 0; k < nr + kRowsAhead; k++) rows[k] = c.row(rb + k < c.W.rows ? rb + k : c.W.rows - 1);
        c.kt.vec_dot_rows[c.W.type](c.W.cols, s, rows, c.x, nr);
        for (int64_t k = 0; k < nr; k++) c.y[rb + k] = c.accumulate ? c.y[rb + k] + s[k] : s[k];
    }
}

// A batch: the tiled product of the chunk's rows with every token, kGemmTokens tokens at a time, so the
// chunk's weights stay in cache across the batch and a token block's activations across the chunk's rows.
void chunk_batch(const Chunk& c) {
    const void* rows[64];
    float s[64 * kGemmTokens];
    const int64_t nr = c.r1 - c.r0;
    for (int64_t k = 0; k < nr; k++) rows[k] = c.row(c.r0 + k);
    if (c.xa && !c.accumulate)
        return c.kt.gemm_pre[c.W.type](c.W.cols, c.y + c.r0, c.W.rows, rows, nr, c.xa, c.n_tokens);
    for (int64_t t0 = 0; t0 < c.n_tokens; t0 += kGemmTokens) {
        const int64_t nt = std::min(c.n_tokens - t0, kGemmTokens);
        if (c.xa)
            c.kt.gemm_pre[c.W.type](c.W.cols, s, nr, rows, nr, c.xa + t0 * gemm_x_row(c.W.cols), nt);
        else
            c.kt.gemm[c.W.type](c.W.cols, s, rows, nr, c.x + t0 * c.x_row, c.x_row, nt);
        for (int64_t t = 0; t < nt; t++) {
            float* out = c.y + (t0 + t) * c.W.rows + c.r0;
            const float* st = s + t * nr;
            for (int64_t k = 0; k < nr; k++) out[k] = c.accumulate ? out[k] + st[k] : st[k];
        }
    }
}

// No batch kernel at this level: tokens four at a time where a 4-token kernel exists (it unpacks each
// weight block once), then one at a time.
void chunk_dots(const Chunk& c) {
    const vec_dot4_fn dot4 = c.kt.vec_dot4[c.W.type];
    const vec_dot_fn dot = c.kt.vec_dot[c.W.type];
    const int64_t rows = c.W.rows;
    int64_t t = 0;
    if (dot4) {
        for (; t + 4 <= c.n_tokens; t += 4) {
            float* out = c.y + t * rows;
            for (int64_t r = c.r0; r < c.r1; r++) {
                float s[4];
                dot4(c.W.cols, s, c.row(r), c.x + t * c.x_row, c.x_row);
                for (int k = 0; k < 4; k++) out[k * rows + r] = c.accumulate ? out[k * rows + r] + s[k] : s[k];
            }
        }
    }
    for (; t < c.n_tokens; t++) {
        const uint8_t* x = c.x + t * c.x_row;
        float* out = c.y + t * rows;
        for (int64_t r = c.r0; r < c.r1; r++) {
            float s;
            dot(c.W.cols, &s, c.row(r), x);
            out[r] = c.accumulate ? out[r] + s : s;
        }
    }
}

void run_chunk(const Chunk& c, const Rows16Terms& terms) {
    if (c.W.rows16) return chunk_rows16(c, terms);
    if (c.n_tokens == 1 && c.kt.vec_dot_rows[c.W.type]) return chunk_one_token(c);
    if (c.n_tokens > 1 && c.kt.gemm[c.W.type]) return chunk_batch(c);
    chunk_dots(c);
}

// Checks the matrices of one product (the same input: the same cols and vec_dot_type); whether any is in
// the rows16 layout.
bool check_matmul_many(const KernelTable& kt, const WeightMatrix* w, int n_mats) {
    const int64_t cols = w[0].cols;
    const int32_t xtype = type_traits(w[0].type).vec_dot_type;
    bool any_rows16 = false;
    for (int m = 0; m < n_mats; m++) {
        check_matmul_args(w[m].type, w[m].cols);
        if (w[m].rows16 && (!kt.gemm_rows16[w[m].type] || !kt.rows16_terms))
            throw Error(format("internal: a %s matrix in the rows16 layout, and the %s kernels have no product for it",
                               type_traits(w[m].type).name, simd_level_name(kt.level)));
        any_rows16 = any_rows16 || w[m].rows16;
        if (w[m].cols != cols || type_traits(w[m].type).vec_dot_type != xtype)
            throw ArgumentError("matmul_many: matrices sharing an input need the same row length and vec_dot_type");
    }
    if (n_mats > 7) throw ArgumentError("matmul_many takes at most 7 matrices");
    return any_rows16;
}

// The rows16 kernels read the activations regrouped, once for all chunks: into the calling thread's
// buffer, returned by reference (inside the jobs the thread_local's name is each worker's own).
const Rows16Terms& rows16_terms_for(ThreadPool& pool, const KernelTable& kt, int32_t xtype, const uint8_t* x,
                                    size_t x_row, int64_t cols, int64_t n_tokens) {
    static thread_local Rows16Terms terms_buf;
    Rows16Terms& terms = terms_buf;
    const int64_t nb = cols / 32;
    rows16_terms_size(n_tokens, nb, terms);
    if (n_tokens * nb <= 2048) {
        kt.rows16_terms(xtype, x, x_row, nb, 0, n_tokens, terms);
    } else {
        pool.run([&](int ith, int nth) {
            int64_t t0, t1;
            split_range(n_tokens, ith, nth, &t0, &t1);
            kt.rows16_terms(xtype, x, x_row, nb, t0, t1, terms);
        });
    }
    return terms;
}

}  // namespace

void matmul_many(ThreadPool& pool, const KernelTable& kt, const WeightMatrix* w, float* const* y, int n_mats,
                 const float* X, int64_t n_tokens, bool accumulate) {
    if (n_mats <= 0 || n_tokens <= 0) return;
    const bool any_rows16 = check_matmul_many(kt, w, n_mats);
    const int64_t cols = w[0].cols;
    const int32_t xtype = type_traits(w[0].type).vec_dot_type;
    const size_t x_row = row_size(xtype, cols);

    // Rows are handed out in chunks from a shared counter, so a thread slowed by the OS does not
    // hold the others up. A chunk of rows is applied to every token before moving on, keeping the
    // chunk's weights in cache across the batch.
    const int nth = pool.size();
    int64_t total_rows = 0;
    for (int m = 0; m < n_mats; m++) total_rows += w[m].rows;
    int64_t chunk = total_rows / (nth * 8);
    if (chunk < 16) chunk = 16;
    if (n_tokens > 1 && chunk > 64) chunk = 64;  // the batch path holds 64 rows at most
    chunk = (chunk + 7) / 8 * 8;  // whole 8-row tiles: a matrix's last rows are its only remainder
    if (any_rows16) chunk = (chunk + 15) / 16 * 16;  // whole panels of 16 rows
    int64_t chunk_start[8];  // first global chunk index of each matrix (n_mats is small)
    int64_t n_chunks = 0;
    for (int m = 0; m < n_mats; m++) {
        chunk_start[m] = n_chunks;
        n_chunks += (w[m].rows + chunk - 1) / chunk;
    }
    chunk_start[n_mats] = n_chunks;
    std::atomic<int64_t> next{0};

    // The first rows of a chunk: the rows that follow are fetched while the rows before them are
    // computed, but a chunk's first ones would be waited for. A batch step computes long enough per
    // chunk to hide them, so with a batch each thread claims its next chunk one ahead and fetches
    // its first rows into L2 now.
    auto chunk_matrix = [&](int64_t c) {
        int m = 0;
        while (c >= chunk_start[m + 1]) m++;
        return m;
    };
    auto fetch_chunk_start = [&](int64_t c) {
        const int m = chunk_matrix(c);
        const size_t w_row = row_size(w[m].type, cols);
        const int64_t r0 = (c - chunk_start[m]) * chunk;
        const int64_t nr = w[m].rows - r0 < 8 ? w[m].rows - r0 : 8;
        const char* p = (const char*)w[m].data + r0 * w_row;
        for (size_t off = 0; off < nr * w_row; off += 64) __builtin_prefetch(p + off, 0, 2);
    };
    const bool claim_ahead = n_tokens > 1;

    // Activations are converted once per call (F32 weights read X directly).
    const uint8_t* xbase = activations_for(pool, kt, xtype, X, cols, n_tokens);
    static const Rows16Terms no_terms;
    const Rows16Terms& terms =
        any_rows16 ? rows16_terms_for(pool, kt, xtype, xbase, x_row, cols, n_tokens) : no_terms;
    bool pre = n_tokens > 1 && !any_rows16 && kt.gemm_x;
    for (int m = 0; m < n_mats; m++) pre = pre && kt.gemm_pre[w[m].type];
    const uint8_t* xa = pre ? gemm_x_for(pool, kt, xbase, x_row, cols, n_tokens) : nullptr;
    pool.run([&](int, int) {
        int64_t c = next.fetch_add(1), ahead = n_chunks;
        if (claim_ahead && c < n_chunks) ahead = next.fetch_add(1);
        auto advance = [&] {
            if (!claim_ahead) {
                c = next.fetch_add(1);
                return;
            }
            c = ahead;
            ahead = c < n_chunks ? next.fetch_add(1) : n_chunks;
        };
        for (; c < n_chunks; advance()) {
            if (ahead < n_chunks) fetch_chunk_start(ahead);
            const int m = chunk_matrix(c);
            const int64_t r0 = (c - chunk_start[m]) * chunk;
            const int64_t r1 = r0 + chunk < w[m].rows ? r0 + chunk : w[m].rows;
            run_chunk(Chunk{kt, w[m], y[m], r0, r1, xbase, x_row, xa, n_tokens, accumulate, row_size(w[m].type, cols)},
                      terms);
        }
    });
}

}  // namespace optiml

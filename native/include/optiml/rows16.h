// The rows16 layout: a weight matrix of Q4_0, Q4_1 or Q8_0 repacked once at load so that 16 rows'
// block i lie together, codes transposed for vectors with one row per 32-bit lane.
//
// Why: the batched product with rows in the vector lanes (simd_gemm_q32_rows.h) first transposes 16
// rows' codes into such a panel on every call. Stored that way, every call reads it as it is: the
// panel costs a few logic operations per block instead of a transpose, so small batches (8 decoded
// sequences) gain what only prompt-sized batches gained before. It is a permutation of the same
// bytes, so the matrix keeps its size, and the arithmetic is vec_dot's: the same bits per (row, token).
//
// Rows 16p..16p+15 (panel p) take the bytes rows 16p..16p+15 took (16 row sizes), in three parts, for
// blocks i = 0..nb-1 (nb = cols / 32, elements 32i..32i+31):
//   codes, block after block: Q4_0/Q4_1 4 x 64 bytes, part k holding dword k of each row's packed
//          nibbles, row r at byte 4r (low nibbles: elements 4k..4k+3; high: 16+4k..16+4k+3); Q8_0 8 x 64
//          bytes, part k holding elements 4k..4k+3 of each row as unsigned codes (+128), row r at 4r;
//   d[i][r]: row r's fp16 scale, after all the codes;
//   m[i][r]: row r's fp16 min (Q4_1 only), after the scales.
// The codes come first so that every 64-byte part starts a cache line where the panel does (nb even;
// 16 rows' blocks of Q4_0 or Q8_0 with their scales are not a whole number of lines). Only matrices
// whose rows are a multiple of 16 are repacked.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optiml/ggml_types.h"

namespace optiml {

class ThreadPool;

// Bytes of one block's codes in a panel (16 rows x 32 elements).
constexpr size_t rows16_code_bytes(int32_t type) { return type == TYPE_Q8_0 ? 512 : 256; }

// Whether a matrix of this type and shape can be repacked (the type has the layout, rows % 16 == 0).
bool rows16_fits(int32_t type, int64_t rows, int64_t cols);

// In place: row layout -> rows16, and back. `data` holds rows * row_size(type, cols) bytes; with a
// pool the panels are split across its threads. Throws ArgumentError where rows16_fits is false.
void repack_rows16(int32_t type, void* data, int64_t rows, int64_t cols, ThreadPool* pool = nullptr);
void unpack_rows16(int32_t type, void* data, int64_t rows, int64_t cols, ThreadPool* pool = nullptr);

// Row r of a rows16 matrix, dequantized (the embedding lookup of a tied output matrix).
void dequantize_rows16_row(int32_t type, const void* data, int64_t r, int64_t cols, float* out);

}  // namespace optiml

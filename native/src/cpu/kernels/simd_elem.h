// Element types of the float kernels (F32, F16, BF16 rows): how a vector of FV::N of them and a single
// one are read. Included by simd_x86.h and simd_neon.h after their vector types and h2f.
#pragma once

namespace optiml {
namespace {

struct ElemF32 {
    typedef float T;
    template <class FV> static typename FV::V load(const T* p) { return FV::load_f32(p); }
    static float one(T v) { return v; }
};
struct ElemF16 {
    typedef fp16_t T;
    template <class FV> static typename FV::V load(const T* p) { return FV::load_f16(p); }
    static float one(T v) { return h2f(v); }
};
struct ElemBF16 {
    typedef bf16_t T;
    template <class FV> static typename FV::V load(const T* p) { return FV::load_bf16(p); }
    static float one(T v) { return bf16_to_fp32(v); }
};

}  // namespace
}  // namespace optiml

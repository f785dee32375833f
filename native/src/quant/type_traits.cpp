// The table of ggml tensor types: names, block sizes, bytes per block, activation pairing.
#include <cctype>
#include <cstring>

#include "optiml/ggml_types.h"

namespace optiml {

namespace {

struct TraitsTable {
    TypeTraits t[TYPE_COUNT];
    TraitsTable() {
        for (auto& e : t) e = TypeTraits{nullptr, 0, 0, false, TYPE_F32};
        auto set = [&](GGMLType id, const char* name, int64_t bs, size_t ts, bool q, GGMLType dot) {
            t[id] = TypeTraits{name, bs, ts, q, dot};
        };
        set(TYPE_F32, "F32", 1, 4, false, TYPE_F32);
        set(TYPE_F16, "F16", 1, 2, false, TYPE_F16);
        set(TYPE_BF16, "BF16", 1, 2, false, TYPE_BF16);
        set(TYPE_F64, "F64", 1, 8, false, TYPE_F64);
        set(TYPE_I8, "I8", 1, 1, false, TYPE_I8);
        set(TYPE_I16, "I16", 1, 2, false, TYPE_I16);
        set(TYPE_I32, "I32", 1, 4, false, TYPE_I32);
        set(TYPE_I64, "I64", 1, 8, false, TYPE_I64);
        set(TYPE_Q4_0, "Q4_0", 32, sizeof(block_q4_0), true, TYPE_Q8_0);
        set(TYPE_Q4_1, "Q4_1", 32, sizeof(block_q4_1), true, TYPE_Q8_1);
        set(TYPE_Q5_0, "Q5_0", 32, sizeof(block_q5_0), true, TYPE_Q8_0);
        set(TYPE_Q5_1, "Q5_1", 32, sizeof(block_q5_1), true, TYPE_Q8_1);
        set(TYPE_Q8_0, "Q8_0", 32, sizeof(block_q8_0), true, TYPE_Q8_0);
        set(TYPE_Q8_1, "Q8_1", 32, sizeof(block_q8_1), true, TYPE_Q8_1);
        set(TYPE_Q2_K, "Q2_K", 256, sizeof(block_q2_K), true, TYPE_Q8_K);
        set(TYPE_Q3_K, "Q3_K", 256, sizeof(block_q3_K), true, TYPE_Q8_K);
        set(TYPE_Q4_K, "Q4_K", 256, sizeof(block_q4_K), true, TYPE_Q8_K);
        set(TYPE_Q5_K, "Q5_K", 256, sizeof(block_q5_K), true, TYPE_Q8_K);
        set(TYPE_Q6_K, "Q6_K", 256, sizeof(block_q6_K), true, TYPE_Q8_K);
        set(TYPE_Q8_K, "Q8_K", 256, sizeof(block_q8_K), true, TYPE_Q8_K);
        set(TYPE_MXFP4, "MXFP4", 32, sizeof(block_mxfp4), true, TYPE_Q8_0);
        set(TYPE_IQ4_NL, "IQ4_NL", 32, sizeof(block_iq4_nl), true, TYPE_Q8_0);
        set(TYPE_IQ4_XS, "IQ4_XS", 256, sizeof(block_iq4_xs), true, TYPE_Q8_K);
        // Types this library reads from files (sizes known) but has no kernels for.
        set(TYPE_IQ2_XXS, "IQ2_XXS", 256, 66, true, TYPE_Q8_K);
        set(TYPE_IQ2_XS, "IQ2_XS", 256, 74, true, TYPE_Q8_K);
        set(TYPE_IQ3_XXS, "IQ3_XXS", 256, 98, true, TYPE_Q8_K);
        set(TYPE_IQ1_S, "IQ1_S", 256, 50, true, TYPE_Q8_K);
        set(TYPE_IQ3_S, "IQ3_S", 256, 110, true, TYPE_Q8_K);
        set(TYPE_IQ2_S, "IQ2_S", 256, 82, true, TYPE_Q8_K);
        set(TYPE_IQ1_M, "IQ1_M", 256, 56, true, TYPE_Q8_K);
        set(TYPE_TQ1_0, "TQ1_0", 256, 54, true, TYPE_Q8_K);
        set(TYPE_TQ2_0, "TQ2_0", 256, 66, true, TYPE_Q8_K);
    }
};

const TraitsTable& table() {
    static const TraitsTable tt;
    return tt;
}

}  // namespace

bool type_is_known(int32_t type) {
    return type >= 0 && type < TYPE_COUNT && table().t[type].name != nullptr;
}

const TypeTraits& type_traits(int32_t type) {
    static const TypeTraits unknown{nullptr, 0, 0, false, TYPE_F32};
    return type_is_known(type) ? table().t[type] : unknown;
}

int32_t type_from_name(const char* name) {
    for (int32_t i = 0; i < TYPE_COUNT; i++) {
        const char* n = table().t[i].name;
        if (!n || std::strlen(n) != std::strlen(name)) continue;
        bool same = true;
        for (size_t k = 0; n[k]; k++) {
            if (std::toupper((unsigned char)name[k]) != n[k]) { same = false; break; }
        }
        if (same) return i;
    }
    return -1;
}

}  // namespace optiml

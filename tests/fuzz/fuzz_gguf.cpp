// libFuzzer harness over everything that reads a GGUF file: the header parser, every metadata getter,
// the tokenizer loader (tokenizer.ggml.*), the model loader (hyper-parameters, tensor binding,
// optiml.sparsity.* thresholds, optiml.placement.*), and for a small model one forward pass.
// A malformed file must end in optiml::Error (GGUFError, UnsupportedModelError, ...); anything else
// (a crash, a sanitizer report, another exception, a huge allocation) is a bug.
//
// Built by CMake with -DOPTIML_FUZZ=ON and clang (see tools/checks/fuzz.py), run as
//   build/fuzz/fuzz_gguf CORPUS_DIR -max_total_time=60
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <system_error>

#include "optiml/gguf.h"
#include "optiml/model.h"
#include "optiml/threadpool.h"
#include "optiml/tokenizer.h"

using namespace optiml;

namespace {

// The parser reads from a mapped file, so each input is written to one (in /dev/shm where it exists:
// memory, not disk).
const std::string& input_path() {
    static const std::string path = [] {
        const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        return std::string(dir) + "/optiml-fuzz-gguf-" + std::to_string(getpid()) + ".gguf";
    }();
    static const bool cleanup = [] { return std::atexit([] { std::remove(path.c_str()); }) == 0; }();
    (void)cleanup;
    return path;
}

void write_input(const uint8_t* data, size_t size) {
    FILE* f = std::fopen(input_path().c_str(), "wb");
    if (!f) abort();
    if (size && std::fwrite(data, 1, size, f) != size) abort();
    std::fclose(f);
}

// Every metadata value through the getter of its type (the Python layer's reads go the same way).
void read_metadata(const GGUFFile& f) {
    for (const GGUFKeyValue& kv : f.metadata()) {
        const std::string& k = kv.key;
        try {
            switch (kv.value.type) {
                case GGUF_TYPE_STRING: (void)f.get_string(k); break;
                case GGUF_TYPE_FLOAT32:
                case GGUF_TYPE_FLOAT64: (void)f.get_f64(k); (void)f.get_f32(k); break;
                case GGUF_TYPE_BOOL: (void)f.get_bool(k); break;
                case GGUF_TYPE_ARRAY:
                    if (kv.value.elem_type == GGUF_TYPE_STRING) (void)f.get_string_array(k);
                    else if (kv.value.elem_type != GGUF_TYPE_ARRAY) {
                        (void)f.get_f32_array(k);
                        (void)f.get_i32_array(k);
                        (void)f.get_u32_array(k);
                    }
                    break;
                default: (void)f.get_i64(k); (void)f.get_u64(k); (void)f.get_u32(k); (void)f.get_i32(k); break;
            }
        } catch (const Error&) {
            // a value that does not fit the getter's type: refused with a message, as it should be
        }
    }
}

// The first and last byte of every tensor: the parser promised they lie inside the mapping.
unsigned touch_tensors(const GGUFFile& f) {
    unsigned sum = 0;
    for (const GGUFTensorInfo& t : f.tensors()) {
        if (t.n_bytes == 0) continue;
        const uint8_t* p = (const uint8_t*)f.tensor_data(t);
        sum += p[0] + p[t.n_bytes - 1];
    }
    return sum;
}

void use_tokenizer(const GGUFFile& f) {
    std::unique_ptr<Tokenizer> tok;
    try {
        tok = Tokenizer::from_gguf(f);
    } catch (const Error&) {
        return;
    }
    static const char* texts[] = {"Hello world!", " 123 abc\n\n  <|im_start|>user\xe2\x80\x99s", "\xff\xfe\xc3", ""};
    for (const char* text : texts)
        for (int special = 0; special < 2; special++) {
            std::vector<int32_t> ids = tok->encode(text, special, special);
            (void)tok->decode(ids, special);
        }
    int32_t n = tok->n_vocab();
    for (int32_t id = 0; id < n && id < 4096; id++) {
        (void)tok->token_to_piece(id, true);
        (void)tok->is_eog(id);
    }
    Detokenizer detok(*tok);
    for (int32_t id = 0; id < n && id < 256; id++) (void)detok.push(id);
    (void)detok.flush();
}

void use_model(const std::shared_ptr<GGUFFile>& f) {
    std::shared_ptr<Model> m;
    try {
        m = Model::load(f);
    } catch (const Error&) {
        return;
    }
    // One step of a small model: the kernels meet whatever shapes and values the loader accepted.
    const HParams& hp = m->hp;
    if (hp.n_embd > 256 || hp.n_layer > 4 || hp.n_vocab > 4096 || hp.n_ff > 1024 || hp.n_vocab < 2) return;
    static auto pool = std::make_shared<ThreadPool>(1);
    try {
        Session s(m, 8, pool, TYPE_F32, 8, 1);
        int32_t tokens[2] = {1, hp.n_vocab - 1};
        std::vector<float> logits((size_t)hp.n_vocab * 2);
        s.eval(tokens, 2, true, logits.data());
    } catch (const Error&) {
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    write_input(data, size);
    std::shared_ptr<GGUFFile> f;
    try {
        f = GGUFFile::open(input_path());
    } catch (const Error&) {
        return 0;
    }
    read_metadata(*f);
    volatile unsigned sink = touch_tensors(*f);
    (void)sink;
    use_tokenizer(*f);
    use_model(f);
    return 0;
}

// optiml._core.Generator: the native generation loop (optiml/generate.h) as a Python iterator of text
// pieces. python/optiml/engine/model.py (Model.stream) drives it. optiml._core.OutputStage: one sequence's
// output stage (sampling, logprobs, detokenization, stop strings) for the server; optiml._core.step_sequence:
// one token of one sequence decoded and taken through its output stage in one call.
//
// __next__ releases the GIL for the whole step (eval, sampling, detokenization, stop strings) and
// returns one non-empty str, or raises StopIteration at the end. The object keeps the Python Session,
// Tokenizer and Sampler it was given alive, so it is safe to drop at any point; the session then holds
// the prompt and the first `n_evaluated` generated tokens.
#include "bindings.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "optiml/common.h"
#include "optiml/generate.h"
#include "optiml/model.h"
#include "optiml/sampling.h"
#include "optiml/tokenizer.h"

namespace {

using namespace optiml;

using Tokens1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Floats1D = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

struct PyGenerator {
    // Declared before `gen`, so they outlive it.
    nb::object session_owner, sampler_owner;
    std::shared_ptr<const Tokenizer> tok;
    std::unique_ptr<Generator> gen;
    std::atomic<bool> running{false};  // a step is in progress (with the GIL released)
};

// Refuses a second thread while one is inside a step: the Generator, Session and Sampler are not
// thread-safe, and with the GIL released nothing else would stop it.
struct RunGuard {
    std::atomic<bool>& flag;
    explicit RunGuard(std::atomic<bool>& f) : flag(f) {
        if (flag.exchange(true)) throw Error("this generator is running in another thread; use one per thread");
    }
    ~RunGuard() { flag.store(false); }
};

std::vector<std::string> as_strings(const std::vector<nb::bytes>& stops) {
    std::vector<std::string> st;
    st.reserve(stops.size());
    for (const nb::bytes& b : stops) st.emplace_back(b.c_str(), b.size());
    return st;
}

void init(PyGenerator* self, nb::object session, nb::object tokenizer, nb::object sampler, Tokens1D prompt,
          int32_t n_cached, int32_t max_tokens, const std::vector<nb::bytes>& stops) {
    Session& s = native_session(session);
    std::shared_ptr<const Tokenizer> tok = native_tokenizer(tokenizer);
    Sampler& smp = nb::cast<Sampler&>(sampler);
    std::vector<int32_t> ids(prompt.data(), prompt.data() + prompt.shape(0));
    auto gen = std::make_unique<Generator>(s, *tok, smp, std::move(ids), n_cached, max_tokens, as_strings(stops));
    PyGenerator* g = new (self) PyGenerator();
    g->session_owner = std::move(session);
    g->sampler_owner = std::move(sampler);
    g->tok = std::move(tok);
    g->gen = std::move(gen);
}

nb::str next_piece(PyGenerator& g) {
    std::string piece;
    bool more;
    {
        RunGuard guard(g.running);
        InterruptScope interruptible(native_session(g.session_owner));
        nb::gil_scoped_release release;
        more = g.gen->next(piece);
    }
    // Ctrl-C between tokens: a caller that drains the stream in C ("".join, list(), `yield from`) runs
    // no bytecode that would let Python's handler raise KeyboardInterrupt until the whole answer is done.
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
    if (!more) throw nb::stop_iteration();
    return nb::str(piece.data(), piece.size());
}

// The rest of the generation in one native call (no Python per token): for measuring the loop's own
// time, and for callers that want only the whole text.
nb::str run_to_end(PyGenerator& g) {
    std::string all, piece;
    {
        RunGuard guard(g.running);
        InterruptScope interruptible(native_session(g.session_owner));
        nb::gil_scoped_release release;
        while (g.gen->next(piece)) all += piece;
    }
    return nb::str(all.data(), all.size());
}

nb::list to_list(const std::vector<int32_t>& ids, size_t n) {
    nb::list l;
    for (size_t i = 0; i < n; i++) l.append(ids[i]);
    return l;
}

nb::dict stats(const PyGenerator& g) {
    const GenerateStats& s = g.gen->stats();
    nb::dict d;
    d["prompt_tokens"] = s.prompt_tokens;
    d["prompt_evaluated"] = s.prompt_evaluated;
    d["prompt_s"] = s.prompt_s;
    d["gen_tokens"] = s.gen_tokens;
    d["gen_s"] = s.gen_s;
    d["busy_s"] = s.busy_s;
    return d;
}

// Reading state while another thread is inside a step would race with it.
const Generator& idle(const PyGenerator& g) {
    if (g.running.load()) throw Error("this generator is running in another thread; read it when the step ends");
    return *g.gen;
}

// optiml._core.OutputStage: one sequence's output stage (optiml/generate.h), for the server. Keeps the
// Python Tokenizer's native object and the Python Sampler alive.
struct PyOutputStage {
    nb::object sampler_owner;
    std::shared_ptr<const Tokenizer> tok;
    std::unique_ptr<OutputStage> stage;
    std::vector<float> row;  // a copy of the logits to bias and mask
    std::atomic<bool> running{false};
};

void init_output(PyOutputStage* self, nb::handle tokenizer, nb::object sampler, const std::vector<nb::bytes>& stops,
                 Tokens1D bias_ids, Floats1D bias_values, int32_t top_logprobs) {
    if (bias_ids.shape(0) != bias_values.shape(0))
        throw ArgumentError("OutputStage: bias_ids and bias_values must have the same length");
    std::shared_ptr<const Tokenizer> tok = native_tokenizer(tokenizer);
    Sampler& smp = nb::cast<Sampler&>(sampler);
    std::vector<std::pair<int32_t, float>> bias(bias_ids.shape(0));
    for (size_t i = 0; i < bias.size(); i++) bias[i] = {bias_ids(i), bias_values(i)};
    auto stage = std::make_unique<OutputStage>(*tok, smp, as_strings(stops), std::move(bias), top_logprobs);
    PyOutputStage* o = new (self) PyOutputStage();
    o->sampler_owner = std::move(sampler);
    o->tok = std::move(tok);
    o->stage = std::move(stage);
}

// The allowed-token bitmask (None: every token), checked to cover the vocabulary.
const uint8_t* allowed_bits(nb::handle allowed, int32_t n_vocab) {
    if (allowed.is_none()) return nullptr;
    auto bits = nb::cast<nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(allowed);
    if (bits.shape(0) * 8 < (size_t)n_vocab)
        throw ArgumentError(format("the allowed-token mask holds %zu bits, the vocabulary has %d tokens",
                                   (size_t)bits.shape(0) * 8, n_vocab));
    return bits.data();
}

// (token or -1, end: None/'stop'/'length', text out, logprobs: None or (logprob, [(token, logprob), ...])).
nb::tuple to_tuple(const TokenOutput& r) {
    nb::object end = r.end ? nb::object(nb::str(r.end)) : nb::none();
    nb::object lp = nb::none();
    if (r.has_logprobs) {
        nb::list top;
        for (const TokenLogprob& t : r.top) top.append(nb::make_tuple(t.token, t.logprob));
        lp = nb::make_tuple(r.logprob, top);
    }
    return nb::make_tuple(r.token, end, nb::str(r.out.data(), r.out.size()), lp);
}

nb::tuple output_step(PyOutputStage& o, Floats1D logits, nb::handle allowed, bool last) {
    const int32_t n_vocab = o.stage->n_vocab();
    if ((int64_t)logits.shape(0) != n_vocab)
        throw ArgumentError(format("logits hold %zu values, but the sampler's vocabulary has %d tokens",
                                   (size_t)logits.shape(0), n_vocab));
    const uint8_t* bits = allowed_bits(allowed, n_vocab);
    TokenOutput r;
    {
        RunGuard guard(o.running);
        nb::gil_scoped_release release;
        o.row.assign(logits.data(), logits.data() + n_vocab);
        o.stage->step(o.row.data(), bits, last, r);
    }
    return to_tuple(r);
}

// step_sequence (optiml/generate.h) with the GIL released. The scheduler calls it from one thread and
// keeps every object alive across the call; the Model's lock keeps other threads off the session.
nb::tuple step_sequence_py(nb::handle session, int32_t seq, int32_t pos, int32_t token, PyOutputStage& o,
                           nb::handle allowed, bool last) {
    Session& s = native_session(session);
    const uint8_t* bits = allowed_bits(allowed, o.stage->n_vocab());
    TokenOutput r;
    {
        RunGuard guard(o.running);
        nb::gil_scoped_release release;
        step_sequence(s, seq, pos, token, *o.stage, bits, last, o.row, r);
    }
    return to_tuple(r);
}

void bind_output(nb::module_& m) {
    nb::class_<PyOutputStage>(m, "OutputStage")
        .def("__init__", &init_output, nb::arg("tokenizer"), nb::arg("sampler"), nb::arg("stops"),
             nb::arg("bias_ids"), nb::arg("bias_values"), nb::arg("top_logprobs"),
             "One sequence's output stage (optiml/generate.h): the sampler (its prompt already accepted), stop "
             "strings (UTF-8 bytes), the logit bias (int32 ids, float32 values), top_logprobs (-1: none).")
        .def("step", &output_step, nb::arg("logits"), nb::arg("allowed").none(), nb::arg("last"),
             "Takes the next token from one row of float32 logits (not changed), with an allowed-token "
             "bitmask (uint8, little-endian bits) or None: (token or -1, end, text out, logprobs).")
        .def("flush", [](PyOutputStage& o) {
            RunGuard guard(o.running);
            const std::string s = o.stage->flush();
            return nb::str(s.data(), s.size());
        }, "The text the stream still holds; the stream starts over.")
        .def_prop_ro("pending", [](const PyOutputStage& o) {
            if (o.running.load()) throw Error("this output stage is running in another thread");
            return nb::str(o.stage->pending().data(), o.stage->pending().size());
        }, "The text held back (it may begin a stop string).");
    m.def("step_sequence", &step_sequence_py, nb::arg("session"), nb::arg("seq"), nb::arg("pos"), nb::arg("token"),
          nb::arg("output"), nb::arg("allowed").none(), nb::arg("last"),
          "Runs `token` at `pos` of sequence `seq` and takes the next token through `output` (an OutputStage): "
          "(token or -1, end, text out, logprobs), as OutputStage.step.");
}

}  // namespace

void bind_generate(nb::module_& m) {
    nb::class_<PyGenerator>(m, "Generator")
        .def("__init__", &init, nb::arg("session"), nb::arg("tokenizer"), nb::arg("sampler"), nb::arg("prompt"),
             nb::arg("n_cached"), nb::arg("max_tokens"), nb::arg("stops"),
             "Generates after `prompt` (int32 ids; the session already holds its first n_cached) with the "
             "sampler (already seeded, no tokens accepted), stopping at stops (UTF-8 bytes).")
        .def("__iter__", [](nb::handle self) { return nb::borrow(self); })
        .def("__next__", &next_piece)
        .def("run_to_end", &run_to_end, "The rest of the text in one native call.")
        .def_prop_ro("tokens", [](const PyGenerator& g) {
            const Generator& gen = idle(g);
            return to_list(gen.generated(), gen.generated().size());
        }, "The ids generated so far (end-of-generation tokens excluded).")
        .def_prop_ro("n_evaluated", [](const PyGenerator& g) { return idle(g).n_generated_evaluated(); },
                     "How many of `tokens` the session holds (after the prompt).")
        .def_prop_ro("context_tokens", [](const PyGenerator& g) -> nb::object {
            const Generator& gen = idle(g);
            if (!gen.started()) return nb::none();
            // The prompt and the evaluated generated tokens, cut to what the session holds (less when an
            // eval failed part way).
            const size_t n = (size_t)native_session(g.session_owner).n_past();
            std::vector<int32_t> ids = gen.prompt();
            ids.insert(ids.end(), gen.generated().begin(), gen.generated().begin() + gen.n_generated_evaluated());
            return to_list(ids, std::min(n, ids.size()));
        }, "The ids the session holds since the prompt began to run (None before): the prompt and the "
           "evaluated generated tokens.")
        .def_prop_ro("finished", [](const PyGenerator& g) { return idle(g).finished(); })
        .def_prop_ro("stats", [](const PyGenerator& g) {
            idle(g);
            return stats(g);
        }, "prompt_tokens, prompt_evaluated, prompt_s, gen_tokens, gen_s, busy_s (see optiml/generate.h).");
    bind_output(m);
}

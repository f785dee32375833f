// optiml._core.Sampler and find_stop (wrapped by python/optiml/sampling.py).
#include "bindings.h"

#include <string>
#include <vector>

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "optiml/common.h"
#include "optiml/sampling.h"
#include "optiml/stop_strings.h"

namespace {

using namespace optiml;

using Floats1D = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Ints1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

const float* check_logits(const Sampler& s, const Floats1D& logits) {
    if ((int64_t)logits.shape(0) != s.n_vocab())
        throw ArgumentError(format("logits hold %zu values, but the sampler's vocabulary has %d tokens",
                                   (size_t)logits.shape(0), s.n_vocab()));
    return logits.data();
}

std::string as_string(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

}  // namespace

void bind_sampling(nb::module_& m) {
    m.attr("SAMPLING_RANDOM_SEED") = SAMPLING_RANDOM_SEED;

    nb::class_<Sampler>(m, "Sampler")
        .def(
            "__init__",
            [](Sampler* self, int32_t n_vocab, float temperature, int32_t top_k, float top_p, float min_p,
               float repeat_penalty, int32_t repeat_last_n, float frequency_penalty, float presence_penalty,
               uint64_t seed) {
                SamplingParams p;
                p.temperature = temperature;
                p.top_k = top_k;
                p.top_p = top_p;
                p.min_p = min_p;
                p.repeat_penalty = repeat_penalty;
                p.repeat_last_n = repeat_last_n;
                p.frequency_penalty = frequency_penalty;
                p.presence_penalty = presence_penalty;
                p.seed = seed;
                new (self) Sampler(p, n_vocab);
            },
            nb::arg("n_vocab"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"), nb::arg("min_p"),
            nb::arg("repeat_penalty"), nb::arg("repeat_last_n"), nb::arg("frequency_penalty"),
            nb::arg("presence_penalty"), nb::arg("seed"))
        .def("sample", [](Sampler& s, Floats1D logits) { return s.sample(check_logits(s, logits)); },
             nb::arg("logits"))
        .def("accept", &Sampler::accept, nb::arg("token"))
        .def(
            "accept_many",
            [](Sampler& s, Ints1D tokens) {
                for (size_t i = 0; i < tokens.shape(0); i++) s.accept(tokens.data()[i]);
            },
            nb::arg("tokens"))
        .def("reset", &Sampler::reset)
        .def(
            "probs",
            [](Sampler& s, Floats1D logits) {
                std::vector<int32_t> ids;
                std::vector<double> pr;
                s.probs(check_logits(s, logits), ids, pr);
                return nb::make_tuple(to_array(ids), to_array(pr));
            },
            nb::arg("logits"))
        .def_prop_ro("n_vocab", &Sampler::n_vocab)
        .def_prop_ro("seed", &Sampler::seed)
        .def_prop_ro("penalty_window", &Sampler::penalty_window);

    m.def(
        "find_stop",
        [](nb::bytes text, const std::vector<nb::bytes>& stops, size_t from) {
            std::vector<std::string> s;
            s.reserve(stops.size());
            for (const nb::bytes& b : stops) s.push_back(as_string(b));
            const std::string t = as_string(text);
            const StopMatch r = find_stop(t, s, from);
            return std::make_tuple(r.pos, r.which, r.hold_back);
        },
        nb::arg("text"), nb::arg("stops"), nb::arg("from_") = 0,
        "(pos or -1, index of the stop or -1, bytes to hold back) for UTF-8 bytes text and stops.");
}

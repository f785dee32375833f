// Predictors::load: the companion GGUF of `optiml train-predictors`, bound tensor by tensor with shapes and
// types checked against the model, so a file for another model fails here and not in a kernel.
#include "optiml/predictor.h"

#include <cmath>

#include "optiml/common.h"
#include "optiml/ggml_types.h"

namespace optiml {

namespace {

Weight bind_tensor(const GGUFFile& f, const std::string& name, int64_t cols, int64_t rows, bool matrix) {
    const GGUFTensorInfo* t = f.find_tensor(name);
    if (!t) throw GGUFError(format("%s: tensor %s is missing", f.path().c_str(), name.c_str()));
    if (t->ne[0] != cols || t->n_rows() != rows || t->n_dims > 2)
        throw GGUFError(format("%s: tensor %s has shape [%lld, %lld], expected [%lld, %lld]: a predictor for another "
                               "model?",
                               f.path().c_str(), name.c_str(), (long long)t->ne[0], (long long)t->n_rows(),
                               (long long)cols, (long long)rows));
    const bool ok = matrix ? (t->type == TYPE_F32 || t->type == TYPE_F16 || t->type == TYPE_Q8_0) : t->type == TYPE_F32;
    if (!ok)
        throw GGUFError(format("%s: tensor %s is %s; predictors use %s", f.path().c_str(), name.c_str(),
                               (type_traits(t->type).name ? type_traits(t->type).name : "an unknown type"), matrix ? "F32, F16 or Q8_0" : "F32"));
    Weight w;
    w.name = t->name.c_str();
    w.type = t->type;
    w.cols = cols;
    w.rows = rows;
    w.row_bytes = row_size(t->type, cols);
    w.data = (const uint8_t*)f.tensor_data(*t);
    return w;
}

}  // namespace

std::shared_ptr<const Predictors> Predictors::load(const std::string& path, const Model& model) {
    const HParams& hp = model.hp;
    auto p = std::make_shared<Predictors>();
    p->file = GGUFFile::open(path);
    const GGUFFile& f = *p->file;
    if (!f.has("optiml.predictor.threshold"))
        throw GGUFError(format("%s: not a predictor file (no optiml.predictor.threshold)", f.path().c_str()));
    const std::vector<float> thr = f.get_f32_array("optiml.predictor.threshold");
    if ((int64_t)thr.size() != hp.n_layer)
        throw GGUFError(format("%s: predictors for %zu layers; the model has %d", f.path().c_str(), thr.size(),
                               hp.n_layer));
    p->layers.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; il++) {
        LayerPredictor& L = p->layers[il];
        const std::string pre = "blk." + std::to_string(il) + ".ffn_pred_";
        const GGUFTensorInfo* a = f.find_tensor(pre + "a.weight");
        if (!a) throw GGUFError(format("%s: tensor %sa.weight is missing", f.path().c_str(), pre.c_str()));
        const int64_t rank = a->n_rows();
        if (rank <= 0 || rank > hp.n_embd)
            throw GGUFError(format("%s: %sa.weight has rank %lld; expected 1..%d", f.path().c_str(), pre.c_str(),
                                   (long long)rank, hp.n_embd));
        L.rank = (int32_t)rank;
        L.a = bind_tensor(f, pre + "a.weight", hp.n_embd, rank, true);
        L.b = bind_tensor(f, pre + "b.weight", rank, hp.n_ff, true);
        L.bias = bind_tensor(f, pre + "b.bias", hp.n_ff, 1, false);
        if (!std::isfinite(thr[il]))
            throw GGUFError(format("%s: optiml.predictor.threshold[%d] is not finite", f.path().c_str(), il));
        L.threshold = thr[il];
        if (L.rank > p->max_rank) p->max_rank = L.rank;
    }
    return p;
}

}  // namespace optiml

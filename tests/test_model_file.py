"""The real SmolLM2 GGUF (written by llama.cpp) through OptiML's own reader and kernels, checked
against gguf-py's reader and dequantizer as the independent oracle."""

import gguf as ggufpy
import numpy as np

import optiml


def test_every_tensor_dequantizes_like_gguf_py(smollm2_path):
    ref = ggufpy.GGUFReader(smollm2_path)
    ref_tensors = {t.name: t for t in ref.tensors}
    with optiml.gguf.open(smollm2_path) as f:
        assert len(f.tensors) == len(ref_tensors) == 272
        counts = {}
        for t in f.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
            r = ref_tensors[t.name]
            ours = f.dequantize(t.name)
            theirs = ggufpy.quants.dequantize(r.data, r.tensor_type).reshape(ours.shape)
            np.testing.assert_array_equal(ours, theirs, err_msg=t.name)
        assert counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_real_weight_matmul_matches_float64(smollm2_path):
    # A real quantized weight matrix times an activation, against float64 numpy on its values.
    with optiml.gguf.open(smollm2_path) as f:
        t = f.tensor("blk.0.ffn_up.weight")
        w = f.tensor_data(t.name)
        wd = f.dequantize(t.name).astype(np.float64)
    x = np.random.default_rng(0).standard_normal(t.shape[0]).astype(np.float32)
    y = optiml.quant.matmul(w, t.type_name, x)
    ref = wd @ x.astype(np.float64)
    # Q4_1 pairs with 8-bit activations: error bounded by half a step per element of x.
    step = np.abs(x).reshape(-1, 32).max(axis=1).repeat(32) / 127
    bound = np.abs(wd) @ (step / 2) + 1e-4 * (np.abs(wd) @ np.abs(x))
    assert np.all(np.abs(y - ref) <= bound)

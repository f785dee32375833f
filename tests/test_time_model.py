"""The solver's time model (optiml.offline.time_model) against sums written here neuron by neuron and tensor by
tensor, and the choices it leads to: the output matrix on the GPU when it pays, followed by the plan and run on
cpu:1."""

import os

import numpy as np
import pytest

import optiml
from optiml import ArgumentError, gguf
from optiml.formats import stats as st
from optiml.formats.quant import type_info
from optiml.offline.hardware import Hardware
from optiml.offline.solve import format_report, solve_placement
from optiml.offline.time_model import neuron_cpu_bytes

from conftest import fixed_predictor
from test_solve import FAST, _synthetic_stats, check_split_run

HW = Hardware(cpu_bandwidth=40e9, gpu_bandwidth=1e12, cpu_dense={"q4_1": 30e9, "q8_0": 20e9},
              cpu_sparse={"q4_1": 25e9}, launch_overhead=6e-6, sync_cost=1e-6, transfer_latency=2e-6)


@pytest.fixture(scope="module")
def relu_stats(smollm2_path):
    return _synthetic_stats(st.model_fingerprint(smollm2_path))


def _tensors(path):
    with gguf.open(path) as f:
        return {t.name: (t.n_bytes, type_info(t.type).name.lower(), t.shape) for t in f.tensors}


def _dense_s(nbytes, type_name, hw=HW):
    return nbytes / hw.cpu_dense.get(type_name, hw.cpu_bandwidth)


LAYER = dict(gate_row=100, gate_type="Q4_0", up_row=100, up_type="Q4_0", down=50.0, down_type="Q4_0",
             down_row=120.0)


@pytest.mark.parametrize("mode", ["gate", "product", "dense"])
def test_neuron_costs_per_group_add_up_neuron_by_neuron(mode):
    """Per neuron, as the engine reads: the rows that decide who fires for every neuron at the dense rate, the
    rest for the firing ones at the row-sparse rate; dense mode gate and up at the dense rate (the whole down
    is a per-layer cost). Bytes are at the row-sparse rate, as layer_times divides them."""
    hw = Hardware(cpu_bandwidth=50.0, cpu_dense={"q4_0": 40.0}, cpu_sparse={"q4_0": 20.0})
    ffn_hw = hw.for_type("q4_0")
    f = np.sort(np.random.default_rng(1).uniform(0, 1, 70))[::-1]
    got = neuron_cpu_bytes(f, 32, LAYER, mode, hw, ffn_hw)
    assert got.shape == (3,) and np.all(np.diff(got) <= 1e-9)
    per_neuron = {"gate": 100 / 40.0 + f * (100 + 120) / 20.0,
                  "product": 200 / 40.0 + f * 120 / 20.0,
                  "dense": np.full(70, 200 / 40.0)}[mode]  # (down: once per layer, dense_down_seconds)
    assert got / 20.0 == pytest.approx([per_neuron[:32].sum(), per_neuron[32:64].sum(), per_neuron[64:].sum()])


@pytest.mark.parametrize("activation,metadata,predictors,mode", [
    ("relu", {}, False, "gate"), ("silu", {}, False, "dense"), ("silu", {}, True, "product"),
    ("silu", {"optiml.sparsity.criterion": "product", "optiml.sparsity.threshold": [0.1]}, False, "product"),
    ("silu", {"optiml.sparsity.threshold": [0.1]}, False, "gate"),  # before the criterion was recorded
    ("relu", {"optiml.sparsity.criterion": "product"}, True, "product")])
def test_ffn_mode_follows_the_engine(activation, metadata, predictors, mode):
    from optiml.offline.time_model import ffn_mode

    assert ffn_mode(activation, metadata, predictors) == mode


def test_down_rows_at_their_measured_rate():
    """With the sparse down projection measured (Hardware.cpu_sparse_down), a firing neuron's 8-bit down row
    costs its bytes at that rate; everything else is as before."""
    hw = Hardware(cpu_bandwidth=50.0, cpu_dense={"q4_0": 40.0}, cpu_sparse={"q4_0": 20.0})
    slow_down = Hardware(**{**hw.to_dict(), "cpu_sparse_down": 10.0})
    f = np.sort(np.random.default_rng(3).uniform(0, 1, 64))[::-1]
    base = neuron_cpu_bytes(f, 64, LAYER, "gate", hw, hw.for_type("q4_0"))
    got = neuron_cpu_bytes(f, 64, LAYER, "gate", slow_down, slow_down.for_type("q4_0"))
    assert (got - base)[0] / 20.0 == pytest.approx(f.sum() * 120 * (1 / 10.0 - 1 / 20.0))


def test_neuron_costs_with_predictors():
    """With predictors: gate (and up with the product criterion) for the neurons predicted active (those that
    fire, and a false-positive share of the others), the rest for the firing ones; the predictor itself once
    per layer whose share the CPU keeps (it scores every neuron), at the dense rate of its type."""
    from optiml.offline.time_model import PredictorCosts, predictor_seconds

    hw = Hardware(cpu_bandwidth=50.0, cpu_dense={"q4_0": 40.0, "q8_0": 10.0}, cpu_sparse={"q4_0": 20.0})
    f = np.sort(np.random.default_rng(2).uniform(0, 0.5, 64))[::-1]
    pred = PredictorCosts(layer_bytes=[0, 3000], row_type="Q8_0", false_positive=[0.0, 0.1])
    p = f + 0.1 * (1 - f)
    for mode, first, after in (("gate", 100, 220), ("product", 200, 120)):
        got = neuron_cpu_bytes(f, 64, LAYER, mode, hw, hw.for_type("q4_0"), pred, layer=1)
        assert got[0] / 20.0 == pytest.approx(np.sum(p * first / 20.0 + f * after / 20.0))
    assert predictor_seconds(pred, 1, hw) == pytest.approx(3000 / 10.0)


def test_cpu_only_estimate_by_part_from_the_file(smollm2_path, relu_stats):
    """Every layer's attention at the dense rate of its types plus the KV cache of `positions` tokens at
    the read bandwidth; the output (SmolLM2 ties it to its Q8_0 embeddings) and final norm at their rates."""
    t = _tensors(smollm2_path)
    with pytest.warns(UserWarning):
        p = solve_placement(smollm2_path, relu_stats, 0, HW, ctx=256, positions=100)
    ffn = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    attn = sum(_dense_s(b, ty) for n, (b, ty, _) in t.items() if n.startswith("blk.") and not n.endswith(ffn))
    kv = 30 * 100 * 3 * (64 + 64) * 2 / HW.cpu_bandwidth  # 3 KV heads of 64
    out = _dense_s(t["token_embd.weight"][0], "q8_0") + _dense_s(t["output_norm.weight"][0], "f32")
    assert p.cpu_only_parts["attention"] == pytest.approx(attn + kv)
    assert p.cpu_only_parts["output"] == pytest.approx(out)
    assert p.cpu_only_token_s == pytest.approx(sum(p.cpu_only_parts.values()))
    # The FFN: every gate row at the dense rate, up and down rows of firing neurons at the row-sparse rate.
    gate = t["blk.0.ffn_gate.weight"][0] / 1536
    up = t["blk.0.ffn_up.weight"][0] / 1536
    down_row = 576 * 34 / 32
    ffn_s = sum(1536 * gate / 30e9 + relu_stats.freq[l].astype(np.float64).sum() * (up + down_row) / 25e9
                for l in range(30))
    assert p.cpu_only_parts["ffn"] == pytest.approx(ffn_s)
    assert "100 positions" in format_report(p)


def test_a_dense_ffn_reads_every_row_and_its_whole_down_while_the_cpu_keeps_any_neuron(smollm2_path):
    """SmolLM2 without thresholds runs its FFN dense: all on the CPU, every FFN byte at the dense rate; with
    all but one group on the GPU, the CPU still computes the whole down product (a split's down runs whole on
    the host)."""
    from optiml.offline.solve import layer_times, make_groups
    from optiml.offline.time_model import dense_down_seconds

    silu = _synthetic_stats(st.model_fingerprint(smollm2_path), activation="silu")
    with pytest.warns(UserWarning):
        p = solve_placement(smollm2_path, silu, 0, HW, ctx=256)
    t = _tensors(smollm2_path)
    ffn = sum(b for n, (b, _, _) in t.items() if n.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")))
    assert p.cpu_only_parts["ffn"] == pytest.approx(ffn / 30e9)
    layer = dict(LAYER, n_ff=64, down=50.0)
    fast_gpu = Hardware(cpu_bandwidth=50.0, gpu_bandwidth=1e30, cpu_dense={"q4_0": 40.0}, launch_overhead=0.0,
                        sync_cost=0.0, transfer_latency=0.0)
    gb, _ = make_groups(np.ones(64), 16, 250)
    cb = neuron_cpu_bytes(np.ones(64), 16, layer, "dense", fast_gpu, fast_gpu)
    times = layer_times(gb, cb, fast_gpu, cpu_fixed=dense_down_seconds(layer, fast_gpu))
    assert times[3] == pytest.approx(16 * 200 / 40.0 + 64 * 50 / 40.0) and times[4] < 1e-20


def test_predictors_make_the_cpu_share_cheaper(smollm2_path, gemma3_path, relu_stats, tmp_path):
    """A predictor that marks about the firing share active replaces the dense gate read: the CPU's FFN
    costs less, by the amount worked out neuron by neuron."""
    mean = float(relu_stats.freq.mean())
    pred = fixed_predictor(smollm2_path, tmp_path / "p.gguf", active=0.05, recorded_share=mean + 0.02)
    with pytest.warns(UserWarning):
        without = solve_placement(smollm2_path, relu_stats, 0, HW, ctx=256)
        with_ = solve_placement(smollm2_path, relu_stats, 0, HW, ctx=256, predictors=pred)
    assert with_.cpu_only_parts["ffn"] < 0.7 * without.cpu_only_parts["ffn"]
    assert with_.cpu_only_parts["attention"] == without.cpu_only_parts["attention"]
    t = _tensors(pred)
    layer = sum(b for n, (b, _, _) in t.items() if n.startswith("blk.0.ffn_pred"))  # A, B and B's bias
    gate = _tensors(smollm2_path)["blk.0.ffn_gate.weight"][0] / 1536
    total = 0.0
    for l in range(30):
        f = relu_stats.freq[l].astype(np.float64)
        e = max(0.0, (mean + 0.02 - f.mean()) / (1 - f.mean()))  # a layer that fires more: no false positives
        total += layer / 20e9 + np.sum((f + e * (1 - f)) * gate / 25e9 + f * (gate + 576 * 34 / 32) / 25e9)
    assert with_.cpu_only_parts["ffn"] == pytest.approx(total)
    assert "with p.gguf" in format_report(with_)
    from optiml.formats.predictors import PredictorMismatchError

    other = fixed_predictor(gemma3_path, tmp_path / "gemma.gguf", active=0.05, recorded_share=0.1)
    with pytest.raises(PredictorMismatchError, match="another model"):
        solve_placement(smollm2_path, relu_stats, 0, HW, ctx=256, predictors=other)


def test_output_matrix_goes_to_the_gpu_when_it_pays(smollm2_path, relu_stats, tmp_path):
    """66 MiB do not hold SmolLM2's whole fixed part. Where the CPU reads Q8_0 slowly, the output matrix (30
    MB of Q8_0 embeddings, tied) and the last layers' attention take the budget, and the plan on cpu:1 puts the
    logits on the device as the solver counted; where it reads them fast, the budget goes to attention."""
    from optiml import plan
    from optiml.formats.placement import write_placed

    vram = 66 * 2**20
    slow = Hardware(**{**FAST.to_dict(), "source": "test", "cpu_dense": {"q8_0": 2e9}})
    fast = Hardware(**{**FAST.to_dict(), "source": "test", "cpu_dense": {"q8_0": 1e12}})
    p = solve_placement(smollm2_path, relu_stats, vram, slow, ctx=256)
    assert p.fixed_bytes > vram and p.output_on_gpu and p.gpu_attention[-1] and p.vram_used <= vram
    assert "and the output matrix" in p.status and "output matrix on the GPU" in format_report(p)
    assert not solve_placement(smollm2_path, relu_stats, vram, fast, ctx=256).output_on_gpu
    out = tmp_path / "placed.gguf"
    write_placed(smollm2_path, relu_stats, p, out, progress=False)
    pl = plan.make(out, n_ctx=256, n_batch=512, device="cpu:1", vram=vram)
    assert pl.output_on_device and pl.device_bytes["total"] <= vram
    assert [l["attention"] == "cpu:1" for l in pl.layers] == p.gpu_attention
    with optiml.Model(out, n_ctx=256, device="cpu:1", vram=vram) as m:
        assert m.plan.output_on_device
    check_split_run(out, vram, list(range(300, 316)))


def test_bad_positions_and_predictors(smollm2_path, relu_stats, tmp_path):
    with pytest.raises(ArgumentError, match="positions"):
        solve_placement(smollm2_path, relu_stats, 0, HW, positions=-1)
    with pytest.raises(FileNotFoundError):
        solve_placement(smollm2_path, relu_stats, 0, HW, predictors=tmp_path / "none.gguf")


def test_solve_times_and_hands_on_the_predictors_beside_the_model(smollm2_path, tmp_path, capsys):
    """`optiml solve` times the CPU's share with MODEL.predictors.gguf when a Model would use it, says so,
    and puts them beside the placed file, where a Model of it finds them; --predictors none places without
    (SmolLM2 has no thresholds: dense on the CPU, the predicted neurons' products with predictors)."""
    import shutil

    from optiml import cli
    from optiml.formats.predictors import default_predictor_path

    model = tmp_path / "m.gguf"
    shutil.copyfile(smollm2_path, model)
    fixed_predictor(model, default_predictor_path(model), active=0.05, recorded_share=0.08)
    sp = tmp_path / "s.npz"
    st.save(_synthetic_stats(st.model_fingerprint(model), activation="silu"), sp)
    hw = tmp_path / "hw.json"
    hw.write_text('{"launch_overhead": 1e-6, "sync_cost": 1e-6, "transfer_latency": 1e-6}')
    est = {}
    for how in ("auto", "none"):
        out = tmp_path / f"placed-{how}.gguf"
        rc = cli.main(["solve", "-m", str(model), "--stats", str(sp), "--vram", "90MiB", "--hardware", str(hw),
                       "--ctx", "256", "--predictors", how, "-o", str(out)])
        text = capsys.readouterr()
        assert rc == 0, text.err
        est[how] = text.out.split("all-CPU by part: ")[1].split(";")[0]
        assert (f"with {default_predictor_path(model).split('/')[-1]}" in text.out) == (how == "auto")
        assert os.path.exists(default_predictor_path(out)) == (how == "auto")
    assert est["auto"] != est["none"]  # the FFN part differs
    assert cli.main(["info", str(tmp_path / "placed-auto.gguf")]) == 0  # what the estimate assumed, recorded
    assert "estimate: decode steps attending to 128 positions, predictors m.predictors.gguf" in capsys.readouterr().out
    with optiml.Model(tmp_path / "placed-auto.gguf", n_ctx=64) as m:
        assert m.predictors == default_predictor_path(tmp_path / "placed-auto.gguf")

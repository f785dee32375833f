"""optiml solve: sizes, the hardware description, the MIP against brute force, exact bytes on a real model."""

import itertools
import json
import re
import math
import warnings

import numpy as np
import pytest

from optiml import ArgumentError, cli
from optiml.formats import stats as st
from optiml.offline.hardware import Hardware
from optiml.offline.solve import (SolveWarning, format_report, layer_times, make_groups, solve_groups,
                          solve_placement)
from optiml.util.sizes import parse_size


# ---- parse_size -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("512", 512), ("1B", 1), ("2 b", 2), ("1KB", 1000), ("1kb", 1000), ("1KiB", 1024),
    ("512MiB", 512 * 2**20), ("6GiB", 6 * 2**30), ("6GB", 6 * 10**9), ("6 gib", 6 * 2**30), ("1TB", 10**12),
    ("2TiB", 2 * 2**40), ("1.5GiB", 3 * 2**29), (" 1.5 GB ", 1_500_000_000), (".5KiB", 512), ("1.", 1),
    ("0.5B", 0), (4096, 4096), ("1048576TiB", 2**60), (2**60, 2**60),
])
def test_parse_size_good(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "  ", "-1", "-6GiB", "abc", "6 GiBs", "6G", "1e9", "GiB", "1.2.3MB", "inf",
                                  "nan", "6 Gi B", "0x10", -5, None, 1.5,
                                  "9999999999999999999999", "1048577TiB", 2**60 + 1, 2**64])
def test_parse_size_bad(text):
    with pytest.raises(ArgumentError):
        parse_size(text)


# ---- Hardware -------------------------------------------------------------------------------------
def test_hardware_defaults_and_json(tmp_path):
    hw = Hardware()
    assert hw.cpu_bandwidth == 50e9 and hw.gpu_bandwidth == 900e9 and hw.split_cost == pytest.approx(20e-6)
    json.dumps(hw.to_dict())
    p = tmp_path / "hw.json"
    p.write_text(json.dumps({"cpu_bandwidth": 80e9, "sync_cost": 1e-5, "gpu_memory": 8 * 2**30}))
    hw = Hardware.from_json(p)
    assert hw.cpu_bandwidth == 80e9 and hw.sync_cost == 1e-5 and hw.gpu_bandwidth == 900e9
    assert "hw.json" in hw.source


@pytest.mark.parametrize("content,word", [
    ({"cpu_bandwith": 1e9}, "cpu_bandwith"),
    ({"cpu_bandwidth": -1}, "cpu_bandwidth"),
    ({"gpu_bandwidth": 0}, "gpu_bandwidth"),
    ({"sync_cost": "fast"}, "sync_cost"),
    ({"launch_overhead": True}, "launch_overhead"),
    ({"source": "x", "gpu_bandwidth": 0}, "gpu_bandwidth"),
    ([1, 2], "object"),
])
def test_hardware_json_bad(tmp_path, content, word):
    p = tmp_path / "hw.json"
    p.write_text(json.dumps(content))
    with pytest.raises(ArgumentError, match=word):
        Hardware.from_json(p)


def test_hardware_json_from_a_placed_file(tmp_path):
    """The hardware a placed file records (its source included) is read back as it is."""
    hw = Hardware(cpu_bandwidth=40e9, source="measured (CPU only): cpu_bandwidth")
    p = tmp_path / "hw.json"
    p.write_text(json.dumps(hw.to_dict()))
    back = Hardware.from_json(p)
    assert back.cpu_bandwidth == 40e9 and back.source == "file hw.json (measured (CPU only): cpu_bandwidth)"


def test_hardware_json_not_json(tmp_path):
    p = tmp_path / "hw.json"
    p.write_text("{cpu: fast")
    with pytest.raises(ArgumentError, match="JSON"):
        Hardware.from_json(p)
    with pytest.raises(ArgumentError, match="not found"):
        Hardware.from_json(tmp_path / "missing.json")


def test_hardware_auto():
    hw = Hardware.auto(measure_bytes=16 << 20)
    assert hw.cpu_bandwidth > 0 and hw.gpu_bandwidth > 0
    assert "cpu_bandwidth" in hw.source or hw.source == "defaults"


def test_hardware_measure_on_the_second_cpu_device(tmp_path):
    """optiml hw's numbers: every rate and cost measured (positive, finite), the profile round-trips through
    its JSON file, and solve weighs the CPU share at the measured rate of the model's FFN type."""
    hw = Hardware.measure(device="cpu:1", types=("q4_0", "q8_0"), weight_bytes=4 << 20, n_threads=1)
    assert set(hw.cpu_dense) == set(hw.cpu_sparse) == {"q4_0", "q8_0"}
    for v in [*hw.cpu_dense.values(), *hw.cpu_sparse.values(), hw.cpu_bandwidth, hw.gpu_bandwidth,
              hw.transfer_bandwidth, hw.transfer_latency, hw.launch_overhead, hw.cpu_sparse_down]:
        assert 0 < v < 1e15 and math.isfinite(v)
    assert hw.sync_cost >= 0 and "cpu:1" in hw.source and "gpu_bandwidth" in hw.source
    p = tmp_path / "hw.json"
    hw.save(p)
    back = Hardware.from_json(p)
    assert back.to_dict() | {"source": ""} == hw.to_dict() | {"source": ""}
    q4 = back.for_type("Q4_0")
    assert q4.cpu_bandwidth == hw.cpu_sparse["q4_0"] and "Q4_0 rate" in q4.source
    assert back.for_type("F16") is back  # not measured: cpu_bandwidth as it is


@pytest.mark.parametrize("content", [{"cpu_sparse": {"q4_0": -1.0}}, {"cpu_dense": [1, 2]},
                                     {"cpu_sparse": {"q4_0": True}}])
def test_hardware_json_bad_rates(tmp_path, content):
    p = tmp_path / "hw.json"
    p.write_text(json.dumps(content))
    with pytest.raises(ArgumentError, match="type names to bytes/s"):
        Hardware.from_json(p)


def test_hardware_measure_bad_input():
    with pytest.raises(ArgumentError, match="density"):
        Hardware.measure(density=0)
    with pytest.raises(ArgumentError, match="not a device"):
        Hardware.measure(device="gpu", types=(), weight_bytes=1 << 20)


def test_hw_command_writes_what_solve_reads(tmp_path, capsys):
    out = tmp_path / "hw.json"
    rc = cli.main(["hw", "--device", "cpu:1", "--types", "q4_1", "--size", "2MiB", "-t", "1", "-q", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "q4_1" in text and "device cpu:1" in text and f"--hardware {out}" in text
    assert set(json.loads(out.read_text())["cpu_sparse"]) == {"q4_1"}


def test_solve_uses_the_measured_cpu_rate(smollm2_path, smollm2_stats):
    """SmolLM2's FFN is Q4_1: a profile whose Q4_1 rows are slow makes the CPU's FFN share cost more (and only
    that: attention, the output and the gate rows that decide who fires are read at the dense rate)."""
    fast = solve_placement(smollm2_path, smollm2_stats, 60 * 2**20, FAST, ctx=256)
    slow = solve_placement(smollm2_path, smollm2_stats, 60 * 2**20,
                           Hardware(**{**{k: v for k, v in FAST.to_dict().items() if k != "source"},
                                       "cpu_sparse": {"q4_1": FAST.cpu_bandwidth / 4}}), ctx=256)
    assert slow.cpu_only_token_s > 1.1 * fast.cpu_only_token_s  # the FFN part 4x slower, attention and output not
    assert sum(slow.gpu_neurons) > sum(fast.gpu_neurons)  # so more of the FFN is worth the GPU
    assert slow.hardware["cpu_bandwidth"] == fast.hardware["cpu_bandwidth"]
    assert "Q4_1 rows" in format_report(slow)


# ---- the program against brute force --------------------------------------------------------------
def _brute(gbs, cbs, budget, hw):
    """Every x vector, its time from first principles (not layer_times), the best that fits."""
    best = math.inf
    for x in itertools.product(*[range(len(gb) + 1) for gb in gbs]):
        used = sum(int(np.sum(gb[:v])) for gb, v in zip(gbs, x))
        if used > budget:
            continue
        total = 0.0
        for gb, cb, v in zip(gbs, cbs, x):
            gpu = float(np.sum(gb[:v])) / hw.gpu_bandwidth + (hw.launch_overhead if v > 0 else 0.0)
            cpu = float(np.sum(cb[v:])) / hw.cpu_bandwidth
            total += max(gpu, cpu) + (hw.transfer_latency + hw.sync_cost if 0 < v < len(gb) else 0.0)
        best = min(best, total)
    return best


def _random_instance(rng, split_costs: bool):
    L = int(rng.integers(2, 4))
    hw = Hardware(cpu_bandwidth=float(rng.uniform(20e9, 100e9)), gpu_bandwidth=float(rng.uniform(200e9, 2e12)),
                  sync_cost=float(rng.choice([1e-6, 2e-5])) if split_costs else 0.0,
                  transfer_latency=float(rng.choice([0.0, 5e-6])) if split_costs else 0.0,
                  launch_overhead=float(rng.choice([0.0, 3e-6])) if split_costs else 0.0)
    group = int(rng.choice([4, 8]))
    gbs, cbs = [], []
    for _ in range(L):
        n = int(rng.integers(3, 7)) * group - int(rng.integers(0, 2)) * (group // 2)  # sometimes a partial group
        s = rng.uniform(0.3, 2.0)
        freq = np.minimum(1.0, rng.uniform(0.05, 1.0) * np.arange(1, n + 1) ** -s)
        gb, cb = make_groups(freq, group, int(rng.integers(1_000, 200_000)))
        gbs.append(gb)
        cbs.append(cb)
    total = sum(int(gb.sum()) for gb in gbs)
    budget = int(rng.integers(0, total + total // 4 + 1))
    return gbs, cbs, budget, hw


@pytest.mark.parametrize("split_costs", [True, False])
def test_mip_equals_brute_force(split_costs):
    rng = np.random.default_rng(1234 + split_costs)
    for _ in range(60):
        gbs, cbs, budget, hw = _random_instance(rng, split_costs)
        sol = solve_groups(gbs, cbs, budget, hw, mip_gap=0.0)
        assert sol.method == "mip" and sol.status == "Optimal"
        best = _brute(gbs, cbs, budget, hw)
        assert sol.objective_s == pytest.approx(best, rel=1e-7, abs=1e-12)
        used = sum(int(np.sum(gb[:v])) for gb, v in zip(gbs, sol.x))
        assert used == sol.ffn_bytes <= budget
        assert sol.objective_s == pytest.approx(sum(layer_times(gb, cb, hw)[v] for gb, cb, v in zip(gbs, cbs, sol.x)))


def test_mip_with_split_bytes_and_a_cpu_constant_equals_brute_force():
    """A file that keeps its order: a split share of x < G groups takes x * per + once bytes (8-bit down rows
    and their scales), the whole layer its own; a predictor costs the CPU a constant while it keeps any neuron.
    The program against every x vector, timed here from first principles."""
    rng = np.random.default_rng(99)
    for _ in range(40):
        gbs, cbs, budget, hw = _random_instance(rng, True)
        splits = [(int(gb[0] * rng.uniform(1.2, 1.8)), int(rng.integers(0, 3000))) for gb in gbs]
        fixed = [float(rng.choice([0.0, 2e-6, 2e-5])) for _ in gbs]

        def dev_bytes(l, v):
            G = len(gbs[l])
            return 0 if v == 0 else int(gbs[l].sum()) if v == G else v * splits[l][0] + splits[l][1]

        best = math.inf
        for x in itertools.product(*[range(len(gb) + 1) for gb in gbs]):
            if sum(dev_bytes(l, v) for l, v in enumerate(x)) > budget:
                continue
            total = 0.0
            for l, v in enumerate(x):
                G = len(gbs[l])
                gpu = dev_bytes(l, v) / hw.gpu_bandwidth + (hw.launch_overhead if v else 0.0)
                cpu = float(np.sum(cbs[l][v:])) / hw.cpu_bandwidth + (fixed[l] if v < G else 0.0)
                total += max(gpu, cpu) + (hw.split_cost if 0 < v < G else 0.0)
            best = min(best, total)
        sol = solve_groups(gbs, cbs, budget, hw, mip_gap=0.0, split_bytes=splits, cpu_fixed=fixed)
        assert sol.method == "mip" and sol.objective_s == pytest.approx(best, rel=1e-7, abs=1e-12)
        assert sol.ffn_bytes == sum(dev_bytes(l, v) for l, v in enumerate(sol.x)) <= budget
        greedy = solve_groups(gbs, cbs, budget, hw, method="greedy", split_bytes=splits, cpu_fixed=fixed)
        assert greedy.ffn_bytes <= budget and greedy.objective_s >= sol.objective_s * (1 - 1e-9)


def test_greedy_is_feasible_and_not_better_than_mip():
    rng = np.random.default_rng(7)
    for _ in range(30):
        gbs, cbs, budget, hw = _random_instance(rng, True)
        g = solve_groups(gbs, cbs, budget, hw, method="greedy")
        m = solve_groups(gbs, cbs, budget, hw, mip_gap=0.0)
        assert g.method == "greedy" and math.isnan(g.gap)
        assert g.ffn_bytes <= budget
        assert m.objective_s <= g.objective_s * (1 + 1e-9)


def test_greedy_fallback_when_highs_has_no_solution(monkeypatch):
    from optiml.offline import solve as solve_mod

    monkeypatch.setattr(solve_mod, "_mip", lambda *a, **k: (None, "Time limit reached", math.nan))
    rng = np.random.default_rng(3)
    gbs, cbs, budget, hw = _random_instance(rng, True)
    with pytest.warns(SolveWarning, match="greedy"):
        sol = solve_groups(gbs, cbs, budget, hw)
    assert sol.method == "greedy" and "no solution" in sol.status and sol.ffn_bytes <= budget


def test_time_limit_on_a_big_instance_keeps_a_valid_solution():
    rng = np.random.default_rng(5)
    gbs, cbs = [], []
    for _ in range(40):
        freq = np.minimum(1.0, rng.uniform(0.01, 0.03) * (np.arange(1, 8193) / 8192) ** -rng.uniform(0.6, 0.95))
        gb, cb = make_groups(freq, 32, 6912)
        gbs.append(gb)
        cbs.append(cb)
    budget = sum(int(g.sum()) for g in gbs) // 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sol = solve_groups(gbs, cbs, budget, Hardware(), time_limit=1e-3)
    assert sol.ffn_bytes <= budget
    assert sol.ffn_bytes == sum(int(np.sum(gb[:v])) for gb, v in zip(gbs, sol.x))
    if sol.status != "Optimal":  # stopped early: told so
        assert any(issubclass(w.category, SolveWarning) for w in caught)


def test_solve_groups_bad_input():
    gb, cb = make_groups(np.array([0.5, 0.2, 0.1, 0.05]), 2, 100)
    hw = Hardware()
    with pytest.raises(ArgumentError, match="non-increasing"):
        solve_groups([gb], [cb[::-1].copy()], 100, hw)
    with pytest.raises(ArgumentError, match="negative"):
        solve_groups([gb], [cb], -1, hw)
    with pytest.raises(ArgumentError, match="method"):
        solve_groups([gb], [cb], 100, hw, method="magic")


def test_extremes_of_the_budget():
    rng = np.random.default_rng(11)
    gbs, cbs, _, hw = _random_instance(rng, False)
    total = sum(int(gb.sum()) for gb in gbs)
    assert solve_groups(gbs, cbs, 0, hw).x == [0] * len(gbs)
    # unconstrained, each layer takes its own best x (more GPU groups past the CPU/GPU crossing only cost time)
    best = [int(np.argmin(layer_times(gb, cb, hw))) for gb, cb in zip(gbs, cbs)]
    sol = solve_groups(gbs, cbs, total * 10, hw, mip_gap=0.0)
    assert sol.objective_s == pytest.approx(sum(layer_times(gb, cb, hw)[b] for gb, cb, b in zip(gbs, cbs, best)))
    hw_slow_cpu = Hardware(cpu_bandwidth=1.0, launch_overhead=0.0, sync_cost=0.0, transfer_latency=0.0)
    assert solve_groups(gbs, cbs, total, hw_slow_cpu).x == [len(gb) for gb in gbs]  # exactly enough for all
    assert solve_groups(gbs, cbs, total - 1, hw_slow_cpu).ffn_bytes < total


# ---- a real model ---------------------------------------------------------------------------------
def _synthetic_stats(fingerprint: str, L=30, F=1536, seed=0, model="SmolLM2-135M-Instruct.Q4_1.gguf",
                     activation="relu"):
    """Stats of power-law firing. As "relu" (the default) the solver times the CPU's share as the sparse FFN
    reads it (SmolLM2 itself is SiLU without thresholds: its CPU share runs dense, whatever fires)."""
    rng = np.random.default_rng(seed)
    B = 8
    rank = (rng.permutation(F)[None, :] + 1) / F
    freq = np.minimum(1.0, rng.uniform(0.01, 0.03, (L, 1)) * rank ** -rng.uniform(0.6, 0.95, (L, 1)))
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    return st.ActivationStats(
        fingerprint=fingerprint, model=model, activation=activation, n_tokens=1000, sources="synthetic",
        threshold=z(L), freq=freq.astype(np.float32), mean_abs=z(L, F), mean_abs_up=z(L, F), down_norm=z(L, F),
        impact=rng.random((L, F)).astype(np.float32), hist_edges=z(B + 1), gate_hist=np.zeros((L, B)),
        gate_err=np.zeros((L, B)), prod_hist=np.zeros((L, B)), prod_err=np.zeros((L, B)))


@pytest.fixture(scope="module")
def smollm2_stats(smollm2_path):
    return _synthetic_stats(st.model_fingerprint(smollm2_path))


def _tensor_bytes(path):
    from optiml import gguf

    with gguf.open(path) as f:
        return {t.name: t.n_bytes for t in f.tensors}, dict(f.metadata)


FAST = Hardware(launch_overhead=1e-6, sync_cost=1e-6, transfer_latency=1e-6)  # small layers worth splitting


# Budgets include the device's scratch for 512-token steps (14 MiB for SmolLM2) and 64 rows of logits (12 MiB).
@pytest.mark.parametrize("vram_mib,ctx,group", [(86, 256, 64), (96, 512, 32), (81, 128, 100), (116, 1024, 64),
                                                   (106, 256, 320)])  # 320: a partial last group of 256
def test_smollm2_bytes_exact_and_within_budget(smollm2_path, smollm2_stats, vram_mib, ctx, group, tmp_path):
    vram = vram_mib * 2**20
    p = solve_placement(smollm2_path, smollm2_stats, vram, FAST, ctx=ctx, group=group)
    tb, md = _tensor_bytes(smollm2_path)
    L, F = 30, 1536
    ffn = {f"blk.{l}.{k}.weight" for l in range(L) for k in ("ffn_gate", "ffn_up", "ffn_down")}
    # SmolLM2 ties its output to the token embeddings: they count once, as the output matrix
    assert "output.weight" not in tb
    n_kv = md["llama.attention.head_count_kv"]
    head_dim = md["llama.embedding_length"] // md["llama.attention.head_count"]
    kv = 2 * L * ctx * n_kv * head_dim * 2
    n_head = md["llama.attention.head_count"]
    steps = min(512, ctx)  # plan.cpp's n_batch: 512, at most the context
    scratch = 4 * steps * (4 * 576 + 2 * n_head * head_dim + 2 * n_kv * head_dim + 2 * F)  # plan.cpp's
    logits = 4 * 64 * md["llama.vocab_size"] if "llama.vocab_size" in md else 4 * 64 * 49152  # the plan's rows
    fixed = sum(v for k, v in tb.items() if k not in ffn) + kv + scratch + logits
    assert p.fixed_bytes == fixed
    assert p.group == max(32, -(-group // 32) * 32)  # Q4_1: blocks of 32 along n_ff
    assert p.method == "mip" and len(p.gpu_neurons) == L and len(p.coverage) == L
    per_layer = [sum(tb[f"blk.{l}.{k}.weight"] for k in ("ffn_gate", "ffn_up", "ffn_down")) for l in range(L)]
    assert p.ffn_bytes == per_layer
    for l, k in enumerate(p.gpu_neurons):
        assert 0 <= k <= F and (k % p.group == 0 or k == F)
        # The placed file keeps its order (Q4_1 down, hot-first neurons): a split share holds gate and up rows
        # and 8-bit neuron-major down rows with n_embd scales; a whole layer its own tensors.
        split = k * (2 * 360 + 576 // 32 * 34) + 4 * 576
        assert p.gpu_ffn_bytes[l] == (per_layer[l] if k == F else split if k else 0)
    assert p.vram_used == fixed + sum(p.gpu_ffn_bytes) <= vram
    assert p.vram_budget == vram and p.ctx == ctx and p.hardware == FAST.to_dict()
    assert sum(p.gpu_neurons) > 0 and p.est_token_s < p.cpu_only_token_s
    order = st.hot_first_order(smollm2_stats.freq, smollm2_stats.impact)
    for l, k in enumerate(p.gpu_neurons):
        f = smollm2_stats.freq[l][order[l]].astype(np.float64)
        assert p.coverage[l] == pytest.approx(f[:k].sum() / f.sum())
    assert "ms/token" in format_report(p)
    u = p.used_parts  # every layer's KV cache for ctx, the rest of the fixed part, the FFN share
    assert sum(u.values()) == p.vram_used and sum(u.values()) - u["ffn"] == p.fixed_bytes
    assert u["ffn"] == sum(p.gpu_ffn_bytes) and u["kv_cache"] == 30 * ctx * 3 * 64 * 2 * 2
    # The plan of the placed file (its own count, native) takes the same neurons, within the budget, and puts
    # the output matrix on the device as the solver counted.
    from optiml import plan
    from optiml.formats.placement import write_placed

    out = tmp_path / "placed.gguf"
    write_placed(smollm2_path, smollm2_stats, p, out, progress=False)
    pl = plan.make(out, n_ctx=ctx, n_batch=512, device="cpu:1", vram=vram)
    assert [l["ffn_on_device"] for l in pl.layers] == p.gpu_neurons
    assert pl.output_on_device == p.output_on_gpu and pl.device_bytes["total"] <= vram


def test_smollm2_budget_below_fixed_part_places_attention_layer_by_layer(smollm2_path, smollm2_stats, tmp_path):
    """24 MiB (10 beside the scratch) cannot hold SmolLM2's whole fixed part: the attention and KV cache of the last m layers go to the
    GPU (and the output matrix after them when it pays), FFN groups wherever they pay, and the plan (on cpu:1)
    follows the file layer by layer."""
    vram = 24 * 2**20
    p = solve_placement(smollm2_path, smollm2_stats, vram, FAST, ctx=256)
    m = sum(p.gpu_attention)
    assert 0 < m < 30 and p.gpu_attention == [False] * (30 - m) + [True] * m
    which = f"layers {30 - m}-29" if m > 1 else "layer 29"
    assert p.method in ("mip", "greedy") and f"the GPU holds the attention of {which}" in p.status
    assert p.vram_used <= vram and p.fixed_bytes > vram
    assert p.est_token_s < p.cpu_only_token_s
    report = format_report(p)
    assert "the budget cannot hold every layer's attention" in report
    assert f"of {m} of 30 layers is on the GPU: {which}" in report
    # the VRAM used, by part: the scratch, the KV cache and attention of the m layers, the FFN share
    u = p.used_parts
    assert sum(u.values()) == p.vram_used and u["ffn"] == sum(p.gpu_ffn_bytes) and u["kv_cache"] > 0
    assert f"FFN neurons {u['ffn'] / 2**20:,.1f} MiB" in report
    from optiml import plan
    from optiml.formats.placement import read_placement, write_placed

    out = tmp_path / "placed.gguf"
    write_placed(smollm2_path, smollm2_stats, p, out, progress=False)
    assert read_placement(out)["gpu_attention"] == [int(a) for a in p.gpu_attention]
    pl = plan.make(out, n_ctx=256, n_batch=512, device="cpu:1", vram=vram)
    assert [l["attention"] == "cpu:1" for l in pl.layers] == p.gpu_attention
    assert pl.output_on_device == p.output_on_gpu
    assert any(l["attention"] == "cpu" and l["ffn_on_device"] > 0 for l in pl.layers) or \
        all(k == 0 for k in p.gpu_neurons[:30 - m])
    assert pl.device_bytes["total"] <= vram
    # The engine runs it: layers whose FFN neurons are on the device while their attention is not included.
    check_split_run(out, vram, list(range(200, 216)))


def test_search_below_the_fixed_part_shares_the_time_limit_and_warns_once(smollm2_path, smollm2_stats, monkeypatch):
    """A budget below the fixed part solves up to four programs: together they keep to the time limit (each
    an even share of what is left), and when any stopped at it the user hears so once (it was silent)."""
    from optiml.offline import solve as solve_mod

    limits = []
    real = solve_mod.solve_groups

    def stopped(*a, **k):
        sol = real(*a, **k)
        if a[6] != "greedy":  # (time_limit and method are passed in this order)
            limits.append(a[4])
            sol.status = "Time limit reached"
        return sol

    monkeypatch.setattr(solve_mod, "solve_groups", stopped)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = solve_placement(smollm2_path, smollm2_stats, 24 * 2**20, FAST, ctx=256, time_limit=8.0)
    said = [str(w.message) for w in caught if issubclass(w.category, SolveWarning)]
    assert len(said) == 1 and said[0].startswith(f"HiGHS stopped at its time limit in {len(limits)} of the "
                                                 f"{len(limits)} programs")
    assert len(limits) >= 2 and limits[0] <= 8.0 / len(limits) and all(0 < t <= 8.0 for t in limits)
    assert p.vram_used <= 24 * 2**20


def check_split_run(path, vram: int, ids: list[int]) -> None:
    """A placed file run split on cpu:1 within vram gives the CPU run's logits: the same argmax but where the
    CPU's top two are within the differences this path allows (the split sums in another order, and an
    activation's 8-bit code may round the other way: on AVX-512 a 0.22 margin flipped, with logits up to 0.5
    apart)."""
    import optiml

    with optiml.Model(path, n_ctx=256, device="cpu:1", vram=vram) as m:
        got = m.eval(ids, all_logits=True)
    with optiml.Model(path, n_ctx=256, device="cpu") as m:
        ref = m.eval(ids, all_logits=True)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    assert ((got.argmax(-1) == ref.argmax(-1)) | (top2[:, 1] - top2[:, 0] < 0.5)).all()
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_budget_below_one_layers_attention_is_all_cpu(smollm2_path, smollm2_stats):
    with pytest.warns(SolveWarning, match="scratch"):
        p = solve_placement(smollm2_path, smollm2_stats, 100_000, FAST, ctx=256)
    assert p.method == "all-cpu" and p.gpu_neurons == [0] * 30 and p.vram_used == 0 and math.isnan(p.gap)
    assert p.coverage == [0.0] * 30 and p.est_token_s == pytest.approx(p.cpu_only_token_s)
    assert p.gpu_attention == [False] * 30


def test_split_costs_follow_the_attention():
    """layer_times: with the attention on the GPU a layer pays the transfer unless its whole FFN is there too;
    with it on the CPU, as soon as any neuron is on the GPU."""
    gb, cb = np.array([10, 10, 5]), np.array([8.0, 2.0, 1.0])
    hw = Hardware(cpu_bandwidth=1.0, gpu_bandwidth=100.0, launch_overhead=0.0, sync_cost=3.0, transfer_latency=0.0)
    base = layer_times(gb, cb, hw, None)
    assert list(layer_times(gb, cb, hw, "gpu") - base) == [3.0, 0.0, 0.0, 0.0]
    assert list(layer_times(gb, cb, hw, "cpu") - base) == [0.0, 0.0, 0.0, 3.0]
    with pytest.raises(ArgumentError, match="attention"):
        solve_groups([gb], [cb], 100, hw, attention=["tpu"])


@pytest.mark.parametrize("where", [("gpu", "cpu", "gpu"), ("cpu", "cpu", "gpu")])
def test_mip_with_attention_equals_brute_force(where):
    rng = np.random.default_rng(7)
    hw = Hardware(cpu_bandwidth=1e3, gpu_bandwidth=1e4, launch_overhead=1e-4, sync_cost=2e-3, transfer_latency=1e-3)
    gbs, cbs = [], []
    for _ in range(3):
        f = np.sort(rng.random(4))[::-1]
        gb, cb = make_groups(f, 1, 3)
        gbs.append(gb)
        cbs.append(cb)
    budget = 17
    sol = solve_groups(gbs, cbs, budget, hw, method="mip", attention=list(where))
    times = [layer_times(gb, cb, hw, a) for gb, cb, a in zip(gbs, cbs, where)]
    best = min(sum(t[x] for t, x in zip(times, xs)) for xs in itertools.product(range(5), repeat=3)
               if sum(int(gb[:x].sum()) for gb, x in zip(gbs, xs)) <= budget)
    assert sol.objective_s == pytest.approx(best, rel=1e-6)


def test_smollm2_huge_budget_everything_on_gpu(smollm2_path, smollm2_stats):
    # The GPU reads its share densely, the CPU only the firing neurons: all-GPU is the optimum only where the
    # GPU reads a whole layer faster than the CPU reads its active part (so: a slow CPU here).
    slow_cpu = Hardware(cpu_bandwidth=2e9, launch_overhead=1e-6, sync_cost=1e-6, transfer_latency=1e-6)
    p = solve_placement(smollm2_path, smollm2_stats, 2**40, slow_cpu, ctx=256)
    assert p.gpu_neurons == [1536] * 30 and p.coverage == [1.0] * 30
    assert p.vram_used == p.fixed_bytes + sum(p.ffn_bytes)


def test_smollm2_forced_greedy(smollm2_path, smollm2_stats):
    p = solve_placement(smollm2_path, smollm2_stats, 74 * 2**20, FAST, ctx=256, method="greedy")
    assert p.method == "greedy" and p.vram_used <= 74 * 2**20 and math.isnan(p.gap)


def test_stats_of_another_model_rejected(smollm2_path):
    other = _synthetic_stats("0" * 32, model="other-model.gguf")
    with pytest.raises(ArgumentError, match="measured on other-model.gguf"):
        solve_placement(smollm2_path, other, 2**30, FAST)


def test_stats_shape_mismatch_rejected(smollm2_path):
    fp = st.model_fingerprint(smollm2_path)
    with pytest.raises(ArgumentError, match="n_ff"):
        solve_placement(smollm2_path, _synthetic_stats(fp, F=1024), 2**30, FAST)
    with pytest.raises(ArgumentError, match="layers"):
        solve_placement(smollm2_path, _synthetic_stats(fp, L=12), 2**30, FAST)


def test_bad_arguments(smollm2_path, smollm2_stats):
    for kw in (dict(vram=-1), dict(vram=1.5), dict(vram=2**30, ctx=0), dict(vram=2**30, group=0)):
        with pytest.raises(ArgumentError):
            solve_placement(smollm2_path, smollm2_stats, hardware=FAST, **kw)


def test_model_without_ffn_rejected(tmp_path):
    gguf_writer = pytest.importorskip("gguf")
    from hf_gguf import write_and_close
    path = tmp_path / "noffn.gguf"
    w = gguf_writer.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), np.float32))
    write_and_close(w)
    stats = _synthetic_stats("x" * 32, L=1, F=64)
    with pytest.raises(ArgumentError, match="no FFN neurons"):
        solve_placement(path, stats, 2**30, FAST)


# ---- the command line, up to writing the file -----------------------------------------------------
def test_cli_output_errors_before_any_work(smollm2_path, tmp_path, capsys, monkeypatch):
    from optiml.cli import solve as solve_command

    def boom(*a, **k):
        raise AssertionError("no solving before the output is checked")

    monkeypatch.setattr(solve_command, "solve_placement", boom)
    stats = tmp_path / "s.npz"
    stats.write_bytes(b"")
    base = ["solve", "-m", str(smollm2_path), "--stats", str(stats), "--vram", "1GiB", "--hardware", "auto"]
    assert cli.main(base + ["-o", str(tmp_path / "missing" / "out.gguf")]) == 2  # bad input
    assert "output folder does not exist" in capsys.readouterr().err
    assert cli.main(base + ["-o", str(smollm2_path)]) == 2
    assert "is an input file" in capsys.readouterr().err
    assert cli.main(base[:-4] + ["--vram=-3GiB", "--hardware", "auto", "-o", str(tmp_path / "o.gguf")]) == 2
    assert "negative" in capsys.readouterr().err
    # a size past any GGUF or memory is refused when read (it was solved, reported, then failed to write)
    assert cli.main(base[:-4] + ["--vram", "9" * 22, "--hardware", "auto", "-o", str(tmp_path / "o.gguf")]) == 2
    assert "cannot be more than 2**60 bytes" in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()


def test_cli_checks_the_inputs_before_solving(smollm2_path, smollm2_stats, tmp_path, capsys, monkeypatch):
    """What solve can tell from its inputs it says before the solver's work: stats of another model (not a
    complaint about the predictors beside the model), positions past the context, a stats file that is not
    one (a file already placed: test_placement.py's test_errors)."""
    from optiml.cli import solve as solve_command

    def never(*a, **k):
        raise AssertionError("solved")

    monkeypatch.setattr(solve_command, "solve_placement", never)
    model = tmp_path / "m.gguf"
    model.symlink_to(smollm2_path)
    (tmp_path / "m.predictors.gguf").write_bytes(b"beside the model")  # (read only after the stats' check)
    other = tmp_path / "other.npz"
    st.save(_synthetic_stats("another model's fingerprint", activation="gelu"), other)
    sp = tmp_path / "s.npz"
    st.save(smollm2_stats, sp)
    text = tmp_path / "t.txt"
    text.write_text("some words")
    base = ["solve", "-m", str(model), "--vram", "40MiB", "--hardware", "auto", "-o", str(tmp_path / "o.gguf")]
    for extra, said in [(["--stats", str(other)], "measured on"),
                        (["--stats", str(text)], re.escape("is not an activation stats file (.npz from `optiml profile`)") + "$"),
                        (["--stats", str(sp), "--positions", "9000"], "--positions 9000 is more than --ctx 4096")]:
        assert cli.main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert re.search(said, err) and "predictors" not in err, err


def test_cli_bad_predictor_files_are_bad_input(smollm2_path, smollm2_stats, tmp_path, capsys):
    """--predictors naming a file that is not a predictor GGUF, or a folder, is bad input (exit 2) like a bad
    --stats or --hardware (a non-GGUF once exited 1)."""
    sp = tmp_path / "s.npz"
    st.save(smollm2_stats, sp)
    text = tmp_path / "t.txt"
    text.write_text("some words")
    base = ["solve", "-m", str(smollm2_path), "--stats", str(sp), "--vram", "40MiB", "--hardware", "auto",
            "-o", str(tmp_path / "o.gguf")]
    for pred, said in [(text, "t.txt: not a predictor file (not a GGUF file"), (tmp_path, "is a folder")]:
        assert cli.main(base + ["--predictors", str(pred)]) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()


def test_cli_solves_and_hands_over_to_the_writer(smollm2_path, smollm2_stats, tmp_path, capsys, monkeypatch):
    from optiml.cli import solve as solve_command

    sp = tmp_path / "s.npz"
    st.save(smollm2_stats, sp)
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"launch_overhead": 1e-6, "sync_cost": 1e-6, "transfer_latency": 1e-6}))
    seen = {}
    def write_placed(model, stats, placement, out, order=None, order_name="custom", progress=True):
        seen.update(model=model, placement=placement, out=out, order=order)
        return {"form": "neuron_order", "down_types": {"Q4_1": 30}}

    monkeypatch.setattr(solve_command, "write_placed", write_placed)
    out = tmp_path / "placed.gguf"
    # predictors beside an earlier file at the output: a Model of the new one would take them up, so they go
    (tmp_path / "placed.predictors.gguf").write_bytes(b"an earlier placement's predictors")
    rc = cli.main(["solve", "-m", str(smollm2_path), "--stats", str(sp), "--vram", "74MiB", "--hardware", str(hw),
                   "--ctx", "256", "--predictors", "none", "-o", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert not (tmp_path / "placed.predictors.gguf").exists() and "removed" in text.err
    assert "status Optimal" in text.out and "ms/token" in text.out
    assert seen["out"] == str(out) and seen["placement"].vram_used <= 74 * 2**20
    assert seen["order"] is None  # --order hot: the writer's own hot-first order
    assert "weights kept in their order" in text.out and "optiml.placement.neuron_order" in text.out

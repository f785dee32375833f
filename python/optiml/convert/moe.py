"""Mixtures of experts: Qwen3MoeForCausalLM (qwen3moe), Qwen2MoeForCausalLM (qwen2moe: a shared expert
behind a sigmoid gate) and MixtralForCausalLM (llama with experts), laid out as llama.cpp's
convert_hf_to_gguf.py lays them out: each layer's router as ffn_gate_inp, its experts stacked into 3-D
ffn_{gate,up,down}_exps tensors [n_expert, rows, cols], the shared expert as ffn_*_shexp with its gate
ffn_gate_inp_shexp. A checkpoint whose routing llama.cpp's graph for the architecture (which OptiML's
engine follows) would not compute as transformers does is refused, naming the config.json field."""

from __future__ import annotations

from .common import TensorPlan, get_value
from .errors import ConvertError

MIXTRAL, QWEN2MOE, QWEN3MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = {MIXTRAL: "llama", QWEN2MOE: "qwen2moe", QWEN3MOE: "qwen3moe"}


def read_config(cfg: dict, path: str, hf_arch: str) -> dict:
    """The experts' ModelConfig fields: n_expert, n_expert_used, n_ff_exp, n_ff_shexp, qk_norm."""
    count_key = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"
    n_expert = get_value(cfg, path, count_key, kind=int)
    used = get_value(cfg, path, "num_experts_per_tok", kind=int)
    if used > n_expert:
        raise ConvertError(f"{path}: num_experts_per_tok = {used} is more than the {n_expert} experts "
                           f"({count_key})")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConvertError(f"{path}: hidden_act {act!r} is not supported for a mixture of experts (silu)")
    out = {"n_expert": n_expert, "n_expert_used": used}
    if hf_arch == MIXTRAL:  # (its sliding_window: hf_config._full_attention_context)
        out["n_ff_exp"] = get_value(cfg, path, "intermediate_size", kind=int)
        return out
    _check_qwen_layers(cfg, path, hf_arch)
    out["n_ff_exp"] = get_value(cfg, path, "moe_intermediate_size", kind=int)
    if hf_arch == QWEN2MOE:
        out["n_ff_shexp"] = get_value(cfg, path, "shared_expert_intermediate_size", kind=int)
    else:
        out["qk_norm"] = True
    return out


def _check_qwen_layers(cfg: dict, path: str, hf_arch: str) -> None:
    """Every layer a mixture of experts with full attention, and the top k weights renormalized exactly
    where llama.cpp's graph renormalizes them (always for qwen3moe, never for qwen2moe)."""
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise ConvertError(f"{path}: decoder_sparse_step = {step!r} is not supported (every layer a mixture "
                           "of experts: 1)")
    if cfg.get("mlp_only_layers"):
        raise ConvertError(f"{path}: mlp_only_layers = {cfg['mlp_only_layers']!r} is not supported (dense "
                           "layers among the experts' layers; [] is)")
    if cfg.get("use_sliding_window"):
        raise ConvertError(f"{path}: use_sliding_window = true is not supported (full attention)")
    norm = cfg.get("norm_topk_prob", False)
    want = hf_arch == QWEN3MOE
    if bool(norm) != want:
        arch = ARCHITECTURES[hf_arch]
        raise ConvertError(f"{path}: norm_topk_prob = {norm!r} is not supported for {hf_arch}: llama.cpp's "
                           f"{arch} {'always' if want else 'never'} renormalizes the chosen experts' weights "
                           f"(norm_topk_prob = {str(want).lower()})")


def ffn_plan(c, i: int, available: set) -> list[TensorPlan]:
    """Layer i's router, stacked experts and shared expert (c: the ModelConfig)."""
    p, b = f"model.layers.{i}.", f"blk.{i}."
    E, D, F = c.n_expert, c.n_embd, c.n_ff_exp
    if c.hf_arch == MIXTRAL:
        m, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        m, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        if {m + "experts.gate_up_proj", m + "experts.gate_up_proj.weight"} & available:
            raise ConvertError(f"{m}experts.gate_up_proj: fused expert tensors are not supported (one tensor "
                               "per expert, as transformers' save_pretrained writes them, is)")
    plan = [TensorPlan(b + "ffn_gate_inp.weight", m + "gate.weight", (E, D))]
    for dst, src, shape in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names, ((F, D), (F, D), (D, F))):
        parts = tuple(f"{m}experts.{j}.{src}.weight" for j in range(E))
        plan.append(TensorPlan(f"{b}{dst}.weight", parts[0], shape, parts=parts))
    if c.n_ff_shexp:
        S = c.n_ff_shexp
        # llama.cpp squeezes the [1, n_embd] gate to a vector (F32, as every 1-D tensor)
        plan.append(TensorPlan(b + "ffn_gate_inp_shexp.weight", m + "shared_expert_gate.weight", (1, D),
                               out_shape=(D,)))
        for dst, src, shape in (("ffn_gate_shexp", "gate_proj", (S, D)), ("ffn_up_shexp", "up_proj", (S, D)),
                                ("ffn_down_shexp", "down_proj", (D, S))):
            plan.append(TensorPlan(f"{b}{dst}.weight", f"{m}shared_expert.{src}.weight", shape))
    return plan

"""optiml.Model: load a GGUF model and run it (tokenize, eval, generate, stream).

    with optiml.Model("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048) as m:
        print(m.generate("The capital of France is", max_tokens=32, temperature=0))
        for piece in m.stream("Once upon a time", max_tokens=64, seed=1):
            print(piece, end="", flush=True)
        print(m.chat([{"role": "user", "content": "Hi!"}], temperature=0))

A known model name (optiml.models, e.g. "smollm2-135m-instruct") works in place of a path: it is pulled
into the model cache on first use.

The forward pass, tokenizer and sampler are native (optiml._core); this module only orchestrates.
A Model is not thread-safe: it holds one context (KV cache). Use one Model per thread; using one
Model from two threads at once raises OptimlError instead of corrupting the context.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import _core
from ._core import ArgumentError, ContextOverflowError, OptimlError
from .sampling import RANDOM_SEED, Sampler, SamplingParams
from .tokenizer import Tokenizer
from .util import memory

__all__ = ["Model"]


def _auto_in_memory(path: str, plan) -> bool:
    """use_mmap="auto": read the file into memory when the OS has transparent huge pages, the file takes
    at most half of the memory available, and the plan (a callable returning the plan dict, called last)
    runs every layer on the CPU: a device's weights need no private host copy."""
    if not memory.huge_pages_allowed():
        return False
    available = memory.memory_available()
    if available is None or os.path.getsize(path) > available // 2:
        return False
    try:
        return plan()["device"] == "cpu"
    except OptimlError:
        return False  # the session reports the bad plan itself


class Model:
    """A llama-family GGUF model (llama, mistral, qwen2) with one context.

    path: the GGUF file, or a known model name (pulled on first use). n_ctx: context length in tokens (default: the model's training context,
    at most 4096). n_threads: CPU threads (default: the physical cores). n_batch: tokens per forward
    pass while reading a prompt. kv_type: the KV cache's type, "f16" (as llama.cpp), "f32" (exact, twice
    the bytes), "q8_0" (half of f16's bytes) or "q4_0" (a quarter and a bit), by llama.cpp's names
    (--cache-type-k/-v; ggml type ids such as llama_cpp.GGML_TYPE_Q8_0 are accepted too); kv_type_k and
    kv_type_v set the keys' and the values' apart (each defaults to kv_type). A quantized cache is read
    by the CPU attention; the CUDA attention reads f16 and f32.

    sparsity: how the FFN skips neurons (see :meth:`set_sparsity`): "auto" (default: the thresholds the
    file carries from `optiml calibrate`; for a ReLU-family model without them, exact zero-skipping;
    otherwise dense), "threshold" (like auto, but an error when there is nothing to skip by), or "none".
    thresholds: per-layer thresholds (or one for all layers) that override the file's.
    down_copy: the sparse FFN's neuron-major copy of each down matrix: "fast" (8-bit rows, about twice a
    4-bit matrix's size), "compact" (for Q4_0/Q4_1/Q4_K: the file's own codes and scales regrouped, lossless
    and about the matrix's size, summed in integers with each 32-neuron group's activations quantized to
    int8; faster than fast when about half of the neurons fire, slower at 10% and below, where each touched
    group's scale row costs more than its codes save; other types get 8-bit rows), or "auto" (the default:
    fast while those copies take at most half of the memory available).

    n_seq: sequence slots of the KV cache (each holds n_ctx positions) for :meth:`decode`; generation and
    chat use sequence 0. device, vram, n_gpu_layers, gpu_neurons: where layers run (see optiml.plan):
    device "auto" (the default: the CPU unless this build can run the GPU), "cpu", "cpu:N" (a second CPU
    instance treated as an accelerator, for testing split execution), "cuda[:N]"; vram a budget such as
    "6GiB"; n_gpu_layers the last N layers whole on the device; gpu_neurons FFN neurons per layer on the
    device (overrides the file's placement). The result is :attr:`plan`. kv_vram (such as "2GiB") limits
    the device's KV cache: it then holds as many sequences as fit, the others live in host memory and
    their attention runs on the CPU (CPU attention offload, see :meth:`kv_place`); it needs every layer's
    attention on the device.

    predictors: activation predictors (see :meth:`set_predictors`): "auto" (default: MODEL.predictors.gguf
    beside MODEL.gguf when it exists, unless its predictors mark so many neurons active that they would
    slow decoding down: then a PredictorWarning says so), a path, or None.

    use_mmap: True maps the file (weights are paged in as they are first read and shared with the page
    cache), False reads it whole into private memory backed by 2 MiB pages where the OS has them (Linux
    transparent huge pages), which the matrix-vector kernels stream about 10-25% faster than a
    mapping's 4 KiB pages; it costs reading the file at load and its size in memory of this process's own
    (on Windows the file is mapped either way). "auto" (the default) reads into memory when the plan runs
    every layer on the CPU, the OS has transparent huge pages enabled and the file takes at most half of
    the memory available (MemAvailable, or the room under a cgroup limit); otherwise it maps.
    :attr:`in_memory` says which.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 512,
        kv_type: str = "f16",
        sparsity: str = "auto",
        thresholds=None,
        n_seq: int = 1,
        device: str = "auto",
        vram=None,
        n_gpu_layers: int | None = None,
        gpu_neurons=None,
        predictors="auto",
        down_copy: str = "auto",
        kv_vram=None,
        use_mmap="auto",
        kv_type_k=None,
        kv_type_v=None,
    ):
        from .hub.registry import resolve

        self.path = resolve(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"model file not found: {self.path}")
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"expected a GGUF file, got a directory: {self.path}")
        if not isinstance(use_mmap, bool) and use_mmap != "auto":
            raise ArgumentError(f"use_mmap must be True, False or 'auto', not {use_mmap!r}")
        # "auto" opens the file mapped first (metadata only is read) to learn where layers would run.
        self._model = _core.Model(os.fsencode(self.path), in_memory=use_mmap is False)
        self.hparams: dict = self._model.hparams
        if n_ctx is None:
            n_ctx = min(self.hparams["n_ctx_train"], 4096)
        n_ctx = _positive_int("n_ctx", n_ctx)
        n_threads = 0 if n_threads is None else _non_negative_int("n_threads", n_threads)
        n_batch = _positive_int("n_batch", n_batch)
        self.tokenizer = Tokenizer.from_file(self.path)
        n_seq = _positive_int("n_seq", n_seq)
        from .plan import kv_types, plan_args

        where = plan_args(self.hparams["n_layer"], device, vram, n_gpu_layers, gpu_neurons, kv_vram)
        kv_type, where["kv_type_v"] = kv_types(kv_type, kv_type_k, kv_type_v)
        if use_mmap == "auto" and _auto_in_memory(
                self.path, lambda: _core.make_plan(self._model, n_ctx, n_seq, n_batch, kv_type, **where)):
            self._model = _core.Model(os.fsencode(self.path), in_memory=True)
        self._session = _core.Session(self._model, n_ctx, n_threads, kv_type, n_batch, n_seq, **where)
        self._tokens: list[int] = []  # what the context (KV cache) holds
        self._busy = threading.Lock()
        self._chat_template = None
        self._chat_text = ""  # the text of the last chat prompt and answer ...
        self._chat_ids: list[int] = []  # ... and its token ids, as the model saw and generated them
        self._stats = {"prompt_tokens": 0, "prompt_evaluated": 0, "prompt_s": 0.0, "gen_tokens": 0, "gen_s": 0.0}
        if down_copy not in ("auto", "fast", "compact"):
            raise ArgumentError(f"down_copy must be 'auto', 'fast' or 'compact', not {down_copy!r}")
        self._down_copy = down_copy
        self._predicted_share = None  # of the attached predictors (see _compact_down)
        # Predictors before the sparsity mode: both need the down copies, and the predictors' share of
        # active neurons picks which kind (_compact_down), so they are made once.
        self.predictors: str | None = None
        if predictors == "auto":
            found = self._predictors_beside()
            if found is not None:
                self._attach_predictors(*found)
        elif predictors is not None:
            self.set_predictors(predictors)
        self.sparsity = "none"
        self.set_sparsity(sparsity, thresholds)

    # ---- properties ---------------------------------------------------------------------------
    @property
    def in_memory(self) -> bool:
        """Whether the weights were read into private memory (use_mmap) rather than mapped."""
        return self._model.in_memory

    @property
    def n_ctx(self) -> int:
        return self._session.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.hparams["n_vocab"]

    @property
    def n_past(self) -> int:
        """Tokens in the context now."""
        return self._session.n_past

    @property
    def tokens(self) -> list[int]:
        """The token ids in the context, oldest first."""
        return list(self._tokens)

    @property
    def last_stats(self) -> dict:
        """The last generation: prompt_tokens (the prompt's length), prompt_evaluated (the tokens actually
        run: those not already in the context), prompt_s, gen_tokens, gen_s (seconds; wall time from the
        prompt's end to the last token) and, once a generation ran, busy_s (the part of gen_s spent in the
        native loop)."""
        return dict(self._stats)

    # ---- activation sparsity ---------------------------------------------------------------------
    def set_sparsity(self, mode: str = "auto", thresholds=None, criterion: str | None = None) -> None:
        """Chooses how the FFN skips neurons from the next evaluated token on.

        mode "none": dense. "threshold": skip neurons whose |act(gate)| (criterion "gate") or
        |act(gate) * up| (criterion "product") is at most the layer's threshold; the thresholds are
        ``thresholds`` (a float for every layer, or one per layer), else the file's calibrated ones
        (`optiml calibrate`; with its per-neuron scales for the "weighted" criterion), else 0 for a
        ReLU-family model (exact: only zeros are skipped).
        "auto": "threshold" when the file is calibrated or the model is ReLU-family, else "none".
        The mode in use is in ``self.sparsity`` ("none", "calibrated", "exact" or "custom").
        """
        if mode not in ("none", "threshold", "auto"):
            raise ArgumentError(f"sparsity must be 'none', 'threshold' or 'auto', not {mode!r}")
        if criterion not in (None, "gate", "product"):
            raise ArgumentError(f"criterion must be 'gate' or 'product', not {criterion!r}")
        cfg = self._model.sparsity
        n_layer = self.hparams["n_layer"]
        scale = None
        relu = self.hparams["ffn_act"] in ("relu", "relu2")
        if mode == "none":
            chosen, thr = "none", None
        elif thresholds is not None:
            thr = np.asarray(thresholds, dtype=np.float32)
            if thr.ndim == 0:
                thr = np.full(n_layer, float(thr), dtype=np.float32)
            if thr.shape != (n_layer,):
                raise ArgumentError(f"thresholds: give one value or {n_layer} (one per layer), not {thr.size}")
            if not np.all(np.isfinite(thr)) or np.any(thr < 0):
                raise ArgumentError("thresholds must be finite and >= 0")
            chosen = "custom"
        elif cfg["calibrated"]:
            chosen, thr = "calibrated", np.asarray(cfg["threshold"], dtype=np.float32)
            criterion = criterion or cfg["criterion"]
            if criterion == "gate" and cfg["neuron_scale"] is not None:
                scale = cfg["neuron_scale"]
        elif relu:
            chosen, thr = "exact", np.zeros(n_layer, dtype=np.float32)
        elif mode == "threshold":
            raise ArgumentError(
                f"{os.path.basename(self.path)} carries no sparsity thresholds and its FFN ({self.hparams['ffn_act']}) "
                "is not ReLU-family: run `optiml calibrate` on it, or pass thresholds=")
        else:
            chosen, thr = "none", None
        with self._exclusive():
            if chosen == "none":
                self._session.set_sparsity(False, compact_down=self._compact_down())
            else:
                self._session.set_sparsity(True, thr, (criterion or "gate") == "product", scale,
                                           compact_down=self._compact_down())
        self.sparsity = chosen

    def _compact_down(self, predicted_share: float | None = None) -> bool:
        """Whether the sparse FFN's neuron-major down copies are compact (grouped: lossless, about the
        matrix's own size, for Q4_0/Q4_1/Q4_K) rather than fast (8-bit rows: about twice a 4-bit matrix).
        Summing them (tools/bench_sparse_kernels.py --parts down, 7B shapes, 2 threads, AVX-512): fast
        takes 0.5x compact's time at 5% of the neurons, 0.65x at 10%, 0.85x at 20%; compact is 10-25%
        faster at 40%, 20-25% at 50% (where fast loses to the dense kernel, compact does not). Compact
        is also the smaller copy, so the crossover is put at 40%. "auto": compact when the
        predictors in use (predicted_share: the mean share of neurons they predicted active on held-out
        tokens, default: those attached) mark at least 40% of a gated FFN's neurons active (a ReLU FFN
        sums only the predicted neurons that fire: far fewer), or when the 8-bit copies would take more
        than half of the memory now available; else fast."""
        if self._down_copy != "auto":
            return self._down_copy == "compact"
        if predicted_share is None:
            predicted_share = self._predicted_share
        relu = self.hparams["ffn_act"] in ("relu", "relu2")
        if predicted_share is not None and not relu and predicted_share >= 0.4:
            return True
        h = self.hparams
        need = h["n_layer"] * h["n_ff"] * h["n_embd"] * 34 / 32  # Q8_0: 34 bytes per 32 weights
        available = memory.memory_available()
        if available is None:  # no way to tell: favour speed
            return False
        return need > available / 2

    def _predictors_beside(self) -> tuple[str, dict] | None:
        """MODEL.predictors.gguf beside the model and its checked metadata, when it exists and would make
        decoding faster. A file whose predictors mark more neurons active on held-out text than
        break_even_share allows is left unused, with a PredictorWarning (predictors=PATH still uses it)."""
        import warnings

        from .predictor import (PredictorWarning, break_even_share, check_predictors, default_predictor_path,
                                predicted_share)

        beside = default_predictor_path(self.path)
        if not os.path.isfile(beside):
            return None
        act = self.hparams["ffn_act"]
        meta = check_predictors(beside, self.path, act)
        share = predicted_share(meta)
        limit = break_even_share(act)
        if share is not None and share > limit:
            warnings.warn(
                f"not using {beside}: its predictors mark {share:.1%} of the FFN neurons active on "
                f"held-out text, and above about {limit:.0%} the sparse FFN is slower than the dense one; name the file "
                "(predictors=PATH, or --predictors PATH on the command line) to use them anyway", PredictorWarning,
                stacklevel=3)
            return None
        return beside, meta

    def set_predictors(self, path: str | os.PathLike | None) -> None:
        """Uses the activation predictors of a companion GGUF (`optiml train-predictors`) from the next
        evaluated token on: the CPU's FFN computes gate, up and down only for the neurons they predict
        active (the sparsity criterion, when one is set, then filters those). None stops using them.
        PredictorMismatchError for a file trained for another model. The file in use is ``self.predictors``."""
        from .predictor import check_predictors

        if path is None:
            self._predicted_share = None
            with self._exclusive():
                self._session.set_predictors(None)
                self._session.set_compact_down(self._compact_down())
            self.predictors = None
            return
        path = os.fspath(path)
        self._attach_predictors(path, check_predictors(path, self.path, self.hparams["ffn_act"]))

    def _attach_predictors(self, path: str, meta: dict) -> None:
        """set_predictors for a file whose metadata check_predictors has returned."""
        from .predictor import predicted_share

        share = predicted_share(meta)
        with self._exclusive():
            # The copy the predictors favour first: set_predictors then makes it, and only it.
            self._session.set_compact_down(self._compact_down(share))
            self._session.set_predictors(path)
        self.predictors = path
        self._predicted_share = share

    def sparsity_stats(self, reset: bool = False) -> dict:
        """Neurons skipped since the model was made (or the last reset=True): per layer and overall
        shares of the (token, FFN neuron) pairs not computed, and the mode."""
        active, seen = self._session.sparsity_counts()
        if reset:
            self._session.reset_sparsity_counts()
        per_layer = [1.0 - a / s if s else 0.0 for a, s in zip(active.tolist(), seen.tolist())]
        total = int(seen.sum())
        return {"mode": self.sparsity, "skipped": 1.0 - int(active.sum()) / total if total else 0.0,
                "layers": per_layer, "tokens": total // self.hparams["n_ff"] // max(1, self.hparams["n_layer"])}

    # ---- devices and batches -----------------------------------------------------------------------
    @property
    def plan(self):
        """The execution plan (optiml.plan.Plan): where each layer's attention and FFN neurons run; str() is
        a readable table."""
        from .plan import Plan

        return Plan(self._session.plan)

    @property
    def n_seq(self) -> int:
        """Sequence slots of the KV cache."""
        return self._session.n_seq

    def decode(self, batch) -> np.ndarray:
        """Runs one step over ``batch`` (optiml.Batch): every sequence in it advances, sharing each weight
        read. Returns float32 logits [tokens that want them, n_vocab] in batch order. Decoding into
        sequence 0 forgets the cached prompt that generate/chat would reuse."""
        tokens, seq, pos, want = batch.arrays()
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ArgumentError(f"token ids must be in [0, {self.n_vocab}), got {int(tokens.min())}..{int(tokens.max())}")
        with self._exclusive():
            if (seq == 0).any():
                self._forget_seq0()
            return self._session.decode(tokens, seq, pos, want)

    def _step_sequence(self, seq: int, pos: int, token: int, bias: tuple, sampler, detok, stops: list,
                       pending: str, last: bool) -> tuple:
        """One token of sequence ``seq`` run and sampled natively (optiml._core.step_sequence): the server's
        scheduler, while a request runs alone. Returns (token or -1, end, flush, text out, text held)."""
        with self._exclusive():
            if seq == 0:
                self._forget_seq0()
            return _core.step_sequence(self._session, seq, pos, token, bias[0], bias[1], sampler._s,
                                       self.tokenizer._t, detok._d, stops, pending.encode(), last)

    def seq_len(self, seq: int) -> int:
        """Positions held by sequence ``seq``."""
        return self._session.seq_len(seq)

    def kv_clear(self, seq: int | None = None) -> None:
        """Forgets sequence ``seq`` (every sequence when None)."""
        with self._exclusive():
            self._session.kv_clear(-1 if seq is None else _non_negative_int("seq", seq))
            if seq is None or seq == 0:
                self._forget_seq0()

    def kv_truncate(self, seq: int, n: int) -> None:
        """Keeps the first ``n`` positions of sequence ``seq``."""
        with self._exclusive():
            self._session.kv_truncate(_non_negative_int("seq", seq), _non_negative_int("n", n))
            if seq == 0:
                del self._tokens[n:]
                self._chat_text, self._chat_ids = "", []

    def kv_copy(self, src: int, dst: int, n: int | None = None) -> None:
        """Sequence ``dst`` becomes the first ``n`` positions of ``src`` (all of them when None): a shared
        prompt is run once and copied to every sequence that continues it."""
        with self._exclusive():
            self._session.kv_copy(_non_negative_int("src", src), _non_negative_int("dst", dst),
                                  -1 if n is None else _non_negative_int("n", n))
            if dst == 0:
                self._forget_seq0()

    def kv_place(self, seq: int, where: str) -> None:
        """CPU attention offload: moves sequence ``seq``'s KV cache to host memory (``where="host"``) or
        back to the device (``"device"``). From the next decode on, the host computes that sequence's
        attention while the device runs the linear layers, the batch split in two sub-batches so that
        both work at once (NEO). Needs a device holding every layer's attention (e.g.
        ``device="cuda"``, or ``"cpu:1"`` with enough ``vram``); the tokens and logits are the same
        wherever a sequence lives."""
        if where not in ("host", "device"):  # a device slot must be free to move a sequence back
            raise ArgumentError(f"where must be 'host' or 'device', not {where!r}")
        with self._exclusive():
            self._session.kv_place(_non_negative_int("seq", seq), where == "host")

    def kv_where(self, seq: int) -> str:
        """Where sequence ``seq``'s KV cache lives: "device" (for a CPU-only plan: with the rest) or
        "host" (moved by :meth:`kv_place`, or beyond what ``kv_vram`` holds on the device)."""
        return "host" if self._session.kv_on_host(_non_negative_int("seq", seq)) else "device"

    def _forget_seq0(self) -> None:
        """Sequence 0 changed outside generate/chat: nothing of it is reused as a cached prompt."""
        self._tokens.clear()
        self._chat_text, self._chat_ids = "", []

    # ---- text <-> tokens ------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``. add_bos: add the BOS/EOS tokens the model's tokenizer asks for
        (none for SmolLM2). special: text such as "<|im_start|>" becomes that control token."""
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(ids)

    # ---- the context ----------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Appends ``tokens`` to the context and runs them. Returns the logits (float32) of the last
        token, shape (n_vocab,), or of every token, shape (len(tokens), n_vocab)."""
        ids = _token_array(tokens, self.n_vocab)
        with self._exclusive():
            logits = self._session.eval(ids, bool(all_logits))
            self._tokens.extend(int(t) for t in ids)
        return logits

    def timeline(self, n_tokens: int = 8, prompt: str = "The history of the printing press begins",
                 batch: int = 1):
        """Decodes ``n_tokens`` steps greedily after ``prompt`` while the engine times every op, copy and
        wait on each device (optiml.timeline.Timeline; str() is a per-layer table). batch > 1 times steps
        of that many tokens instead (the prompt's last tokens again, as in prompt processing). The context
        is emptied before and after."""
        from .timeline import Timeline

        n_tokens = _positive_int("n_tokens", n_tokens)
        batch = _positive_int("batch", batch)
        ids = self.tokenize(prompt)
        if len(ids) + n_tokens * batch > self.n_ctx:
            raise ArgumentError(f"the prompt ({len(ids)} tokens) and {n_tokens} steps of {batch} token(s) do not "
                                f"fit the context of {self.n_ctx}; use fewer tokens or a larger n_ctx")
        self.reset()
        with self._exclusive():
            self._forget_seq0()
            logits = self._session.eval(np.asarray(ids, np.int32), False)
            self._session.timeline_start()
            try:
                for _ in range(n_tokens):
                    step = np.asarray(ids[-batch:] if batch > 1 else [int(np.argmax(logits))], np.int32)
                    if len(step) < batch:
                        step = np.resize(step, batch)
                    logits = self._session.eval(step, False)
            finally:
                spans = self._session.timeline_stop()
        self.reset()
        plan = self.plan
        devices = (("cpu", plan.device) if plan.device != "cpu" else ("cpu",))
        return Timeline(spans, devices, n_tokens)

    def reset(self) -> None:
        """Empties the context."""
        with self._exclusive():
            self._session.truncate(0)
            self._tokens.clear()
            self._chat_text, self._chat_ids = "", []

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, **kwargs) -> str:
        """The text generated after ``prompt`` (a string, or token ids). Keywords as :meth:`stream`."""
        return "".join(self.stream(prompt, max_tokens=max_tokens, **kwargs))

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[str]:
        """Yields the generated text piece by piece as tokens decode (always whole UTF-8 characters).

        Generation ends at an end-of-generation token, at the first stop string (not included in the
        output), after max_tokens tokens, or when the context is full. The context is replaced by
        the prompt and the generated tokens; a prompt that starts like the current context reuses
        its cached part. temperature <= 0 is greedy; seed (None = random) makes sampling repeatable.
        Sampling parameters are llama.cpp's (see optiml.sampling).
        """
        return self._stream(*self._prepare(prompt, max_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
                                           repeat_last_n, frequency_penalty, presence_penalty, seed, stop))

    def _prepare(self, prompt, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                 repeat_penalty=1.0, repeat_last_n=64, frequency_penalty=0.0, presence_penalty=0.0, seed=None,
                 stop=None):
        """Validates stream()'s arguments: (ids, max_tokens, sampler, stops)."""
        if self._session is None:
            raise OptimlError(f"{self.path}: the model is closed")
        max_tokens = _non_negative_int("max_tokens", max_tokens)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ArgumentError("stop strings must be non-empty str")
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            seed=RANDOM_SEED if seed is None else seed,
        )
        sampler = Sampler(self.n_vocab, params)  # validates the parameters before any work
        ids = self.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ArgumentError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx} (n_ctx), leaving no room to generate"
            )
        return ids, max_tokens, sampler, stops

    def _stream(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: list[str],
                generated: list[int] | None = None) -> Iterator[str]:
        """The generation loop; appends the generated token ids to ``generated`` when given.

        The loop is native (optiml._core.Generator: eval, sampling, detokenization and stop strings run
        with the GIL released); this only hands its pieces on. However the stream ends (finished,
        closed, dropped, an error), the context's ids and last_stats are brought up to date."""
        with self._exclusive():
            gen = _core.Generator(self._session, self.tokenizer._t, sampler._s, np.array(ids, np.int32),
                                  self._start(ids), max_tokens, [s.encode("utf-8", "surrogatepass") for s in stops])
            try:
                yield from gen
            finally:
                ctx = gen.context_tokens  # None when the prompt never began to run
                if ctx is not None:
                    self._tokens[:] = ctx
                    self._stats.update(gen.stats)
                if generated is not None:
                    generated.extend(gen.tokens)

    def _start(self, ids: list[int]) -> int:
        """How many of ``ids`` the context already holds and may keep (the longest cached prefix, short
        of the last prompt token, which must run for its logits)."""
        common = 0
        for a, b in zip(self._tokens, ids):
            if a != b:
                break
            common += 1
        return min(common, len(ids) - 1, self._session.n_past)

    # ---- chat ---------------------------------------------------------------------------------------
    @property
    def chat_template(self):
        """The model's chat template (optiml.chat.ChatTemplate): GGUF ``tokenizer.chat_template``, or the
        documented fallback when the file has none."""
        if self._chat_template is None:
            from .chat import ChatTemplate, read_template

            self._chat_template = ChatTemplate.for_tokenizer(read_template(self.path), self.tokenizer)
        return self._chat_template

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of ``messages`` rendered with the chat template. When the text begins with the last
        chat prompt and answer, those keep the ids the model saw and generated (only the rest is tokenized),
        so the context's cached prefix is reused exactly; otherwise the whole text is tokenized."""
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self._chat_ids_for(text)

    def _chat_ids_for(self, text: str) -> list[int]:
        if self._chat_text and text.startswith(self._chat_text):
            return self._chat_ids + self.tokenize(text[len(self._chat_text):], add_bos=False, special=True)
        ids = self.tokenize(text, add_bos=False, special=True)
        tk = self.tokenizer
        if tk.add_bos and tk.bos_id >= 0 and (not ids or ids[0] != tk.bos_id):
            ids.insert(0, tk.bos_id)  # the template does not write BOS; the model wants it
        return ids

    def chat(self, messages: Sequence[dict], stream: bool = False, max_tokens: int | None = None, **sampling):
        """The assistant's answer to ``messages`` ([{"role": "system"|"user"|"assistant", "content": str}, ...])
        rendered with the model's chat template: a str, or with stream=True an iterator of text pieces.

        max_tokens: None = until the model ends its turn or the context is full. Other keywords are
        :meth:`stream`'s sampling parameters. Calling chat again with the conversation extended (the answer
        appended as an assistant message, then a new user message) reuses the context's cached tokens: only
        the new tokens are run (see :attr:`last_stats`).
        """
        tpl = self.chat_template
        text = tpl.render(messages, add_generation_prompt=True)
        ids = self._chat_ids_for(text)
        stop = sampling.pop("stop", None)
        stops = ([stop] if isinstance(stop, str) else list(stop or [])) + tpl.stop
        if max_tokens is None:
            max_tokens = self.n_ctx
        args = self._prepare(ids, max_tokens, stop=stops or None, **sampling)
        gen = self._chat_stream(text, args, exact=not stops)
        return gen if stream else "".join(gen)

    def _chat_stream(self, text: str, args, exact: bool) -> Iterator[str]:
        ids = args[0]
        generated: list[int] = []
        pieces: list[str] = []
        for piece in self._stream(*args, generated=generated):
            pieces.append(piece)
            yield piece
        # A finished answer: remember its text and ids for the next turn (not when a stop string cut the
        # text short of the ids; the next prompt is then tokenized whole and the common prefix reused).
        self._chat_text, self._chat_ids = (text + "".join(pieces), ids + generated) if exact else ("", [])

    # ---- lifetime -------------------------------------------------------------------------------
    @contextmanager
    def _exclusive(self):
        if self._session is None:
            raise OptimlError(f"{self.path}: the model is closed")
        if not self._busy.acquire(blocking=False):
            raise OptimlError("this Model is in use by another thread (or an unfinished stream); use one Model per thread")
        try:
            yield
        finally:
            self._busy.release()

    def close(self) -> None:
        """Frees the context and unmaps the model (the object is unusable afterwards)."""
        self._session = None
        self._model = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        hp = self.hparams
        return (
            f"<optiml.Model {os.path.basename(self.path)!r} {hp['arch']} {hp['n_layer']} layers, "
            f"n_embd {hp['n_embd']}, n_ctx {self.n_ctx if self._session else 'closed'}>"
        )


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ArgumentError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _non_negative_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ArgumentError(f"{name} must be a non-negative integer, got {v!r}")
    return int(v)


def _token_array(tokens, n_vocab: int) -> np.ndarray:
    a = np.asarray(tokens)
    if a.ndim != 1 or a.size == 0:
        raise ArgumentError("tokens must be a non-empty 1-D sequence of token ids")
    if a.dtype.kind not in "iu":
        raise ArgumentError(f"token ids must be integers, not {a.dtype}")
    if a.min() < 0 or a.max() >= n_vocab:
        raise ArgumentError(f"token ids must be in [0, {n_vocab}), got {int(a.min())}..{int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int32)

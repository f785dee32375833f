"""optiml.Model: load a GGUF model and run it (tokenize, eval, generate, stream).

    with optiml.Model("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048) as m:
        print(m.generate("The capital of France is", max_tokens=32, temperature=0))
        for piece in m.stream("Once upon a time", max_tokens=64, seed=1):
            print(piece, end="", flush=True)
        print(m.chat([{"role": "user", "content": "Hi!"}], temperature=0))

A known model name (optiml.hub.registry, e.g. "smollm2-135m-instruct") works in place of a path: it is pulled
into the model cache on first use.

The forward pass, tokenizer and sampler are native (optiml._core); this module is the user's API over the
parts of the engine package: loading (the file, mapped or in memory), plan (where layers run), sparsity
(which neurons are skipped), generation (stream's loop and the chat prefix), sequences (decode and the KV
cache API, mixed in), timeline.
A Model is not thread-safe: it holds one context (KV cache). Use one Model per thread; using one
Model from two threads at once raises OptimlError instead of corrupting the context.
"""

from __future__ import annotations

import inspect
import os
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

import numpy as np

from .. import _core
from .._core import ArgumentError, OptimlError
from ..formats.predictors import check_predictors, predicted_share
from . import embeddings, loading, speed_probe
from .chat_template import ChatTemplate, check_variables, read_template
from .checks import boolean, non_negative_int, positive_int, token_array
from .generation import ChatPrefix, cached_prefix, check_prompt, generator, make_sampler, prompt_ids, stop_strings
from .plan import Plan, kv_types, plan_args
from .sampling import Sampler
from .sequences import Sequences
from .sparsity import SkipMeter, choose_mode, compact_down, predictors_beside, skip_stats
from .launches import Launches, count_steps
from .timeline import Timeline, record_steps
from .tokenizer import Tokenizer

# What generate, stream and chat take besides the prompt, max_tokens and stop (make_sampler's parameters).
SAMPLING_SETTINGS = frozenset(inspect.signature(make_sampler).parameters) - {"n_vocab"}

# More threads than any machine this runs on has cores (llama.cpp's limit too): a typo, not a setting.
MAX_THREADS = _core.MAX_THREADS  # (the thread pool's own bound)

__all__ = ["Model"]


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (free memory plus the page cache the kernel can drop); None where
    it cannot be read (not Linux). Not util.memory.memory_available: its other sources would refuse caches
    that fit (free pages alone leave out the page cache; a cgroup's usage counts it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_host_memory(plan: dict, n_ctx: int, n_seq: int, n_ctx_train: int) -> None:
    """Refuses a KV cache larger than this machine's memory, or than the memory available now, before it is
    made: it is allocated as it fills, so the process would otherwise be killed once the context grows past
    what fits."""
    kv = plan["host_kv_bytes"]
    needs = f"n_ctx={n_ctx} x {n_seq} sequence(s) needs a KV cache of {kv / 2**30:.1f} GiB on the host"
    fix = f"give a smaller n_ctx (the model was trained on {n_ctx_train} positions), or kv_type q8_0 or q4_0"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # (no such sysconf here: nothing to check against)
        total = 0
    if total > 0 and kv > total:
        raise ArgumentError(f"{needs}, more than this machine's {total / 2**30:.1f} GiB of memory: {fix}")
    available = _mem_available()
    if available is not None and kv > available:
        raise ArgumentError(f"{needs}, more than the {available / 2**30:.1f} GiB of memory available now "
                            f"(MemAvailable): {fix}, or free memory")


class Model(Sequences):
    """A GGUF model (llama, mistral, qwen2, qwen3, gemma2, gemma3, smollm3, phi3; the mixture-of-experts
    qwen2moe, qwen3moe, Mixtral and gpt-oss) with one context.

    path: the GGUF file, a known model name or a Hugging Face reference org/repo[:QUANT] (pulled on first use;
    docs/models.md). n_ctx: context length in tokens (default: the model's training context,
    at most 4096). n_threads: CPU threads (default: the physical cores). n_batch: tokens per forward
    pass while reading a prompt. kv_type: the KV cache's type, "f16" (as llama.cpp), "f32" (exact, twice
    the bytes), "q8_0" (half of f16's bytes) or "q4_0" (a quarter and a bit), by llama.cpp's names
    (--cache-type-k/-v; ggml type ids such as llama_cpp.GGML_TYPE_Q8_0 are accepted too); kv_type_k and
    kv_type_v set the keys' and the values' apart (each defaults to kv_type). The CPU and the CUDA
    attention read all four.

    sparsity: how the FFN skips neurons (see :meth:`set_sparsity`): "auto" (default: the thresholds the
    file carries from `optiml calibrate`; for a ReLU-family model without them, exact zero-skipping;
    otherwise dense; and with predictors="auto" too, only where that makes a step faster than the dense FFN
    on this machine, timed once and cached: see optiml.engine.speed_probe and :attr:`sparsity_note`),
    "threshold" (the file's thresholds, or zeros for ReLU, whatever the speed; an error when there is
    nothing to skip by), or "none".
    thresholds: per-layer thresholds (or one for all layers) that override the file's.
    down_copy: the sparse FFN's neuron-major copy of each down matrix: "fast" (8-bit rows, about twice a
    4-bit matrix's size), "compact" (for Q4_0/Q4_1/Q4_K: the file's own codes and scales regrouped, lossless
    and about the matrix's size, summed in integers with each 32-neuron group's activations quantized to
    int8; faster than fast when about half of the neurons fire, slower at 10% and below, where each touched
    group's scale row costs more than its codes save; other types get 8-bit rows), or "auto" (the default:
    fast while those copies take at most half of the memory available).

    n_seq: sequence slots of the KV cache (each holds n_ctx positions) for :meth:`decode`; generation and
    chat use sequence 0. device, vram, n_gpu_layers, gpu_neurons: where layers run (see optiml.plan):
    device "auto" (the default: the CPU, until the CUDA backend is verified on a GPU), "cpu", "cpu:N" (a second CPU
    instance treated as an accelerator, for testing split execution), "cuda[:N]"; vram a budget such as
    "6GiB"; n_gpu_layers the last N layers whole on the device; gpu_neurons FFN neurons per layer on the
    device (overrides the file's placement). The result is :attr:`plan`. kv_vram (such as "2GiB") limits
    the device's KV cache: it then holds as many sequences as fit, the others live in host memory and
    their attention runs on the CPU (CPU attention offload, see :meth:`kv_place`); it needs every layer's
    attention on the device. n_cpu_moe (mixtures of experts): the experts of the first N layers stay on the
    CPU while the rest of those layers may go to the device (llama.cpp's --n-cpu-moe; True: every layer's,
    --cpu-moe; past the layers: all of them); the other layers' experts go where their attention goes, or
    as the file's expert placement says. gpu_experts: per layer a list
    of expert ids for the device, hottest first (overrides the file's expert placement, `optiml solve`): as
    many as the budget holds go there, the layer's other experts stay on the CPU, and both sides compute
    at once.

    predictors: activation predictors (see :meth:`set_predictors`): "auto" (default: MODEL.predictors.gguf
    beside MODEL.gguf when it exists, unless its predictors mark so many neurons active that they would
    slow decoding down: then a PredictorWarning says so), a path, or None. With predictors and a file whose
    neurons `optiml solve --order coactive` ordered but whose weights kept their order (quantized down
    tensors), the CPU reads its neurons from a copy in the placed order, made at load, so that neurons that
    fire together are read as runs of rows (:meth:`placed_copy_info`; placed_copy=False reads the file's rows
    where they are, without the copies' memory). predictor_group: the predictors decide by groups of this
    many consecutive neurons as the CPU reads them (in the placed order from a copy, else in the file's
    order; default 1: neuron by neuron), a group computed whole when any of its neurons is predicted
    active: more neurons computed (closer to the dense result), in longer runs where co-active neurons sit
    together.

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
        n_cpu_moe=None,
        gpu_experts=None,
        predictor_group: int = 1,
        placed_copy: bool = True,
    ):
        predictor_group = positive_int("predictor_group", predictor_group)
        placed_copy = boolean("placed_copy", placed_copy)
        try:
            self.path = loading.model_file(path)
        except IsADirectoryError:  # (not among the documented errors: a bad argument, as the CLI says)
            raise ArgumentError(f"{os.fsdecode(path)} is a folder: give a GGUF file (convert a Hugging Face folder "
                                "with optiml convert)") from None
        self._model = loading.open_weights(self.path, use_mmap)
        self.hparams: dict = self._model.hparams
        if n_ctx is None:
            n_ctx = min(self.hparams["n_ctx_train"], 4096)
        n_ctx = positive_int("n_ctx", n_ctx)
        n_threads = 0 if n_threads is None else non_negative_int("n_threads", n_threads, MAX_THREADS)
        self._n_threads = n_threads
        n_batch = positive_int("n_batch", n_batch)
        self.tokenizer = Tokenizer.from_file(self.path)
        n_seq = positive_int("n_seq", n_seq)
        where = plan_args(self.hparams["n_layer"], device, vram, n_gpu_layers, gpu_neurons, kv_vram, n_cpu_moe,
                          gpu_experts)
        kv_type, where["kv_type_v"] = kv_types(kv_type, kv_type_k, kv_type_v)
        plan = _core.make_plan(self._model, n_ctx, n_seq, n_batch, kv_type, **where)
        _check_host_memory(plan, n_ctx, n_seq, self.hparams["n_ctx_train"])
        if use_mmap == "auto" and loading.auto_in_memory(self.path, lambda: plan):
            self._model = _core.Model(os.fsencode(self.path), in_memory=True)
        self._session = _core.Session(self._model, n_ctx, n_threads, kv_type, n_batch, n_seq, **where)
        if not placed_copy:  # before any predictors: their copies are made as they attach
            self._session.placed_copies = False
        self._tokens: list[int] = []  # what the context (KV cache) holds
        self._busy = threading.Lock()
        self._chat_template = None
        self._chat = ChatPrefix()  # the last chat turn, reused by the next
        self._stats = {"prompt_tokens": 0, "prompt_evaluated": 0, "prompt_s": 0.0, "gen_tokens": 0, "gen_s": 0.0}
        if down_copy not in ("auto", "fast", "compact"):
            raise ArgumentError(f"down_copy must be 'auto', 'fast' or 'compact', not {down_copy!r}")
        self._down_copy = down_copy
        self._predicted_share = None  # of the attached predictors (see _compact_down)
        # Predictors before the sparsity mode: both need the down copies, and the predictors' share of
        # active neurons picks which kind (_compact_down), so they are made once.
        self.predictors: str | None = None
        if predictors == "auto":
            found = predictors_beside(self.path, self.hparams["ffn_act"])
            if found is not None:
                self._attach_predictors(*found)
        elif predictors is not None:
            self.set_predictors(predictors)
        self.predictor_group = predictor_group
        self.sparsity = "none"
        self.set_sparsity(sparsity, thresholds)
        self.sparsity_note = ""  # why the FFN is sparse or dense, when sparsity="auto" decided it
        if sparsity == "auto" and thresholds is None and predictors == "auto":
            self._keep_sparsity_if_it_pays()

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
        """The token ids in the context (what its KV cache holds), oldest first. After generation: the prompt
        and the generated tokens but the last, which was sampled and not run (as llama.cpp leaves it)."""
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
        chosen, thr, product, scale = choose_mode(mode, thresholds, criterion, self._model.sparsity, self.hparams,
                                                  self.path)
        with self._exclusive():
            if chosen == "none":
                self._session.set_sparsity(False, compact_down=self._compact_down())
            else:
                self._session.set_sparsity(True, thr, product, scale, compact_down=self._compact_down())
        self.sparsity = chosen

    @property
    def predictor_group(self) -> int:
        """Predictors decide by groups of this many consecutive neurons (see the class doc); settable."""
        return self._session.predictor_group

    @predictor_group.setter
    def predictor_group(self, g: int) -> None:
        g = positive_int("predictor_group", g)
        with self._exclusive():
            self._session.predictor_group = g

    def placed_copy_info(self) -> dict:
        """The layers whose FFN the CPU reads from a copy in the file's placed order (a placed file that kept
        its weights' order, with predictors) and the bytes of those copies (gate/up rows and down's
        neuron-major rows)."""
        return {"layers": list(self._session.placed_copy_layers), "bytes": int(self._session.placed_copy_bytes)}

    def _keep_sparsity_if_it_pays(self) -> None:
        """sparsity="auto": the file's sparsity (its thresholds, a ReLU FFN's zeros, the predictors found beside
        it) stays only where it makes a step faster than the dense FFN on this machine, as timed once and
        cached (engine/speed_probe.py); the verdict is in ``sparsity_note``."""
        if self.sparsity == "none" and self.predictors is None:
            return
        mode, preds = self.sparsity, self.predictors

        def dense():
            if preds:
                self.set_predictors(None)
            self.set_sparsity("none")

        def sparse():
            if preds:
                self.set_predictors(preds)
            self.set_sparsity("auto")

        verdict = speed_probe.sparse_pays(self, f"{mode}:{self._down_copy}", dense, sparse)
        self.sparsity_note = verdict.note
        if not verdict.pays:
            dense()

    def _compact_down(self, predicted_share: float | None = None) -> bool:
        """Whether the down copies are compact (sparsity.compact_down), for the predictors whose share of
        active neurons is given (default: those attached)."""
        share = self._predicted_share if predicted_share is None else predicted_share
        return compact_down(self._down_copy, share, self.hparams)

    def set_predictors(self, path: str | os.PathLike | None) -> None:
        """Uses the activation predictors of a companion GGUF (`optiml train-predictors`) from the next
        evaluated token on: the CPU's FFN computes gate, up and down only for the neurons they predict
        active (the sparsity criterion, when one is set, then filters those). None stops using them.
        PredictorMismatchError for a file trained for another model. The file in use is ``self.predictors``."""
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
        share = predicted_share(meta)
        with self._exclusive():
            # The copy the predictors favour first: set_predictors then makes it, and only it.
            self._session.set_compact_down(self._compact_down(share))
            self._session.set_predictors(path)
        self.predictors = path
        self._predicted_share = share

    def sparsity_stats(self, reset: bool = False) -> dict:
        """Neurons skipped since the model was made (or the last reset=True, set_sparsity or set_predictors):
        per layer ("layers") and overall ("skipped") shares of the (token, FFN neuron) pairs not computed,
        "tokens", the mode ("mode") and the predictor file in use ("predictors", or None)."""
        reset = boolean("reset", reset)
        active, seen = self._session.sparsity_counts()
        if reset:
            self._session.reset_sparsity_counts()
        return skip_stats(active, seen, self.sparsity, self.hparams, self.predictors)

    def sparsity_meter(self, history: int | None = None) -> SkipMeter:
        """Measures the share of FFN neurons skipped step by step from now on (engine.sparsity.SkipMeter):
        call its step() after each eval or decode (or each piece a stream yields), then summary() for the
        mean, the spread over the steps (the last `history` of them; None: all), the mode and the
        predictors. Call step() from the thread that runs the model."""
        if history is not None:
            history = positive_int("history", history)
        return SkipMeter(self._session.sparsity_counts, lambda: (self.sparsity, self.predictors), self.hparams,
                         history)

    # ---- where layers run (decode and the KV cache API: Sequences, engine/sequences.py) -------------
    @property
    def plan(self):
        """The execution plan (optiml.plan.Plan): where each layer's attention and FFN neurons run; str() is
        a readable table."""
        return Plan(self._session.plan)

    def _forget_seq0(self) -> None:
        """Sequence 0 changed outside generate/chat: nothing of it is reused as a cached prompt."""
        self._tokens.clear()
        self._chat.forget()

    # ---- text <-> tokens ------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``. add_bos: add the BOS/EOS tokens the model's tokenizer asks for
        (none for SmolLM2). special: text such as "<|im_start|>" becomes that control token."""
        add_bos, special = boolean("add_bos", add_bos), boolean("special", special)
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ids (integers; control tokens such as <|im_end|> are left out). Bytes that do not
        complete a UTF-8 character come out as U+FFFD; see optiml.tokenizer for the streaming Detokenizer."""
        return self.tokenizer.decode(ids)

    # ---- the context ----------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Appends ``tokens`` to the context and runs them. Returns the logits (float32) of the last
        token, shape (n_vocab,), or of every token, shape (len(tokens), n_vocab). (After generation the
        context lacks the last generated token: see :meth:`stream`.)"""
        ids = token_array(tokens, self.n_vocab)
        all_logits = boolean("all_logits", all_logits)
        with self._exclusive():
            n_past = self._session.n_past
            known = len(self._tokens) == n_past  # (not after a batch's decode on sequence 0)
            try:
                logits = self._session.eval(ids, all_logits)
            finally:  # also when Ctrl-C stopped it part way: the context holds what ran
                if known:
                    self._tokens.extend(int(t) for t in ids[:self._session.n_past - n_past])
                else:
                    self._tokens.clear()
        return logits

    def _greedy_steps(self, prompt: str, n_tokens, batch, run):
        """run(session, prompt ids, n_tokens, batch) on an empty context (emptied again after), for timeline
        and launches: n_tokens greedy steps of `batch` tokens after the prompt, which must fit the context."""
        n_tokens = positive_int("n_tokens", n_tokens)
        batch = positive_int("batch", batch)
        ids = self.tokenize(prompt)
        if len(ids) + n_tokens * batch > self.n_ctx:
            raise ArgumentError(f"the prompt ({len(ids)} tokens) and {n_tokens} steps of {batch} token(s) do not "
                                f"fit the context of {self.n_ctx}; use fewer tokens or a larger n_ctx")
        self.reset()
        with self._exclusive():
            self._forget_seq0()
            out = run(self._session, ids, n_tokens, batch)
        self.reset()
        return out

    def timeline(self, n_tokens: int = 8, prompt: str = "The history of the printing press begins",
                 batch: int = 1):
        """Decodes ``n_tokens`` steps greedily after ``prompt`` while the engine times every op, copy and
        wait on each device (optiml.engine.timeline.Timeline; str() is a per-layer table). batch > 1
        times steps of that many tokens instead (the prompt's last tokens again, as in prompt processing). The context
        is emptied before and after."""
        spans = self._greedy_steps(prompt, n_tokens, batch, record_steps)
        plan = self.plan
        devices = (("cpu", plan.device) if plan.device != "cpu" else ("cpu",))
        return Timeline(spans, devices, n_tokens)

    def launches(self, n_tokens: int = 4, prompt: str = "The history of the printing press begins",
                 batch: int = 1) -> Launches:
        """Decodes ``n_tokens`` steps greedily after ``prompt`` and returns what the device launched for
        them: kernels and copies per layer and kind, and the bytes of weights, activations and KV cache they
        move (optiml.engine.launches.Launches; str() is a table; empty on a device that does not count, the
        CPU ones). batch > 1 counts steps of that many tokens, as :meth:`timeline`. The context is emptied
        before and after."""
        rows, host, positions = self._greedy_steps(prompt, n_tokens, batch, count_steps)
        return Launches([tuple(r) for r in rows], self.plan.device, n_tokens, batch, host,
                        int(self.hparams["n_layer"]), positions)

    def embed(self, input, pooling: str | None = None, normalize: bool = True):
        """Embeddings (engine/embeddings.py) of a text or list of token ids: a float32 vector of n_embd; of a list of
        them: an array [n_inputs, n_embd]. pooling: "mean", "cls", "last" or "none" (each token's vector: an
        array [n_tokens, n_embd] per input); default the file's pooling_type, else mean. normalize: unit vectors.
        Each input runs alone from an empty context (BOS/EOS as the tokenizer adds them, special-token text such as
        <|im_start|> as its token, as llama-embedding and /v1/embeddings take it); the context is empty afterwards.
        ContextOverflowError for an input longer than n_ctx."""
        items, single = embeddings.inputs(input)
        pooling = embeddings.choose_pooling(pooling, self.hparams)
        normalize = boolean("normalize", normalize)
        out = []
        with self._exclusive():
            try:
                for item in items:
                    ids = self.tokenize(item, special=True) if isinstance(item, (str, bytes)) else item
                    if len(ids) == 0:
                        raise ArgumentError("an input of embed() gives no tokens (an empty text?)")
                    ids = token_array(ids, self.n_vocab)
                    self._session.truncate(0)
                    out.append(embeddings.pool(self._session.hidden_states(ids), pooling, normalize))
            finally:
                self._session.truncate(0)
                self._forget_seq0()
        return out[0] if single else out if pooling == "none" else np.stack(out)

    def reset(self) -> None:
        """Empties the context."""
        with self._exclusive():
            self._session.truncate(0)
            self._tokens.clear()
            self._chat.forget()

    # ---- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | bytes | Sequence[int],
        max_tokens: int | None = 128,
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
    ) -> str:
        """The text generated after ``prompt`` (text, or token ids): :meth:`stream`'s pieces joined; the
        parameters are stream's."""
        return "".join(self.stream(
            prompt, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, seed=seed, stop=stop))

    def stream(
        self,
        prompt: str | bytes | Sequence[int],
        max_tokens: int | None = 128,
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
        output), after max_tokens tokens (None: no limit), or when the context is full. The context is then replaced by what
        was run: the prompt and the output, less the last token sampled, which is not run (as llama.cpp
        leaves it): after max_tokens or a full context, the output's last token; after a stop string, the
        token that completed it. :attr:`tokens` lists what the context holds; a later prompt (text, bytes or
        ids) that starts like it reuses that part and runs only the rest. temperature <= 0 is greedy; seed (None = random) makes sampling repeatable.
        Sampling parameters are llama.cpp's (see optiml.sampling).
        """
        return self._stream(*self._prepare(
            prompt, max_tokens, stop, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, seed=seed))

    def _prepare(self, prompt, max_tokens=128, stop=None, **sampling):
        """Checks stream()'s arguments: (ids, max_tokens, sampler, stops)."""
        self._check_open()
        # None: until the end of generation or a full context (llama-cpp-python's, and chat()'s)
        max_tokens = self.n_ctx if max_tokens is None else non_negative_int("max_tokens", max_tokens)
        stops = stop_strings(stop)
        unknown = sorted(set(sampling) - SAMPLING_SETTINGS)
        if unknown:  # (make_sampler's own TypeError would name it, not the method the caller called)
            raise TypeError(f"unexpected keyword argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
                            f"the sampling settings are {', '.join(sorted(SAMPLING_SETTINGS))}")
        sampler = make_sampler(self.n_vocab, **sampling)  # checks the parameters before any work
        if isinstance(prompt, (bytearray, memoryview)):
            prompt = bytes(prompt)
        ids = (self.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, (str, bytes))
               else prompt_ids(prompt, self.n_vocab))
        check_prompt(ids, self.n_ctx)
        return ids, max_tokens, sampler, stops

    def _stream(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: list[str],
                generated: list[int] | None = None) -> Iterator[str]:
        """The generation loop; appends the generated token ids to ``generated`` when given.

        The loop is native (generation.generator: eval, sampling, detokenization and stop strings run
        with the GIL released); this only hands its pieces on. However the stream ends (finished,
        closed, dropped, an error), the context's ids and last_stats are brought up to date."""
        with self._exclusive():
            gen = generator(self._session, self.tokenizer, sampler, ids,
                            cached_prefix(self._tokens, ids, self._session.n_past), max_tokens, stops)
            try:
                yield from gen
            finally:
                ctx = gen.context_tokens  # None when the prompt never began to run
                if ctx is not None:
                    self._tokens[:] = ctx
                    self._stats.update(gen.stats)
                if generated is not None:
                    generated.extend(gen.tokens)

    # ---- chat ---------------------------------------------------------------------------------------
    @property
    def chat_template(self):
        """The model's chat template (optiml.engine.chat_template.ChatTemplate): GGUF
        ``tokenizer.chat_template``, or the documented fallback when the file has none. ChatTemplateError
        (naming the file) when it does not compile. Assign a template's text (or a ChatTemplate) to chat
        with another one, None to return to the file's."""
        self._check_open()
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_tokenizer(read_template(self.path), self.tokenizer,
                                                             os.path.basename(self.path))
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template) -> None:
        self._check_open()
        if template is None or isinstance(template, ChatTemplate):
            tpl = template
        elif isinstance(template, str) and template:
            name = f"{os.path.basename(self.path)} (set by Model.chat_template)"
            tpl = ChatTemplate.for_tokenizer(template, self.tokenizer, name, given=True)
        else:
            raise ArgumentError(f"chat_template: give the template's text, a ChatTemplate or None, not {template!r}")
        self._chat_template = tpl
        self._chat.forget()

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids of ``messages`` rendered with the chat template (with chat_template_kwargs' variables,
        as chat). When the text begins with the last chat prompt and answer, those keep the ids the model saw
        and generated (only the rest is tokenized), so the context's cached prefix is reused exactly; otherwise
        the whole text is tokenized."""
        add_generation_prompt = boolean("add_generation_prompt", add_generation_prompt)
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         **check_variables(chat_template_kwargs))
        return self._chat.ids_for(text, self.tokenizer)

    def chat(self, messages: Sequence[dict], stream: bool = False, max_tokens: int | None = None,
             chat_template_kwargs: dict | None = None, **sampling) -> str | Iterator[str]:
        """The assistant's answer to ``messages`` ([{"role": "system"|"user"|"assistant", "content": str}, ...])
        rendered with the model's chat template: a str, or with stream=True an iterator of text pieces.

        max_tokens: None = until the model ends its turn or the context is full. chat_template_kwargs: extra
        variables for the template, as llama.cpp's (Qwen3: {"enable_thinking": False}). Other keywords are
        :meth:`stream`'s sampling parameters. Calling chat again with the conversation extended (the answer
        appended as an assistant message, then a new user message) reuses the context's cached tokens: only
        the new tokens are run (see :attr:`last_stats`).
        """
        if isinstance(messages, Sequence) and not isinstance(messages, str) and not messages:
            raise ArgumentError("messages is empty: give at least one message to answer")
        stream = boolean("stream", stream)
        tpl = self.chat_template
        text = tpl.render(messages, add_generation_prompt=True, **check_variables(chat_template_kwargs))
        ids = self._chat.ids_for(text, self.tokenizer)
        stops = stop_strings(sampling.pop("stop", None)) + tpl.stop
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
        if exact:
            self._chat.remember(text + "".join(pieces), ids + generated)
        else:
            self._chat.forget()

    # ---- lifetime -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if not self._session:
            raise OptimlError(f"{self.path}: the model is closed")

    @contextmanager
    def _exclusive(self):
        self._check_open()
        if not self._busy.acquire(blocking=False):
            raise OptimlError("this Model is in use by another thread (or an unfinished stream: finish it or call its "
                              "close(); one kept alive by a saved exception or traceback still holds the Model); use "
                              "one Model per thread")
        try:
            yield
        finally:
            self._busy.release()

    def close(self) -> None:
        """Frees the context and unmaps the model (the object is unusable afterwards: any use raises
        OptimlError)."""
        self._session = _Closed(self.path)
        self._model = _Closed(self.path)
        self.tokenizer = _Closed(self.path)
        self._chat_template = None  # (the property says the model is closed)
        self._chat.forget()

    def __enter__(self) -> Model:
        self._check_open()  # (a closed model would otherwise enter silently and fail at its first use)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        hp = self.hparams
        return (
            f"<optiml.Model {os.path.basename(self.path)!r} {hp['arch']} {hp['n_layer']} layers, "
            f"n_embd {hp['n_embd']}, n_ctx {self.n_ctx if self._session else 'closed'}>"
        )


class _Closed:
    """Stands in for the native session and weights after close(): any use says the model is closed."""

    def __init__(self, path: str):
        self._path = path

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, name):
        if name.startswith("_"):  # (copy, pickle and hasattr ask for these: plain Python answers)
            raise AttributeError(name)
        raise OptimlError(f"{self._path}: the model is closed")

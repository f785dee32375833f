"""Prometheus metrics of one server (its own registry, so several servers in one process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("optiml_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("optiml_prompt_tokens", "Prompt tokens received", registry=r)
        self.prompt_evaluated = Counter("optiml_prompt_tokens_evaluated",
                                        "Prompt tokens run through the model (the rest came from the prefix cache)",
                                        registry=r)
        self.generated_tokens = Counter("optiml_generated_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("optiml_queue_depth", "Sequences waiting for a slot", registry=r)
        self.running = Gauge("optiml_running_sequences", "Sequences holding a slot", registry=r)
        self.batch_tokens = Histogram("optiml_batch_tokens", "Tokens per decode step",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.batch_sequences = Histogram("optiml_batch_sequences", "Sequences per decode step",
                                         buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.ttft = Histogram("optiml_time_to_first_token_seconds", "From arrival to the first generated token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("optiml_inter_token_latency_seconds", "Between consecutive tokens of a sequence",
                             buckets=_LATENCY, registry=r)
        # CPU attention offload (--kv-vram): the steps by kind, the policy's admissions, host sequences.
        self.offload_steps = Counter("optiml_offload_steps", "Decode steps by kind: gpu_only (every sequence's "
                                     "attention on the device) or pipelined (some on the CPU)", ["mode"], registry=r)
        self.offload_decisions = Counter("optiml_offload_decisions", "What the offload policy decided for a "
                                         "sequence that found every device KV slot busy", ["decision"], registry=r)
        self.host_sequences = Gauge("optiml_host_sequences", "Running sequences whose KV cache is in host memory",
                                    registry=r)
        self.rejected = Counter("optiml_rejected", "Requests turned away because the queue was full", registry=r)
        # FFN activation sparsity: what is in use (set by the server) and the (token, neuron) pairs skipped.
        self.ffn_sparsity = Info("optiml_ffn_sparsity", "The FFN's sparsity mode (none, calibrated, exact, custom) "
                                 "and the activation predictor file in use (none)", registry=r)
        self.ffn_neurons = Counter("optiml_ffn_neurons", "FFN (token, neuron) pairs of the steps run", registry=r)
        self.ffn_skipped = Counter("optiml_ffn_neurons_skipped", "FFN (token, neuron) pairs not computed (skipped "
                                   "by the sparsity mode or the predictors)", registry=r)
        self.ffn_skipped_mean = Gauge("optiml_ffn_skipped_ratio", "Share of FFN neurons skipped over every step "
                                      "since the server started", registry=r)
        self.ffn_skipped_step = Gauge("optiml_ffn_step_skipped_ratio", "Share of FFN neurons skipped in the last "
                                      "step", registry=r)
        self.ffn_step_skipped = Histogram("optiml_ffn_step_skipped", "Share of FFN neurons skipped, per step",
                                          buckets=tuple(i / 10 for i in range(1, 11)), registry=r)

    def sparsity_in_use(self, mode: str, predictors: str | None) -> None:
        self.ffn_sparsity.info({"mode": mode, "predictors": predictors or "none"})

    def sparsity_step(self, meter, seen: int, active: int) -> None:
        """After a step the SkipMeter `meter` recorded: seen and active were its totals before it."""
        self.ffn_neurons.inc(meter.seen - seen)
        self.ffn_skipped.inc((meter.seen - seen) - (meter.active - active))
        self.ffn_skipped_mean.set(meter.skipped)
        self.ffn_skipped_step.set(meter.last)
        self.ffn_step_skipped.observe(meter.last)

    def render(self) -> bytes:
        return generate_latest(self.registry)

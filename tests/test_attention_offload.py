"""CPU attention offload (issue #19, NEO): sequences whose KV cache lives in host memory, their attention
computed by the host while the device (here the second CPU device, cpu:1) runs the linear layers, the
batch split into two sub-batches that overlap.

Oracle: the same batches with every sequence on the device. The host and cpu:1 run the same CPU kernels
and each (token, head) is computed alone, so moving a sequence changes where its attention runs, not a
bit of its arithmetic: the logits must be identical.
"""

import numpy as np
import pytest

import optiml
from optiml import ArgumentError

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9842, 2056, 253, 655], [1, 378, 260, 3883],
           [1, 7044, 45, 89, 1553, 30, 2]]


def offloaded_run(path, moves, steps=4):
    """PROMPTS read together, then `steps` greedy decode steps of all four sequences. moves[k] is a list of
    (seq, where) applied before step k (k = 0: before the prompts). Returns every logits row of the run."""
    with optiml.Model(path, n_ctx=96, n_threads=2, n_seq=4, device="cpu:1", vram="2GiB") as m:
        assert all(layer["attention"] != "cpu" for layer in m.plan.layers), str(m.plan)
        out = []
        for s, where in moves.get(0, []):
            m.kv_place(s, where)
        b = optiml.Batch()
        for s, p in enumerate(PROMPTS):
            b.add_sequence(p, seq=s, logits="all")
        out.append(m.decode(b))
        pos = [len(p) for p in PROMPTS]
        nxt = [int(out[-1][sum(len(p) for p in PROMPTS[:s + 1]) - 1].argmax()) for s in range(4)]
        for k in range(1, steps + 1):
            for s, where in moves.get(k, []):
                m.kv_place(s, where)
                assert m.kv_where(s) == where
            b = optiml.Batch()
            for s in range(4):
                b.add(nxt[s], s, pos[s], logits=True)
                pos[s] += 1
            lg = m.decode(b)
            out.append(lg)
            nxt = [int(r.argmax()) for r in lg]
        return np.vstack(out)


@pytest.fixture(scope="module")
def on_device(smollm2_path):
    return offloaded_run(smollm2_path, {})


@pytest.mark.parametrize("moves", [
    {1: [(1, "host"), (3, "host")]},                        # two of four offloaded after the prompt
    {0: [(0, "host"), (1, "host"), (2, "host"), (3, "host")]},  # every prompt read with host attention
    {0: [(2, "host")], 2: [(2, "device"), (0, "host")], 3: [(1, "host")]},  # moved back and forth
], ids=["half", "all-from-the-prompt", "moves"])
def test_offloaded_sequences_give_the_same_logits(smollm2_path, on_device, moves):
    np.testing.assert_array_equal(offloaded_run(smollm2_path, moves), on_device)


@pytest.mark.parametrize("where", [("host", "device"), ("device", "host"), ("host", "host")])
def test_a_prefix_copied_between_host_and_device(smollm2_path, where):
    """kv_copy where source and destination live in different places: the positions cross over, each
    sequence stays where it is, and both continue as when everything is on the device."""
    def run(src_where, dst_where):
        with optiml.Model(smollm2_path, n_ctx=64, n_threads=2, n_seq=2, device="cpu:1", vram="2GiB") as m:
            m.kv_place(0, src_where)
            m.kv_place(1, dst_where)
            b = optiml.Batch()
            b.add_sequence(PROMPTS[0], seq=0)
            m.decode(b)
            m.kv_copy(0, 1, len(PROMPTS[0]) - 1)
            assert (m.kv_where(0), m.kv_where(1)) == (src_where, dst_where)
            b = optiml.Batch()
            b.add(PROMPTS[1][1], 0, len(PROMPTS[0]), logits=True)
            b.add(PROMPTS[1][2], 1, len(PROMPTS[0]) - 1, logits=True)
            return m.decode(b)

    np.testing.assert_array_equal(run(*where), run("device", "device"))


def test_kv_vram_leaves_the_other_sequences_on_the_host(smollm2_path, on_device):
    """A KV budget holding 2 of 4 sequences: the plan counts 2 device slots, sequences 2 and 3 start on the
    host, a third cannot move to the device until one leaves, and the logits are those of the device."""
    with optiml.Model(smollm2_path, n_ctx=96, n_threads=2, n_seq=4, device="cpu:1", vram="2GiB",
                      kv_vram="5MiB") as m:
        per_seq = m.plan.device_bytes["kv"] // 2
        assert m.plan.n_seq_device == 2 and per_seq * 2 <= 5 * 2**20 < per_seq * 3
        assert sum(m._session.device_allocations.values()) == m.plan.device_bytes["total"]
        assert [m.kv_where(s) for s in range(4)] == ["device", "device", "host", "host"]
        with pytest.raises(ArgumentError, match="holds 2 sequence"):
            m.kv_place(3, "device")
        m.kv_place(0, "host")
        m.kv_place(3, "device")
        assert [m.kv_where(s) for s in range(4)] == ["host", "device", "host", "device"]
    np.testing.assert_array_equal(offloaded_run(smollm2_path, {0: [(0, "host"), (3, "device")]}), on_device)


def test_offload_needs_the_attention_on_a_device(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=32, n_threads=2, n_seq=2, device="cpu") as m:
        assert m.kv_where(1) == "device"
        with pytest.raises(ArgumentError, match="every layer's attention"):
            m.kv_place(1, "host")
    # A budget that leaves some layers' attention on the host: nothing to offload from there either.
    with optiml.Model(smollm2_path, n_ctx=32, n_threads=2, n_seq=2, device="cpu:1", n_gpu_layers=10) as m:
        assert any(layer["attention"] == "cpu" for layer in m.plan.layers)
        with pytest.raises(ArgumentError, match="every layer's attention"):
            m.kv_place(0, "host")
    with pytest.raises(ArgumentError, match="every layer's attention on the device"):
        optiml.Model(smollm2_path, n_ctx=32, n_threads=2, n_seq=2, device="cpu:1", n_gpu_layers=10, kv_vram="1MiB")
    with pytest.raises(ArgumentError, match="there is no device"):
        optiml.Model(smollm2_path, n_ctx=32, n_threads=2, n_seq=2, device="cpu", kv_vram="1MiB")


def test_bad_offload_arguments_are_refused(smollm2_path):
    with optiml.Model(smollm2_path, n_ctx=32, n_threads=2, n_seq=2, device="cpu:1", vram="2GiB") as m:
        with pytest.raises(ArgumentError, match="'host' or 'device'"):
            m.kv_place(0, "gpu")
        with pytest.raises(ArgumentError, match="outside"):
            m.kv_place(2, "host")
        with pytest.raises(ArgumentError, match="outside"):
            m.kv_where(5)
        with pytest.raises(ArgumentError):
            m.kv_place(-1, "host")


def test_the_host_attention_overlaps_the_device(smollm2_path):
    """The timeline of one pipelined step (four sequences reading prompts, two with their KV cache on the
    host): the host computes attention in every layer, and in most layers that work is in flight while the
    device computes. The host's prompts are long (its attention grows with their square) so that its work
    in a layer outlasts the OS's time slice: then the overlap shows even when one core serves both
    threads, as under the test suite's parallel workers."""
    from optiml.engine.timeline import Timeline

    lengths = [64, 448, 64, 448]
    with optiml.Model(smollm2_path, n_ctx=512, n_threads=1, n_seq=4, n_batch=1024, device="cpu:1",
                      vram="2GiB") as m:
        m.kv_place(1, "host")
        m.kv_place(3, "host")
        b = optiml.Batch()
        for s in range(4):
            b.add_sequence([(97 + 31 * s + 7 * i) % 4000 + 100 for i in range(lengths[s])], seq=s, logits="none")
        m._session.timeline_start()
        try:
            m.decode(b)
        finally:
            spans = m._session.timeline_stop()
        t = Timeline(spans, ("cpu", "cpu:1"), 1)
    layers = [r for r in t.layers() if r.layer >= 0]
    assert len(layers) == m.hparams["n_layer"]
    for r in layers:
        assert r.host_ops.get("attention", 0) > 0 and r.device_ops.get("attention", 0) > 0, r
        assert r.device_ops.get("ffn", 0) > 0 and r.host_ops.get("ffn", 0) == 0, r  # linear work on the device
    assert sum(r.overlap > 0 for r in layers) >= len(layers) // 2 + 1, str(t)

"""optiml serve with --kv-vram (issue #19): a device KV cache for one of three slots, concurrent chats
through the official openai client, some of them with their attention on the CPU. The oracle is
optiml.Model.chat alone (greedy); /metrics must show the pipelined steps and the policy's decisions.
"""

import concurrent.futures

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import optiml  # noqa: E402
from conftest import live_server  # noqa: E402

QUESTIONS = ["Name three colors of the rainbow.", "What is the capital of Italy?", "Say hello in French."]


def test_chats_beyond_the_device_kv_match_chat_alone(smollm2_path):
    from optiml.server import Server

    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with optiml.Model(smollm2_path, n_ctx=256) as ref:
        want = [ref.chat(m, temperature=0, max_tokens=20) for m in msgs]
    model = optiml.Model(smollm2_path, n_ctx=256, n_seq=3, device="cpu:1", vram="2GiB", kv_vram="8MiB")
    assert model.plan.n_seq_device == 1
    with pytest.raises(ValueError, match="--kv-vram"):
        Server(optiml.Model(smollm2_path, n_ctx=64, n_seq=1), n_parallel=1, max_itl_ms=50)
    srv = Server(model, n_parallel=3, model_id="smollm2", max_itl_ms=10_000)
    with live_server(srv):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask(m):
            r = client.chat.completions.create(model="smollm2", messages=m, temperature=0, max_tokens=20)
            return r.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(ask, msgs))
        metrics = httpx.get(srv.url + "/metrics", timeout=60).text
    assert got == want
    pipelined = [line for line in metrics.splitlines() if line.startswith('optiml_offload_steps_total{mode="pipelined"}')]
    assert pipelined and float(pipelined[0].split()[-1]) > 0, metrics
    assert "optiml_offload_decisions_total" in metrics

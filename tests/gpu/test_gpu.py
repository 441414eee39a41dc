"""GPU-only checks (skipped on CPU; run on the device: `pytest tests/test_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graph_replay_capture_equals_eager(tiny_path):
    """The seed's failure: dump code ran only at graph capture. Here hooks copy into static buffers."""
    from draftsmith.capture import AuxCapture
    from draftsmith.capture.graphs import GraphedCapture
    from draftsmith.target_model import load_target

    target = load_target(tiny_path, dtype="bf16", device="cuda")
    aux = [1, 3, 4]
    g = GraphedCapture(target, aux, batch=2, seq_len=64)
    eager = AuxCapture(target, aux)
    for seed in range(4):  # several replays with new inputs: every replay must refill the buffers
        torch.manual_seed(seed)
        ids = torch.randint(2, target.vocab_size, (2, 64), device="cuda")
        a, f = g(ids)
        with torch.no_grad(), eager:
            target.decoder(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        assert torch.equal(a, eager.aux), (seed, (a.float() - eager.aux.float()).abs().max())
        assert torch.equal(f, eager.final)
        ref = target.model(ids, output_hidden_states=True).hidden_states
        H = target.hidden_size
        for s, lid in enumerate(aux):
            torch.testing.assert_close(a[..., s * H : (s + 1) * H], ref[lid + 1], rtol=0, atol=0)


def test_capture_store_with_cuda_graphs_equals_eager(tiny_path, tmp_path):
    from store_helpers import make_corpus

    from draftsmith.capture.job import CaptureConfig, run_capture
    from draftsmith.store import HiddenStateStore

    corpus = make_corpus(tmp_path)
    stores = {}
    for graphs in (False, True):
        out = tmp_path / f"g{int(graphs)}"
        run_capture(
            CaptureConfig(
                target=str(tiny_path),
                data=str(corpus),
                out=str(out),
                max_length=128,
                batch_tokens=512,
                shard_tokens=700,
                cuda_graphs=graphs,
                progress=False,
                aux_layers=[1, 3, 4],
            ),
            log=lambda *a: None,
        )
        stores[graphs] = HiddenStateStore.open(out, dtype=torch.float32)
    assert len(stores[False]) == len(stores[True])
    for i in range(len(stores[False])):
        a, b = stores[False][i], stores[True][i]
        assert torch.equal(a["input_ids"], b["input_ids"])
        # padding to graph buckets changes GEMM shapes, so bf16 results may differ in the last bit
        torch.testing.assert_close(a["aux_hidden_states"], b["aux_hidden_states"], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(a["final_hidden_states"], b["final_hidden_states"], rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "deepseek_v3"])
def test_graph_capture_other_architectures(arch):
    from draftsmith.capture import AuxCapture
    from draftsmith.capture.graphs import GraphedCapture
    from draftsmith.target_model import target_from_model
    from tests.tiny_models import ARCHS

    model = ARCHS[arch]().to("cuda")
    target = target_from_model(model)
    try:
        g = GraphedCapture(target, [1, 2, 4], batch=2, seq_len=32)
    except Exception as e:  # report which architectures cannot be graph-captured through HF code
        pytest.xfail(f"{arch}: HF forward not graph-capturable: {type(e).__name__}: {str(e)[:200]}")
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    a, _ = g(ids)
    eager = AuxCapture(target, [1, 2, 4])
    with torch.no_grad(), eager:
        target.decoder(input_ids=ids, use_cache=False)
    torch.testing.assert_close(a, eager.aux, rtol=1e-5, atol=1e-5)

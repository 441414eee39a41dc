"""`export_speculators`: a hidden-state store as speculators 0.9.0 offline training data.

The layout/value tests need `datasets` (the `speculators` extra). The interop tests read the export with
speculators' own dataset class (`speculators.train.data.ArrowDataset` + `CollateFn`), token-frequency code and
layer-id validation, and (marked slow, ~15 s) the train CLI's own steps up to the accelerator; they are skipped,
with the reason, when speculators 0.9.0 is not importable. To run them (docs/speculators-format.md):
    pip install 'draftsmith[speculators]'
    pip install --no-deps 'speculators==0.9.0' 'hs-connectors==0.9.0'
    pip install openai loguru pydantic-settings httpx
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.export.speculators_store import export_speculators, summary_lines

HAVE_DATASETS = importlib.util.find_spec("datasets") is not None and importlib.util.find_spec("pyarrow") is not None


@pytest.fixture(autouse=True)
def _needs_datasets(request):
    if not HAVE_DATASETS and request.node.originalname != "test_missing_datasets_names_the_extra":
        pytest.skip("the speculators export needs `datasets` and `pyarrow`: pip install 'draftsmith[speculators]'")


H = 8
AUX = [1, 3, 4]  # layer-output ids of a 6-layer target -> hidden_states ids [2, 4, 5]
NUM_LAYERS = 6
LENGTHS = [5, 9, 1, 13, 7]


class FakeStore:
    """The HiddenStateStore interface (len, [i], manifest, token_counts) over in-memory tensors."""

    def __init__(self, lengths=LENGTHS, aux=AUX, hidden=H, seed=0, dtype=torch.bfloat16, **manifest_extra):
        g = torch.Generator().manual_seed(seed)
        self.path = Path("fake-store")
        self.compute_dtype = dtype
        self.manifest = {
            "aux_layers": list(aux),
            "hidden_size": hidden,
            "num_samples": len(lengths),
            "has_final": True,
            "final_is_pre_norm": True,
            "final_layer": NUM_LAYERS - 1,
            "target": {"num_layers": NUM_LAYERS, "hidden_size": hidden, "vocab_size": 50},
            **manifest_extra,
        }
        self.samples = []
        for j, L in enumerate(lengths):
            mask = torch.rand(L, generator=g) > 0.4
            if j == 2:
                mask[:] = False  # a sample with no loss tokens
            self.samples.append(
                {
                    "input_ids": torch.randint(0, 50, (L,), generator=g),
                    "loss_mask": mask,
                    "aux_hidden_states": torch.randn(L, len(aux) * hidden, generator=g).to(dtype),
                    "final_hidden_states": torch.randn(L, hidden, generator=g).to(dtype),
                }
            )

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return {k: v.clone() for k, v in self.samples[i].items()}

    def token_counts(self):
        counts = torch.zeros(50, dtype=torch.long)
        for s in self.samples:
            ids = s["input_ids"][s["loss_mask"]]
            counts.index_add_(0, ids, torch.ones_like(ids))
        return counts


@pytest.fixture
def exported(tmp_path):
    store = FakeStore()
    out = tmp_path / "spec"
    summary = export_speculators(store, out, progress=False)
    return store, out, summary


def _expected_freq(store) -> dict[int, int]:
    freq: dict[int, int] = {}
    for s in store.samples:
        for t in s["input_ids"][s["loss_mask"]].tolist():
            freq[t] = freq.get(t, 0) + 1
    return freq


# -- layout, shapes, values -------------------------------------------------------------------------------
def test_layout_and_arrow_dataset(exported):
    from datasets import load_from_disk

    store, out, summary = exported
    assert not Path(str(out) + ".tmp").exists()
    names = {p.name for p in out.iterdir()}
    assert {"state.json", "dataset_info.json", "hidden_states", "token_freq.pt", "draftsmith_export.json"} <= names
    assert any(n.startswith("data-") and n.endswith(".arrow") for n in names)
    assert not any(n.startswith((".draftsmith", "_staging")) for n in names)

    state = json.loads((out / "state.json").read_text())
    assert state["_format_type"] == "torch"

    ds = load_from_disk(str(out))
    assert len(ds) == len(store)
    assert set(ds.column_names) == {"input_ids", "loss_mask", "seq_len"}
    assert str(ds.features["input_ids"].feature.dtype) == "int32"  # as speculators' prepare-data writes it
    assert str(ds.features["loss_mask"].feature.dtype) == "int64"
    assert str(ds.features["seq_len"].dtype) == "int64"
    for i, s in enumerate(store.samples):
        row = ds[i]  # torch format is on after load_from_disk
        # datasets' torch formatter hands out integer columns as int64
        assert isinstance(row["input_ids"], torch.Tensor) and row["input_ids"].dtype == torch.int64
        assert torch.equal(row["input_ids"], s["input_ids"])
        assert torch.equal(row["loss_mask"], s["loss_mask"].long())
        assert int(row["seq_len"]) == len(s["input_ids"])
    assert summary["num_samples"] == len(LENGTHS)
    assert summary["num_tokens"] == sum(LENGTHS)
    assert summary["num_loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in store.samples)
    assert summary["unsupervised_samples"] == 1
    text = "\n".join(summary_lines(summary))
    assert "--target-layer-ids 2 4 5 (hidden_states ids)" in text and "[1, 3, 4] (layer-output ids)" in text


def test_hidden_state_files(exported):
    from safetensors import safe_open

    store, out, _ = exported
    files = sorted(p.name for p in (out / "hidden_states").iterdir())
    assert files == sorted(f"hs_{i}.safetensors" for i in range(len(store)))
    k = len(AUX)
    for i, s in enumerate(store.samples):
        L = len(s["input_ids"])
        with safe_open(str(out / "hidden_states" / f"hs_{i}.safetensors"), framework="pt") as f:
            assert set(f.keys()) == {"hidden_states", "token_ids"}
            hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        assert hs.shape == (L, k + 1, H) and hs.dtype == torch.bfloat16
        assert tok.dtype == torch.int64 and torch.equal(tok, s["input_ids"])
        # slots 0..k-1: the aux layers in the store's order; slot k: the pre-norm final layer output
        for j in range(k):
            assert torch.equal(hs[:, j], s["aux_hidden_states"][:, j * H : (j + 1) * H])
        assert torch.equal(hs[:, k], s["final_hidden_states"])


def test_layer_id_conventions(exported):
    _, out, summary = exported
    info = json.loads((out / "draftsmith_export.json").read_text())
    assert info["aux_layers"] == AUX  # layer-output ids, as the store names them
    assert info["target_layer_ids"] == [i + 1 for i in AUX] == [2, 4, 5]  # hidden_states ids
    assert summary["target_layer_ids"] == [2, 4, 5]
    args = summary["speculators_train_args"]
    i = args.index("--target-layer-ids")
    assert args[i + 1 : i + 4] == ["2", "4", "5"]
    assert args[args.index("--data-path") + 1] == str(out)
    # the last (final) slot is hidden_states id N, which speculators appends itself (launch_vllm.py
    # --include-last-layer) and must NOT be passed in --target-layer-ids
    assert str(NUM_LAYERS) not in args[i + 1 : i + 4]


def test_token_freq(exported):
    store, out, summary = exported
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert isinstance(freq, dict) and all(type(k) is int and type(v) is int for k, v in freq.items())
    assert freq == _expected_freq(store)
    assert summary["token_counts_match_store"] is True


def test_fp32_store_and_dtype_override(tmp_path):
    store = FakeStore(dtype=torch.float32)
    export_speculators(store, tmp_path / "a", progress=False)
    export_speculators(store, tmp_path / "b", progress=False, dtype="bf16")
    from safetensors.torch import load_file

    a = load_file(tmp_path / "a" / "hidden_states" / "hs_3.safetensors")["hidden_states"]
    b = load_file(tmp_path / "b" / "hidden_states" / "hs_3.safetensors")["hidden_states"]
    assert a.dtype == torch.float32 and torch.equal(a[:, -1], store.samples[3]["final_hidden_states"])
    assert b.dtype == torch.bfloat16 and torch.equal(b, a.to(torch.bfloat16))


# -- refusals and atomicity ---------------------------------------------------------------------------------
def test_refuses_non_empty_out(tmp_path):
    out = tmp_path / "spec"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(DraftsmithError, match="not empty"):
        export_speculators(FakeStore(), out, progress=False)
    assert (out / "x").read_text() == "keep me"
    assert not Path(str(out) + ".tmp").exists()


def test_empty_existing_out_is_fine(tmp_path):
    out = tmp_path / "spec"
    out.mkdir()
    export_speculators(FakeStore(), out, progress=False)
    assert (out / "state.json").is_file()


def test_stale_tmp(tmp_path):
    out = tmp_path / "spec"
    tmp = Path(str(out) + ".tmp")
    tmp.mkdir()
    (tmp / "foreign").write_text("not ours")
    with pytest.raises(DraftsmithError, match="not left by a draftsmith export"):
        export_speculators(FakeStore(), out, progress=False)
    (tmp / "foreign").unlink()
    (tmp / ".draftsmith-export-incomplete").write_text("")  # an interrupted export of ours
    export_speculators(FakeStore(), out, progress=False)
    assert not tmp.exists() and (out / "state.json").is_file()


def test_failure_leaves_nothing(tmp_path):
    class Broken(FakeStore):
        def __getitem__(self, i):
            if i == 3:
                raise RuntimeError("disk on fire")
            return super().__getitem__(i)

    out = tmp_path / "spec"
    with pytest.raises(RuntimeError, match="disk on fire"):
        export_speculators(Broken(), out, progress=False)
    assert not out.exists() and not Path(str(out) + ".tmp").exists()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"aux": [1, 1, 4]}, "repeats a layer"),
        ({"has_final": False}, "no final_hidden_states"),
        ({"final_is_pre_norm": False}, "after the final norm"),
        ({"aux": [1, 3, 6]}, "out of range"),
    ],
)
def test_refuses_what_speculators_cannot_train(tmp_path, kwargs, match):
    aux = kwargs.pop("aux", AUX)
    store = FakeStore(aux=aux, **kwargs)
    with pytest.raises(DraftsmithError, match=match):
        export_speculators(store, tmp_path / "spec", progress=False)
    assert not (tmp_path / "spec").exists()


def test_shape_mismatch_is_a_clear_error(tmp_path):
    store = FakeStore()
    store.samples[1]["final_hidden_states"] = store.samples[1]["final_hidden_states"][:-1]
    with pytest.raises(DraftsmithError, match="store sample 1: final_hidden_states shape"):
        export_speculators(store, tmp_path / "spec", progress=False)


def test_missing_datasets_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DraftsmithError, match=r"pip install 'draftsmith\[speculators\]'"):
        export_speculators(FakeStore(), tmp_path / "spec", progress=False)
    assert not (tmp_path / "spec").exists() and not (tmp_path / "spec.tmp").exists()


# -- a real draftsmith store (hand-written in the store's on-disk format) ----------------------------------------
def _write_real_store(path: Path, dtype: str) -> None:
    """A tiny store in draftsmith's format (draftsmith/store/format.py), two shards, bf16 or fp8."""
    from safetensors.torch import save_file

    from draftsmith.common.io import sha256_file
    from draftsmith.store import format as fmt

    g = torch.Generator().manual_seed(1)
    k = len(AUX)
    lengths = [4, 6, 3, 8]
    samples = []
    for L in lengths:
        ids = torch.randint(0, 50, (L,), generator=g)
        mask = np.zeros(L, dtype=bool)
        mask[L // 2 :] = True
        samples.append((ids, mask, torch.randn(L, k * H, generator=g), torch.randn(L, H, generator=g)))
    (path / fmt.SHARD_DIR).mkdir(parents=True)
    shards = []
    for si, (first, n) in enumerate([(0, 2), (2, 2)]):
        part = samples[first : first + n]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(s[0]) for s in part], out=offsets[1:])
        spans = [fmt.mask_to_spans(s[1]) for s in part]
        span_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(s) for s in spans], out=span_offsets[1:])
        aux = torch.cat([s[2] for s in part])
        final = torch.cat([s[3] for s in part])
        t = {
            "input_ids": torch.cat([s[0] for s in part]).to(torch.int32),
            "sample_offsets": torch.from_numpy(offsets),
            "sample_index": torch.arange(first, first + n),
            "loss_spans": torch.from_numpy(np.concatenate(spans).reshape(-1, 2).astype(np.int32)),
            "span_offsets": torch.from_numpy(span_offsets),
        }
        if dtype == "fp8":
            t["aux_hidden_states"], t["aux_scale"] = fmt.quantize_fp8_rows(aux, H)
            t["final_hidden_states"], fs = fmt.quantize_fp8_rows(final, H)
            t["final_scale"] = fs.reshape(-1)
        else:
            t["aux_hidden_states"], t["final_hidden_states"] = aux.bfloat16(), final.bfloat16()
        save_file({a: b.contiguous() for a, b in t.items()}, str(path / fmt.shard_name(si)))
        f = path / fmt.shard_name(si)  # the manifest's schema (draftsmith/store/manifest.py) wants size and sha256
        shards.append(
            {
                "file": fmt.shard_name(si),
                "first_sample": first,
                "num_samples": n,
                "num_tokens": int(offsets[-1]),
                "bytes": f.stat().st_size,
                "sha256": sha256_file(f),
            }
        )
    counts = torch.zeros(50, dtype=torch.int64)
    for ids, mask, _, _ in samples:
        m = ids[torch.from_numpy(mask)]
        counts.index_add_(0, m, torch.ones_like(m))
    save_file({"token_counts": counts}, str(path / fmt.TOKEN_COUNTS))
    manifest = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "target": {"num_layers": NUM_LAYERS, "hidden_size": H, "vocab_size": 50},
        "aux_layers": AUX,
        "has_final": True,
        "final_layer": NUM_LAYERS - 1,
        "final_is_pre_norm": True,
        "hidden_size": H,
        "vocab_size": 50,
        "dtype": dtype,
        "num_samples": len(lengths),
        "num_tokens": sum(lengths),
        "shards": shards,
    }
    (path / fmt.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_real_store_round_trip(tmp_path, dtype):
    from safetensors.torch import load_file

    from draftsmith.store import HiddenStateStore

    _write_real_store(tmp_path / "store", dtype)
    store = HiddenStateStore.open(tmp_path / "store")
    summary = export_speculators(store, tmp_path / "spec", progress=False)
    assert summary["target_layer_ids"] == [2, 4, 5] and summary["token_counts_match_store"] is True
    for i in range(len(store)):
        s = store[i]
        f = load_file(tmp_path / "spec" / "hidden_states" / f"hs_{i}.safetensors")
        assert torch.equal(f["token_ids"], s["input_ids"])
        assert torch.equal(f["hidden_states"][:, :-1].flatten(1), s["aux_hidden_states"])  # dequantized, bf16
        assert torch.equal(f["hidden_states"][:, -1], s["final_hidden_states"])


# -- interop: speculators 0.9.0 reads the export ---------------------------------------------------------------
def _speculators_data():
    try:
        import speculators
        from speculators.train import data as spec_data
    except ImportError as e:
        pytest.skip(
            f"speculators 0.9.0 is not importable ({e}); to run: pip install --no-deps 'speculators==0.9.0' "
            "'hs-connectors==0.9.0' && pip install openai loguru pydantic-settings httpx"
        )
    version = getattr(speculators, "__version__", None)
    if version is None:
        from importlib.metadata import version as _v

        version = _v("speculators")
    if not str(version).startswith("0.9."):
        pytest.skip(f"interop is pinned to speculators 0.9.x, found {version}")
    return spec_data


def test_speculators_arrow_dataset_reads_export(exported):
    spec_data = _speculators_data()
    store, out, _ = exported
    k = len(AUX)
    ds = spec_data.ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")
    assert len(ds) == len(store)
    assert ds.approx_lengths == LENGTHS
    for i, s in enumerate(store.samples):
        item = ds[i]
        assert isinstance(item, dict), f"sample {i} unavailable: {item}"
        L = len(s["input_ids"])
        assert torch.equal(item["input_ids"], s["input_ids"])
        assert torch.equal(item["hidden_states"], s["aux_hidden_states"])  # [L, k*H], aux order kept
        assert item["hidden_states"].shape == (L, k * H)
        assert torch.equal(item["verifier_last_hidden_states"], s["final_hidden_states"])
        assert torch.equal(item["loss_mask"].bool(), s["loss_mask"])
        assert torch.equal(item["lengths"], torch.tensor([L]))
        assert torch.equal(item["position_ids"], torch.arange(L))

    # speculators' packing collator: all samples in one row of max_len, document ids per sample
    total = sum(LENGTHS)
    collate = spec_data.CollateFn(max_len=total + 3, hidden_size=H, num_target_layers=k)
    batch = collate([ds[i] for i in range(len(ds))])
    assert batch["hidden_states"].shape == (1, total + 3, k * H)
    assert batch["verifier_last_hidden_states"].shape == (1, total + 3, H)
    assert torch.equal(batch["input_ids"][0, :total], torch.cat([s["input_ids"] for s in store.samples]))
    assert torch.equal(
        batch["hidden_states"][0, :total], torch.cat([s["aux_hidden_states"] for s in store.samples]).bfloat16()
    )
    assert batch["error_records"] == 0
    doc = batch["document_ids"][0]
    assert doc[:total].tolist() == [j for j, L in enumerate(LENGTHS) for _ in range(L)]
    assert doc[total:].tolist() == [-1] * 3


def test_speculators_train_val_split_maps_to_the_right_files(exported):
    spec_data = _speculators_data()
    store, out, _ = exported
    val = spec_data.ArrowDataset(max_len=64, datapath=str(out), on_missing="raise", train_ratio=0.6, split="val")
    start = int(len(store) * 0.6)
    assert len(val) == len(store) - start
    for j in range(len(val)):
        item = val[j]
        assert isinstance(item, dict)
        assert torch.equal(item["verifier_last_hidden_states"], store.samples[start + j]["final_hidden_states"])


def test_speculators_token_freq_and_vocab_mapping(exported, tmp_path):
    _speculators_data()
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    store, out, _ = exported
    ours = torch.load(out / "token_freq.pt", weights_only=True)  # what speculators' train CLI does
    theirs_path = tmp_path / "theirs.pt"
    save_token_frequency_distribution(load_from_disk(str(out)), theirs_path)
    assert torch.load(theirs_path, weights_only=True) == ours
    d2t, t2d = build_vocab_mappings_from_distribution(ours, draft_vocab_size=16, target_vocab_size=50)
    assert d2t.shape == (16,) and int(t2d.sum()) == 16


def test_speculators_accepts_the_target_layer_ids(exported, tmp_path):
    _speculators_data()
    from speculators.models.utils import resolve_target_layer_ids
    from transformers import LlamaConfig

    _, _, summary = exported
    cfg_dir = tmp_path / "verifier"
    LlamaConfig(
        num_hidden_layers=NUM_LAYERS, hidden_size=H, intermediate_size=16, num_attention_heads=2, vocab_size=50
    ).save_pretrained(cfg_dir)
    ids = summary["target_layer_ids"]
    assert resolve_target_layer_ids(ids, str(cfg_dir)) == ids
    # and the store's layer-output ids would silently name other tensors: same count, shifted by one
    assert [i - 1 for i in ids] == AUX


def test_speculators_prepare_data_makes_the_same_features(exported):
    """speculators' own pass-through of pre-tokenized rows yields the schema and format we wrote."""
    _speculators_data()
    from datasets import Dataset, load_from_disk

    try:
        from speculators.data_generation.preprocessing import _passthrough_pretokenized
    except ImportError as e:
        pytest.skip(f"speculators' prepare-data module is not importable ({e}); pip install httpx")

    store, out, _ = exported
    raw = Dataset.from_dict(
        {
            "input_ids": [s["input_ids"].tolist() for s in store.samples],
            "loss_mask": [s["loss_mask"].long().tolist() for s in store.samples],
        }
    )
    theirs = raw.map(lambda ex: _passthrough_pretokenized(ex, 1 << 20), batched=True, remove_columns=raw.column_names)
    theirs.set_format(type="torch")
    ours = load_from_disk(str(out))
    assert theirs.features == ours.features
    assert theirs.format["type"] == ours.format["type"] == "torch"
    # speculators drops rows with no loss tokens at prepare time; the export keeps every store row
    # (so row i == store sample i) and reports them
    assert len(theirs) == len(ours) - 1


# -- a real capture of the bundled tiny target, end to end -----------------------------------------------------
TINY = Path(__file__).resolve().parents[3] / "assets" / "pycode-tiny"


@pytest.fixture(scope="module")
def real_export(tmp_path_factory):
    """`draftsmith capture` of assets/pycode-tiny (6 layers, H=192) with aux layers [1, 3, 4], then the export."""
    if not TINY.is_dir():
        pytest.skip(f"{TINY} not present")
    if not HAVE_DATASETS:
        pytest.skip("needs `datasets`: pip install 'draftsmith[speculators]'")
    from draftsmith.capture.job import CaptureConfig, run_capture

    root = tmp_path_factory.mktemp("real")
    data = root / "corpus"
    data.mkdir()
    for i in range(3):
        body = "".join(f"def f_{i}_{j}(x, y={j}):\n    return x * {j} + y - {i}\n\n" for j in range(2 + 3 * i))
        (data / f"mod_{i}.py").write_text("import os\n\n" + body)
    cfg = CaptureConfig(
        target=str(TINY), data=str(data), out=str(root / "store"), aux_layers=[1, 3, 4], max_length=96,
        batch_tokens=512, progress=False, model_dtype="fp32",
    )  # fmt: skip
    run_capture(cfg, log=lambda *a: None)
    summary = export_speculators(root / "store", root / "spec", progress=False)
    return root / "store", root / "spec", summary


def test_real_capture_slots_are_the_named_hidden_states(real_export):
    """Each exported slot j is HF output_hidden_states[target_layer_ids[j]] of the real model, and the last slot
    is the pre-norm final layer output (final norm + lm_head reproduce the logits) — read back with speculators'
    ArrowDataset when it is installed."""
    from safetensors.torch import load_file

    from draftsmith.target_model import load_target

    store_path, out, summary = real_export
    assert summary["aux_layers"] == [1, 3, 4] and summary["target_layer_ids"] == [2, 4, 5]
    assert summary["token_counts_match_store"] is True
    try:
        reader = _speculators_data().ArrowDataset(max_len=1 << 16, datapath=str(out), on_missing="raise")
    except pytest.skip.Exception:
        reader = None
    target = load_target(TINY, dtype="fp32")
    H, k = target.hidden_size, 3
    for i in range(summary["num_samples"]):
        if reader is not None:
            item = reader[i]
            aux, last, ids = item["hidden_states"], item["verifier_last_hidden_states"], item["input_ids"]
        else:
            f = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
            aux, last, ids = f["hidden_states"][:, :-1].flatten(1), f["hidden_states"][:, -1], f["token_ids"]
        with torch.no_grad():
            ref = target.model(ids[None], output_hidden_states=True)
            for slot, hs_id in enumerate(summary["target_layer_ids"]):
                want = ref.hidden_states[hs_id][0].to(torch.bfloat16).float()
                torch.testing.assert_close(aux[:, slot * H : (slot + 1) * H].float(), want, rtol=2e-2, atol=2e-2)
            logits = target.lm_head(target.final_norm(last.float()))
        torch.testing.assert_close(logits, ref.logits[0], rtol=5e-2, atol=5e-2)
        assert aux.shape == (len(ids), k * H)


@pytest.mark.slow
def test_speculators_trainer_pipeline_runs_on_the_export(real_export, tmp_path, monkeypatch):
    """The train CLI's own steps (config resolution, vocab mapping from token_freq.pt, draft model with the real
    verifier's frozen norm and lm_head, packed data loaders, eagle3 forward + loss) on a real export, on CPU —
    everything `speculators train` does before it moves the model to an accelerator."""
    _speculators_data()
    import argparse

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    try:
        from hs_connectors import HiddenStatesBackend
        from speculators.model import SpeculatorModel
        from speculators.models.eagle3.data import shift_batch
        from speculators.train import cli as spec_cli
        from speculators.train.config import TrainConfig
        from speculators.train.dataloader import create_train_val_loaders
    except ImportError as e:
        pytest.skip(f"speculators' trainer is not importable ({e})")
    from draftsmith.target_model import load_target

    _, src, summary = real_export
    data = tmp_path / "data"
    shutil.copytree(src, data)  # speculators writes d2t/t2d caches into the data dir
    argv = [
        "--verifier-name-or-path", str(TINY), "--speculator-type", "eagle3",
        *summary["speculators_train_args"], "--data-path", str(data),
        "--hidden-states-dtype", "float32", "--draft-vocab-size", "64", "--total-seq-len", "256",
        "--num-workers", "0", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--save-path", str(tmp_path / "save"), "--logger", "",
    ]  # fmt: skip
    args = argparse.Namespace(**TrainConfig.resolve(argv).flatten())
    assert args.target_layer_ids == [2, 4, 5] and args.on_missing == "raise" and args.data_path == str(data)
    d2t, t2d, vocab = spec_cli.parse_vocab_mappings(args)  # reads token_freq.pt with weights_only=True
    assert vocab == 64 and (data / "d2t-64.npy").is_file()
    model_class = SpeculatorModel.registry["eagle3"]
    model = spec_cli.build_draft_model(args, model_class, t2d, d2t, vocab)
    assert model.target_layer_ids == [2, 4, 5]

    # speculators' teacher on the exported last slot == the real model's logits on the draft vocab
    ds = spec_data_module().ArrowDataset(max_len=256, datapath=str(data), on_missing="raise")
    target = load_target(TINY, dtype="fp32")
    draft_ids = torch.arange(vocab) + d2t
    item = ds[0]
    with torch.no_grad():
        teacher = model.verifier_lm_head(model.verifier_norm(item["verifier_last_hidden_states"].float()))
        ref = target.model(item["input_ids"][None]).logits[0][:, draft_ids]
    torch.testing.assert_close(teacher, ref, rtol=5e-2, atol=5e-2)

    H = target.hidden_size
    train_loader, _ = create_train_val_loaders(
        data_path=args.data_path, total_seq_len=256, hidden_states_dtype=torch.float32,
        transfer=HiddenStatesBackend.registry["file"].from_train_args(args, args.data_path),
        vllm_endpoint=args.vllm_endpoint, on_missing="raise", verifier_name_or_path=str(TINY),
        request_timeout=1, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=H, num_target_layers=3, num_workers=0, prefetch_factor=None, preprocess=shift_batch,
        train_data_ratio=args.train_data_ratio,
    )  # fmt: skip
    batch = next(iter(train_loader))
    assert batch["error_records"] == 0
    assert batch["hidden_states"].shape == (1, 256, 3 * H)
    assert batch["verifier_last_hidden_states"].shape == (1, 256, H)
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    _, loss, metrics = model(**{k: v for k, v in batch.items() if torch.is_tensor(v)}, **train_kwargs)
    assert torch.isfinite(loss) and loss.item() > 0
    assert metrics["full_acc_0_total"] > 0


def spec_data_module():
    from speculators.train import data

    return data

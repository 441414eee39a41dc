"""Shared fixtures: the bundled demo target and tiny random models of other architectures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Test helpers (tiny_models, decode_helpers) live beside this file, outside the package; tests in the tiers below
# import them by module name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Without a GPU, triton (if installed) can only run kernels in its interpreter, and that mode must be on before
# triton is first imported (transformers imports it early): tests/unit/decode/test_decode_kernels*.py relies on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "assets" / "pycode-tiny"
SHARED_TARGETS = REPO.parent / "shared" / "targets"


def _small_path() -> Path | None:
    p = SHARED_TARGETS / "pycode-small"
    return p if p.is_dir() else None


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return TINY


@pytest.fixture(scope="session")
def small_path() -> Path:
    p = _small_path()
    if p is None:
        pytest.skip("../shared/targets/pycode-small not present")
    return p


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Run a test with one intra-op thread (small decode steps are slower with two on 2 shared cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The fast tier (`bash scripts/test.sh --fast`, i.e. `pytest -m fast`): one or two representative tests per package,
# the golden-numerics ones (each against an independent reference) first, in <= 3 minutes on 2 cores. Entries are
# node ids: a whole file, a test (every parameter) or one parameter. Keep it to what a package cannot do without.
FAST = [
    # common: the schema (flags/YAML/checks), atomic writes, torch-free --help
    "tests/unit/common/test_schema.py::test_yaml_nested_flat_and_flags_give_one_config",
    "tests/unit/common/test_schema.py::test_python_api_checks_the_same_bounds",
    "tests/unit/common/test_io_atomic.py::test_enospc_is_one_line_and_nothing_is_renamed",
    "tests/unit/common/test_cli_startup.py::test_help_does_not_import_torch",
    # data: assistant-only loss masks from a real chat template
    "tests/unit/data/test_data.py::test_llama3_mask",
    "tests/unit/data/test_data.py::test_text_records_full_mask_and_bos",
    # target model + capture hooks: hooks == HF output_hidden_states; the layer-id conventions
    "tests/unit/target_model/test_target.py::test_capture_matches_output_hidden_states[llama]",
    "tests/unit/target_model/test_target.py::test_default_layers_match_peers",
    "tests/unit/target_model/test_target.py::test_layer_validation_errors",
    # store: a captured store == output_hidden_states; fp8 rows
    "tests/unit/store/test_store.py::test_store_matches_output_hidden_states",
    "tests/unit/store/test_store.py::test_fp8_roundtrip_unit",
    "tests/unit/store/test_store_integrity.py::test_a_corrupted_shard_is_named_on_first_read",
    # drafter: the forward against an independent reference
    "tests/unit/drafter/test_drafter.py::test_matches_independent_reference_with_hf_rope",
    "tests/unit/drafter/test_drafter.py::test_save_load_round_trip",
    # train: TTT loss and grads against the naive reference, the fused CE
    "tests/unit/train/test_train_ttt.py::test_unroll_loss_and_grads_match_naive[2]",
    "tests/unit/train/test_train_ttt.py::test_fused_soft_ce_matches_log_softmax",
    "tests/unit/train/test_train_loop.py::test_padding_is_not_trained",
    # decode: greedy == plain greedy, exact acceptance rule, own forward == HF, sync-free rounds, the CLI schema
    "tests/unit/decode/test_decode_greedy.py::test_greedy_equal_random_drafter_pycode[tree]",
    "tests/unit/decode/test_decode_sampling.py::test_chain_accept_rule_is_exact",
    "tests/unit/decode/test_decode_forward.py::test_own_forward_matches_hf[qwen3]",
    "tests/unit/decode/test_decode_syncfree.py::test_round_has_no_host_sync[tree-top_p_k]",
    "tests/unit/decode/test_decode_config.py::test_commands_share_engine_and_mode_flags",
    "tests/unit/decode/test_decode_config.py::test_bad_value_is_one_line_naming_the_flag",
    # export: every layout reloads to identical logits; the store export's layer ids
    "tests/unit/export/test_export.py::test_round_trip_identical_logits[vllm-variant1]",
    "tests/unit/export/test_store_export.py::test_layer_id_conventions",
    # doctor: simulated chain drafts == a from-scratch reference; a clean drafter passes
    "tests/unit/doctor/test_checks.py::test_chain_drafts_equal_a_from_scratch_reference[2]",
    "tests/unit/doctor/test_checks.py::test_clean_native_drafter_passes_every_check",
    # regenerate: answers are the target's greedy continuation
    "tests/unit/regenerate/test_regenerate.py::test_answers_are_the_targets_greedy_continuation",
    # serve: flags shared with generate; recorded rows == a prefill capture
    "tests/unit/serve/test_serve_cli.py",
    "tests/unit/serve/test_served_capture.py::test_buffer_rows_equal_a_prefill_capture[chain]",
    # integration: the CLI contract flags, generate == plain greedy end to end, pipeline config checks
    "tests/integration/test_cli.py::test_contract_flags",
    "tests/integration/test_serve_queue.py::test_contract_flags",
    "tests/integration/test_decode_cli.py::test_generate_json_matches_plain_greedy[chain]",
    "tests/integration/test_pipeline.py::test_bad_config_fails_before_any_work",
]


def _fast_entry(nodeid: str) -> str | None:
    """The FAST entry selecting `nodeid` (the file, the test or the parametrized test), or None."""
    for entry in FAST:
        if nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "["):
            return entry
    return None


def _fast_only(config) -> bool:
    """-m selects only fast tests ("fast", "fast and not gpu"; not "not fast" or "fast or slow")."""
    expr = f" {config.getoption('markexpr') or ''} "
    return " fast " in expr.replace("(", " ").replace(")", " ") and " not fast " not in expr and " or " not in expr


def pytest_ignore_collect(collection_path, config):
    # -m fast: do not even import the other test files (collecting the whole tree costs ~30 s on 2 cores)
    if _fast_only(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        rel = collection_path.resolve().relative_to(REPO).as_posix()
        return rel not in {e.split("::")[0] for e in FAST} or None
    return None


def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        entry = _fast_entry(item.nodeid)
        if entry is not None:
            item.add_marker(pytest.mark.fast)
            used.add(entry)
    if _fast_only(config):
        # an entry whose file was collected but that selects nothing was renamed: say so instead of shrinking the tier
        files = {item.nodeid.split("::")[0] for item in items}
        stale = [e for e in FAST if e not in used and e.split("::")[0] in files]
        if stale:
            raise pytest.UsageError(f"tests/conftest.py FAST: no such test {stale}")


def pytest_configure(config):
    # one intra-op thread per pytest-xdist worker (scripts/test.sh runs two), two in a single process
    threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
    torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))

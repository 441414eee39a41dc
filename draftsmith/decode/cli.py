"""`draftsmith generate` and `draftsmith eval` (speculative decoding with an EAGLE-3 drafter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.schema import AT_LEAST_ONE, check_value
from draftsmith.decode.config import EVAL_SKIP, EngineConfig, EvalSamplingConfig, ModeConfig, SamplingConfig, settings
from draftsmith.decode.setup import (
    cluster_gemm_setting,
    decode_mode,
    engine_from,
    max_positions,
    mode_from,
    models_from,
)


def _check_tune_flags(
    tune: bool, tuning: Optional[str], tune_prompts: Optional[str], save_tuning: Optional[str], plain: bool = False
) -> None:
    if tune and tuning:
        raise DraftsmithError("--tune and --tuning FILE: give one (measure now, or reuse a saved choice)")
    if (tune_prompts or save_tuning) and not tune:
        raise DraftsmithError(f"{'--tune-prompts' if tune_prompts else '--save-tuning'} needs --tune")
    if plain and (tune or tuning):
        raise DraftsmithError("--plain with --tune/--tuning: plain decoding has nothing to tune")


_CHAT_HELP = "Prompt format. " + (
    "Default: the tokenizer's chat template when it has one (one user message + generation prompt), else the text as "
    "is; --chat requires the template; --raw always takes the text as is. The same rule for generate and eval."
)
_TUNE_HELP = (
    "Pick the mode by measurement: a short calibration (greedy, <= 64 new tokens) times plain decoding and a "
    "handful of chain/tree shapes on this engine; settings within 10 % of each other (or of plain) are timed "
    "again with up to 4x the tokens, and the fastest is used, or plain decoding when none beats it (and says "
    "so). Overrides --draft-tokens/--tree."
)
_TUNE_PROMPTS_HELP = "Calibration prompts for --tune (any --prompts format; first 4 used). Default: the prompt(s)."
_SAVE_TUNING_HELP = "Write the --tune choice and its measurements to FILE (JSON), for --tuning FILE later."
_TUNING_HELP = "Use the mode saved by --save-tuning FILE (no calibration)."


def _tuning_need() -> int:
    from draftsmith.decode.tuning import DEFAULT_CANDIDATES

    return max(m.cache_need for m in DEFAULT_CANDIDATES)


def _run_tune(eng, prompts, max_new_tokens: int, save_tuning: Optional[str], context: dict):
    from draftsmith.decode.tuning import CALIBRATION_PROMPTS, CALIBRATION_TOKENS, FINAL_TOKENS_FACTOR, describe, tune

    def show(row):
        from draftsmith.decode.engine import DecodeMode

        m = DecodeMode(**row["mode"])
        rt = "" if row["round_ms"] is None else f", {row['round_ms']:.2f} ms/round"
        stage = "final (longer)" if row.get("stage") == 2 else "calibrate"
        typer.secho(f"  {stage} {describe(m)}: {row['tok_s']:.1f} tok/s, tau {row['tau']:.2f}{rt}", err=True)

    try:
        n = min(max_new_tokens, CALIBRATION_TOKENS)
        # the close settings' second measurement: as many tokens as the engine's cache was sized for, at most 4x
        final = min(max_new_tokens, FINAL_TOKENS_FACTOR * CALIBRATION_TOKENS)
        res = tune(eng, prompts[:CALIBRATION_PROMPTS], n, progress=show, final_tokens=final)
    except ValueError as e:
        raise DraftsmithError(f"--tune: {e}") from None
    typer.secho(res.summary(), err=True, fg=typer.colors.CYAN)
    if save_tuning:
        res.save(save_tuning, **context)
        typer.secho(f"wrote {save_tuning}", err=True)
    return res


def _tuning_context(target, drafter, eng) -> dict:
    return {
        "target": target,
        "drafter": drafter,
        "device": str(eng.device),
        "dtype": str(eng.dtype),
        "kernels": getattr(eng.runner, "kernels", "torch"),
        "kernel_rows": int(getattr(eng.runner, "triton_max_rows", 1)),
        "cluster_gemm": cluster_gemm_setting(eng),
        "compiled": bool(getattr(eng, "_compiled", False)),
    }


def _load_tuning(path: str, drafter):
    from draftsmith.decode.tuning import Tuning

    t = Tuning.load(path)
    if t.mode.kind != "plain" and drafter is None:
        raise DraftsmithError(f"{path}: the saved mode is {t.mode.kind} decoding, which needs --drafter")
    return t


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    app.command("eval")(eval_cmd)


# The engine, decode-mode and sampling options come from the schemas in draftsmith/decode/config.py (shared with
# `draftsmith serve`); the options below are the command's own.
@settings(engine=EngineConfig, mode=ModeConfig, sampling=SamplingConfig)
def generate(
    target: str = typer.Option(..., "--target", help="HF target model directory."),
    prompt: str = typer.Option(..., "--prompt", help="Prompt text (see --chat/--raw)."),
    drafter: Optional[str] = typer.Option(
        None, "--drafter", help="EAGLE-3 drafter (draftsmith/SGLang/EAGLE layout). Without it: plain decoding."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text, token_ids, tau, timing)."),
    tune: bool = typer.Option(False, "--tune", help=_TUNE_HELP),
    tune_prompts: Optional[str] = typer.Option(None, "--tune-prompts", help=_TUNE_PROMPTS_HELP),
    save_tuning: Optional[str] = typer.Option(None, "--save-tuning", help=_SAVE_TUNING_HELP),
    tuning: Optional[str] = typer.Option(None, "--tuning", help=_TUNING_HELP),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--raw", help=_CHAT_HELP),
    *,
    engine: EngineConfig,
    mode: ModeConfig,
    sampling: SamplingConfig,
) -> None:
    """Generate from a prompt with speculative decoding (greedy output == plain greedy decoding)."""
    from draftsmith.decode.evaluate import load_prompt_ids, read_prompts_text, use_chat_template
    from draftsmith.decode.sampling import SamplingParams

    mode_from(mode)
    _check_tune_flags(tune, tuning, tune_prompts, save_tuning, mode.plain)
    if prompt == "":
        raise DraftsmithError("--prompt: empty (give the text to continue)")
    saved = _load_tuning(tuning, drafter) if tuning else None
    if tune_prompts:
        read_prompts_text(tune_prompts)
    t, d = models_from(target, drafter, engine)
    tok = t.tokenizer
    if use_chat_template(tok, chat):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tok(prompt)["input_ids"]
    if not ids:
        raise DraftsmithError("--prompt: the tokenizer gives no tokens for it")
    dm = saved.mode if saved is not None else mode_from(mode, d)
    cal = [ids]
    if tune and tune_prompts:
        cal = load_prompt_ids(tune_prompts, tok, raw=not use_chat_template(tok, chat), limit=4)
        if not cal:
            raise DraftsmithError(f"{tune_prompts}: no prompts")
    max_new_tokens = sampling.max_new_tokens
    need = max(dm.cache_need, _tuning_need() if tune and d is not None else 0) + 2
    cap = max_positions(t)
    longest = max(len(p) for p in cal + [ids])
    max_len = min(cap, longest + max(max_new_tokens, 1) + need)
    if len(ids) + 2 > max_len:
        raise DraftsmithError(f"--prompt: {len(ids)} tokens do not fit the target's context ({max_len})")
    eng = engine_from(t, d, max_len, engine, modes=(dm,))
    if tune:
        if d is None:
            typer.secho("tuned: plain decoding (no --drafter)", err=True, fg=typer.colors.CYAN)
            dm = decode_mode(True, False, 0, 0, 0, 0)
        else:
            dm = _run_tune(eng, cal, max_new_tokens, save_tuning, _tuning_context(target, drafter, eng)).mode
    elif saved is not None:
        typer.secho(f"using {tuning}: {saved.summary()}", err=True, fg=typer.colors.CYAN)
    sp = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    eng.warmup(dm, sp)
    res = eng.generate(ids, max_new_tokens, sampling=sp, mode=dm, seed=sampling.seed, stop_strings=stop)
    if json_out:
        obj = res.to_json()
        obj["mode"] = dm.kind
        obj["decode_mode"] = dm.__dict__
        obj["backend"] = eng.backend
        obj["cuda_graphs"] = eng.cuda_graphs
        sys.stdout.write(json.dumps(obj) + "\n")
    else:
        typer.echo(res.text)
        typer.secho(
            f"[{len(res.token_ids)} tokens, {dm.kind}, tau={res.tau:.2f}, "
            f"{res.tokens_per_s:.1f} tok/s, finish={res.finish_reason}]",
            err=True,
            fg=typer.colors.CYAN,
        )


@settings(engine=EngineConfig, mode=(ModeConfig, ("plain",)), sampling=(EvalSamplingConfig, EVAL_SKIP))
def eval_cmd(
    target: str = typer.Option(..., "--target", help="HF target model directory."),
    drafter: str = typer.Option(..., "--drafter", help="EAGLE-3 drafter to evaluate."),
    prompts: str = typer.Option(
        ...,
        "--prompts",
        help="JSONL with turns (EAGLE questions) / text / messages / "
        "conversations / prompt records, or a text file with one prompt per line.",
    ),
    chat: Optional[bool] = typer.Option(None, "--chat/--raw", help=_CHAT_HELP),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N prompts (>= 1)."),
    tune: bool = typer.Option(
        False,
        "--tune",
        help=_TUNE_HELP.replace(
            "Overrides --draft-tokens/--tree.", "Reported next to the fixed mode (eval.json 'tuned')."
        ),
    ),
    tune_prompts: Optional[str] = typer.Option(None, "--tune-prompts", help=_TUNE_PROMPTS_HELP),
    save_tuning: Optional[str] = typer.Option(None, "--save-tuning", help=_SAVE_TUNING_HELP),
    tuning: Optional[str] = typer.Option(
        None,
        "--tuning",
        help="Evaluate the mode saved by --save-tuning FILE next to the fixed one (eval.json 'tuned').",
    ),
    out: Path = typer.Option(Path("eval_out"), "--out", help="Directory for eval.json and PNG plots."),
    json_out: bool = typer.Option(False, "--json", help="Also print the report JSON to stdout."),
    passes: int = typer.Option(
        1,
        "--passes",
        help="Time the prompts N times (plain and speculative back to back per prompt each time); the speedup is "
        "the median of the passes (eval.json 'speedup_passes' lists them). Worth 3-5 on a shared or noisy machine.",
    ),
    *,
    engine: EngineConfig,
    mode: ModeConfig,
    sampling: EvalSamplingConfig,
) -> None:
    """Measure a drafter: τ, acceptance rate, per-position acceptance, speedup vs plain (T=0 and T>0)."""
    from draftsmith.common.io import atomic_write_json
    from draftsmith.decode.evaluate import (
        load_prompt_ids,
        print_table,
        read_prompts_text,
        run_eval,
        tuned_entry,
        use_chat_template,
        write_plots,
    )

    temps = sampling.temps
    dm = mode_from(mode)
    check_value("--limit", limit, (AT_LEAST_ONE,))
    check_value("--passes", passes, (AT_LEAST_ONE,))
    _check_tune_flags(tune, tuning, tune_prompts, save_tuning)
    if out.exists() and not out.is_dir():
        raise DraftsmithError(f"--out {out}: is a file, not a directory")
    saved = _load_tuning(tuning, drafter) if tuning else None
    for f in (prompts, tune_prompts):
        if f:
            read_prompts_text(f)  # a missing or binary file: one line, before the models load
    t, d = models_from(target, drafter, engine)
    templated = use_chat_template(t.tokenizer, chat)
    ids = load_prompt_ids(prompts, t.tokenizer, raw=not templated, limit=limit)
    if not ids:
        raise DraftsmithError(f"{prompts}: no prompts")
    cal = load_prompt_ids(tune_prompts, t.tokenizer, raw=not templated, limit=4) if tune_prompts else ids
    cap = max_positions(t)
    max_new_tokens, seed, top_p, top_k = sampling.max_new_tokens, sampling.seed, sampling.top_p, sampling.top_k
    need = max_new_tokens + max(dm.cache_need, saved.mode.cache_need if saved else 0, _tuning_need() if tune else 0) + 2
    kept = [p for p in ids if len(p) + need <= cap]
    if len(kept) < len(ids):
        typer.secho(
            f"skipping {len(ids) - len(kept)} prompts longer than {cap - need} tokens",
            err=True,
            fg=typer.colors.YELLOW,
        )
    if not kept:
        raise DraftsmithError(f"{prompts}: every prompt is longer than the target context allows")
    cal = [p for p in cal if len(p) + need <= cap] or kept
    eng = engine_from(
        t, d, min(cap, max(len(p) for p in kept + cal) + need), engine, modes=(dm, saved.mode if saved else None)
    )
    report = run_eval(eng, kept, dm, temps, max_new_tokens, seed=seed, top_p=top_p, top_k=top_k, passes=passes)
    if tune or saved is not None:
        if tune:
            res = _run_tune(eng, cal, max_new_tokens, save_tuning, _tuning_context(target, drafter, eng))
            report["tuning"] = res.to_json()
        else:
            res = saved
            report["tuning"] = {"file": tuning, **saved.to_json()}
        report["tuned"] = tuned_entry(
            eng, kept, res.mode, report, dm, temps[0], max_new_tokens, seed=seed, top_p=top_p, top_k=top_k
        )
    report.update(
        {
            "target": target,
            "drafter": drafter,
            "prompts_file": prompts,
            "raw": not templated,
            "prompt_format": "chat template" if templated else "text as is",
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out)
    atomic_write_json(out / "eval.json", report)
    print_table(report)
    if "tuned" in report:
        tu = report["tuned"]
        from draftsmith.decode.tuning import describe, mode_from_json

        typer.secho(
            f"tuned {describe(mode_from_json(tu['mode'], 'tuned'))}: {tu['tok_s']:.1f} tok/s vs plain "
            f"{tu['plain_tok_s']:.1f} = {tu['speedup']:.2f}x (T={temps[0]:g}, all prompts)",
            err=True,
            fg=typer.colors.CYAN,
        )
    typer.secho(
        f"wrote {out / 'eval.json'}"
        + (f" and {len(report['plots'])} plots" if report["plots"] else " (install matplotlib for plots)"),
        err=True,
    )
    if json_out:
        sys.stdout.write(json.dumps(report) + "\n")

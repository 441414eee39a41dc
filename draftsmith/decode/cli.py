"""`draftsmith generate` and `draftsmith eval` (speculative decoding with an EAGLE-3 drafter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError
from draftsmith.decode.setup import build_engine, decode_mode, load_models, max_positions


def _check_numbers(max_new_tokens: int, temperatures: list[float], top_p: float, top_k: int, mode) -> None:
    """Every numeric option, before anything loads: one line naming the flag."""
    from draftsmith.common import schema as S

    S.check_max_new_tokens("--max-new-tokens", max_new_tokens)
    for t in temperatures:
        S.check_temperature("--temperature", t)
    S.check_top_p("--top-p", top_p)
    S.check_top_k("--top-k", top_k)
    try:
        mode.validate()
    except ValueError as e:
        raise DraftsmithError(str(e)) from None


def _check_tune_flags(
    tune: bool, tuning: Optional[str], tune_prompts: Optional[str], save_tuning: Optional[str], plain: bool = False
) -> None:
    if tune and tuning:
        raise DraftsmithError("--tune and --tuning FILE: give one (measure now, or reuse a saved choice)")
    if (tune_prompts or save_tuning) and not tune:
        raise DraftsmithError(f"{'--tune-prompts' if tune_prompts else '--save-tuning'} needs --tune")
    if plain and (tune or tuning):
        raise DraftsmithError("--plain with --tune/--tuning: plain decoding has nothing to tune")


_ATTN_HELP = (
    "Attention of the compact forward and the drafter: auto (on CUDA SDPA while cache slots x head_dim "
    "<= 65,536, batched matmuls beyond: 512 slots for head_dim 128) | sdpa | bmm | split."
)


_KERNELS_HELP = (
    "Decode kernels of the compact forward: torch (cuBLAS + separate norms/RoPE/attention) | triton "
    "(one-token steps through draftsmith's fused kernels, 7 a layer, tiles tuned on the GPU at start: "
    "0.87-0.90 of copy bandwidth on an 8B shape vs 0.61 for torch; the rounds' verify, hand-off and "
    "draft-step attention through one tree-mask kernel, a tree level's top-k through two). Fastest: "
    "--kernels triton --compile (8B shape: 3.1x projected for tree rounds against this plain step)."
)

_CHAT_HELP = "Prompt format. " + (
    "Default: the tokenizer's chat template when it has one (one user message + generation prompt), else the text as "
    "is; --chat requires the template; --raw always takes the text as is. The same rule for generate and eval."
)
_TUNE_HELP = (
    "Pick the mode by measurement: a short calibration (greedy, <= 64 new tokens) times plain decoding and a "
    "handful of chain/tree shapes on this engine and uses the fastest, or plain decoding when none beats "
    "it (and says so). Overrides --draft-tokens/--tree."
)
_TUNE_PROMPTS_HELP = "Calibration prompts for --tune (any --prompts format; first 4 used). Default: the prompt(s)."
_SAVE_TUNING_HELP = "Write the --tune choice and its measurements to FILE (JSON), for --tuning FILE later."
_TUNING_HELP = "Use the mode saved by --save-tuning FILE (no calibration)."


def _tuning_need() -> int:
    from draftsmith.decode.tuning import DEFAULT_CANDIDATES

    return max(m.cache_need for m in DEFAULT_CANDIDATES)


def _run_tune(eng, prompts, max_new_tokens: int, save_tuning: Optional[str], context: dict):
    from draftsmith.decode.tuning import CALIBRATION_PROMPTS, CALIBRATION_TOKENS, describe, tune

    def show(row):
        from draftsmith.decode.engine import DecodeMode

        m = DecodeMode(**row["mode"])
        rt = "" if row["round_ms"] is None else f", {row['round_ms']:.2f} ms/round"
        typer.secho(f"  calibrate {describe(m)}: {row['tok_s']:.1f} tok/s, tau {row['tau']:.2f}{rt}", err=True)

    try:
        res = tune(eng, prompts[:CALIBRATION_PROMPTS], min(max_new_tokens, CALIBRATION_TOKENS), progress=show)
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
        "compiled": bool(getattr(eng, "_compiled", False)),
    }


def _load_tuning(path: str, drafter):
    from draftsmith.decode.tuning import Tuning

    t = Tuning.load(path)
    if t.mode.kind != "plain" and drafter is None:
        raise DraftsmithError(f"{path}: the saved mode is {t.mode.kind} decoding, which needs --drafter")
    return t


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        target: str = typer.Option(..., "--target", help="HF target model directory."),
        prompt: str = typer.Option(..., "--prompt", help="Prompt text (see --chat/--raw)."),
        drafter: Optional[str] = typer.Option(
            None, "--drafter", help="EAGLE-3 drafter (draftsmith/SGLang/EAGLE layout). Without it: plain decoding."
        ),
        max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="New tokens to generate (>= 1)."),
        temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples (finite)."),
        top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
        top_k: int = typer.Option(0, "--top-k", help="Sampling top-k (0 = off). The tree width is --top-k-draft."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (reproducible output)."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text, token_ids, tau, timing)."),
        draft_tokens: int = typer.Option(4, "--draft-tokens", help="Chain: draft tokens per round (K)."),
        tree: bool = typer.Option(False, "--tree", help="EAGLE-2 dynamic tree instead of a chain."),
        top_k_draft: int = typer.Option(8, "--top-k-draft", help="Tree: frontier width / children per node."),
        depth: int = typer.Option(5, "--depth", help="Tree: max draft tokens on one path."),
        tree_tokens: int = typer.Option(32, "--tree-tokens", help="Tree: draft nodes verified per round."),
        plain: bool = typer.Option(False, "--plain", help="Plain decoding even with a drafter (baseline)."),
        tune: bool = typer.Option(False, "--tune", help=_TUNE_HELP),
        tune_prompts: Optional[str] = typer.Option(None, "--tune-prompts", help=_TUNE_PROMPTS_HELP),
        save_tuning: Optional[str] = typer.Option(None, "--save-tuning", help=_SAVE_TUNING_HELP),
        tuning: Optional[str] = typer.Option(None, "--tuning", help=_TUNING_HELP),
        stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
        chat: Optional[bool] = typer.Option(None, "--chat/--raw", help=_CHAT_HELP),
        device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
        dtype: str = typer.Option("auto", "--dtype", help="auto = bf16 on CUDA, fp32 on CPU."),
        backend: str = typer.Option("auto", "--backend", help="auto | llama (compact forward) | hf (generic)."),
        cuda_graphs: bool = typer.Option(
            True, "--cuda-graphs/--no-cuda-graphs", help="Replay rounds from CUDA graphs on GPUs."
        ),
        compile: bool = typer.Option(False, "--compile", help="torch.compile the round forwards (slow start)."),
        attn_impl: str = typer.Option("auto", "--attn-impl", help=_ATTN_HELP),
        kernels: str = typer.Option("torch", "--kernels", help=_KERNELS_HELP),
    ) -> None:
        """Generate from a prompt with speculative decoding (greedy output == plain greedy decoding)."""
        from draftsmith.decode.evaluate import load_prompt_ids, read_prompts_text, use_chat_template
        from draftsmith.decode.sampling import SamplingParams

        mode = decode_mode(plain, tree, draft_tokens, top_k_draft, depth, tree_tokens)
        _check_numbers(max_new_tokens, [temperature], top_p, top_k, mode)
        _check_tune_flags(tune, tuning, tune_prompts, save_tuning, plain)
        if prompt == "":
            raise DraftsmithError("--prompt: empty (give the text to continue)")
        saved = _load_tuning(tuning, drafter) if tuning else None
        if tune_prompts:
            read_prompts_text(tune_prompts)
        t, d = load_models(target, drafter, device, dtype)
        tok = t.tokenizer
        if use_chat_template(tok, chat):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tok(prompt)["input_ids"]
        if not ids:
            raise DraftsmithError("--prompt: the tokenizer gives no tokens for it")
        mode = decode_mode(plain, tree, draft_tokens, top_k_draft, depth, tree_tokens, d)
        if saved is not None:
            mode = saved.mode
        cal = [ids]
        if tune and tune_prompts:
            cal = load_prompt_ids(tune_prompts, tok, raw=not use_chat_template(tok, chat), limit=4)
            if not cal:
                raise DraftsmithError(f"{tune_prompts}: no prompts")
        need = max(mode.cache_need, _tuning_need() if tune and d is not None else 0) + 2
        cap = max_positions(t)
        longest = max(len(p) for p in cal + [ids])
        max_len = min(cap, longest + max(max_new_tokens, 1) + need)
        if len(ids) + 2 > max_len:
            raise DraftsmithError(f"--prompt: {len(ids)} tokens do not fit the target's context ({max_len})")
        eng = build_engine(t, d, max_len, backend, cuda_graphs, compile, attn_impl, kernels)
        if tune:
            if d is None:
                typer.secho("tuned: plain decoding (no --drafter)", err=True, fg=typer.colors.CYAN)
                mode = decode_mode(True, False, 0, 0, 0, 0)
            else:
                mode = _run_tune(eng, cal, max_new_tokens, save_tuning, _tuning_context(target, drafter, eng)).mode
        elif saved is not None:
            typer.secho(f"using {tuning}: {saved.summary()}", err=True, fg=typer.colors.CYAN)
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        eng.warmup(mode, sp)
        res = eng.generate(ids, max_new_tokens, sampling=sp, mode=mode, seed=seed, stop_strings=stop)
        if json_out:
            obj = res.to_json()
            obj["mode"] = mode.kind
            obj["decode_mode"] = mode.__dict__
            obj["backend"] = eng.backend
            obj["cuda_graphs"] = eng.cuda_graphs
            sys.stdout.write(json.dumps(obj) + "\n")
        else:
            typer.echo(res.text)
            typer.secho(
                f"[{len(res.token_ids)} tokens, {mode.kind}, tau={res.tau:.2f}, "
                f"{res.tokens_per_s:.1f} tok/s, finish={res.finish_reason}]",
                err=True,
                fg=typer.colors.CYAN,
            )

    @app.command("eval")
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
        max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="New tokens per prompt (>= 1)."),
        temperatures: str = typer.Option("0,1", "--temperatures", help="Comma-separated, e.g. '0,0.7'."),
        top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass at T > 0, in (0, 1]."),
        top_k: int = typer.Option(0, "--top-k", help="Sampling top-k at T > 0 (0 = off)."),
        draft_tokens: int = typer.Option(4, "--draft-tokens", help="Chain: draft tokens per round (K)."),
        tree: bool = typer.Option(False, "--tree", help="EAGLE-2 dynamic tree instead of a chain."),
        top_k_draft: int = typer.Option(8, "--top-k-draft", help="Tree: frontier width / children per node."),
        depth: int = typer.Option(5, "--depth", help="Tree: max draft tokens on one path."),
        tree_tokens: int = typer.Option(32, "--tree-tokens", help="Tree: draft nodes verified per round."),
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
        seed: int = typer.Option(0, "--seed", help="Sampling seed (prompt i uses seed + i)."),
        out: Path = typer.Option(Path("eval_out"), "--out", help="Directory for eval.json and PNG plots."),
        device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
        dtype: str = typer.Option("auto", "--dtype", help="auto = bf16 on CUDA, fp32 on CPU."),
        backend: str = typer.Option("auto", "--backend", help="auto | llama (compact forward) | hf (generic)."),
        cuda_graphs: bool = typer.Option(
            True, "--cuda-graphs/--no-cuda-graphs", help="Replay rounds from CUDA graphs on GPUs."
        ),
        compile: bool = typer.Option(False, "--compile", help="torch.compile the round forwards (slow start)."),
        attn_impl: str = typer.Option("auto", "--attn-impl", help=_ATTN_HELP),
        kernels: str = typer.Option("torch", "--kernels", help=_KERNELS_HELP),
        json_out: bool = typer.Option(False, "--json", help="Also print the report JSON to stdout."),
    ) -> None:
        """Measure a drafter: τ, acceptance rate, per-position acceptance, speedup vs plain (T=0 and T>0)."""
        from draftsmith.common import schema as S
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

        try:
            temps = [float(x) for x in temperatures.split(",") if x.strip()]
        except ValueError:
            raise DraftsmithError(f"--temperatures: expected comma-separated numbers, got {temperatures!r}") from None
        if not temps:
            raise DraftsmithError("--temperatures: give at least one temperature, e.g. '0'")
        mode = decode_mode(False, tree, draft_tokens, top_k_draft, depth, tree_tokens)
        _check_numbers(max_new_tokens, temps, top_p, top_k, mode)
        S.check_value("--limit", limit, (S.AT_LEAST_ONE,))
        _check_tune_flags(tune, tuning, tune_prompts, save_tuning)
        if out.exists() and not out.is_dir():
            raise DraftsmithError(f"--out {out}: is a file, not a directory")
        saved = _load_tuning(tuning, drafter) if tuning else None
        for f in (prompts, tune_prompts):
            if f:
                read_prompts_text(f)  # a missing or binary file: one line, before the models load
        t, d = load_models(target, drafter, device, dtype)
        templated = use_chat_template(t.tokenizer, chat)
        ids = load_prompt_ids(prompts, t.tokenizer, raw=not templated, limit=limit)
        if not ids:
            raise DraftsmithError(f"{prompts}: no prompts")
        cal = load_prompt_ids(tune_prompts, t.tokenizer, raw=not templated, limit=4) if tune_prompts else ids
        cap = max_positions(t)
        need = (
            max_new_tokens
            + max(mode.cache_need, saved.mode.cache_need if saved else 0, _tuning_need() if tune else 0)
            + 2
        )
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
        eng = build_engine(
            t, d, min(cap, max(len(p) for p in kept + cal) + need), backend, cuda_graphs, compile, attn_impl, kernels
        )
        report = run_eval(eng, kept, mode, temps, max_new_tokens, seed=seed, top_p=top_p, top_k=top_k)
        if tune or saved is not None:
            if tune:
                res = _run_tune(eng, cal, max_new_tokens, save_tuning, _tuning_context(target, drafter, eng))
                report["tuning"] = res.to_json()
            else:
                res = saved
                report["tuning"] = {"file": tuning, **saved.to_json()}
            report["tuned"] = tuned_entry(
                eng, kept, res.mode, report, mode, temps[0], max_new_tokens, seed=seed, top_p=top_p, top_k=top_k
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

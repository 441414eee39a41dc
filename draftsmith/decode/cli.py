"""`draftsmith generate` and `draftsmith eval` (speculative decoding with an EAGLE-3 drafter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from draftsmith.common.hf import text_config
from draftsmith.common.errors import DraftsmithError


def _load(target: str, drafter: Optional[str], device: str, dtype: str):
    import torch

    from draftsmith.target_model import load_target

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    t = load_target(target, dtype=dtype, device=device)
    d = None
    if drafter:
        from draftsmith.drafter import Drafter

        d = Drafter.from_pretrained(drafter, target=t)
        d = d.to(device=t.device, dtype=t.dtype).eval()
        d.requires_grad_(False)
    return t, d


def _mode(plain: bool, tree: bool, draft_tokens: int, top_k_draft: int, depth: int, tree_tokens: int, drafter):
    from draftsmith.decode.engine import DecodeMode

    if plain or drafter is None:
        return DecodeMode("plain")
    if tree:
        return DecodeMode("tree", top_k=top_k_draft, depth=depth, tree_tokens=tree_tokens)
    return DecodeMode("chain", draft_tokens=draft_tokens)


_ATTN_HELP = ("Attention of the compact forward and the drafter: auto (on CUDA SDPA while cache slots x head_dim "
              "<= 65,536, batched matmuls beyond: 512 slots for head_dim 128) | sdpa | bmm | split.")


_KERNELS_HELP = ("Decode kernels of the compact forward: torch (cuBLAS + separate norms/RoPE/attention) | triton "
                 "(one-token steps through draftsmith's fused kernels, 7 a layer, tiles tuned on the GPU at start: "
                 "0.87-0.90 of copy bandwidth on an 8B shape vs 0.61 for torch; the rounds' verify, hand-off and "
                 "draft-step attention through one tree-mask kernel, a tree level's top-k through two). Fastest: "
                 "--kernels triton --compile (8B shape: 3.1x projected for tree rounds against this plain step).")


def _engine(t, d, max_len: int, backend: str, cuda_graphs: bool, compile: bool = False, attn_impl: str = "auto",
            kernels: str = "torch"):
    from draftsmith.decode.engine import SpeculativeDecoder

    try:
        return SpeculativeDecoder(t, d, max_len=max_len, backend=backend, cuda_graphs=None if cuda_graphs else False,
                                  compile=compile, attn_impl=attn_impl, kernels=kernels)
    except ValueError as e:
        raise DraftsmithError(str(e)) from None


def _max_positions(t) -> int:
    cfg = text_config(t.config)
    return int(getattr(cfg, "max_position_embeddings", None) or 1 << 20)


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        target: str = typer.Option(..., "--target", help="HF target model directory."),
        prompt: str = typer.Option(..., "--prompt", help="Prompt text (tokenized as is; see --chat)."),
        drafter: Optional[str] = typer.Option(None, "--drafter", help="EAGLE-3 drafter (draftsmith/SGLang/EAGLE "
                                              "layout). Without it: plain decoding."),
        max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
        temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
        top_p: float = typer.Option(1.0, "--top-p"),
        top_k: int = typer.Option(0, "--top-k", help="Sampling top-k (0 = off). The tree width is --top-k-draft."),
        seed: Optional[int] = typer.Option(None, "--seed"),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text, token_ids, tau, timing)."),
        draft_tokens: int = typer.Option(4, "--draft-tokens", help="Chain: draft tokens per round (K)."),
        tree: bool = typer.Option(False, "--tree", help="EAGLE-2 dynamic tree instead of a chain."),
        top_k_draft: int = typer.Option(8, "--top-k-draft", help="Tree: frontier width / children per node."),
        depth: int = typer.Option(5, "--depth", help="Tree: max draft tokens on one path."),
        tree_tokens: int = typer.Option(32, "--tree-tokens", help="Tree: draft nodes verified per round."),
        plain: bool = typer.Option(False, "--plain", help="Plain decoding even with a drafter (baseline)."),
        stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
        device: str = typer.Option("auto", "--device"),
        dtype: str = typer.Option("auto", "--dtype", help="auto = bf16 on CUDA, fp32 on CPU."),
        backend: str = typer.Option("auto", "--backend", help="auto | llama (compact forward) | hf (generic)."),
        cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs"),
        compile: bool = typer.Option(False, "--compile", help="torch.compile the round forwards (slow start)."),
        attn_impl: str = typer.Option("auto", "--attn-impl", help=_ATTN_HELP),
        kernels: str = typer.Option("torch", "--kernels", help=_KERNELS_HELP),
    ) -> None:
        """Generate from a prompt with speculative decoding (greedy output == plain greedy decoding)."""
        from draftsmith.decode.sampling import SamplingParams

        t, d = _load(target, drafter, device, dtype)
        tok = t.tokenizer
        if chat:
            if not getattr(tok, "chat_template", None):
                raise DraftsmithError(f"{target}: --chat given but the tokenizer has no chat template")
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tok(prompt)["input_ids"]
        mode = _mode(plain, tree, draft_tokens, top_k_draft, depth, tree_tokens, d)
        try:
            mode.validate()
        except ValueError as e:
            raise DraftsmithError(str(e)) from None
        max_len = min(_max_positions(t), len(ids) + max_new_tokens + mode.cache_need + 2)
        if len(ids) + 2 > max_len:
            raise DraftsmithError(f"--prompt: {len(ids)} tokens do not fit the target's context ({max_len})")
        eng = _engine(t, d, max_len, backend, cuda_graphs, compile, attn_impl, kernels)
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        eng.warmup(mode, sp)
        res = eng.generate(ids, max_new_tokens, sampling=sp, mode=mode, seed=seed, stop_strings=stop)
        if json_out:
            obj = res.to_json()
            obj["mode"] = mode.kind
            obj["backend"] = eng.backend
            obj["cuda_graphs"] = eng.cuda_graphs
            sys.stdout.write(json.dumps(obj) + "\n")
        else:
            typer.echo(res.text)
            typer.secho(f"[{len(res.token_ids)} tokens, {mode.kind}, tau={res.tau:.2f}, "
                        f"{res.tokens_per_s:.1f} tok/s, finish={res.finish_reason}]", err=True, fg=typer.colors.CYAN)

    @app.command("eval")
    def eval_cmd(
        target: str = typer.Option(..., "--target"),
        drafter: str = typer.Option(..., "--drafter"),
        prompts: str = typer.Option(..., "--prompts", help="EAGLE question JSONL, JSONL with text/messages, or a "
                                    "text file with one prompt per line."),
        raw: bool = typer.Option(False, "--raw", help="Skip the chat template (prompt text as is)."),
        limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N prompts."),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
        temperatures: str = typer.Option("0,1", "--temperatures", help="Comma-separated, e.g. '0,0.7'."),
        top_p: float = typer.Option(1.0, "--top-p"),
        top_k: int = typer.Option(0, "--top-k"),
        draft_tokens: int = typer.Option(4, "--draft-tokens"),
        tree: bool = typer.Option(False, "--tree"),
        top_k_draft: int = typer.Option(8, "--top-k-draft"),
        depth: int = typer.Option(5, "--depth"),
        tree_tokens: int = typer.Option(32, "--tree-tokens"),
        seed: int = typer.Option(0, "--seed"),
        out: Path = typer.Option(Path("eval_out"), "--out", help="Directory for eval.json and PNG plots."),
        device: str = typer.Option("auto", "--device"),
        dtype: str = typer.Option("auto", "--dtype"),
        backend: str = typer.Option("auto", "--backend"),
        cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs"),
        compile: bool = typer.Option(False, "--compile", help="torch.compile the round forwards (slow start)."),
        attn_impl: str = typer.Option("auto", "--attn-impl", help=_ATTN_HELP),
        kernels: str = typer.Option("torch", "--kernels", help=_KERNELS_HELP),
        json_out: bool = typer.Option(False, "--json", help="Also print the report JSON to stdout."),
    ) -> None:
        """Measure a drafter: τ, acceptance rate, per-position acceptance, speedup vs plain (T=0 and T>0)."""
        from draftsmith.decode.evaluate import load_prompt_ids, print_table, run_eval, write_plots
        from draftsmith.common.io import atomic_write_json

        try:
            temps = [float(x) for x in temperatures.split(",") if x.strip()]
        except ValueError:
            raise DraftsmithError(f"--temperatures: expected comma-separated numbers, got {temperatures!r}") from None
        t, d = _load(target, drafter, device, dtype)
        ids = load_prompt_ids(prompts, t.tokenizer, raw=raw, limit=limit)
        if not ids:
            raise DraftsmithError(f"{prompts}: no prompts")
        mode = _mode(False, tree, draft_tokens, top_k_draft, depth, tree_tokens, d)
        try:
            mode.validate()
        except ValueError as e:
            raise DraftsmithError(str(e)) from None
        cap = _max_positions(t)
        need = max_new_tokens + mode.cache_need + 2
        kept = [p for p in ids if len(p) + need <= cap]
        if len(kept) < len(ids):
            typer.secho(f"skipping {len(ids) - len(kept)} prompts longer than {cap - need} tokens", err=True,
                        fg=typer.colors.YELLOW)
        if not kept:
            raise DraftsmithError(f"{prompts}: every prompt is longer than the target context allows")
        eng = _engine(t, d, min(cap, max(len(p) for p in kept) + need), backend, cuda_graphs, compile, attn_impl,
                      kernels)
        report = run_eval(eng, kept, mode, temps, max_new_tokens, seed=seed, top_p=top_p, top_k=top_k)
        report.update({"target": target, "drafter": drafter, "prompts_file": prompts, "raw": raw})
        out.mkdir(parents=True, exist_ok=True)
        report["plots"] = write_plots(report, out)
        atomic_write_json(out / "eval.json", report)
        print_table(report)
        typer.secho(f"wrote {out / 'eval.json'}" + (f" and {len(report['plots'])} plots" if report["plots"] else
                                                    " (install matplotlib for plots)"), err=True)
        if json_out:
            sys.stdout.write(json.dumps(report) + "\n")

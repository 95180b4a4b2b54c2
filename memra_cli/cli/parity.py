"""`memra parity CKPT ORACLE.npz`: the drafter against a reference oracle, stage by stage.

Also `memra parity CKPT --make-oracle OUT.npz`: write an oracle from the independent reference
implementation (`parity/reference.py`). Exit 0 when every stage passes on both paths, 1 when any
fails, 2 on bad input (one `error:` line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from memra_cli.cli.common import AdaptOpt, HarvestOpt, JsonOpt, TauOpt, VtOpt, at_least, policy_settings, refusals

PREC_HELP = ("Precision policy of the engine under test: f32 | bf16 | q8 | mixed (MLP q8_0, attention+fc bf16) | "
             "fc (all q8_0 but fc) | q4. Picks the thresholds. Unset: f32 or bf16 from --dtype.")
DEFAULT_CTX = 32
SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes an unsigned 64-bit seed


@refusals
def parity(
    ckpt: Path = typer.Argument(..., help="Drafter checkpoint: a directory (config.json + safetensors) or a memra .gguf file."),
    oracle: Optional[Path] = typer.Argument(None, help="A memra-oracle/1 .npz to check against (omit with --make-oracle)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target model directory: its lm_head gives draft_logits (and its embedding the oracle's block rows with --make-oracle). Unset: the checkpoint's own lm_head / embed_tokens when it ships them (DeepSpec exports)."),
    prec: Optional[str] = typer.Option(None, "--prec", envvar="MEMRA_DFLASH_PREC", show_envvar=True, help=PREC_HELP),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    dump: Optional[Path] = typer.Option(None, "--dump", help="Write the engine's per-stage arrays here as PATH.STAGE.npy (e.g. cached.hidden_out.npy)."),
    make_oracle: Optional[Path] = typer.Option(None, "--make-oracle", help="Write a memra-oracle/1 .npz file from the reference implementation (float64, random inputs) instead of checking one. An existing file needs --force."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --make-oracle file."),
    ctx: Optional[int] = typer.Option(None, "--ctx", callback=at_least(1), help=f"Context rows of the oracle made by --make-oracle (default {DEFAULT_CTX}; >= 1)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the random inputs of --make-oracle (default 0)."),
    json_out: bool = JsonOpt,
    harvest: Optional[str] = HarvestOpt,
    vt: Optional[str] = VtOpt,
    tau: Optional[str] = TauOpt,
    adapt: Optional[bool] = AdaptOpt,
) -> None:
    """Check the engine's drafter against an oracle, stage by stage, on both paths.

    Feeds the oracle's raw target taps, block embedding rows and positions through the fresh
    full-context forward (`full`) and the cached path (`cached`: ingest the ctx rows, then the
    block round), and compares every stage the oracle holds: ctx_features, layer_out,
    hidden_out, draft_logits, markov_tokens, confidence_raw. Prints the receipts, then max-abs,
    relative L2, argmax agreement and the threshold of the precision policy per stage and path
    (confidence_raw's relative L2 has its denominator floored at the head's scale, since its
    b scores can cancel: docs/oracle-format.md). Notes follow the table.

    With --make-oracle OUT.npz it writes an oracle instead, from a plain-torch float64 drafter
    built on transformers' Qwen3 blocks (independent of the engine's code path).
    """
    from memra_cli.cli.checks import check_model_dir, check_prec, check_run_flags

    check_prec(prec)  # the flags first: they need neither the checkpoint nor torch (nor numpy)
    check_run_flags(dtype, device, None)
    check_model_dir(target, "--target")
    from memra_cli.cli import render
    from memra_cli.engine.formats.census import take_census
    from memra_cli.parity.oracle import OracleError
    from memra_cli.engine.spec.policy import resolve_receipts

    if (oracle is None) == (make_oracle is None):
        raise OracleError("give exactly one of ORACLE.npz (to check) or --make-oracle OUT.npz (to write one)")
    if make_oracle is not None:
        _check_out(make_oracle, force)  # before the census and the reference's slow imports
    elif force:
        raise OracleError("--force applies to --make-oracle (overwrite an existing oracle file)")
    if dump is not None:
        from memra_cli.engine.files import check_output

        check_output(dump, "--dump", directory=True)  # before the check runs
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise OracleError(f"--seed {seed}: expected an integer from 0 to 2^64-1 (a torch generator's seed)")
    census = take_census(ckpt)
    receipts = resolve_receipts(policy_settings(harvest, vt, tau, adapt), census.strategy_dspark, census.confidence is not None)
    if make_oracle is not None:
        if dump is not None or dtype != "auto" or device != "auto":
            raise OracleError("--dump, --dtype and --device apply to a check; --make-oracle computes in float64 on CPU")
        rows = DEFAULT_CTX if ctx is None else ctx
        _check_ctx(rows, census.config)
        _make(ckpt, make_oracle, target, rows, 0 if seed is None else seed, receipts, json_out)
        return
    if ctx is not None or seed is not None:
        raise OracleError("--ctx and --seed apply to --make-oracle only (a check takes its inputs from the oracle)")
    assert oracle is not None
    result = _check(census, oracle, target, prec, dtype, device)
    if dump is not None:
        result["dumped"] = _dump(dump, result["report"].engine)
    if json_out:
        render.emit_json(_as_json(result, receipts))
    else:
        _report(result, receipts, oracle)
    if not result["report"].passed:
        raise typer.Exit(code=1)


def _check_out(out: Path, force: bool) -> None:
    """--make-oracle: a .npz name (what the file is), and the rule of every output
    (`files.check_output`: an existing file needs --force; its directory must exist and take a file)."""
    from memra_cli.engine.files import check_output
    from memra_cli.parity.oracle import OracleError

    if out.suffix != ".npz":
        raise OracleError(f"--make-oracle {out}: expected a .npz file name (a memra-oracle/1 file is an .npz)")
    check_output(out, "--make-oracle", force=force)


def _check_ctx(ctx: int, cfg: Any) -> None:
    """--ctx: the oracle's positions run 0 .. ctx + block - 1, within the drafter's positions."""
    from memra_cli.parity.oracle import OracleError

    limit = cfg.max_position_embeddings - cfg.block_size
    if ctx > limit:
        raise OracleError(f"--ctx {ctx}: expected at most {limit} (the drafter's max_position_embeddings "
                          f"{cfg.max_position_embeddings} less its block of {cfg.block_size})")


def _check(census: Any, oracle_path: Path, target: Optional[Path], prec: Optional[str], dtype: str, device: str) -> dict:
    import torch

    from memra_cli.engine.api import load_drafter
    from memra_cli.parity.oracle import parity as run_parity, read_oracle, target_tables

    oracle = read_oracle(oracle_path)
    drafter, policy, dt, dev = load_drafter(census, prec=prec, dtype=dtype, device=device)
    if target is not None:
        lm_head, head_src = target_tables(target, dt, dev, census.config.hidden_size, embed=False)[1], f"target {target}"
    else:
        lm_head, head_src = drafter.own_lm_head, "checkpoint lm_head"
    if lm_head is None:
        head_src = "none"
    with torch.inference_mode():
        report = run_parity(drafter, oracle, lm_head, policy)
    return {"report": report, "oracle": oracle, "policy": policy, "dtype": str(dt).removeprefix("torch."),
            "device": str(dev), "lm_head": head_src}


def _dump(directory: Path, engine: dict) -> list[str]:
    import numpy as np

    directory.mkdir(exist_ok=True)  # its parent was checked to exist (check_output)
    written = []
    for path, stages in engine.items():
        for stage, arr in stages.items():
            out = directory / f"{path}.{stage}.npy"
            np.save(out, arr, allow_pickle=False)
            written.append(str(out))
    return written


def _as_json(result: dict, receipts: Any) -> dict:
    report, oracle = result["report"], result["oracle"]
    return {
        "pass": report.passed,
        "stages": [r.as_json() for r in report.results],
        "failed": report.failed_stages,
        "precision": result["policy"], "dtype": result["dtype"], "device": result["device"],
        "lm_head": result["lm_head"],
        "oracle": {"path": str(oracle.path), "meta": oracle.meta},
        "dumped": result.get("dumped"),
        "receipts": receipts.as_json(), "receipt_lines": receipts.lines(),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.2e}"


def _bound(r: Any) -> str:
    """The row's bound on its rel L2 (markov_tokens has a token rule instead)."""
    if isinstance(r.threshold, str):  # markov_tokens: "exact" or "reported"
        return "tokens equal" if r.threshold == "exact" else "reported"
    return f"≤ {r.threshold:.2e}"


def _bound_words(th: Any) -> str:
    return "every token equal" if th.tokens_exact else "reported, not required"


def _report(result: dict, receipts: Any, oracle_path: Path) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from memra_cli.cli import render
    from memra_cli.parity.oracle import THRESHOLDS

    report, oracle = result["report"], result["oracle"]
    render.print_receipts(receipts.lines())
    meta, th = oracle.meta, THRESHOLDS[result["policy"]]
    render.console.print(f"memra parity {oracle_path}  ({meta['source']})", markup=False, soft_wrap=render.unwrapped(render.console))
    render.console.print(
        f"ctx {oracle.ctx}, block {oracle.block}, anchor {oracle.anchor}; all {oracle.block} block rows compared; "
        f"precision {th.name} ({th.why}); {result['dtype']} on {result['device']}; lm_head from {result['lm_head']}",
        markup=False, soft_wrap=render.unwrapped(render.console),
    )
    if meta.get("harvest") and meta["harvest"] != receipts.harvest.value:
        render.warn(f"oracle made for harvest={meta['harvest']}, receipts say {receipts.harvest.value} "
                    "(parity compares all rows, so the result does not depend on it)")
    table = Table(title="stages", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    # the pass rule sits beside the value it bounds (rel L2) and says so; max-abs is information only
    for col in ("stage", "path", "rel L2", "rel L2 bound", "argmax", "max-abs", "result", ""):
        table.add_column(col, no_wrap=True)
    notes = []  # under the table, whole: a notes column gets squeezed to nothing in 80 columns
    for r in report.results:
        argmax = "-" if r.argmax_agree is None else f"{r.argmax_agree:.3f}"
        verdict = "[green]pass[/green]" if r.passed else "[bold red]FAIL[/bold red]"
        mark = ""
        if r.note:
            notes.append(f"[{len(notes) + 1}] {r.stage} {r.path}: {r.note}")
            mark = escape(f"[{len(notes)}]")
        table.add_row(r.stage, r.path, _fmt(r.rel_l2), _bound(r), argmax, _fmt(r.max_abs), verdict, mark)
    render.console.print(table)
    argmax_rule = "; draft_logits also needs the oracle's argmax on every row that is not a near-tie" if th.argmax_required else ""
    render.console.print(f"pass: rel L2 within its bound{argmax_rule}; markov_tokens: {_bound_words(th)}; "
                         "max-abs is information, not a criterion", markup=False, soft_wrap=render.unwrapped(render.console))
    for line in notes:
        render.console.print(line, markup=False, soft_wrap=render.unwrapped(render.console))
    if result.get("dumped"):
        render.console.print(f"dumped {len(result['dumped'])} arrays to {Path(result['dumped'][0]).parent}", markup=False)
    n = len(report.results)
    if report.passed:
        render.console.print(f"parity PASS: {n}/{n} checks", markup=False)
    else:
        bad = sum(not r.passed for r in report.results)
        render.console.print(f"parity FAIL: {', '.join(report.failed_stages)} ({bad} of {n} checks)", markup=False)


def _make(ckpt: Path, out: Path, target: Optional[Path], ctx: int, seed: int, receipts: Any, json_out: bool) -> None:
    from memra_cli.cli import render
    from memra_cli.parity.reference import make_oracle

    meta = make_oracle(ckpt, out, target_dir=target, ctx=ctx, seed=seed)
    if json_out:
        stages = meta.pop("stages")
        render.emit_json({"oracle": str(out), "meta": meta, "stages": stages,
                          "receipts": receipts.as_json(), "receipt_lines": receipts.lines()})
        return
    render.print_receipts(receipts.lines())
    render.console.print(
        f"wrote {out} (memra-oracle/1): stages {', '.join(meta['stages'])}; ctx {ctx}, block {meta['block_size']}, "
        f"anchor {meta['anchor_token']}, seed {seed}", markup=False, soft_wrap=render.unwrapped(render.console),
    )
    render.console.print(f"source: {meta['source']}", markup=False, soft_wrap=render.unwrapped(render.console))
    for stage, why in (meta.get("omitted") or {}).items():
        render.warn(f"{stage} left out: {why}")

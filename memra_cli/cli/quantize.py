"""`memra quantize CKPT --policy q8|mixed|fc|q4 --out FILE.gguf`: a drafter as ggml q8_0 / q4_0 GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from memra_cli.cli.common import AdaptOpt, HarvestOpt, JsonOpt, TauOpt, VtOpt, policy_settings, refusals

POLICY_HELP = ("Precision policy: q8 (every matmul weight q8_0) | mixed (attention + fc bf16, MLP q8_0) | "
               "fc (fc bf16, the rest q8_0) | q4 (every matmul weight q4_0). Norms f32, confidence head f32, "
               "markov w1 as stored, markov w2 as the policy.")


@refusals
def quantize(
    ckpt: Path = typer.Argument(..., help="Drafter checkpoint directory (config.json + safetensors)."),
    policy: str = typer.Option("q8", "--policy", help=POLICY_HELP),
    out: Path = typer.Option(..., "--out", help="Output .gguf file (written to a temporary file, then renamed)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --out."),
    json_out: bool = JsonOpt,
    harvest: Optional[str] = HarvestOpt,
    vt: Optional[str] = VtOpt,
    tau: Optional[str] = TauOpt,
    adapt: Optional[bool] = AdaptOpt,
) -> None:
    """Quantize a drafter to ggml q8_0 / q4_0 blocks in one self-describing GGUF file.

    The bytes equal llama.cpp's reference quantizers (`quantize_row_q8_0_ref` /
    `quantize_row_q4_0_ref`). The source config.json rides in the GGUF metadata, so
    `memra census FILE.gguf` and `memra generate --draft FILE.gguf` read the file alone.
    Prints the source's receipts first, a progress bar over tensors (stderr), then one row per
    tensor (shape, type, bytes before / after, relative RMS error vs the source values) and the
    totals. Nothing is left behind on an error or an interrupt.
    """
    from memra_cli.engine.quant.precision import FILE_POLICIES, check_policy

    check_policy(policy, FILE_POLICIES, "--policy")  # before numpy's import (census, the GGUF writer)
    from memra_cli.cli import render
    from memra_cli.engine.formats.census import take_census
    from memra_cli.engine.quant.gguf_write import check_out
    from memra_cli.engine.spec.policy import resolve_receipts

    check_out(out, force)  # before the census: an occupied --out is refused at once
    census = take_census(ckpt)
    receipts = resolve_receipts(policy_settings(harvest, vt, tau, adapt), census.strategy_dspark,
                                census.confidence is not None)
    if not json_out:
        render.console.print(f"[bold]memra quantize[/bold] {ckpt} → {out} (policy {policy})", soft_wrap=render.unwrapped(render.console))
        render.console.print(
            f"source: {census.kind} drafter, {census.config.num_hidden_layers} layers × hidden "
            f"{census.config.hidden_size}, {len(census.tensors)} tensors, {render.human_count(census.n_params)} params, "
            f"{render.human_bytes(census.n_bytes)} ({census.checkpoint_format})", markup=False, soft_wrap=render.unwrapped(render.console))
        render.print_receipts(receipts.lines())
    report = _write(out, ckpt, policy, force, census)
    if json_out:
        render.emit_json({**report.as_json(), "receipts": receipts.as_json(), "receipt_lines": receipts.lines()})
        return
    _table(report, render)
    for row in report.kept:
        render.warn(f"tensor '{row.name}' {row.why}")


def _write(out: Path, ckpt: Path, policy: str, force: bool, census: Any):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memra_cli.cli import render
    from memra_cli.cli.common import raise_if_signalled
    from memra_cli.engine.quant.gguf_write import write_gguf

    progress = Progress(TextColumn("quantize"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[name]}"), console=render.err_console, transient=True)
    with progress:
        task = progress.add_task("quantize", total=len(census.tensors), name="")

        def step(done: int, total: int, name: str) -> None:
            raise_if_signalled()  # between tensors: a signal whose exception native code swallowed
            progress.update(task, completed=done, name=name)

        return write_gguf(out, ckpt, policy, step, overwrite=force, census=census)


def _table(report: Any, render: Any) -> None:
    from rich import box
    from rich.table import Table

    table = Table(title="tensors", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("tensor", overflow="fold")
    for col in ("shape", "type"):
        table.add_column(col, no_wrap=True)
    for col in ("bytes before", "bytes after", "rel RMS err"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in report.rows:
        err = "0" if r.rel_rms == 0.0 else f"{r.rel_rms:.3e}"
        kind = f"{r.source_dtype}→{r.gguf_type}" + (" (kept)" if r.kept else "")
        table.add_row(r.name, "×".join(map(str, r.shape)), kind, f"{r.bytes_before:,}", f"{r.bytes_after:,}", err)
    console = render.console
    if console.is_terminal:
        console.print(table)  # names fold to the terminal's width
    else:  # a pipe or a log file gets whole lines (rich would assume 80 columns there)
        render.PipeAwareConsole(highlight=False, width=max(console.width, 132)).print(table)
    types = ", ".join(f"{k}×{v}" for k, v in report.as_json()["totals"]["types"].items())
    console.print(
        f"total: {len(report.rows)} tensors ({types}); {render.human_bytes(report.bytes_before)} → "
        f"{render.human_bytes(report.bytes_after)} of tensors (ratio {report.ratio:.2f}x), file "
        f"{render.human_bytes(report.file_bytes)}; {report.seconds:.2f} s", markup=False, soft_wrap=render.unwrapped(render.console))
    console.print(f"wrote {report.out}", markup=False, soft_wrap=render.unwrapped(render.console))

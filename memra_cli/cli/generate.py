"""`memra generate`: speculative (or plain) generation, greedy or sampled, streamed, with receipts and stats."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from memra_cli.cli.common import (
    AdaptOpt, CudaGraphsOpt, DeviceOpt, DraftVocabOpt, DrafterPrecOpt, DtypeOpt, EmbScaleOpt, HarvestOpt, JsonOpt, MarkovOpt,
    StepWidthOpt, TauOpt, VerifyCapOpt, VtCostOpt, VtOpt, at_least, policy_settings, refusals,
)
from memra_cli.cli.sampling import (
    AcceptanceOpt, MinPOpt, SeedOpt, TemperatureOpt, TopKOpt, TopPOpt, sampling_notes, sampling_params,
)
from memra_cli.cli.threads import ThreadsOpt, threads_setting, use_threads
from memra_cli.engine.defaults import default_models as _default_models


def _parse_ids(text: str) -> list[int]:
    from memra_cli.engine.errors import PromptError

    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise PromptError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None


@refusals
def generate(
    target: Optional[Path] = typer.Option(None, "--target", help="Target model directory (HF Qwen3, the Qwen3.5 hybrid or Gemma 4, either layout: config.json + safetensors, tokenizer.json for text). Default: the embedded model."),
    draft: Optional[Path] = typer.Option(None, "--draft", help="Drafter checkpoint directory (or memra .gguf). Default with no --target: the embedded DSpark drafter; with --target: none (plain greedy)."),
    spec: str = typer.Option("auto", "--spec", help="off | dflash (parallel drafts, ladder) | dspark (census-keyed DSpark program) | auto (dspark for DSpark-class drafters, else dflash; off without --draft)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text, tokenized with the target's tokenizer.json."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3."),
    chat: bool = typer.Option(False, "--chat", help="Wrap --prompt in the target's chat template. Needs a target made for chat (a chat_template in its tokenizer_config.json, or a chat_template.jinja); the embedded target is a raw code model and has none."),
    max_new: int = typer.Option(128, "--max-new", callback=at_least(0), help="Generate exactly this many tokens (>= 0) unless EOS comes first."),
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
    temperature: Optional[str] = TemperatureOpt,
    top_k: Optional[str] = TopKOpt,
    top_p: Optional[str] = TopPOpt,
    min_p: Optional[str] = MinPOpt,
    seed: Optional[str] = SeedOpt,
    acceptance: Optional[str] = AcceptanceOpt,
    threads: Optional[str] = ThreadsOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Generation from a target (greedy, or sampled with --temperature), sped up by a DFlash /
    DSpark drafter.

    The output equals plain decoding of the target token for token: the drafter only proposes,
    the target's own selection decides every committed token (greedy: its argmax; sampled: its
    position-keyed sample, so the same --seed gives the same stream with or without a drafter).
    Receipts come first (stderr),
    text streams to stdout as rounds commit (an EOS token ends it and is not printed), and a final line reports tokens, rounds, tau (mean
    committed per round), acceptance, tok/s and per-phase times.
    """
    _check_flags(target=target, draft=draft, spec=spec, dtype=dtype, device=device, step_width=step_width, prec=prec,
                 harvest=harvest, vt=vt, tau=tau, adapt=adapt, verify_cap=verify_cap, vt_cost=vt_cost)
    given = {"harvest": harvest, "vt": vt, "vt_cost": vt_cost, "tau": tau, "adapt": adapt, "verify_cap": verify_cap, "markov": markov,
             "emb_scale": emb_scale, "draft_vocab": draft_vocab,
             "prec": prec, "draft": draft}  # as the user gave them, before any default
    target, draft, defaults_note = _default_models(target, draft, spec)
    codec, ids = _prompt(target, prompt, prompt_ids, chat)
    sampling = sampling_params(temperature, top_k, top_p, min_p, seed, acceptance)
    if draft_vocab is not None and sampling.temperature > 0:
        from memra_cli.engine.spec.proposer import SpecError

        raise SpecError(f"--draft-vocab {draft_vocab} with --temperature {sampling.temperature:g}: a draft vocabulary "
                        "drafts greedily only (sampled drafting needs the whole vocabulary's q)")
    from memra_cli.cli import render

    import torch  # only now: the flags and the prompt are good

    from memra_cli.cli.common import raise_if_signalled
    from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
    from memra_cli.engine.text import StreamDecoder

    from memra_cli.engine.spec.keyed import make_sampler

    arm_cfg = ArmConfig(draft=draft, mode=spec, settings=policy_settings(harvest, vt, tau, adapt, vt_cost), markov=markov,
                        verify_cap=verify_cap, prec=prec, emb_scale=emb_scale, draft_vocab=draft_vocab)
    with torch.inference_mode():
        engine = Engine.load(EngineConfig(target=target, device=device, dtype=dtype, step_width=step_width,
                                          cuda_graphs=cuda_graphs, env=dict(os.environ), **threads_setting(threads)))
        cpu = use_threads(engine.threads)  # until the command ends; the note comes with the others
        engine.resolve(arm_cfg)  # program and pair first, then the prompt, then the (slow) drafter load
        engine.check_prompt(ids, max_new)
        arm = engine.arm(arm_cfg)
        if arm.mode == "off":
            arm.warnings += _ignored_by_plain(given)
        if defaults_note and not json_out:  # once everything was accepted: a refusal stays one line
            render.note(defaults_note)
        if not json_out:
            _announce(arm, "; ".join(engine.notes), cpu.note)
            for line in sampling_notes(sampling, arm.mode != "off"):
                render.note(line)
        stream = StreamDecoder(codec) if codec else None
        eos = set(engine.target.cfg.eos_token_ids)  # ends the stream; it is not text (the ids keep it)
        with engine.session(ids, max_new, arm, sampler=make_sampler(sampling), timed=True) as session:
            session.prime()
            while not session.finished:
                raise_if_signalled()  # between rounds: a signal whose exception native code swallowed
                new = session.burst(1)
                if not json_out:
                    render.stream_out(stream.push([t for t in new if t not in eos]) if stream else "".join(f"{t} " for t in new))
    stats = session.stats.as_json()
    if arm.mode == "off":  # nothing was drafted: no acceptance (null, as bench reports it), not 0
        stats["acceptance"] = None
    if json_out:
        render.emit_json({
            "tokens": session.tokens, "text": codec.decode([t for t in session.tokens if t not in eos]) if codec else None,
            "mode": arm.mode, "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
            "step_width": engine.step_width, "cuda_graphs": engine.cuda_graphs, "threads": cpu.threads, "threads_wide": cpu.wide,
            "sampling": sampling.as_json(),
            "stats": {k: stats[k] for k in ("rounds", "drafted", "accepted", "tau", "acceptance", "tok_per_s", "phase_ms",
                                            "window_cost") if k in stats},
            "receipts": arm.receipts.as_json() if arm.receipts else None,
            "receipt_lines": arm.receipts.lines() if arm.receipts else [],
            "precision": arm.precision if arm.mode != "off" else None,
            "drafter_load_ms": arm.load_ms,
            "warnings": arm.warnings,
        })
    else:
        render.stream_out("\n")
        if "window_cost" in stats:  # the priced window's cost as this prompt resolved it
            render.note(f"priced window cost: {stats['window_cost']['why']}")
        render.generate_summary(arm.mode, stats)


def _check_flags(*, target: Optional[Path], draft: Optional[Path], spec: str, dtype: str, device: str,
                 step_width: Optional[str], prec: Optional[str], harvest: Optional[str], vt: Optional[str],
                 tau: Optional[str], adapt: Optional[bool], verify_cap: Optional[str],
                 vt_cost: Optional[str] = None) -> None:
    """Everything that can be refused without a checkpoint or torch, first: a typo is answered
    in a fraction of a second, not after torch's two-second import."""
    from memra_cli.cli.checks import (
        check_exists, check_model_dir, check_policy_values, check_prec, check_run_flags, check_spec,
    )

    check_model_dir(target, "--target")
    check_exists(draft, "--draft")  # before the note that names the models in use
    check_spec(spec)
    check_run_flags(dtype, device, step_width)
    check_prec(prec)
    check_policy_values(harvest, vt, tau, adapt, verify_cap, vt_cost)


def _ignored_by_plain(given: dict) -> list[str]:
    """Plain greedy (--spec off, or auto without a drafter) drafts nothing: name every drafter
    setting that was given anyway (flag or environment), rather than ignore it silently."""
    from memra_cli.cli.common import setting_label

    named = [f"--draft {value}" if name == "draft" else setting_label(name, value)
             for name, value in given.items() if value is not None]
    if not named:
        return []
    return [f"plain greedy drafts nothing, so {', '.join(named)} {'has' if len(named) == 1 else 'have'} no effect"]


def _prompt(target: Path, prompt: Optional[str], prompt_ids: Optional[str], chat: bool):
    """(codec or None, prompt ids). Text needs the target's tokenizer; ids decode with it if present."""
    from memra_cli.engine.errors import PromptError
    from memra_cli.engine.text import TextCodec

    if (prompt is None) == (prompt_ids is None):
        raise PromptError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if chat and prompt is None:
        raise PromptError("--chat applies to --prompt text")
    if prompt is not None:
        codec = TextCodec(target)
        return codec, codec.encode(prompt, chat=chat)
    ids = _parse_ids(prompt_ids or "")
    return (TextCodec(target) if (target / "tokenizer.json").is_file() else None), ids


def _announce(arm, width_note: str, threads_note: Optional[str]) -> None:
    """Receipts first, then the drafter precision, the target's step width, the CPU threads and
    any warnings (all on stderr)."""
    from memra_cli.cli import render

    if arm.receipts:
        render.print_receipts(arm.receipts.lines(), to_stderr=True)
        if arm.precision is not None:
            source = "GGUF policy" if arm.precision_source == "GGUF policy" else "--prec / MEMRA_DFLASH_PREC"
            render.note(f"drafter precision {arm.precision} ({source})")
    if arm.load_ms is not None:
        render.note(f"drafter loaded in {arm.load_ms:.0f} ms (weights and one-time tables; not in tok/s)")
    render.note(width_note)
    if threads_note:
        render.note(threads_note)
    for w in arm.warnings:
        render.warn(w)

"""`memra train` as a library call: every check before anything is written, then train, export,
evaluate on held-out prompts through the engine's own round loop, and report.

    plan = plan_training(TrainRequest(...))        # loads the engine, resolves geometry; writes nothing
    report = run_training(plan, on_step=..., should_stop=...)

Layout: the drafter goes to `out` (config.json + model.safetensors + train_report.json), renamed
into place whole; the resumable state lives beside it in `out.ckpt/` (kept after a finished run,
so the run can be inspected or continued with more steps).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memra_cli.engine.errors import ConfigError, SettingError
from memra_cli.engine.files import OutputExistsError
from memra_cli.train.geometry import Geometry, check_target_dir, resolve_geometry, text_config
from memra_cli.train.job import Hyper, Progress, TrainJob
from memra_cli.train.online import OnlineData, Prompts, encode_prompts, thinking_note
from memra_cli.train.taps import EngineTaps


@dataclass(frozen=True)
class TrainRequest:
    target: Path
    kind: str
    prompts: str
    out: Path
    steps: int = 2000
    budget_s: float | None = None
    resume: bool = False
    force: bool = False
    device: str = "auto"
    dtype: str = "auto"
    max_new: int = 128  # the bench's regime: answers of 128 tokens
    max_prompt: int = 512
    heldout: int | None = None
    layers: int | None = None
    block: int | None = None
    taps: tuple[int, ...] | None = None
    mask_token: int | None = None
    markov_rank: int | None = None
    confidence: bool | None = None
    batch: int = 8
    anchors: int = 16
    lr: float = 6e-4
    seed: int = 0
    checkpoint_every: int = 200
    export_dtype: str = "bfloat16"
    eval_new: int = 64
    temperature: float = 0.0  # answers: 0 = greedy, else sampled (engine keyed sampling, seed + prompt index)
    top_p: float = 1.0
    compile: bool | str = False  # the drafter's forward and losses through torch.compile (job.py)
    thinking: bool | None = None  # chat prompts: the template's thinking switch (None: its own default)
    emb_scale: bool | None = None  # block embedding times the target's embed_scale (None/False: raw rows)
    gguf: str | None = None  # a quantize policy: also write OUT/model.POLICY.gguf


@dataclass
class Plan:
    req: TrainRequest
    engine: object
    geometry: Geometry
    prompts: Prompts
    train_rows: list[int]
    heldout_rows: list[int]
    notes: list[str] = field(default_factory=list)

    @property
    def ckpt_dir(self) -> Path:
        return checkpoint_dir(self.req.out)


def checkpoint_dir(out: Path) -> Path:
    return out.with_name(out.name + ".ckpt")


def _check_outputs(req: TrainRequest) -> None:
    if req.out.exists() and not req.force:
        raise OutputExistsError(f"--out {req.out}: already exists (use --force to replace it)")
    ckpt = checkpoint_dir(req.out)
    if req.resume and not (ckpt / "state.pt").is_file():
        raise ConfigError(f"--resume: {ckpt / 'state.pt'} does not exist (no interrupted run of --out {req.out})")
    if not req.resume and ckpt.exists() and not req.force:
        raise OutputExistsError(f"--out {req.out}: {ckpt} holds a run's checkpoint (use --resume to continue it, "
                                "or --force to start over)")


def _split(n: int, heldout: int | None, notes: list[str]) -> tuple[list[int], list[int]]:
    """The last `heldout` prompts are held out for the final tau (default: a tenth, 1..16)."""
    if heldout is None:
        heldout = 0 if n < 2 else max(1, min(16, n // 10))
        notes.append(f"held out: the last {heldout} of {n} prompts for the final tau (default; --heldout)")
    if heldout >= n:
        raise SettingError("heldout", heldout, f"expected fewer than the {n} prompts (some must train)")
    return list(range(n - heldout)), list(range(n - heldout, n))


def plan_training(req: TrainRequest) -> Plan:
    """Check everything (outputs, target, geometry, prompts), load the target through the engine."""
    from memra_cli.engine.api import Engine, EngineConfig
    from memra_cli.engine.models.base import target_family
    from memra_cli.engine.text import TextCodec

    _check_outputs(req)
    if req.gguf is not None:
        from memra_cli.engine.quant.precision import FILE_POLICIES, check_policy

        check_policy(req.gguf, FILE_POLICIES, "--gguf")
    check_target_dir(req.target)
    target_family(req.target)  # a family memra cannot run is refused before anything loads
    geo, notes = resolve_geometry(req.target, req.kind, layers=req.layers, block=req.block, taps=req.taps,
                                  mask_token=req.mask_token, markov_rank=req.markov_rank, confidence=req.confidence)
    if req.max_new < geo.block + 1:
        raise SettingError("max_new", req.max_new, f"expected more than the block size {geo.block}")
    prompts = encode_prompts(req.prompts, TextCodec(req.target), req.max_prompt, req.thinking)
    if prompts.template is not None:
        notes.append(thinking_note(prompts.template))
    train_rows, held = _split(len(prompts.ids), req.heldout, notes)
    _sampling(req)  # refused before the engine loads
    notes.append("drafter forward and losses compiled (--compile)" if req.compile else
                 "drafter eager (default; --compile fuses its elementwise kernels)")
    notes.append("answers: greedy (default; --temperature)" if req.temperature == 0 else
                 f"answers: sampled at temperature {req.temperature}, top-p {req.top_p}, seed {req.seed} + prompt index")
    engine = Engine.load(EngineConfig(target=req.target, device=req.device, dtype=req.dtype))
    engine.target.check_taps(geo.taps)
    geo = _block_embedding(req, engine, geo, notes)
    notes.append(f"target on {engine.device} in {str(engine.dtype).removeprefix('torch.')}: {engine.steps} "
                 "(--device, --dtype)")
    target, family = engine.target, engine.target.cfg.model_type
    limit = f"; {target.batched_taps_limit}" if target.batched_taps_limit else ""
    notes.append(f"taps: each batch's sequences through the target's layers together ({family}{limit})"
                 if target.batched_taps else f"taps: one sequence at a time (the {family} family's forward)")
    return Plan(req, engine, geo, prompts, train_rows, held, notes)


def _block_embedding(req: TrainRequest, engine, geo: Geometry, notes: list[str]) -> Geometry:
    """The block embedding the drafter trains with, as the engine's arm resolves `emb_scale`: the
    target's raw rows, or those rows times its `embed_scale` rounded to the model dtype."""
    from dataclasses import replace

    scale = float(torch.tensor(engine.target.embed_scale, dtype=engine.dtype))
    if geo.backbone == "gemma4":  # the format fixes a scaled block embedding (the engine's arm: only agreeing)
        if req.emb_scale is False:
            raise SettingError("emb_scale", False, "a Gemma4DSparkModel drafter's block embedding is the target's "
                               f"rows scaled by its embed_scale (x{scale:g}); drop --no-emb-scale", quote=False)
        notes.append(f"block embedding: the target's rows scaled x{scale:g} (Gemma4DSparkModel's own)")
        return replace(geo, emb_scale=scale)
    if req.emb_scale:
        notes.append(f"block embedding: the target's rows scaled x{scale:g} (its embed_scale; --emb-scale): "
                     "run the drafter with --emb-scale (a z-lab config.json cannot record it)")
        return replace(geo, emb_scale=scale)
    default = " (default" + (f"; --emb-scale trains with the target's embed_scale x{scale:g})" if scale != 1.0 else ")")
    notes.append(f"block embedding: the target's raw rows{'' if req.emb_scale is False else default}")
    return geo


def _sampling(req: TrainRequest):
    from memra_cli.engine.spec.keyed import SamplingParams

    if req.temperature == 0 and req.top_p == 1.0:
        return None
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed)


def _hyper(req: TrainRequest) -> Hyper:
    return Hyper(steps=req.steps, batch=req.batch, anchors=req.anchors, lr=req.lr, seed=req.seed,
                 checkpoint_every=req.checkpoint_every)


def run_training(plan: Plan, *, on_step: Callable[[Progress], None] = lambda p: None,
                 should_stop: Callable[[], bool] = lambda: False, stop_after: int | None = None) -> dict:
    """Train (resuming when asked), export, evaluate. Returns the report (also written as
    `out/train_report.json`); a run stopped early returns `finished: False` and exports nothing."""
    req, engine = plan.req, plan.engine
    source = EngineTaps(engine.target)
    data = OnlineData(engine, plan.prompts, req.max_new, _sampling(req))
    job = TrainJob(plan.geometry, _hyper(req), data, source, engine.device, plan.train_rows, compile=req.compile)
    if req.resume:
        job.load(plan.ckpt_dir)
    elif plan.ckpt_dir.exists():
        shutil.rmtree(plan.ckpt_dir)  # --force: start over
    resumed_from = job.step if req.resume else None
    result = job.run(plan.ckpt_dir, budget_s=req.budget_s, stop_after=stop_after, should_stop=should_stop,
                     on_step=on_step)
    report = {"target": str(req.target), "kind": req.kind, "prompts": plan.prompts.source,
              "chat_template": plan.prompts.template,
              "geometry": plan.geometry.as_json(), "hyper": json.loads(json.dumps(job.state()["hyper"])),
              "notes": plan.notes, "resumed_from": resumed_from, "steps_planned": job.hyper.steps,
              "steps_run": result.steps_run, "finished": result.finished,
              "stopped_by": result.stopped_by, "tokens": result.tokens, "tokens_this_run": result.tokens_this_run,
              "train_s": round(result.train_s, 3),
              "tokens_per_s": round(result.tokens_this_run / result.train_s, 1) if result.train_s > 0 else None,
              "generated_tokens": data.generated_tokens, "losses": result.losses,
              "checkpoint": str(plan.ckpt_dir / "state.pt")}
    if result.stopped_by in ("signal", "stop_after"):
        return report
    from memra_cli.train.export import write_drafter
    from memra_cli.train.heldout import heldout_tau

    job.drafter.eval()
    out = write_drafter(req.out, job.drafter, plan.geometry, source, dtype=req.export_dtype,
                        num_anchors=req.anchors, target_config=text_config(req.target))
    if req.gguf is not None:  # the quantize command's writer, on the exported drafter
        from memra_cli.engine.quant.gguf_write import write_gguf

        gg = write_gguf(out / f"model.{req.gguf}.gguf", out, req.gguf, overwrite=True)
        report["gguf"] = {"path": str(gg.out), "policy": req.gguf, "file_bytes": gg.file_bytes}
    held = [plan.prompts.ids[i] for i in plan.heldout_rows]
    report["heldout"] = heldout_tau(engine, out, req.kind, held, req.eval_new,
                                                    emb_scale=req.emb_scale) if held else None
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


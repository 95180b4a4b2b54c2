"""A `memra train` job: the training loop with its checkpoints, resume and budget.

One step: draw `batch` prompts (a seeded generator), make their sequences (online.py), take the
target's taps through the engine, draw `anchors` blocks per row after the prompt, one clipped
AdamW step on the shared loss (losses.py `drafter_loss`) under a cosine schedule with warm-up.
Every `checkpoint_every` steps and whenever the run stops early (a signal, the budget) the state
is written atomically (temp file + rename): drafter, optimizer, the step, the batch generator's
and torch's RNG, the losses. `resume` loads it and continues exactly where it was: a run
interrupted and resumed ends with the same weights, bit for bit, as one that was not.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from memra_cli.engine.errors import ConfigError
from memra_cli.engine.files import signals_held
from memra_cli.train.drafter import TrainDrafter
from memra_cli.train.geometry import Geometry
from memra_cli.train.losses import DraftSpec, drafter_loss, sample_anchors, slot_decay
from memra_cli.train.ranks import Ranks
from memra_cli.train.schedule import PLAN_AT_STEP, WARM_STEPS, cosine_lr, fit_steps

STATE_FILE = "state.pt"
# the loss is read (a host sync) and recorded every LOSS_EVERY steps: a read every step would stall
# the CPU until the GPU finishes, and a small drafter's step is launch-bound
LOSS_EVERY = 10
RANK_SEED_STRIDE = 7919  # rank r draws its batches from seed + 1 + r * this: ranks never share a draw


@dataclass(frozen=True)
class Hyper:
    """Optimisation settings (defaults: the embedded build's drafter recipe scaled to one GPU)."""

    steps: int
    batch: int = 8
    anchors: int = 16
    lr: float = 6e-4  # DeepSpec's DSpark configs
    warmup_frac: float = 0.04  # DeepSpec's warmup_ratio
    seed: int = 0
    checkpoint_every: int = 200


@dataclass
class Progress:
    """What a front end shows after each step."""

    step: int
    steps: int
    loss: float  # the last loss read (every LOSS_EVERY steps, and the first and last step)
    tokens: int  # target tokens trained on in this run (sequence positions; a resumed run counts from its start)
    elapsed_s: float  # since this run started


@dataclass
class RunResult:
    steps_run: int
    finished: bool  # False: stopped early (a signal or the budget) with a checkpoint to resume
    stopped_by: str | None
    losses: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0  # over the whole training, resumed parts included
    tokens_this_run: int = 0
    train_s: float = 0.0  # this run's


def new_drafter(geo: Geometry, seed: int) -> torch.nn.Module:
    """The trainable drafter of the geometry's backbone (drafter.py, or drafter_gemma4.py)."""
    torch.manual_seed(seed)
    if geo.backbone == "gemma4":
        from memra_cli.engine.formats.gemma4_config import Gemma4Rope
        from memra_cli.train.drafter_gemma4 import TrainGemma4Drafter

        rope = Gemma4Rope(geo.rope_type, geo.rope_theta, geo.rope_partial, geo.rope_factor)
        return TrainGemma4Drafter(geo.hidden, geo.layers, geo.heads, geo.kv_heads, geo.head_dim, geo.ffn, len(geo.taps),
                                  geo.vocab, k_eq_v=geo.k_eq_v, rope=rope, eps=geo.rms_eps,
                                  markov_rank=geo.markov_rank, confidence=geo.confidence)
    return TrainDrafter(geo.hidden, geo.layers, geo.heads, geo.kv_heads, geo.ffn, len(geo.taps), geo.vocab,
                        markov_rank=geo.markov_rank, confidence=geo.confidence, head_dim=geo.head_dim)


def spec_of(geo: Geometry) -> DraftSpec:
    return DraftSpec(geo.kind, geo.block, geo.taps, geo.mask_id, geo.emb_scale)


class TrainJob:
    """The drafter, its optimizer and the loop's state; `run` trains, `save`/`load` checkpoint."""

    def __init__(self, geo: Geometry, hyper: Hyper, data, source, device: torch.device, train_rows: list[int],
                 compile: bool | str = False, ranks: Ranks = Ranks()):
        """`compile`: the drafter's forward and losses through torch.compile (True: its default
        backend; a string names one), the taps staying eager and gradient-free: an eager step is
        mostly elementwise kernels the compiler fuses (docs/bench.md, the embedded build's profile).
        `ranks`: a data-parallel group (ranks.py); each rank passes its own `data` and
        `train_rows`, all the same geometry, hyper and seed (the same initial drafter)."""
        self.geo, self.hyper, self.data, self.source, self.device = geo, hyper, data, source, device
        self.train_rows, self.ranks = train_rows, ranks
        self.spec = spec_of(geo)
        self.drafter = new_drafter(geo, hyper.seed).to(device).train()
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=hyper.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(hyper.seed + 1 + RANK_SEED_STRIDE * ranks.rank)
        self.step, self.tokens, self.losses = 0, 0, []
        self.decay = slot_decay(self.spec, device)
        self.loss = self._eager_loss
        if compile:
            self.loss = torch.compile(self._eager_loss, **({"backend": compile} if isinstance(compile, str) else {}))

    def _eager_loss(self, ids: torch.Tensor, anc: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        return drafter_loss(self.drafter, self.source, ids, anc, taps, self.spec, self.decay)

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        return {"geometry": self.geo.as_json(), "hyper": asdict(self.hyper), "step": self.step, "tokens": self.tokens,
                "losses": self.losses, "drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(),
                "gen": self.gen.get_state(), "torch_rng": torch.get_rng_state()}

    def save(self, directory: Path) -> Path:
        """Write the state to `directory/state.pt` atomically (a stop mid-write leaves the last one).
        In a data-parallel group only rank 0 writes (every rank holds the same drafter)."""
        if not self.ranks.lead:
            return directory / STATE_FILE
        directory.mkdir(parents=True, exist_ok=True)
        path, tmp = directory / STATE_FILE, directory / f".{STATE_FILE}.{os.getpid()}.tmp"
        with signals_held():
            torch.save(self.state(), tmp)
            os.replace(tmp, path)
        return path

    def load(self, directory: Path) -> None:
        """Continue from `directory/state.pt`; refuses a state of another geometry."""
        path = directory / STATE_FILE
        if not path.is_file():
            raise ConfigError(f"{path}: no checkpoint to resume from (run without --resume first)")
        if self.ranks.world > 1:  # the checkpoint holds rank 0's batch generator only
            raise ConfigError(f"{path}: a data-parallel run ({self.ranks.world} ranks) does not resume; start over")
        st = torch.load(path, map_location=self.device, weights_only=False)
        if st["geometry"] != self.geo.as_json():
            raise ConfigError(f"{path}: the checkpoint's drafter geometry differs from this run's "
                              f"(checkpoint {st['geometry']}, asked {self.geo.as_json()})")
        mine = asdict(self.hyper)
        changed = [k for k in ("batch", "anchors", "lr", "warmup_frac", "seed") if st["hyper"].get(k) != mine[k]]
        if changed:  # a resumed run must be the same run: only its length and checkpoint interval may change
            k = changed[0]
            raise ConfigError(f"{path}: the checkpoint was trained with {k}={st['hyper'].get(k)!r}, this run asks "
                              f"{k}={mine[k]!r} (resume with the same settings, or start over with --force)")
        self.drafter.load_state_dict(st["drafter"])
        self.opt.load_state_dict(st["optimizer"])
        self.gen.set_state(st["gen"])
        torch.set_rng_state(st["torch_rng"])
        self.step, self.tokens, self.losses = st["step"], st["tokens"], [tuple(x) for x in st["losses"]]

    # ------------------------------------------------------------------ the loop

    def one_step(self) -> torch.Tensor:
        """One optimizer step; returns its loss (a 0-d tensor on the device: reading it waits for
        the GPU, which `run` does only every LOSS_EVERY steps)."""
        h, spec = self.hyper, self.spec
        pick = torch.randint(0, len(self.train_rows), (h.batch,), generator=self.gen).tolist()
        ids, lengths, plens = self.data.batch([self.train_rows[i] for i in pick], pad=spec.mask_id)
        anc = sample_anchors(h.batch, h.anchors, plens - 1, lengths - 1 - spec.block, self.gen)
        ids, anc = ids.to(self.device), anc.to(self.device)
        taps = self.source.tap_batch(ids, spec.taps, lengths.tolist())
        for g in self.opt.param_groups:
            g["lr"] = cosine_lr(self.step, h.steps, h.lr, max(1, int(h.steps * h.warmup_frac)))
        loss = self.loss(ids, anc, taps)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.ranks.average_grads(self.drafter.parameters())
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.opt.step()
        self.tokens += int(lengths.sum()) * self.ranks.world  # every rank's batch is the same size
        return loss.detach()

    def run(self, ckpt_dir: Path | None, *, budget_s: float | None = None, stop_after: int | None = None,
            should_stop: Callable[[], bool] = lambda: False,
            on_step: Callable[[Progress], None] = lambda p: None) -> RunResult:
        """Train up to `hyper.steps` (or until `budget_s` seconds, or `stop_after` more steps, or
        `should_stop()`), checkpointing every `checkpoint_every` steps and at any early stop
        (`ckpt_dir` None: no checkpoints). With a budget, the total is re-planned once from the
        steady step time (`schedule.fit_steps`) so the cosine schedule ends inside the budget.
        A signal's exception (Ctrl-C) is held until the step ends, then the state is saved and
        the exception goes on."""
        t0, start, tokens0 = time.perf_counter(), self.step, self.tokens
        t_warm, stopped_by, loss = t0, None, None
        try:
            while self.step < self.hyper.steps:
                stopped_by = self._stop_reason(should_stop, budget_s, t0, self.step - start)
                if stopped_by is not None:
                    break
                if stop_after is not None and self.step - start >= stop_after:
                    stopped_by = "stop_after"
                    break
                t_warm = self._plan(budget_s, self.step - start, t0, t_warm)
                with signals_held():
                    step_loss = self.one_step()
                    self.step += 1
                    if self.step % LOSS_EVERY == 0 or self.step == self.hyper.steps or loss is None:
                        loss = float(step_loss)
                        if self.step % LOSS_EVERY == 0 or self.step == self.hyper.steps:
                            self.losses.append((self.step, round(loss, 5)))
                on_step(Progress(self.step, self.hyper.steps, loss, self.tokens - tokens0, time.perf_counter() - t0))
                if ckpt_dir is not None and self.step % self.hyper.checkpoint_every == 0:
                    self.save(ckpt_dir)
        except Exception:
            raise  # a fault mid-step: the last periodic checkpoint stands
        except BaseException:
            if ckpt_dir is not None:
                self.save(ckpt_dir)  # the state after the last whole step (signals_held let it finish)
            raise
        if ckpt_dir is not None:
            self.save(ckpt_dir)
        return RunResult(self.step, self.step >= self.hyper.steps, stopped_by, list(self.losses), self.tokens,
                         self.tokens - tokens0, time.perf_counter() - t0)

    def _stop_reason(self, should_stop, budget_s: float | None, t0: float, ran: int) -> str | None:
        """"signal", "budget" or None. Ranks of a group agree every LOSS_EVERY steps (an
        all-reduce is a host sync), so all of them stop at the same step."""
        if self.ranks.world > 1 and ran % LOSS_EVERY:
            return None
        if should_stop():
            reason = 1
        elif budget_s is not None and time.perf_counter() - t0 >= budget_s:
            reason = 2
        else:
            reason = 0
        reason = self.ranks.agree(reason, self.device, op="max")
        return (None, "signal", "budget")[reason]

    def _plan(self, budget_s: float | None, ran: int, t0: float, t_warm: float) -> float:
        """Before this run's step `ran`: at WARM_STEPS note the time (the steps before pay start-up
        and compilation), at PLAN_AT_STEP fit `hyper.steps` to the budget. Returns t_warm."""
        if budget_s is None or ran not in (WARM_STEPS, PLAN_AT_STEP):
            return t_warm
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if ran == WARM_STEPS:
            return now
        start = self.step - ran
        planned = start + fit_steps(self.hyper.steps - start, ran, t0, t_warm, now, budget_s)
        planned = self.ranks.agree(planned, self.device)  # the slowest rank's plan: every rank runs it
        self.hyper = replace(self.hyper, steps=planned)
        return t_warm

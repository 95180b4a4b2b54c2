"""The learning-rate schedule and the plain training loop the embedded build runs (cosine with
warm-up, clipped AdamW steps, a wall-clock budget planned from the steady step time)."""

from __future__ import annotations

import math

import torch

def fit_steps(steps: int, step: int, t0: float, t_warm: float, now: float, budget_s: float | None) -> int:
    """Re-plan the total so the run fits `budget_s`, from the steady step time measured since
    step WARM_STEPS (the first steps pay CUDA start-up and allocator warm-up, which would
    shrink the planned total far below what the budget holds). The cosine schedule is re-planned around
    the new total, so it still finishes its decay."""
    if budget_s is None or step <= WARM_STEPS:
        return steps
    per_step = (now - t_warm) / (step - WARM_STEPS)
    remaining = budget_s - (now - t0)
    return max(step + 1, min(steps, step + int(remaining / per_step)))


WARM_STEPS = 10
PLAN_AT_STEP = 40


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def optimize(params, opt, steps: int, lr: float, device, loss_fn, log, label: str, budget_s: float | None = None,
             log_every: int = 200, stop=None) -> tuple[list[float], int]:
    """The shared training loop: cosine LR with warm-up, clipped AdamW steps, a wall-clock
    budget planned from steady-state step time. `loss_fn(step) -> loss`. Returns (losses logged,
    steps actually run). `stop(step) -> bool`, when given, is asked after every step and ends the
    run early (early stopping)."""
    import time

    losses, t0, t_warm, step = [], time.time(), 0.0, 0
    while step < steps:
        if step == WARM_STEPS:
            _sync(device)
            t_warm = time.time()
        if step == PLAN_AT_STEP:
            _sync(device)
            steps = fit_steps(steps, step, t0, t_warm, time.time(), budget_s)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, max(1, steps // 20))
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            losses.append(loss.item())
            log(f"{label} step {step}/{steps} loss {loss.item():.3f}")
        step += 1
        if stop is not None and stop(step):
            log(f"{label} stopped early at step {step}/{steps}")
            return losses, step
    return losses, steps

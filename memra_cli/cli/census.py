"""`memra census CKPT`: what a drafter checkpoint is and what the engine will do with it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from memra_cli.cli.common import AdaptOpt, HarvestOpt, JsonOpt, TauOpt, VtOpt, policy_settings, refusals


@refusals
def census(
    ckpt: Path = typer.Argument(..., help="Drafter checkpoint: a directory (config.json + safetensors) or a memra .gguf file."),
    json_out: bool = JsonOpt,
    harvest: Optional[str] = HarvestOpt,
    vt: Optional[str] = VtOpt,
    tau: Optional[str] = TauOpt,
    adapt: Optional[bool] = AdaptOpt,
) -> None:
    """Inspect a drafter checkpoint and print the receipts the engine would run with.

    Reports the exporter and training strategy, markov / confidence heads, rope (YaRN divisors
    and mscale), the per-layer attention layout, the tensor census and size, then the harvest
    convention and verify-window policy with the reason for each.

    Reads headers only: a multi-GB checkpoint is inventoried in well under a second. Exits
    non-zero with one `error:` line when the checkpoint would be refused at load.
    """
    from memra_cli.cli import render
    from memra_cli.engine.formats.census import take_census
    from memra_cli.engine.spec.policy import resolve_receipts

    settings = policy_settings(harvest, vt, tau, adapt)
    result = take_census(ckpt)
    receipts = resolve_receipts(settings, result.strategy_dspark, result.confidence is not None)
    if json_out:
        render.emit_json(render.census_json(result, receipts))
    else:
        render.census_report(result, receipts)

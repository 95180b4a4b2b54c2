"""The sampling flags `generate` and `bench` share: --temperature/--top-k/--top-p/--min-p/--seed.

Values arrive as text and are parsed by the engine (`SamplingParams.parse`), so a bad value is
one `error:` line naming the flag (exit 2), not a usage box.
"""

from __future__ import annotations

from typing import Optional

import typer

TEMPERATURE_HELP = ("Sampling temperature: 0 (default) = greedy (argmax); > 0 samples with the "
                    "position-keyed rule (docs/sampling.md): lossless, and with the same --seed the speculative "
                    "stream equals plain sampling token for token.")
TOP_K_HELP = "Sample among the K most likely tokens only (0 = off, the default). Ignored at temperature 0."
TOP_P_HELP = "Nucleus sampling: the smallest set of most likely tokens with probability >= P, in (0, 1] (1 = off). Ignored at temperature 0."
MIN_P_HELP = "Drop tokens less likely than MIN_P x the most likely one, in [0, 1) (0 = off). Ignored at temperature 0."
SEED_HELP = "Seed of the position-keyed sampler, an integer (default 0, said in a note). Ignored at temperature 0."
ACCEPTANCE_HELP = ("The acceptance rule at temperature > 0: keyed (default: a draft is kept while it equals the "
                   "target's own position-keyed sample; the stream equals plain sampling with the same --seed) | "
                   "rejection (drafts sampled from the drafter, kept with probability min(1, p/q), residual "
                   "resampled: lossless in distribution, not identical to plain sampling).")

TemperatureOpt = typer.Option(None, "--temperature", help=TEMPERATURE_HELP)
TopKOpt = typer.Option(None, "--top-k", help=TOP_K_HELP)
TopPOpt = typer.Option(None, "--top-p", help=TOP_P_HELP)
MinPOpt = typer.Option(None, "--min-p", help=MIN_P_HELP)
SeedOpt = typer.Option(None, "--seed", help=SEED_HELP)
AcceptanceOpt = typer.Option(None, "--acceptance", help=ACCEPTANCE_HELP)

def sampling_params(temperature: Optional[str], top_k: Optional[str], top_p: Optional[str], min_p: Optional[str],
                    seed: Optional[str], acceptance: Optional[str] = None):
    """Flags as given -> engine SamplingParams (refuses in one line naming the setting)."""
    from memra_cli.engine.spec.keyed import SamplingParams

    return SamplingParams.parse(temperature, top_k, top_p, min_p, seed, acceptance)


def sampling_notes(params, speculative: bool) -> list[str]:
    """What a sampled run applied (params, the seed and whether it was the default) and, for a
    speculative run, the acceptance rule. Greedy: nothing (the output is as it always was)."""
    if params.greedy:
        return []
    from memra_cli.engine.spec.keyed import make_sampler

    notes = [params.describe()]
    if speculative:
        notes.append(f"acceptance: {make_sampler(params).acceptance}")
    return notes

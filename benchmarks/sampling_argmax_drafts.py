"""tau at temperature 1 with argmax drafts under the position-keyed rule (the comparison row of
docs/sampling.md): the same bench as `memra bench --n 20 --max-new 64 --temperature 1`, with a
sampler whose drafting is switched off, so drafts are the drafter's argmax / greedy markov chain.

    OMP_NUM_THREADS=1 python benchmarks/sampling_argmax_drafts.py
"""

from __future__ import annotations

import torch

from memra_cli.engine.bench import BenchRequest, prepare_bench
from memra_cli.engine.spec.keyed import PositionKeyed, SamplingParams


class ArgmaxDrafts(PositionKeyed):
    def drafting(self, positions, vocab):
        return None  # proposer.draft_heads then drafts argmax / the greedy markov chain


def main() -> None:
    torch.set_num_threads(1)
    params = SamplingParams(temperature=1.0)
    bench = prepare_bench(BenchRequest(target=None, draft=None, prompts="humaneval", n=20, max_new=64, chat=False,
                                       arms=["dflash", "dspark"], warmup=0, dtype="auto", device="cpu",
                                       sampling=params))
    sampler = ArgmaxDrafts(params)
    for arm in bench.arms:
        arm.sampler = sampler
    for a in bench.run().as_json()["arms"]:
        acc = "-" if a["acceptance"] is None else f"{a['acceptance']:.3f}"
        print(f"{a['name']:8s} tau {a['tau']:.3f}  acceptance {acc}  exact {a['exact']}  tokens {a['tokens']}")


if __name__ == "__main__":
    main()

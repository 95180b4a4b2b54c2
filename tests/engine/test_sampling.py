"""Sampling at temperature > 0 (engine/spec/keyed.py): settings, the keyed hash, the one logit
processor, and seeded streams that are token-for-token identical between speculative and plain
decoding for every program.

- `SamplingParams` refuses bad values in one line naming the setting; temperature 0 is `GREEDY`.
- The hash: the tensor `mix32` equals an independent Python-int lowbias32, is a bijection, and
  `keyed_bits` matches a Python-int evaluation of its formula (seeds past 2^64, negative seeds).
- Rows are independent: a row's processed scores, noise and token are bit-identical whether it
  is selected alone or among other rows (the property that makes a verify row's token equal the
  plain step's token).
- Seeded streams over test_spec's world (tiny target, tiny drafters, planted markov heads):
  every program in `CASES`, at width 16, T in {0.3, 0.7, 1.0, 1.5}, top-p 0.9 and without:
  the speculative stream equals plain sampling (a `Session` without a proposer, and the naive
  `sampled_reference`), with partial acceptance; a different seed gives a different stream.
  The oracle proposer (test_spec) proposes the *sampled* continuation with planted errors: the
  accounting is the greedy one, exactly.

Losslessness in distribution is tested in test_sampling_distribution.py.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.errors import SettingError
from memra_cli.engine.greedy import sampled_reference
from memra_cli.engine.spec.keyed import (
    DEFAULT_SEED, PositionKeyed, SamplingParams, keyed_bits, keyed_gumbel, make_sampler, mix32, process_logits,
    processed_probs, seed_keys,
)
from memra_cli.engine.spec.policy import LADDER, Harvest, PolicySettings, VerifyWindow
from memra_cli.engine.spec.proposer import Program
from memra_cli.engine.spec.sampling import GREEDY
from memra_cli.engine.spec.session import Session
from memra_cli.engine.runtime.steps import StepRunner

from test_spec import (  # noqa: F401  (world, ckpts: module fixtures shared with the greedy tests)
    CASES, MAX_NEW, ORACLE_TAPS, PARTIAL, PROMPT_LENS, VOCAB, OracleProposer, check_stats, ckpts, simulate,
    world,
)

TEMPERATURES = (0.3, 0.7, 1.0, 1.5)
TOP_PS = (1.0, 0.9)
WIDTH = 16


# --------------------------------------------------------------------------- settings


BAD = [
    ({"temperature": -0.5}, "temperature=-0.5: expected a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"temperature": float("inf")}, "temperature=inf"),
    ({"temperature": "1"}, "temperature=1: expected"),
    ({"top_k": -1}, "top_k=-1: expected an integer >= 0"),
    ({"top_k": 2.5}, "top_k=2.5: expected an integer >= 0"),
    ({"top_p": 0.0}, "top_p=0.0: expected a number in (0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5: expected a number in (0, 1]"),
    ({"min_p": 1.0}, "min_p=1.0: expected a number in [0, 1)"),
    ({"min_p": -0.1}, "min_p=-0.1: expected a number in [0, 1)"),
    ({"seed": 1.5}, "seed=1.5: expected an integer"),
    ({"seed": "7"}, "seed=7: expected an integer"),
    ({"seed": True}, "seed=True: expected an integer"),
]


@pytest.mark.parametrize("kw, message", BAD, ids=[str(kw) for kw, _ in BAD])
def test_bad_settings_refuse_in_one_line(kw, message):
    with pytest.raises(SettingError) as e:
        SamplingParams(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert e.value.setting == next(iter(kw))


@pytest.mark.parametrize("texts, message", [
    ({"temperature": "-1"}, "temperature=-1: expected a finite number >= 0"),
    ({"temperature": "hot"}, "temperature=hot: expected a finite number >= 0"),
    ({"top_p": "0"}, "top_p=0: expected a number in (0, 1]"),
    ({"top_k": "3.0"}, "top_k=3.0: expected an integer >= 0"),
    ({"seed": "0.5"}, "seed=0.5: expected an integer"),
    ({"seed": "x"}, "seed=x: expected an integer"),
])
def test_parse_refuses_naming_the_value_as_given(texts, message):
    with pytest.raises(SettingError) as e:
        SamplingParams.parse(**texts)
    assert str(e.value) == message or str(e.value).startswith(message)
    flag = "--" + next(iter(texts)).replace("_", "-")
    assert e.value.flag_message(flag).startswith(f"{flag} {next(iter(texts.values()))}: ")


def test_parse_and_defaults():
    p = SamplingParams.parse("0.7", "40", "0.9", "0.05", "-3")
    assert p == SamplingParams(0.7, 40, 0.9, 0.05, -3)
    assert SamplingParams.parse() == SamplingParams() and SamplingParams().greedy
    assert SamplingParams(temperature=1).applied_seed == DEFAULT_SEED == 0
    assert SamplingParams(temperature=1, seed=9).applied_seed == 9 and SamplingParams(seed=9).applied_seed is None
    j = SamplingParams(temperature=1.0, top_p=0.9).as_json()
    assert j["seed"] == 0 and j["seed_source"] == "default" and j["sampler"] == "position-keyed"
    assert j["acceptance"].startswith("position-keyed sampling (seed 0): a draft is kept while it equals the "
                                      "target's own sample at its position; lossless")
    assert SamplingParams(temperature=0.5, seed=4).describe() == "sampling: temperature 0.5, seed 4 (--seed)"
    assert SamplingParams(temperature=1).describe() == "sampling: temperature 1, seed 0 (default; --seed)"
    assert SamplingParams().as_json()["sampler"] == "greedy"


def test_temperature_zero_is_the_greedy_sampler_itself():
    for p in (None, SamplingParams(), SamplingParams(top_k=3, top_p=0.5, min_p=0.2, seed=5)):
        assert make_sampler(p) is GREEDY
    assert isinstance(make_sampler(SamplingParams(temperature=1e-3)), PositionKeyed)
    with pytest.raises(ValueError):
        PositionKeyed(SamplingParams())


# --------------------------------------------------------------------------- the hash


def lowbias32_ref(x: int) -> int:
    """Independent lowbias32 over Python ints (mod 2^32 by %)."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) % 2**32
    x ^= x >> 15
    x = (x * 0x735A2D97) % 2**32
    x ^= x >> 15
    return x


def test_mix32_is_lowbias32_and_a_bijection():
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    xs[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
    got = mix32(xs)
    assert got.tolist() == [lowbias32_ref(x) for x in xs.tolist()] == [mix32(x) for x in xs.tolist()]
    block = torch.arange(2**20, dtype=torch.int64) * 4093 % 2**32
    assert mix32(block).unique().numel() == 2**20
    assert int(mix32(torch.tensor([2**32 - 1])).max()) < 2**32


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 3, 2**64 + 5, -7])
def test_keyed_bits_is_its_formula(seed):
    k0, k1, k2, k3 = seed_keys(seed)
    assert len({k0, k1, k2, k3}) == 4 and all(0 <= k < 2**32 for k in (k0, k1, k2, k3))
    m = lowbias32_ref
    positions = torch.tensor([0, 5, 2047, 40000])
    bits = keyed_bits((k0, k1, k2, k3), positions, 64)
    assert bits.shape == (4, 64) and bits.dtype == torch.int64
    for r, j in enumerate(positions.tolist()):
        a, b = m(j ^ k0), m(j ^ k1)
        assert bits[r].tolist() == [m(m(v ^ a) ^ b) for v in range(64)]
    if seed == 2**64 + 5:
        assert seed_keys(seed) == seed_keys(5)


def test_noise_is_gumbel_and_independent_across_positions_and_seeds():
    g = keyed_gumbel(seed_keys(0), torch.arange(2000), 512).flatten()
    assert torch.isfinite(g).all() and g.max() < 23.0
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.std().item() - math.pi / math.sqrt(6)) < 0.01
    a = keyed_gumbel(seed_keys(0), torch.arange(64), 4096)
    b = keyed_gumbel(seed_keys(1), torch.arange(64), 4096)
    c = torch.corrcoef(torch.stack([a[:-1].flatten(), a[1:].flatten(), b[:-1].flatten()]))
    assert (c - torch.eye(3, dtype=c.dtype)).abs().max() < 0.01  # neighbours and seeds uncorrelated


# --------------------------------------------------------------------------- processing


def test_process_logits_rules():
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda **kw: torch.isfinite(process_logits(lp, SamplingParams(temperature=1.0, **kw)))[0].tolist()  # noqa: E731
    assert keep() == [True] * 4
    assert keep(top_k=2) == [True, True, False, False] and keep(top_k=9) == [True] * 4
    assert keep(top_p=0.5) == [True, False, False, False]  # mass before token 1 is 0.5: not < 0.5
    assert keep(top_p=0.51) == [True, True, False, False]
    assert keep(top_p=0.9) == [True, True, True, False]
    assert keep(min_p=0.29) == [True, True, True, False]  # 0.15 >= 0.29 * 0.5 > 0.05
    assert keep(min_p=0.61) == [True, False, False, False]
    assert keep(top_k=3, top_p=0.9, min_p=0.4) == [True, True, False, False]
    ties = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert torch.isfinite(process_logits(ties, SamplingParams(temperature=1.0, top_k=1)))[0].tolist() == [False, True, True, False]
    p = processed_probs(lp, SamplingParams(temperature=2.0, top_k=3))[0]
    want = torch.softmax(lp[0, :3].double() / 2.0, -1)
    assert torch.allclose(p[:3], want) and p[3] == 0.0
    assert processed_probs(lp, SamplingParams())[0].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.9}, {"top_k": 20, "min_p": 0.02}, {"top_k": 50, "top_p": 0.7, "min_p": 0.01}])
def test_a_row_selects_the_same_alone_or_among_others(kw):
    """Scores, noise and token of a row do not depend on the other rows of its tensor."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 4096, generator=g) * 3
    positions = torch.arange(1000, 1016)
    s = PositionKeyed(SamplingParams(temperature=0.8, seed=11, **kw))
    together = s.scores(logits, positions)
    tokens = s.select(logits, positions)
    for r in range(16):
        alone = s.scores(logits[r : r + 1], positions[r : r + 1])
        assert torch.equal(alone, together[r : r + 1])
        assert s.select(logits[r : r + 1], positions[r : r + 1]).item() == tokens[r].item()
    # the token is keyed by position and seed: the same logits elsewhere (or another seed) differ
    same = logits[:1].expand(64, -1)
    assert len(set(s.select(same, torch.arange(64)).tolist())) > 1
    other = PositionKeyed(SamplingParams(temperature=0.8, seed=12, **kw))
    assert s.select(logits, positions).tolist() != other.select(logits, positions).tolist()


# --------------------------------------------------------------------------- seeded streams


def params_id(t: float, top_p: float) -> str:
    return f"T{t}" + (f"-p{top_p}" if top_p < 1 else "")


@pytest.fixture(scope="module")
def engine16(world) -> Engine:
    return Engine.from_model(world.target, step_width=WIDTH)


@pytest.fixture(scope="module")
def plain_streams(world, engine16) -> dict:
    """(prompt, T, top_p, seed) -> plain sampled stream (a Session without a proposer), checked
    against the naive `sampled_reference` (one token per step)."""
    out = {}
    for pi, prompt in enumerate(world.prompts):
        for t in TEMPERATURES:
            for top_p in TOP_PS:
                for seed in (0, 1):
                    s = make_sampler(SamplingParams(temperature=t, top_p=top_p, seed=seed))
                    plain = engine16.session(prompt, MAX_NEW, None, sampler=s, eos_ids=()).run()
                    if seed == 0:
                        assert plain == sampled_reference(engine16.runner, prompt, MAX_NEW, s), (pi, t, top_p)
                    out[pi, t, top_p, seed] = plain
    return out


def test_a_different_seed_gives_a_different_stream(world, plain_streams):
    for pi in range(len(world.prompts)):
        for t in TEMPERATURES:
            for top_p in TOP_PS:
                assert plain_streams[pi, t, top_p, 0] != plain_streams[pi, t, top_p, 1], (pi, t, top_p)
    # and none of them is the greedy stream
    assert all(plain_streams[pi, 1.0, 1.0, 0] != world.truths[pi][:MAX_NEW] for pi in range(len(world.prompts)))


@pytest.mark.parametrize("name", list(CASES))
def test_seeded_speculative_stream_equals_plain_sampling(world, ckpts, engine16, plain_streams, name):
    """Every program, every temperature, top-p 0.9 and without, at width 16: token for token."""
    case = CASES[name]
    arm = engine16.arm(ArmConfig(draft=ckpts[case.ckpt], mode=case.mode, settings=PolicySettings(**case.settings),
                                 markov=case.markov, verify_cap=case.cap))
    totals = Counter()
    k = list(CASES).index(name)
    for i, t in enumerate(TEMPERATURES):
        for top_p in TOP_PS:
            pi, seed = (k + i) % len(PROMPT_LENS), (k + i) % 2
            s = make_sampler(SamplingParams(temperature=t, top_p=top_p, seed=seed))
            session = engine16.session(world.prompts[pi], MAX_NEW, arm, sampler=s, eos_ids=())
            assert session.run() == plain_streams[pi, t, top_p, seed], (name, params_id(t, top_p), pi, seed)
            st = session.stats
            assert st.accepted + st.rounds == MAX_NEW == st.tokens
            totals.update(accepted=st.accepted, drafted=st.drafted)
            if t == 0.3:
                totals.update(accepted_03=st.accepted, drafted_03=st.drafted)
    if case.ckpt.startswith("spark") and case.want[2]:
        # the planted markov head knows the greedy bigrams: at low temperature drafts are often
        # the target's sample, and sometimes not
        assert 0 < totals["accepted_03"] < totals["drafted_03"], totals


def test_seeded_streams_at_variable_width(world, ckpts):
    """The variable-width runner (each step at its own width): still identical on CPU float32
    for these prompts (not guaranteed in bf16: the default width 16 is what makes it structural)."""
    engine = Engine.from_model(world.target)
    for name in ("dflash-zlab8-hdspark-cap4-fixed", "dspark-spark8-conf-tau03"):
        case = CASES[name]
        arm = engine.arm(ArmConfig(draft=ckpts[case.ckpt], mode=case.mode, settings=PolicySettings(**case.settings),
                                   markov=case.markov, verify_cap=case.cap))
        for t, top_p in ((0.7, 1.0), (1.5, 0.9)):
            s = make_sampler(SamplingParams(temperature=t, top_p=top_p, seed=3))
            for prompt in world.prompts[1:]:
                plain = sampled_reference(engine.runner, prompt, MAX_NEW, s)
                assert engine.session(prompt, MAX_NEW, arm, sampler=s, eos_ids=()).run() == plain, (name, t, prompt)


@pytest.mark.parametrize("t, top_p", [(0.7, 1.0), (1.0, 0.9), (1.5, 1.0)])
def test_oracle_proposing_the_sampled_stream_keeps_the_greedy_accounting(world, t, top_p):
    """OracleProposer proposes the *sampled* continuation with planted errors (a wrong draft is
    the right one + 1): every right draft is the target's own sample, so the accepted counts
    are exactly those of the greedy model of the round, for the ladder and confidence windows."""
    s = make_sampler(SamplingParams(temperature=t, top_p=top_p, seed=21))
    runner = StepRunner(world.target, WIDTH)
    for pi, prompt in enumerate(world.prompts):
        truth = sampled_reference(runner, prompt, MAX_NEW + 16, s)
        for window, raws, sizes in (
            (LADDER, None, None),
            (VerifyWindow("confidence-slot", 0.5), lambda r: [3.0] * (r % 5) + [-3.0] * (7 - r % 5),
             lambda r: min(max(1 + r % 5, 2), 8)),
        ):
            program = Program(Harvest.DFLASH, window, False, 8, True, 8)
            oracle = OracleProposer(truth, len(prompt), 7, world.target.device, PARTIAL, raws)
            session = Session(runner, prompt, MAX_NEW, proposer=oracle, program=program, taps=ORACLE_TAPS,
                              sampler=s)
            assert session.run() == truth[:MAX_NEW]
            first_wrong = lambda r: min(PARTIAL[r], default=7) if r < len(PARTIAL) else 7  # noqa: E731
            check_stats(session, simulate(first_wrong, MAX_NEW, 8, True, sizes))
            assert session.stats.accepted > 0


# --------------------------------------------------------------------------- drafts at temperature > 0


@pytest.mark.parametrize("name", ["dspark-spark8-ladder", "dflash-zlab8-hdspark-cap4-fixed"])
@pytest.mark.parametrize("rule", ["keyed", "rejection"])
def test_drafts_are_the_drafters_keyed_samples(world, ckpts, name, rule):
    """At T > 0 draft k is argmax(process(drafter scores_k [+ markov bias of the previous
    draft]) + noise keyed to position start + k): the target's own noise under the position-keyed
    rule (coupled drafts), the drafts' own stream under rejection sampling, which also keeps q."""
    from memra_cli.engine.formats.census import take_census
    from memra_cli.engine.layers.ops import linear
    from memra_cli.engine.models.drafter import Drafter
    from memra_cli.engine.api import resolve_program
    from memra_cli.engine.spec.keyed import DRAFT_STREAM
    from memra_cli.engine.spec.proposer import DrafterProposer

    case = CASES[name]
    census = take_census(ckpts[case.ckpt])
    program, _, _ = resolve_program(case.mode, census, PolicySettings(**case.settings), case.markov, case.cap)
    drafter = Drafter.load(ckpts[case.ckpt], census=census)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, acceptance=rule)
    sampler = make_sampler(params)
    proposer = DrafterProposer(drafter, world.target, program, sampler=sampler)
    prompt = world.prompts[1]
    runner = StepRunner(world.target)
    cache = runner.new_state(len(prompt) + 1)
    _, taps = runner.prefill(torch.tensor(prompt), cache, census.config.target_layer_ids)
    proposer.reset(len(prompt) + 1)
    proposer.ingest(taps, torch.arange(len(prompt)))
    last, start, b = torch.tensor([17]), len(prompt), program.block_size
    got = proposer.propose(last, start, False)
    # the reference: the same hidden rows, the chain written out
    proposer.block_ids[0] = 17
    hidden = drafter.forward_round(proposer.kv, world.target.embed(proposer.block_ids), torch.arange(start, start + b)).hidden_out
    rows = hidden[program.harvest.first_row : program.harvest.first_row + program.n_drafts]
    logits = world.target.logits(rows)
    keys = seed_keys(5, DRAFT_STREAM) if rule == "rejection" else seed_keys(5)
    noise = keyed_gumbel(keys, torch.arange(start, start + program.n_drafts), VOCAB)
    prev, chain, qs = 17, [], []
    for k in range(program.n_drafts):
        scores = logits[k : k + 1]
        if program.markov:
            scores = scores + linear(drafter.markov_w1[torch.tensor([prev])], drafter.markov_w2).float()
        z = process_logits(scores, params)
        prev = int(torch.argmax(z + noise[k : k + 1]))
        chain.append(prev)
        qs.append(torch.softmax(z, -1))
    assert got.drafts.tolist() == chain
    if rule == "rejection":
        assert torch.equal(got.probs, torch.cat(qs)) and (got.probs.gather(1, got.drafts[:, None]) > 0).all()
    else:
        assert got.probs is None


def test_rejection_sampling_sessions(world, ckpts, engine16):
    """Rejection sampling runs every program: exactly max_new tokens, the accounting holds,
    plain decoding with it is position-keyed plain sampling; its speculative stream is a
    different sample than the plain one (lossless in distribution only)."""
    differs = 0
    for name in ("dspark-spark8-conf-tau03", "dflash-zlab16", "dspark-spark16-fixed-cap9", "dspark-spark4-defaults"):
        case = CASES[name]
        arm = engine16.arm(ArmConfig(draft=ckpts[case.ckpt], mode=case.mode, settings=PolicySettings(**case.settings),
                                     markov=case.markov, verify_cap=case.cap))
        for t in (0.7,) if name == "dflash-zlab16" else (1.0,):
            rs = make_sampler(SamplingParams(temperature=t, seed=2, acceptance="rejection"))
            keyed = make_sampler(SamplingParams(temperature=t, seed=2))
            for pi, prompt in enumerate(world.prompts):
                session = engine16.session(prompt, MAX_NEW, arm, sampler=rs, eos_ids=())
                out = session.run()
                st = session.stats
                assert len(out) == MAX_NEW == st.tokens and st.accepted + st.rounds == MAX_NEW
                plain = engine16.session(prompt, MAX_NEW, None, sampler=rs, eos_ids=()).run()
                assert plain == engine16.session(prompt, MAX_NEW, None, sampler=keyed, eos_ids=()).run()
                differs += out != plain
                assert out[0] == plain[0]  # the prefill's token is the target's own keyed sample
    assert differs > 0


def test_rejection_verify_rows():
    """`verify`: p == q keeps every draft; a draft where p is 0 is rejected for a residual token
    that is never the draft; after a kept window the last row is the target's keyed sample."""
    from memra_cli.engine.spec.keyed import RejectionSampling

    s = RejectionSampling(SamplingParams(temperature=1.0, seed=4, acceptance="rejection"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32, generator=g)
    positions = torch.arange(50, 54)
    q = torch.softmax(process_logits(logits, s.params), -1)
    cand = torch.tensor([1, 5, 6, 7])
    vam = s.verify(logits, cand, q[:3], positions)
    assert vam[:3].tolist() == [5, 6, 7] and vam[3] == s.select(logits[3:], positions[3:])
    masked = logits.clone()
    masked[1, 6] = -math.inf  # the target cannot say 6 after row 1
    vam = s.verify(masked, cand, q[:3], positions)
    assert vam[0] == 5 and vam[1] != 6
    assert s.verify(logits[:1], cand[:1], q[:0], positions[:1]).tolist() == s.select(logits[:1], positions[:1]).tolist()


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draft_graphs", [False, True], ids=["drafter-eager", "drafter-graphed"])
def test_cuda_bf16_graphed_seeded_streams_equal_plain(world, ckpts, draft_graphs):
    """bf16 on CUDA, 16-row steps replayed as CUDA graphs (and the drafter's rounds graphed, with
    the coupled drafts inside the graph): speculative == plain sampling, token for token, at every
    temperature, top-p 0.9 and without. The keyed words are the same on both devices."""
    from memra_cli.engine.models.qwen3 import Qwen3Target
    from memra_cli.engine.runtime.pool import StoragePool

    positions = torch.arange(0, 4096, 37)
    assert torch.equal(keyed_bits(seed_keys(9), positions.cuda(), 512).cpu(), keyed_bits(seed_keys(9), positions, 512))
    target = Qwen3Target.from_dir(world.target_dir, torch.bfloat16, "cuda")
    engine = Engine.from_model(target, step_width=WIDTH, cuda_graphs=True, draft_graphs=draft_graphs,
                               pool=StoragePool())
    for name in ("dflash-zlab16", "dspark-spark8-conf-tau03", "dspark-spark16-fixed-cap9", "dspark-spark4-defaults"):
        case = CASES[name]
        arm = engine.arm(ArmConfig(draft=ckpts[case.ckpt], mode=case.mode, settings=PolicySettings(**case.settings),
                                   markov=case.markov, verify_cap=case.cap))
        for t in TEMPERATURES:
            for top_p in TOP_PS:
                s = make_sampler(SamplingParams(temperature=t, top_p=top_p, seed=7))
                for pi, prompt in enumerate(world.prompts):
                    plain = engine.session(prompt, MAX_NEW, None, sampler=s, eos_ids=()).run()
                    spec = engine.session(prompt, MAX_NEW, arm, sampler=s, eos_ids=()).run()
                    assert spec == plain, (name, t, top_p, pi)

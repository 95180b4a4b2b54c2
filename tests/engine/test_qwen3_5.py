"""Qwen35Target (Qwen3.5 hybrid: Gated DeltaNet + gated attention) against transformers, and its
state under the step runner: fixed-width exactness, exact rollback of the recurrent state, the
speculative round loop.

- HF parity: tiny random `qwen3_5_text` checkpoints loaded by `Qwen3_5ForCausalLM.from_pretrained`
  (float32, eager attention, the torch fallback of the DeltaNet kernels): prompt logits on
  prompts longer than HF's 64-row GDN chunk, incremental decode, 256-token greedy streams vs
  `generate` (variable width and the product default of 16-row steps), taps vs
  `output_hidden_states`. The published multimodal layout (renamed keys, fake `model.visual.*` /
  `mtp.*` tensors) loads the same weights and gives identical logits.
- Exactness: with a step width, logits and states do not depend on how tokens are grouped into
  steps (f32 and bf16), padding rows leave no trace, and a verify rolled back to k then continued
  is bit-identical to running the first k tokens directly — under both rollback modes, which
  agree bit for bit, and when a verify spans several fixed steps. Planted bugs (a rejected row's
  state kept; a padding row's state committed) are run and must fail those checks.
- The round loop: `Session` with an oracle proposer that is right for a while then wrong, over
  the hybrid target, reproduces plain greedy with partially accepted rounds; so do real tiny
  DFlash / DSpark drafters through `Engine.from_model` in bf16.
- Refusals: configs missing their layer types (or other required keys), checkpoints missing a
  DeltaNet tensor, rollbacks the state cannot do, CUDA graphs, bad requests: one line each.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_cli.engine.api import ArmConfig, Engine, resolve_cuda_graphs
from memra_cli.engine.errors import CheckpointError, ConfigError, PromptError, SettingError, UnsupportedError
from memra_cli.engine.formats.qwen3_5_config import load_qwen35_config, parse_qwen35_config
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers.deltanet import gated_delta_rule, gated_delta_rule_chunked, l2norm
from memra_cli.engine.models.base import MODEL_FAMILIES, load_target, target_family
from memra_cli.engine.models.qwen3_5 import Qwen35State, Qwen35Target, default_rollback
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import LADDER, Harvest
from memra_cli.engine.spec.proposer import Program
from memra_cli.engine.spec.session import Session
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35
from memra_cli.tiny.target import special_token_ids

from fp32_bounds import layer_reductions, reorder_bound
from host_reads import NoHostReads
from scripted_oracle import ScriptedOracle, moving_wrong_slot

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB = 512
EOS = special_token_ids(VOCAB)["<|endoftext|>"]
WIDTH = 16
INTERVAL_TYPES = ("linear_attention", "linear_attention", "full_attention") * 2
VARIANTS = {
    "text": {},  # L F L L F, untied
    "tied-bias-interval": {"tie": True, "attention_bias": True, "seed": 1, "layer_types": INTERVAL_TYPES,
                           "write_layer_types": False, "full_attention_interval": 3, "partial_rotary_factor": 0.5,
                           "mrope_section": (4, 2, 2), "linear_value_heads": 2, "shards": 2},
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    dirs = {name: make_tiny_qwen35(root / name, **kw) for name, kw in VARIANTS.items()}
    dirs["multimodal"] = make_tiny_qwen35(root / "multimodal", layout="multimodal")  # "text"'s weights
    return dirs


def load_hf(path):
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {name: (Qwen35Target.from_dir(tiny_dirs[name]), load_hf(tiny_dirs[name])) for name in VARIANTS}


def prompt(n: int, seed: int) -> list[int]:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    if n > 3:
        ids[n // 2] = EOS  # HF's pad-masking trap, as in the Qwen3 tests
    return ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def ours_logits(target: Qwen35Target, ids: list[int]) -> torch.Tensor:
    state = target.new_state(len(ids))
    hidden, _ = target.forward(torch.tensor(ids, device=target.device), 0, state)
    return target.logits(hidden)


@torch.no_grad()
def hf_out(hf, ids: list[int], **kw):
    x = torch.tensor([ids])
    return hf(x, attention_mask=torch.ones_like(x), **kw)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], max_new: int) -> list[int]:
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id = VOCAB, EOS  # no EOS: the never-produced id VOCAB
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens, gc.max_length = False, max_new, None, None
    x = torch.tensor([ids])
    return hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)[0, len(ids):].tolist()


def states_of(state: Qwen35State) -> list[torch.Tensor]:
    """Everything a continuation reads: K/V up to the length, conv windows, recurrent states."""
    return [state.kv[:, :, :, :state.length].clone(), *state.conv, *state.rec]


def assert_same_states(a: Qwen35State, b: Qwen35State) -> None:
    assert a.length == b.length
    for x, y in zip(states_of(a), states_of(b), strict=True):
        assert torch.equal(x, y)


# --------------------------------------------------------------------------- HF parity


def test_transformers_runs_its_torch_fallback():
    """The reference is HF's plain-torch DeltaNet (chunked prefill, recurrent decode): no fla or
    causal-conv1d kernels may stand in for it on this machine."""
    assert importlib.util.find_spec("fla") is None
    assert importlib.util.find_spec("causal_conv1d") is None


def test_registry_dispatches_both_layouts_and_the_moe_hybrid_to_its_class(tiny_dirs):
    assert MODEL_FAMILIES["qwen3_5"]() is MODEL_FAMILIES["qwen3_5_text"]() is Qwen35Target
    assert target_family(tiny_dirs["text"]) is target_family(tiny_dirs["multimodal"]) is Qwen35Target
    assert isinstance(load_target(tiny_dirs["multimodal"]), Qwen35Target)
    assert Qwen35Target.supports_cuda_graphs is True and Qwen35Target.moe is None
    moe = MODEL_FAMILIES["qwen3_5_moe"]()  # tests/engine/test_qwen3_5_moe.py covers it
    assert moe is MODEL_FAMILIES["qwen3_5_moe_text"]() and issubclass(moe, Qwen35Target) and moe.routes_experts


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logits_match_hf(models, variant):
    target, hf = models[variant]
    for n, seed in ((1, 0), (7, 1), (150, 2)):  # 150 > HF's 64-row chunk: two full chunks and a tail
        ids = prompt(n, seed)
        ours, ref = ours_logits(target, ids), hf_out(hf, ids).logits[0]
        assert rel_err(ours, ref) < 1e-5, (variant, n)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_config_reads_like_transformers(models):
    for target, hf in models.values():
        cfg, ref = target.cfg, hf.config
        assert cfg.layer_types == tuple(ref.layer_types)
        assert cfg.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"]
        assert cfg.tie_word_embeddings == ref.tie_word_embeddings
        assert (cfg.rope.theta, cfg.head_dim) == (ref.rope_parameters["rope_theta"], ref.head_dim)
        assert (cfg.vocab_size, cfg.max_position_embeddings) == (ref.vocab_size, ref.max_position_embeddings)
    tied, _ = models["tied-bias-interval"]
    assert tied.cfg.layer_types_from == "full_attention_interval=3"
    assert tied.lm_head_weight is tied.embed_weight


def test_incremental_decode_matches_full_sequence(models):
    target, hf = models["text"]
    ids = prompt(170, 5)
    ref = hf_out(hf, ids).logits[0]
    state = target.new_state(len(ids))
    rows, start = [], 0
    for chunk in (23, 1, 1, 6, 1, 16, 1, 2, 90, 1, 28):  # prefill, decodes, verify blocks
        hidden, _ = target.forward(torch.tensor(ids[start:start + chunk]), start, state)
        rows.append(target.logits(hidden))
        start += chunk
        assert state.length == start
    assert rel_err(torch.cat(rows), ref) < 1e-5


@pytest.mark.parametrize("width", [None, WIDTH], ids=["variable", "default-16"])
def test_greedy_matches_hf_generate(models, width):
    """HF prefills in 64-row chunks (the chunked delta rule), then decodes one token at a time;
    ours decodes through the step runner, at the product default every step 16 rows (15 padding)."""
    target, hf = models["text"]  # (a tied random model loops on a few tokens)
    runner = StepRunner(target, width)
    for n, seed, max_new in ((80, 11, 256), (5, 10, 64)):
        ids = prompt(n, seed)
        ours = greedy_reference(runner, ids, max_new)
        assert len(ours) == max_new and len(set(ours)) > 20, "degenerate tiny model"
        assert ours == hf_greedy(hf, ids, max_new), n


def test_taps_match_hf_hidden_states(models):
    target, hf = models["text"]
    ids = prompt(33, 30)
    states = hf_out(hf, ids, output_hidden_states=True).hidden_states
    taps = (2, -1, 0, 1, 3)  # out of order on purpose; 0, 2, 3 DeltaNet, 1 attention
    state = target.new_state(len(ids))
    hidden, tapped = target.forward(torch.tensor(ids), 0, state, taps=taps)
    h = target.hidden_size
    assert tapped.shape == (len(ids), len(taps) * h)
    # HF and we sum in different orders (and BLAS's order depends on the CPU): the bound is the
    # float32 reordering bound of the layers' chained reductions (fp32_bounds.py), the wider of
    # the attention and DeltaNet mixers for every layer; a tap after layer t chains t + 1 layers.
    per_layer = _layer_reductions(target.cfg, len(ids))
    for j, tap in enumerate(taps):
        depth = tap % target.n_layers + 1
        assert rel_err(tapped[:, j * h:(j + 1) * h], states[tap + 1][0]) < reorder_bound(*per_layer * depth), tap
    _, last = target.forward(torch.tensor(ids), 0, state, taps=(target.n_layers - 1,))
    # HF's last entry is final-normed: one more reduction over the hidden size
    whole = reorder_bound(*per_layer * target.n_layers, target.hidden_size)
    assert rel_err(target.final_norm(last), states[-1][0]) < whole
    assert rel_err(hidden, states[-1][0]) < whole


def _layer_reductions(cfg, keys: int) -> tuple[int, ...]:
    """One hybrid layer's reduction lengths (fp32_bounds.layer_reductions), each the larger of
    the gated attention's and the DeltaNet's: the state of a DeltaNet layer sums `keys` rows too."""
    mixer = max(cfg.num_attention_heads * cfg.head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    head = max(cfg.head_dim, cfg.linear_key_head_dim)
    return layer_reductions(cfg.hidden_size, mixer, head, keys, cfg.intermediate_size)


def test_embed_is_the_embedding_table(models):
    target, hf = models["text"]
    ids = torch.tensor(prompt(5, 31))
    assert torch.equal(target.embed(ids), hf.model.embed_tokens(ids))


def test_chunked_form_equals_the_sequential_one():
    g = torch.Generator().manual_seed(0)
    for t in (1, 63, 64, 65, 200):
        hv, dk, dv = 4, 16, 32
        q = l2norm(torch.randn(t, hv, dk, generator=g)) / dk ** 0.5
        k = l2norm(torch.randn(t, hv, dk, generator=g))
        v, s0 = torch.randn(t, hv, dv, generator=g), torch.randn(hv, dk, dv, generator=g)
        decay, beta = -2 * torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
        o1, s1, per_row = gated_delta_rule(q, k, v, decay, beta, s0, keep_states=True)
        o2, s2 = gated_delta_rule_chunked(q, k, v, decay, beta, s0)
        assert rel_err(o2, o1) < 1e-5 and rel_err(s2, s1) < 1e-5, t
        assert torch.equal(per_row[-1], s1)
        assert torch.equal(gated_delta_rule(q[:t // 2], k[:t // 2], v[:t // 2], decay[:t // 2], beta[:t // 2], s0)[1],
                           per_row[t // 2 - 1] if t > 1 else s0)


def test_chunked_prefill_matches_hf_and_the_sequential_prefill(models):
    target, hf = models["text"]
    ids = prompt(150, 3)  # > rollback_rows: the chunked form (HF prefills in 64-row chunks too)
    last = target.n_layers - 1
    runner = StepRunner(target)
    states = {}
    try:
        for chunked in (True, False):
            target.chunked_prefill = chunked
            state = states[chunked] = runner.new_state(160)
            _, tapped = runner.prefill(torch.tensor(ids), state, taps=(last,))
            logits = target.logits(target.final_norm(tapped))
            assert rel_err(logits, hf_out(hf, ids).logits[0]) < 1e-5, chunked
    finally:
        target.chunked_prefill = True
    for a, b in zip(states_of(states[True]), states_of(states[False])):
        assert rel_err(a, b) < 1e-5


def test_the_rollback_default_is_per_device_and_an_asked_mode_is_said(tiny_dirs):
    """Replay on CUDA, stash elsewhere (each measured the faster there); a mode asked for is
    kept and the load note says it was asked."""
    assert default_rollback(torch.device("cuda")) == "replay"
    assert default_rollback(torch.device("cpu")) == "stash"
    asked = Qwen35Target.from_dir(tiny_dirs["text"], rollback="replay")
    assert asked.rollback_mode == "replay" and "rollback record replay (as asked)" in asked.load_note


def test_multimodal_layout_loads_the_same_weights(tiny_dirs, models, caplog):
    text, _ = models["text"]
    with caplog.at_level("INFO", logger="memra_cli.engine.models.qwen3_5"):
        mm = Qwen35Target.from_dir(tiny_dirs["multimodal"])
    assert mm.cfg.layout == "multimodal" and mm.cfg.model_type == "qwen3_5"
    assert "model.language_model." in mm.load_note
    assert "skipped 4 model.visual.* and 3 mtp.* tensor(s)" in mm.load_note
    assert mm.load_note in caplog.text and "not used" not in caplog.text
    assert "rollback record stash (the default on cpu" in mm.load_note  # a default applied says so
    assert mm.rollback_mode == "stash"
    assert mm.cfg.eos_token_ids == text.cfg.eos_token_ids == (EOS,)
    for n, seed in ((9, 50), (100, 51)):
        ids = prompt(n, seed)
        assert torch.equal(ours_logits(mm, ids), ours_logits(text, ids))
    # and transformers reads the multimodal directory to the same model
    hf_mm = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["multimodal"], dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = prompt(70, 52)
    assert rel_err(ours_logits(mm, ids), hf_out(hf_mm, ids).logits[0]) < 1e-5


# --------------------------------------------------------------------------- fixed-width exactness


def _ids(n: int, seed: int, device="cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def run_groups(runner: StepRunner, prompt_ids: torch.Tensor, cont: torch.Tensor, groups):
    """Prefill, then teacher-force `cont` in runner steps of the given sizes: (logits, state)."""
    state = runner.new_state(prompt_ids.shape[0] + cont.shape[0] + 1)
    runner.prefill(prompt_ids, state)
    out, at = [], 0
    for g in groups:
        logits, _ = runner.step(cont[at:at + g], state.length, state)
        out.append(logits)
        at += g
    assert at == cont.shape[0] and state.length == prompt_ids.shape[0] + at
    return torch.cat(out), state


GROUPINGS = ([1] * 24, [24], [16, 8], [5, 7, 1, 11], [3] * 8)


def check_groupings(runner: StepRunner) -> None:
    """Every grouping gives the logits and states of one row at a time, bit for bit."""
    dev = runner.model.device
    p, cont = _ids(37, 0, dev), _ids(24, 1, dev)
    runs = [run_groups(runner, p, cont, g) for g in GROUPINGS]
    for g, (logits, state) in zip(GROUPINGS[1:], runs[1:]):
        assert torch.equal(logits, runs[0][0]), f"grouping {g}: logits differ from one row at a time"
        assert_same_states(state, runs[0][1])


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    return make_tiny_qwen35(tmp_path_factory.mktemp("q35steps") / "t", hidden=128, intermediate=256,
                            linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=32,
                            linear_value_head_dim=32, seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_fixed_width_logits_and_states_do_not_depend_on_the_grouping(step_dir, dtype, mode):
    target = Qwen35Target.from_dir(step_dir, dtype=dtype, rollback=mode)
    check_groupings(StepRunner(target, WIDTH))
    # and they are the model's numbers: a variable-width run agrees to rounding
    fixed, _ = run_groups(StepRunner(target, WIDTH), _ids(37, 0), _ids(24, 1), [24])
    variable, _ = run_groups(StepRunner(target), _ids(37, 0), _ids(24, 1), [24])
    assert rel_err(fixed, variable) < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_per_layer_state_tensors_are_views_of_one_stacked_tensor(step_dir, mode):
    """A commit or rollback moves every layer's state with one op per kind of tensor, which
    is only right while each layer's tensor the model reads and writes is a view of the stacked
    one (of the buffer `_cur` names, for the committed conv windows and states)."""
    state = StepRunner(Qwen35Target.from_dir(step_dir, rollback=mode), WIDTH).new_state(64)
    pairs = [(state._xs_all, state._xs)]
    if mode == "stash":
        pairs.append((state._stash_all, state._stash))
    else:
        pairs += [(state._qkv_all, state._qkv), (state._g_all, state._g), (state._beta_all, state._beta)]
    for cur in (0, 1):
        state._cur = cur
        pairs += [(state._conv2[cur], state.conv), (state._rec2[cur], state.rec), (state._rec2[1 - cur], state._final)]
    for stacked, views in pairs:
        assert len(views) == stacked.shape[0] > 0
        for i, v in enumerate(views):
            assert v.data_ptr() == stacked[i].data_ptr() and v.shape == stacked.shape[1:]
    assert state.nbytes >= sum(t.numel() * t.element_size() for t in (state.kv, *state._all))


@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_a_commit_flips_buffers_instead_of_copying_states(step_dir, mode, monkeypatch):
    """The committed state lives in one of two buffers: a fixed step reads it and (replay mode)
    writes its last row's state into the other, so keeping every row flips `_cur` and moves no
    recurrent state; a partial keep computes the kept row's state into the buffer the step did
    not read, whose contents (the base) stay untouched either way."""
    target = Qwen35Target.from_dir(step_dir, rollback=mode)
    replays = []
    real = target.step_ops.gated_delta_replay
    monkeypatch.setattr(target.step_ops, "gated_delta_replay", lambda *a, **k: replays.append(a) or real(*a, **k))
    runner = StepRunner(target, 1)
    state = runner.new_state(64)
    runner.prefill(_ids(20, 4), state)
    for _ in range(3):
        cur, base = state._cur, state._rec2[state._cur].clone()
        copies, copy_ = [], torch.Tensor.copy_
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "copy_", lambda self, *a, **k: copies.append(self.shape) or copy_(self, *a, **k))
            runner.step(_ids(1, 5), state.length, state)
        assert state._cur == 1 - cur and torch.equal(state._rec2[cur], base)
        # what the commit moves: every layer at once (stacked shapes; the step's own writes are per layer)
        rec_shape, conv_shape = tuple(state._rec2.shape[1:]), tuple(state._conv2.shape[1:])
        moved = [tuple(c) for c in copies if tuple(c) in (rec_shape, conv_shape)]
        assert moved == ([] if mode == "replay" else [rec_shape])  # stash: the kept row's state, once
    assert replays == []
    # width 4, one real row: the recurrence runs the live row only (the runner's set_live_rows),
    # so what the step wrote into the other buffer is the kept state: no replay. With the padding
    # rows run too (set_live_rows ignored: every row is live) the same commit replays the kept
    # row from the base (replay mode); the states and the real row's logits are the same bits.
    runner4 = StepRunner(target, 4)
    padded = runner.new_state(64)
    runner.prefill(_ids(20, 4), padded)
    for _ in range(3):  # the history `state` has
        runner.step(_ids(1, 5), padded.length, padded)
    monkeypatch.setattr(padded, "set_live_rows", lambda n: None)
    got = []
    for st in (state, padded):
        cur, base, before = st._cur, st._rec2[st._cur].clone(), len(replays)
        logits, _ = runner4.step(_ids(1, 6), st.length, st)
        assert st._cur == 1 - cur and torch.equal(st._rec2[cur], base)
        got.append((logits, len(replays) - before, [*st.conv, *st.rec]))
    assert got[0][1] == 0 and got[1][1] == (1 if mode == "replay" else 0)
    assert torch.equal(got[0][0], got[1][0]) and all(torch.equal(a, b) for a, b in zip(got[0][2], got[1][2]))


@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_padding_rows_skip_the_recurrence_and_change_no_bit(step_dir, mode):
    """Steps of 1, 5 and 15 real rows padded to 16, then a partial rollback: the real rows'
    logits and every state (windows, recurrent states, K/V) are the bits of the same steps with
    their padding rows run through the recurrence (set_live_rows ignored: every row is live),
    and the next step's logits too. A commit past the live rows is refused (those rows ran no
    recurrence)."""
    target = Qwen35Target.from_dir(step_dir, rollback=mode)
    runner = StepRunner(target, WIDTH)
    states, outs = [], []
    for padded in (False, True):
        state = runner.new_state(96)
        if padded:
            state.set_live_rows = lambda n: None
        runner.prefill(_ids(9, 30), state)
        got = []
        for n in (1, 5, 15):
            got.append(runner.step(_ids(n, 31 + n), state.length, state)[0])
            # what the step wrote into the other buffer is the kept state only when padding was skipped
            assert (state._final_at == state.length) != padded, (n, padded)
        runner.step(_ids(6, 40), state.length, state)
        state.rollback(state.length - 2)
        got.append(runner.step(_ids(1, 41), state.length, state)[0])
        states.append(state)
        outs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert_same_states(*states)
    state = states[0]
    state.set_live_rows(2)
    runner.fixed_step(_ids(WIDTH, 42), state.length, state, live=2)
    with pytest.raises(ValueError, match="ran only its 2 live rows"):
        state.commit(state.length + 3)


@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_a_window_known_before_the_verify_skips_the_rows_past_it(step_dir, mode):
    """A ladder round's verify with its window as the step's live rows (`live_rows_from`, as the
    round bodies run it), candidates from the plain stream so every row of the window is
    accepted: the window's picks are the plain stream's (its last row's included, the one a
    window one row short would get wrong) and the state kept after it is, bit for bit, what
    steps of the same tokens leave."""
    target = Qwen35Target.from_dir(step_dir, rollback=mode)
    runner = StepRunner(target, WIDTH)
    ids = _ids(12, 50).tolist()
    truth = greedy_reference(runner, ids, 40)
    seq = torch.tensor(ids + truth)
    state, ref = runner.new_state(96), runner.new_state(96)
    runner.prefill(seq[:12], state), runner.prefill(seq[:12], ref)
    for vt in (1, 3, 7, 16):
        start = state.length
        live = torch.tensor([vt], dtype=torch.int32)
        with state.live_rows_from(live):
            logits, _ = target.static_step(seq[start:start + WIDTH], torch.arange(start, start + WIDTH), state)
        assert logits[:vt].argmax(-1).tolist() == seq[start + 1:start + 1 + vt].tolist(), vt
        state.commit(start + vt)
        runner.step(seq[ref.length:ref.length + vt], ref.length, ref)
        assert_same_states(state, ref)


def test_restores_are_graphed_only_with_ops_that_read_their_rows_on_the_device():
    """The torch ops read a replay's rows on the host, which a CUDA graph capture refuses (the
    H200 caught a torch-ops target on CUDA trying): only the kernels' ops are graphed, on CUDA,
    in replay mode."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps
    from memra_cli.engine.models.qwen3_5 import restores_as_graphs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not restores_as_graphs(cuda, "replay", TorchStepOps())
    assert TritonStepOps.restores_on_device and restores_as_graphs(cuda, "replay", TritonStepOps)
    assert not restores_as_graphs(cuda, "stash", TritonStepOps)
    assert not restores_as_graphs(cpu, "replay", TritonStepOps)


@pytest.mark.parametrize("width", [WIDTH, 4], ids=["fixed", "fixed-4-chunks"])
def test_graphed_replay_restores_give_the_eager_restores_bits(step_dir, monkeypatch, width):
    """On CUDA a replay-mode rollback (and a partial commit) runs as a CUDA graph per (base,
    destination) buffer pair, reading its rows on the device. Here with a stand-in capture
    (replay reruns the body): the same logits and states as the eager restore for every k, one
    capture per pair, reused after."""
    from memra_cli.engine.runtime import cuda_graphs

    captured = []

    def capture(fn, device, pool=None):
        out = fn()
        captured.append(fn)

        class Replay:
            def replay(self):
                fn()

        return Replay(), out

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    target = Qwen35Target.from_dir(step_dir, rollback="replay")
    runner = StepRunner(target, width)
    p, block, after = _ids(40, 20), _ids(16, 21), _ids(5, 22)
    for k in (0, 1, 2, 5, 7, 12, 15, 16):
        states, outs = [], []
        for graphed in (True, False):
            state = runner.new_state(80)
            state.graph_restores = graphed
            runner.prefill(p[:-1], state)
            runner.step(p[-1:], state.length, state)  # a partial commit at width > 1
            runner.step(block, state.length, state, taps=(0, 1))
            state.rollback(40 + k)
            outs.append(runner.step(after, state.length, state)[0])
            states.append(state)
        assert torch.equal(outs[0], outs[1]), k
        assert_same_states(*states)
        # a rollback into the block restores; the one-row step's commit is a flip (its
        # recurrence ran the live row only), and so are k = 0 (the base) and 16 (no rollback)
        assert not states[0].graphs and len(states[0]._restore_graphs) <= 6
        assert (len(states[0]._restore_graphs) > 0) == (0 < k < 16), k
        assert not states[1]._restore_graphs
    assert 0 < len(captured) <= 8 * 6  # a few per fresh state, never one per restore


@pytest.mark.parametrize("row0,rows", [(0, 1), (6, 4), (3, 0), (2, 8), (5, -1)])
def test_the_torch_device_row_restores_read_nothing_on_the_host(row0, rows):
    """The torch step ops' graphed-restore forms (layers/deltanet.py `gated_delta_replay_dev`,
    `ring_window`: every ring row masked by a device row count) give the host-argument forms'
    bits, and run with host reads forbidden (a graph body or its stand-in runs them)."""
    from memra_cli.engine.layers import deltanet as torch_dn

    gen = torch.Generator().manual_seed(rows + 20)
    layers, ring, hk, hv, dk, dv = 3, 8, 2, 4, 16, 16
    qkv = torch.randn(layers, ring, 2 * hk * dk + hv * dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(layers, ring, hv, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(layers, ring, hv, generator=gen))
    state = torch.randn(layers, hv, dk, dv, generator=gen) * 0.3
    params = torch.tensor([row0, rows], dtype=torch.int32)
    want = torch.full_like(state, 7.0)
    if rows >= 0:
        torch_dn.gated_delta_replay(qkv, g, beta, state, 2, row0, rows, want)
    got = torch.full_like(state, 7.0)
    base, xs = torch.randn(3, 3, 40), torch.randn(3, 8, 40)
    win_want, win_got = torch.full_like(base, 7.0), torch.full_like(base, 7.0)
    if rows >= 0:  # the last 3 rows of [base; ring rows row0..row0+rows-1]
        win_want = torch.cat([base, xs[:, [(row0 + r) % ring for r in range(rows)]]], dim=1)[:, -3:]
    with NoHostReads():
        torch_dn.gated_delta_replay_dev(qkv, g, beta, state, 2, params, got)
        torch_dn.ring_window(base, xs, params, win_got)
    assert torch.equal(got, want) and torch.equal(win_got, win_want)


def test_padding_rows_leave_no_trace(step_dir):
    """Padding rows run the recurrence too (every fixed step is W rows, as a kernel would run
    it); the commit takes the state after the last real row."""
    runner = StepRunner(Qwen35Target.from_dir(step_dir, dtype=torch.bfloat16), WIDTH)
    a, ca = run_groups(runner, _ids(20, 2), _ids(6, 3), [2, 4])  # the first step pads 14 rows
    b, cb = run_groups(runner, _ids(20, 2), _ids(6, 3), [6])
    assert torch.equal(a, b)
    assert_same_states(ca, cb)


def test_planted_bug_padding_state_committed_is_caught(step_dir, monkeypatch):
    """Plant it: the commit keeps the state after the padding rows."""
    runner = StepRunner(Qwen35Target.from_dir(step_dir), WIDTH)
    right = Qwen35State.commit

    def commit_keeping_padding(self, end, step_continues=False):
        start, rows = self._pending
        right(self, end, step_continues)
        self._restore(start + rows)  # the bug: the state after the whole W-row step

    monkeypatch.setattr(Qwen35State, "commit", commit_keeping_padding)
    with pytest.raises(AssertionError):
        check_groupings(runner)


# --------------------------------------------------------------------------- rollback


def check_rollback(runner: StepRunner, exact: bool, ks=(0, 1, 2, 7, 15, 16)) -> None:
    """Decode one token, verify 16 rows, roll back to k, continue: the same logits and states as
    running the first k rows as their own step and continuing (bit for bit when `exact`). The
    decode step first: its committed state is then one of the stash rows the verify reuses."""
    dev = runner.model.device
    p, block, after = _ids(40, 20, dev), _ids(16, 21, dev), _ids(5, 22, dev)
    for k in ks:
        state = runner.new_state(80)
        runner.prefill(p[:-1], state)
        runner.step(p[-1:], state.length, state)
        runner.step(block, state.length, state, taps=(0, 1))
        state.rollback(40 + k)
        assert state.length == 40 + k
        got, _ = runner.step(after, state.length, state)

        fresh = runner.new_state(80)
        runner.prefill(p[:-1], fresh)
        runner.step(p[-1:], fresh.length, fresh)
        if k:
            runner.step(block[:k], fresh.length, fresh, taps=(0, 1))
        want, _ = runner.step(after, fresh.length, fresh)
        if exact:
            assert torch.equal(got, want), k
            assert_same_states(state, fresh)
        else:
            assert rel_err(got, want) < 1e-5, k
            for x, y in zip(states_of(state), states_of(fresh)):
                assert rel_err(x, y) < 1e-5, k


@pytest.mark.parametrize("mode", ["stash", "replay"])
@pytest.mark.parametrize("width", [WIDTH, 4, None], ids=["fixed", "fixed-4-chunks", "variable"])
def test_verify_rollback_continue_equals_direct(step_dir, mode, width):
    """Width 4: the 16-row verify is four fixed steps, and a rollback reaches into any of them."""
    ks = (0, 1, 2, 3, 4, 5, 7, 8, 11, 12, 15, 16) if width == 4 else (0, 1, 2, 7, 15, 16)
    check_rollback(StepRunner(Qwen35Target.from_dir(step_dir, rollback=mode), width), exact=width is not None, ks=ks)


def test_stash_and_replay_restore_the_same_bits(step_dir):
    states = []
    for mode in ("stash", "replay"):
        runner = StepRunner(Qwen35Target.from_dir(step_dir, rollback=mode), WIDTH)
        state = runner.new_state(64)
        runner.prefill(_ids(30, 23), state)
        runner.step(_ids(16, 24), 30, state)
        state.rollback(30 + 9)
        states.append(state)
    assert_same_states(*states)


def restored_in_round(runner: StepRunner, prompt_ids, block, keep: int, rows_written: int | None = None,
                      window: int | None = None):
    """A round restored on the device, as a round graph runs it: the fixed step of `block`
    (W rows) at the committed length, `round_params` as the settlement writes them for `keep`
    kept rows (`rows_written` overrides the row count: a planted bug), `restore_round`, then
    the host's `settled_on_device`. `window`: a ladder round's, the step's live rows (as
    spec/round_bodies.py runs it), also given to the restore."""
    model, width = runner.model, runner.width
    state = runner.new_state(80)
    runner.prefill(prompt_ids, state)
    start = state.length
    live = None if window is None else torch.tensor([window], dtype=torch.int32)
    with state.live_rows_from(live) if live is not None else contextlib.nullcontext():
        model.static_step(block, torch.arange(start, start + width), state)
    rows = rows_written if rows_written is not None else (-1 if keep == width else keep)
    state.round_params.copy_(torch.tensor([start % state.ring, rows], dtype=torch.int32))
    state.restore_round(live)
    state.settled_on_device(start + keep)
    return state


@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_a_round_with_a_ladder_window_restores_the_host_rollback(step_dir, mode):
    """A ladder round runs its window as the step's live rows and tells the restore: keeping the
    whole window (replay mode: no replay at all, the step wrote that state) or less of it leaves
    the host rollback's states bit for bit. Planted: a restore that skipped on any keep (the
    rows written as the window) is caught by the keep-less-than-the-window case."""
    runner = StepRunner(Qwen35Target.from_dir(step_dir, rollback=mode), WIDTH)
    p, block = _ids(30, 60), _ids(WIDTH, 61)
    for window, keep in ((5, 5), (5, 3), (1, 1), (9, 2)):
        want = runner.new_state(80)
        runner.prefill(p, want)
        runner.step(block, want.length, want)
        want.rollback(30 + keep)
        assert_same_states(restored_in_round(runner, p, block, keep, window=window), want)
    planted = restored_in_round(runner, p, block, 3, rows_written=5, window=5)
    want = runner.new_state(80)
    runner.prefill(p, want)
    runner.step(block, want.length, want)
    want.rollback(30 + 3)
    with pytest.raises(AssertionError):
        assert_same_states(planted, want)


@pytest.mark.parametrize("mode", ["stash", "replay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_round_restored_on_the_device_is_the_host_rollback(step_dir, mode, dtype):
    """`restore_round` (the rollback inside a pipelined round's graph) leaves the conv windows and
    recurrent states a host rollback does, bit for bit, for every kept count 1..W (W: the step's
    own last row), and the next step's logits follow. Planted: the restore told one row too many
    (a rejected draft's state) or every row (a padding row's) is caught by the same comparison."""
    runner = StepRunner(Qwen35Target.from_dir(step_dir, dtype=dtype, rollback=mode), WIDTH)
    p, block, after = _ids(30, 40), _ids(WIDTH, 41), _ids(3, 42)
    for keep in (1, 2, 7, WIDTH - 1, WIDTH):
        want = runner.new_state(80)
        runner.prefill(p, want)
        runner.step(block, want.length, want)
        want.rollback(30 + keep)
        got = restored_in_round(runner, p, block, keep)
        assert_same_states(got, want)
        truth = states_of(want)
        if keep > 1:  # the round's record is spent: no rollback reaches back into it
            with pytest.raises(ValueError, match="settled on the device"):
                got.rollback(30 + 1)
        a, _ = runner.step(after, got.length, got)
        b, _ = runner.step(after, want.length, want)
        assert torch.equal(a, b), keep
        if keep < WIDTH:
            for wrong in (keep + 1, -1):  # a rejected row's state; the step's last (padding) row's
                bad = restored_in_round(runner, p, block, keep, rows_written=wrong)
                ours = states_of(bad)
                assert [x.shape for x in ours] == [x.shape for x in truth]
                assert any(not torch.equal(x, y) for x, y in zip(ours, truth)), (keep, wrong)


@pytest.mark.parametrize("bug", ["final-state", "off-by-one"])
@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_planted_bug_rejected_row_state_kept_is_caught(step_dir, monkeypatch, bug, mode):
    """Plant it: the restore gives the state of the last verified row (or of row k instead of
    k-1), i.e. of a rejected draft."""
    runner = StepRunner(Qwen35Target.from_dir(step_dir, rollback=mode), WIDTH)
    right = Qwen35State._restore

    def wrong(self, n):
        return right(self, self._recorded if bug == "final-state" else min(n + 1, self._recorded))

    monkeypatch.setattr(Qwen35State, "_restore", wrong)
    with pytest.raises(AssertionError):
        check_rollback(runner, exact=True)


def test_rollback_refusals(step_dir):
    runner = StepRunner(Qwen35Target.from_dir(step_dir), WIDTH)
    state = runner.new_state(120)
    runner.prefill(_ids(70, 25), state)  # 70 rows > rollback_rows 64: no per-row record
    with pytest.raises(ValueError, match="ran 70 rows, more than the rollback limit"):
        state.rollback(69)
    runner.step(_ids(10, 26), 70, state)
    state.rollback(80)  # == length: a no-op, always allowed
    with pytest.raises(ValueError, match=r"only back to the start of the last step \(position 70\)"):
        state.rollback(69)
    state.rollback(75)
    with pytest.raises(ValueError, match="already rolled back to 75"):
        state.rollback(72)
    with pytest.raises(ValueError, match="of length 75 back to 76"):
        state.rollback(76)
    with pytest.raises(AttributeError):
        state.length = 3  # length moves with the recurrent state, never alone
    # a step starting below the length is an implicit rollback: allowed inside the last step only
    runner.step(_ids(4, 27), 75, state)
    runner.step(_ids(3, 28), 77, state)  # back to 77: inside the last step (75..79)
    assert state.length == 80
    with pytest.raises(ValueError, match="cannot roll"):
        runner.step(_ids(3, 28), 76, state)
    with pytest.raises(ValueError, match="no pending step"):
        state.commit(81)  # nothing ran
    state.rollback(0)  # a reset
    assert state.length == 0 and all(not r.any() for r in state.rec)


def test_a_step_past_rollback_rows_keeps_only_its_last_chunks(step_dir):
    target = Qwen35Target.from_dir(step_dir)
    target.set_rollback("stash", 8)
    runner = StepRunner(target, 4)
    state = runner.new_state(64)
    runner.prefill(_ids(20, 29), state)
    runner.step(_ids(16, 30), 20, state)  # four 4-row chunks, 8 rows recorded at a time
    with pytest.raises(ValueError, match=r"more than rollback_rows \(8\) rows, so its per-row states are kept only "
                                         r"back to position 28"):
        state.rollback(27)
    state.rollback(29)  # inside the last 8 rows: exact as ever
    fresh = runner.new_state(64)
    runner.prefill(_ids(20, 29), fresh)
    runner.step(_ids(16, 30)[:9], 20, fresh)
    assert_same_states(state, fresh)
    assert state.nbytes > fresh.kv.numel() * fresh.kv.element_size()


# --------------------------------------------------------------------------- the round loop


@pytest.mark.parametrize("mode", ["stash", "replay"])
@pytest.mark.parametrize("width", [WIDTH, 4, None], ids=["fixed", "fixed-4-chunks", "variable"])
def test_spec_session_equals_plain_greedy(tiny_dirs, mode, width):
    engine = Engine.from_model(Qwen35Target.from_dir(tiny_dirs["text"], rollback=mode), step_width=width)
    target, runner = engine.target, engine.runner
    block, max_new, taps = 8, 40, (-1, 1, 3)
    for seed, n in ((60, 9), (61, 30)):
        ids = prompt(n, seed)
        truth = greedy_reference(runner, ids, max_new + block + 1)
        oracle = ScriptedOracle(truth, n, block - 1, moving_wrong_slot, VOCAB)
        program = Program(Harvest.DFLASH, LADDER, False, block, False, block)
        session = Session(runner, ids, max_new, proposer=oracle, program=program, taps=taps)
        assert session.run() == truth[:max_new]
        hist = session.stats.accept_hist
        assert any(0 < m < block - 1 for m in hist if hist[m]) and hist[block - 1] > 0, hist
        # what the drafter was fed is the target's own taps of the committed stream
        got = torch.cat(oracle.taps)
        state = target.new_state(got.shape[0])
        _, want = target.forward(torch.tensor((ids + truth)[:got.shape[0]]), 0, state, taps)
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_bf16_drafter_sessions_equal_plain_greedy(tmp_path, spec):
    """The real proposer path (`Engine.from_model` + `engine.arm`, tiny random drafters) over the
    hybrid target in bfloat16 with fixed-width steps: every stream is plain greedy's."""
    from memra_cli.tiny.draft import make_tiny_draft

    target_dir = make_tiny_qwen35(tmp_path / "t", layout="multimodal", seed=3)
    engine = Engine.from_model(Qwen35Target.from_dir(target_dir, dtype=torch.bfloat16), step_width=WIDTH)
    fmt = "zlab" if spec == "dflash" else "deepspec"
    extra = {} if spec == "dflash" else dict(markov_rank=16, confidence="markov")
    draft = make_tiny_draft(tmp_path / spec, fmt, block_size=8, target_layer_ids=(-1, 1, 3), num_target_layers=5,
                            dtype=torch.bfloat16, **extra)
    arm = engine.arm(ArmConfig(draft=draft, mode=spec))
    assert arm.mode == spec and arm.taps == (-1, 1, 3)
    for seed in range(2):
        ids = prompt(9 + 11 * seed, 70 + seed)
        plain = greedy_reference(engine.runner, ids, 30)
        with engine.session(ids, 30, arm, eos_ids=()) as session:
            assert session.run() == plain, seed


# --------------------------------------------------------------------------- refusals


def _edit_config(src, dst, edit):
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit(raw)))
    for f in src.glob("*.safetensors*"):
        (dst / f.name).symlink_to(f)
    return dst


def _drop(d: dict, *path):
    inner = d
    for key in path[:-1]:
        inner = inner[key]
    del inner[path[-1]]
    return d


@pytest.mark.parametrize("which,edit,match", [
    ("multimodal", lambda c: _drop(c, "text_config", "layer_types"),
     r"config.json: required key 'text_config.layer_types' is missing \(and no 'text_config.full_attention_interval'"),
    ("text", lambda c: _drop(c, "layer_types"), r"config.json: required key 'layer_types' is missing"),
    ("multimodal", lambda c: _drop(c, "text_config"), r"config.json: required key 'text_config' is missing"),
    ("text", lambda c: _drop(c, "linear_num_value_heads"), r"required key 'linear_num_value_heads' is missing"),
    ("multimodal", lambda c: _drop(c, "text_config", "linear_key_head_dim"),
     r"required key 'text_config.linear_key_head_dim' is missing"),
    ("text", lambda c: {**c, "layer_types": c["layer_types"][:-1]}, r"'layer_types' has 4 entries for num_hidden_layers 5"),
    ("text", lambda c: {**c, "layer_types": ["mamba"] * 5}, r"key 'layer_types' must be a list of linear_attention\|full_attention"),
    ("multimodal", lambda c: {**c, "tie_word_embeddings": True},
     r"'tie_word_embeddings' \(true\) and 'text_config.tie_word_embeddings' \(false\) disagree"),
    ("text", lambda c: {**c, "num_key_value_heads": 3}, r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_bad_configs_are_refused_by_key(tiny_dirs, tmp_path, which, edit, match):
    bad = _edit_config(tiny_dirs[which], tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=match) as err:
        load_target(bad)
    assert "\n" not in str(err.value) and str(bad / "config.json") in str(err.value)


def test_other_model_types_are_refused(tmp_path):
    with pytest.raises(UnsupportedError, match="model_type 'qwen3_next' is not a Qwen3.5 hybrid target"):
        parse_qwen35_config({"model_type": "qwen3_next"}, "x/config.json")
    with pytest.raises(UnsupportedError, match="text_config.model_type 'qwen3_5_text' is not 'qwen3_5_moe_text'"):
        parse_qwen35_config({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_text"}},
                            "x/config.json")
    with pytest.raises(UnsupportedError, match="hidden_act='gelu'"):
        parse_qwen35_config({"model_type": "qwen3_5_text", "hidden_act": "gelu"}, "x/config.json")


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("which,name,shape", [
    ("text", "model.layers.0.linear_attn.A_log", [4]),
    ("text", "model.layers.3.linear_attn.in_proj_qkv.weight", [128, 64]),
    ("multimodal", "model.language_model.layers.2.linear_attn.conv1d.weight", [128, 1, 4]),
    ("text", "model.layers.1.self_attn.q_proj.weight", [256, 64]),
])
def test_missing_tensors_are_refused_by_name(tiny_dirs, tmp_path, which, name, shape):
    missing = _rewrite(tiny_dirs[which], tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{name}' is missing (expected shape {shape}")) as err:
        load_target(missing)
    assert "\n" not in str(err.value)
    if ".linear_attn." in name:
        assert "linear_attention (Gated DeltaNet)" in str(err.value)


def test_wrong_shapes_are_refused_by_name(tiny_dirs, tmp_path):
    name = "model.layers.2.linear_attn.dt_bias"
    wrong = _rewrite(tiny_dirs["text"], tmp_path / "wrong", lambda t: {**t, name: torch.zeros(5)})
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[5\], expected shape \[4\]"):
        load_target(wrong)


def test_bad_requests_are_refused(models):
    target, _ = models["text"]
    with pytest.raises(PromptError, match="empty"):
        greedy_reference(target, [], 4)
    with pytest.raises(PromptError, match=r"id 512 at index 1 .*\[0, 512\)"):
        greedy_reference(target, [3, 512], 4)
    runner = StepRunner(target, WIDTH)
    with pytest.raises(PromptError, match="KV cache length 4096"):
        runner.new_state(4096)
    state = target.new_state(10)
    with pytest.raises(PromptError, match=r"positions up to 11 exceed the KV cache \(10"):
        target.forward(torch.arange(11), 0, state)
    with pytest.raises(ConfigError, match=r"tap layer id 5 .*\[-1, 4\]"):
        target.forward(torch.arange(3), 0, state, taps=(0, 5))
    with pytest.raises(ConfigError, match="rollback mode"):
        target.set_rollback("undo")
    with pytest.raises(ConfigError, match="rollback_rows must be a positive integer"):
        target.set_rollback("stash", 0)


def test_cuda_graphs_default_on_with_cuda_and_a_fixed_width(models):
    """The hybrid's static_step is capturable: graphs default on with CUDA and a fixed width
    (drafter graphs with them), as for Qwen3; off elsewhere."""
    cuda = torch.device("cuda")
    on, drafter, _ = resolve_cuda_graphs(None, cuda, WIDTH, {}, Qwen35Target)
    assert (on, drafter) == (True, True)
    assert resolve_cuda_graphs(None, cuda, None, {}, Qwen35Target)[0] is False
    assert resolve_cuda_graphs(None, torch.device("cpu"), WIDTH, {}, Qwen35Target)[0] is False
    target, _ = models["text"]
    with pytest.raises(ConfigError, match="cuda_graphs needs the target on a CUDA device"):
        StepRunner(target, WIDTH, cuda_graphs=True)  # on the CPU: refused by the runner, not the family


@pytest.mark.parametrize("spec", ["plain", "plain-unpipelined", "dflash", "dflash-pipelined", "dspark-pipelined",
                                  "dflash-pipelined-stash",
                                  pytest.param("dflash-pipelined-moe", marks=pytest.mark.exhaustive)])
def test_round_graphs_over_the_hybrid_equal_plain_greedy(tmp_path, replay_graphs, spec, monkeypatch):
    """Whole rounds as one graph each (spec/chained.py, read one by one or queued one ahead)
    over the hybrid: a graph per buffer arrangement (the stand-in fails a replay in another
    one, except a speculative round queued ahead, which it replays in its own as a real graph
    would), a plain round's commit queued on the device after its replay, a speculative round's
    rollback inside its graph (`restore_round`), and every stream plain greedy's, in bfloat16.
    `-moe`: the mixture-of-experts hybrid (models/qwen3_5_moe.py), its twin running every expert
    as in a capture (no host read; the same bits)."""
    from memra_cli.engine.api import Engine as _Engine
    from memra_cli.engine.models.qwen3_5_moe import Qwen35MoeTarget
    from memra_cli.tiny.draft import make_tiny_draft
    from memra_kernels import moe_ref

    mode, _, how = spec.partition("-")
    pipelined = how.startswith("pipelined") or spec == "plain"
    routed = how.endswith("moe")
    target_dir = make_tiny_qwen35(tmp_path / "t", seed=5, **(dict(moe=(8, 2, 32), intermediate=48) if routed else {}))
    family = Qwen35MoeTarget if routed else Qwen35Target
    if routed:
        monkeypatch.setattr(moe_ref, "capturing", lambda x: True)
    rollback = "stash" if how.endswith("stash") else "replay"  # (the CPU's default is stash, CUDA's replay)
    model = family.from_dir(target_dir, dtype=torch.bfloat16, rollback=rollback)
    runner = graphed(model)
    engine = _Engine(model, runner, model.device, model.dtype, ["graphs on (CPU stand-in)"], draft_graphs=True,
                     round_graphs=True)
    engine.pipelined = pipelined
    if mode != "plain" and pipelined:
        monkeypatch.setattr(Qwen35State, "_ahead_ok", True, raising=False)
    arm = None
    if mode != "plain":
        fmt = "zlab" if mode == "dflash" else "deepspec"
        extra = {} if mode == "dflash" else dict(markov_rank=16, confidence="markov")
        draft = make_tiny_draft(tmp_path / spec, fmt, block_size=8, target_layer_ids=(-1, 1, 3),
                                num_target_layers=5, dtype=torch.bfloat16, **extra)
        arm = engine.arm(ArmConfig(draft=draft, mode=mode))
    reference = Engine.from_model(family.from_dir(target_dir, dtype=torch.bfloat16), step_width=WIDTH)
    live_seen = []  # each fixed step's live rows, as the recurrence reads them (the stand-in runs every body)
    recurrence = model.step_ops.gated_delta_rule

    def counting(*a, live=None, **k):
        if live is not None:
            live_seen.append(live.clone())  # read after the sessions: a graph body reads nothing on the host
        return recurrence(*a, live=live, **k)

    monkeypatch.setattr(model.step_ops, "gated_delta_rule", counting)
    for seed in range(2):
        ids = prompt(9 + 11 * seed, 80 + seed)
        plain = greedy_reference(reference.runner, ids, 24)
        with engine.session(ids, 24, arm, eos_ids=()) as session:
            assert session.graphed_rounds
            assert session.run() == plain, seed
            assert session.pipelined == pipelined
    steps = {int(n[0]) for n in live_seen}
    if mode == "plain":  # one real row of 16: the padding rows skip the recurrence
        assert steps == {1}, steps
    elif mode == "dflash":  # an adapting ladder (and block 8 < 16): the rows past the window skip it
        assert min(steps) < 8 and max(steps) <= 8, steps
    else:  # the confidence window, sized from the raws before the verify: the rows past it skip it too
        assert min(steps) < 8 and max(steps) < WIDTH, steps
    if mode == "plain":
        variants = set(session.cache.graphs[("plain-chain", WIDTH)].graphs)
    else:
        variants = {v for k, chain in session.cache.graphs.items() if k[0] == "spec-chain" for v in chain.graphs}
    assert variants == {0, 1}


@pytest.fixture
def replay_graphs(monkeypatch):
    """`cuda_graphs.capture` swapped for an eager stand-in (as tests/engine/test_step_width.py's
    `eager_graphs`) that also undoes a fixed step's Python side effects on the state at each
    replay: a real graph replays kernels only, so `commit` must not need them. Returns the list
    of captures."""
    from memra_cli.engine.runtime import cuda_graphs

    captures, replaying = [], [False]
    right = Qwen35Target._static_hidden  # what static_step and a greedy round's static_step_picks run
    capturing, variant_of = [None], {}

    def static_hidden(self, ids, positions, state, taps):
        # a real graph binds the buffers of the arrangement it was captured in: a replay in
        # another arrangement would read and write the wrong ones. A round queued ahead of the
        # host's read (a speculative round that restores the state itself) runs while the host
        # still holds the previous arrangement: the stand-in then replays in the captured one,
        # as the bound buffers of a real graph do, and exactness decides.
        if replaying[0] is not False:
            if not getattr(state, "_ahead_ok", False):
                assert state.graph_variant == variant_of[replaying[0]][1], "a graph replayed in another arrangement"
        elif capturing[0] is not None:
            variant_of.setdefault(capturing[0], (state, state.graph_variant))
        before = (state._pending, state._width)
        out = right(self, ids, positions, state, taps)
        if replaying[0] is not False:
            state._pending, state._width = before
        return out

    def capture(fn, device, pool=None):
        capturing[0] = fn
        try:
            with NoHostReads():  # a body that reads a device value on the host fails here too
                out = fn()
        finally:
            capturing[0] = None

        class Replay:
            def replay(self):
                replaying[0] = fn
                state, variant = variant_of.get(fn, (None, None))
                host = None if state is None else state._cur
                try:
                    if state is not None and getattr(state, "_ahead_ok", False):
                        state._cur = variant  # the captured arrangement, as a real graph's buffers
                    with NoHostReads():
                        fresh = fn()
                finally:
                    replaying[0] = False
                    if state is not None:
                        state._cur = host
                for mine, new in zip(_flat(out), _flat(fresh)):
                    mine.copy_(new)

        captures.append(fn)
        return Replay(), out

    monkeypatch.setattr(Qwen35Target, "_static_hidden", static_hidden)
    monkeypatch.setattr(cuda_graphs, "capture", capture)
    return captures


def _flat(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for y in x for t in _flat(y)] if isinstance(x, (tuple, list)) else []


def graphed(model, width=WIDTH) -> StepRunner:
    """A runner with graphs on, on the CPU (the runner refuses them off CUDA, so they are switched
    on after construction, rope tables made at full length as its constructor does)."""
    runner = StepRunner(model, width)
    runner.cuda_graphs = True
    model.ensure_positions(runner.max_rows())
    return runner


@pytest.mark.parametrize("mode", ["stash", "replay"])
def test_graph_plumbing_groupings_rollback_and_sessions(tiny_dirs, step_dir, replay_graphs, mode):
    """Fixed steps through StepGraph (replayed by the stand-in): groupings and verify + rollback
    bit for bit as eager steps give them, one capture per pooled storage, and speculative
    sessions equal plain greedy."""
    runner = graphed(Qwen35Target.from_dir(step_dir, rollback=mode))
    check_groupings(runner)
    check_rollback(runner, exact=True)
    # a 16-row verify as four graphed steps: the base moves aside before a later one overwrites it
    check_rollback(graphed(Qwen35Target.from_dir(step_dir, rollback=mode), width=4), exact=True,
                   ks=(0, 1, 3, 4, 5, 8, 12, 15, 16))
    eager = StepRunner(Qwen35Target.from_dir(step_dir, rollback=mode), WIDTH)
    p, cont = _ids(37, 0), _ids(24, 1)
    for groups in ([24], [5, 7, 1, 11]):
        got, s_graph = run_groups(runner, p, cont, groups)
        want, s_eager = run_groups(eager, p, cont, groups)
        assert torch.equal(got, want)
        assert_same_states(s_graph, s_eager)
    # a released storage comes back from the pool with its graph: no new capture, same numbers
    first = runner.new_state(64)
    runner.prefill(p, first)
    runner.step(cont[:3], 37, first)
    n = len(replay_graphs)
    runner.release(first)
    again = runner.new_state(64)
    assert again is first and again.length == 0
    runner.prefill(p, again)
    got, _ = runner.step(cont[:3], 37, again)
    fresh = eager.new_state(64)
    eager.prefill(p, fresh)
    assert torch.equal(got, eager.step(cont[:3], 37, fresh)[0]) and len(replay_graphs) == n
    assert_same_states(again, fresh)

    target = Qwen35Target.from_dir(tiny_dirs["text"], rollback=mode)
    g_runner = graphed(target)
    block, max_new = 8, 30
    ids = prompt(12, 62)
    truth = greedy_reference(StepRunner(Qwen35Target.from_dir(tiny_dirs["text"], rollback=mode), WIDTH), ids,
                             max_new + block + 1)
    assert greedy_reference(g_runner, ids, max_new + block + 1) == truth
    oracle = ScriptedOracle(truth, len(ids), block - 1, moving_wrong_slot, VOCAB)
    program = Program(Harvest.DFLASH, LADDER, False, block, False, block)
    session = Session(g_runner, ids, max_new, proposer=oracle, program=program, taps=(-1, 1, 3))
    assert session.run() == truth[:max_new]
    hist = session.stats.accept_hist
    assert any(0 < m < block - 1 for m in hist if hist[m]), hist


def test_config_interval_rule_and_defaults(tiny_dirs):
    cfg = load_qwen35_config(tiny_dirs["tied-bias-interval"])
    assert cfg.layer_types == INTERVAL_TYPES and cfg.full_layers == (2, 5)
    assert (cfg.rotary_dim, cfg.mrope_section, cfg.mrope_interleaved) == (16, (4, 2, 2), True)
    mm = load_qwen35_config(tiny_dirs["multimodal"])
    assert (mm.layout, mm.conv_dim, mm.rotary_dim) == ("multimodal", 2 * 32 + 64, 8)


# --------------------------------------------------------------------------- GPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_logits_greedy_exactness_and_rollback(tiny_dirs, step_dir, dtype):
    """The plain-torch path on CUDA: HF parity (f32 exact streams; bf16 agreement printed),
    fixed-width groupings and rollback bit for bit, both modes."""
    path = tiny_dirs["text"]
    target = Qwen35Target.from_dir(path, dtype=dtype, device="cuda")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to("cuda").eval()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for n, seed in ((7, 1), (150, 2)):
        ids = prompt(n, seed)
        assert rel_err(ours_logits(target, ids), _hf_cuda(hf, ids)) < tol, n
    ids = prompt(80, 11)
    ours, ref = greedy_reference(target, ids, 128), _hf_greedy_cuda(hf, ids, 128)
    same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ours))
    print(f"\n[{dtype}] greedy agreement with HF on CUDA (common prefix of 128): {same}")
    if dtype == torch.float32:
        assert ours == ref
    for mode in ("stash", "replay"):
        runner = StepRunner(Qwen35Target.from_dir(step_dir, dtype=dtype, device="cuda", rollback=mode), WIDTH)
        check_groupings(runner)
        check_rollback(runner, exact=True)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_cuda_pipelined_hybrid_rounds_equal_plain_greedy(tmp_path, spec):
    """On CUDA with the kernels and every graph on: speculative rounds over the hybrid queued one
    ahead of the host, each rolling the recurrent state back inside its own graph
    (`restore_round`), give plain greedy's stream in bfloat16, rollback replay and stash."""
    from memra_cli.engine.layers.step_ops import select_step_ops
    from memra_cli.tiny.draft import make_tiny_draft

    target_dir = make_tiny_qwen35(tmp_path / "t", seed=5)
    fmt = "zlab" if spec == "dflash" else "deepspec"
    extra = {} if spec == "dflash" else dict(markov_rank=16, confidence="markov")
    draft = make_tiny_draft(tmp_path / spec, fmt, block_size=8, target_layer_ids=(-1, 1, 3), num_target_layers=5,
                            dtype=torch.bfloat16, **extra)
    ref_model = Qwen35Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda")
    ref_model.step_ops, _ = select_step_ops(ref_model.device)  # the same kernels: the same bits
    reference = Engine.from_model(ref_model, step_width=WIDTH)
    for mode in ("replay", "stash"):
        model = Qwen35Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda", rollback=mode)
        model.step_ops, _ = select_step_ops(model.device)
        engine = Engine.from_model(model, step_width=WIDTH, cuda_graphs=True, draft_graphs=True, round_graphs=True)
        arm = engine.arm(ArmConfig(draft=draft, mode=spec))
        for seed in range(3):
            ids = prompt(9 + 11 * seed, 80 + seed)
            plain = greedy_reference(reference.runner, ids, 40)
            for pipelined in (True, False):  # queued ahead (rollback in the graph) and read one by one
                engine.pipelined = pipelined
                with engine.session(ids, 40, arm, eos_ids=()) as session:
                    assert session.graphed_rounds and session.pipelined == pipelined, (mode, seed)
                    assert session.run() == plain, (mode, seed, pipelined)


@torch.no_grad()
def _hf_cuda(hf, ids):
    x = torch.tensor([ids], device="cuda")
    return hf(x, attention_mask=torch.ones_like(x)).logits[0]


@torch.no_grad()
def _hf_greedy_cuda(hf, ids, max_new):
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id = VOCAB, EOS
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens, gc.max_length = False, max_new, None, None
    x = torch.tensor([ids], device="cuda")
    return hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)[0, len(ids):].tolist()


def test_oracle_target_tables_read_both_hybrid_layouts(tiny_dirs):
    """`memra parity --target` reads embed / lm_head without the layers: the multimodal layout
    keeps them under `model.language_model.`; a tied model's lm_head is its embedding."""
    from memra_cli.parity.oracle import OracleError, target_tables

    for name in ("multimodal", "text", "tied-bias-interval"):
        target = Qwen35Target.from_dir(tiny_dirs[name])
        embed, head = target_tables(tiny_dirs[name], torch.float32, "cpu", 64)
        assert torch.equal(embed, target.embed_weight) and torch.equal(head, target.lm_head_weight), name
    assert target_tables(tiny_dirs["multimodal"], torch.float32, "cpu", 64, embed=False)[0] is None
    with pytest.raises(OracleError, match="target hidden_size 64 does not match the drafter's 32"):
        target_tables(tiny_dirs["multimodal"], torch.float32, "cpu", 32)


def test_the_fixed_step_is_step_ops_and_weight_matmuls():
    """What a fixed step launches on the GPU, counted on the CPU (benchmarks/qwen3_5_step_ops.py):
    per DeltaNet layer 6 step-op launches (the two norms fused with the residual adds, the conv
    and gates in one, the recurrence, the gated norm, SiLU·mul; 7 while conv and gates were two),
    per attention layer 6 (the norms, the fused prep, attention's two with the output gate in the
    second, SiLU·mul; 7 while the gate was its own launch),
    and the weight matmuls, no torch op left outside the seam (before the fusion: 41 non-GEMM
    launches per DeltaNet layer, 54 per attention layer, in bf16 at width 1). Fails when a torch
    op creeps back into the step."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "qwen3_5_step_ops.py"
    spec = importlib.util.spec_from_file_location("qwen3_5_step_ops", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    counts = bench.per_layer(width=3)
    _, per_gdn, per_attn = counts["launches_step_ops"]
    assert (per_gdn, per_attn) == (6, 6), counts["step_op_calls"]
    assert counts["step_op_calls"]["gated_attention"][1:] == [0, 1], counts["step_op_calls"]
    assert counts["step_op_calls"]["gdn_conv_gates"][1:] == [1, 0], counts["step_op_calls"]
    assert counts["launches_torch_non_gemm"][1:] == [0, 0], counts["torch_ops"]
    assert counts["gemms"][1:] == [4, 4]

"""Qwen3Target against the real reference: HF `transformers.Qwen3ForCausalLM` on the same files.

Tiny random checkpoints are written at test time (float32, CPU, eager attention on the HF side):
prefill logits, cached incremental decode, greedy streams vs `generate` (at variable width and
through a `StepRunner` at the product default of 16-row steps), taps vs `output_hidden_states`,
verify/rollback, and refusals. A `gpu`-marked variant repeats prefill and greedy on CUDA in
float32 and bf16.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_cli.engine.errors import CheckpointError, ConfigError, MemraError
from memra_cli.engine.errors import PromptError
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.layers.ops import rms_norm
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.target import YARN, make_tiny_qwen3, make_tiny_tokenizer, special_token_ids

from fp32_bounds import layer_reductions, reorder_bound

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB = 512
EOS = special_token_ids(VOCAB)["<|endoftext|>"]  # also HF's implied pad id: see hf_greedy
VARIANTS = {
    "untied": {},
    "tied": {"tie": True, "seed": 1},
    "yarn": {"rope": YARN, "seed": 2},
    "sharded-bias": {"shards": 3, "attention_bias": True, "seed": 3},
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return {name: make_tiny_qwen3(root / name, **kw) for name, kw in VARIANTS.items()}


def load_hf(path, dtype=torch.float32, device="cpu"):
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {name: (Qwen3Target.from_dir(d), load_hf(d)) for name, d in tiny_dirs.items()}


def prompt(n: int, seed: int, with_eos: bool = True) -> list[int]:
    """Random ids; the EOS id is planted so HF's pad-masking trap would bite if present."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
    if with_eos and n > 3:
        ids[n // 2] = EOS
    return ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def ours_logits(target: Qwen3Target, ids: list[int]) -> torch.Tensor:
    cache = target.new_state(len(ids))
    hidden, _ = target.forward(torch.tensor(ids, device=target.device), 0, cache)
    return target.logits(hidden)


@torch.no_grad()
def hf_logits(hf, ids: list[int], **kw):
    x = torch.tensor([ids], device=hf.device)
    return hf(x, attention_mask=torch.ones_like(x), **kw)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """HF greedy generate. The explicit all-ones attention_mask matters: without it, generate
    infers a mask from pad_token_id and would drop prompt tokens equal to the pad id.

    No EOS is spelled as the never-produced id VOCAB: generate fills a None eos_token_id back in
    from the model's generation_config (and refuses negative ids).
    """
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id = VOCAB if eos is None else eos, EOS
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens, gc.max_length = False, max_new, None, None
    x = torch.tensor([ids], device=hf.device)
    out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    return out[0, len(ids):].tolist()


# --------------------------------------------------------------------------- (a) prefill


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_hf(models, variant):
    target, hf = models[variant]
    for n, seed in ((1, 0), (7, 1), (40, 2), (300, 3)):  # 300 > YaRN's original 128 positions
        ids = prompt(n, seed)
        ours, ref = ours_logits(target, ids), hf_logits(hf, ids).logits[0]
        assert rel_err(ours, ref) < 1e-5, (variant, n)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_tied_lm_head_is_the_embedding(models):
    target, _ = models["tied"]
    assert target.lm_head_weight is target.embed_weight


# --------------------------------------------------------------------------- (b) incremental


@pytest.mark.parametrize("variant", ["untied", "yarn"])
def test_incremental_decode_matches_full_sequence(models, variant):
    target, hf = models[variant]
    ids = prompt(170, 5)
    ref = hf_logits(hf, ids).logits[0]
    cache = target.new_state(len(ids))
    rows, start = [], 0
    for chunk in (23, 1, 1, 6, 1, 16, 1, 2, 90, 1, 28):  # prefill, decode steps, verify blocks
        hidden, _ = target.forward(torch.tensor(ids[start:start + chunk]), start, cache)
        rows.append(target.logits(hidden))
        start += chunk
        assert cache.length == start
    assert start == len(ids)
    assert rel_err(torch.cat(rows), ref) < 1e-5


# --------------------------------------------------------------------------- (c) greedy streams


@pytest.mark.parametrize("variant,prompts", [
    ("untied", [(5, 10), (64, 11), (1, 12)]),
    ("yarn", [(100, 13)]),  # runs to position 356, past YaRN's original 128
])
def test_greedy_matches_hf_generate(models, variant, prompts):
    target, hf = models[variant]
    for n, seed in prompts:
        ids = prompt(n, seed)
        ours = greedy_reference(target, ids, 256)
        assert len(ours) == 256
        assert len(set(ours)) > 20, "degenerate tiny model: greedy stream loops on a few tokens"
        assert ours == hf_greedy(hf, ids, 256), (variant, n)


DEFAULT_STEP_WIDTH = 16  # api.DEFAULT_STEP_WIDTH: what `generate` / `bench` run unless told otherwise


@pytest.mark.parametrize("variant,prompts", [
    ("untied", [(5, 10), (64, 11), (1, 12)]),
    ("yarn", [(100, 13)]),  # runs to position 228, past YaRN's original 128
])
def test_greedy_at_the_default_step_width_matches_hf_generate(models, variant, prompts):
    """The product default: every decode step runs 16 rows (15 of them padding) through
    `static_step`. In float32 the stream is still transformers' greedy token for token."""
    from memra_cli.engine.api import DEFAULT_STEP_WIDTH as product_default

    assert product_default == DEFAULT_STEP_WIDTH
    target, hf = models[variant]
    runner = StepRunner(target, DEFAULT_STEP_WIDTH)
    for n, seed in prompts:
        ids = prompt(n, seed)
        ours = greedy_reference(runner, ids, 128)
        assert len(ours) == 128
        assert len(set(ours)) > 20, "degenerate tiny model: greedy stream loops on a few tokens"
        assert ours == hf_greedy(hf, ids, 128), (variant, n)


def test_greedy_stops_at_eos_like_hf(models):
    target, hf = models["untied"]
    ids = prompt(9, 20)
    free = greedy_reference(target, ids, 40)
    eos = free[12]
    stop = free.index(eos)
    ours = greedy_reference(target, ids, 40, eos_ids=(eos,))
    assert ours == free[:stop + 1] and ours[-1] == eos
    assert ours == hf_greedy(hf, ids, 40, eos=eos)
    assert greedy_reference(target, ids, 3) == free[:3]
    assert greedy_reference(target, ids, 0) == []


# --------------------------------------------------------------------------- (d) taps


def test_taps_match_hf_hidden_states(models):
    target, hf = models["untied"]
    ids = prompt(33, 30)
    states = hf_logits(hf, ids, output_hidden_states=True).hidden_states
    taps = (2, -1, 0, 1)  # out of order on purpose: output follows the given order
    cache = target.new_state(len(ids))
    hidden, tapped = target.forward(torch.tensor(ids), 0, cache, taps=taps)
    h = target.hidden_size
    assert tapped.shape == (len(ids), len(taps) * h)
    # HF and we sum in different orders (and BLAS's order depends on the CPU): the bound is the
    # float32 reordering bound of the chained reductions (fp32_bounds.py); a tap after layer t
    # chains t + 1 layers.
    cfg = target.cfg
    per_layer = _per_layer(target, len(ids))
    for j, tap in enumerate(taps):
        depth = tap % target.n_layers + 1
        assert rel_err(tapped[:, j * h:(j + 1) * h], states[tap + 1][0]) < reorder_bound(*per_layer * depth), tap
    # The last layer's tap is the raw residual; HF overwrites hidden_states[-1] with the
    # final-normed output (one more reduction), so the two agree only after the final norm.
    _, last = target.forward(torch.tensor(ids), 0, cache, taps=(target.n_layers - 1,))
    whole = reorder_bound(*per_layer * target.n_layers, cfg.hidden_size)
    assert rel_err(rms_norm(last, target.norm, target.cfg.rms_norm_eps), states[-1][0]) < whole
    assert rel_err(hidden, states[-1][0]) < whole


def _per_layer(target: Qwen3Target, keys: int) -> tuple[int, ...]:
    cfg = target.cfg
    return layer_reductions(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.head_dim, keys,
                            cfg.intermediate_size)


def test_embed_is_the_embedding_table(models):
    target, hf = models["untied"]
    ids = torch.tensor(prompt(5, 31))
    assert torch.equal(target.embed(ids), hf.model.embed_tokens(ids))


# --------------------------------------------------------------------------- (e) rollback


def _verify(runner: StepRunner, ids, start, cache, taps):
    """What the round loop's verify is: a runner step, then the argmax per row."""
    logits, tapped = runner.step(torch.tensor(ids), start, cache, taps)
    return torch.argmax(logits, dim=-1), tapped


def test_verify_rollback_reverify_equals_fresh_run(models):
    target, hf = models["untied"]
    runner = StepRunner(target)  # variable width: each step at its own width
    ids, block_a, block_b = prompt(20, 40), prompt(7, 41), prompt(6, 42)
    taps = (-1, 1, 3)
    cache = runner.new_state(64)
    logits, _ = runner.prefill(torch.tensor(ids), cache, taps)
    first = torch.argmax(logits, dim=-1)
    _verify(runner, block_a, len(ids), cache, taps)  # a round accepting 2 of 7
    cache.rollback(len(ids) + 2)
    vam, tapped = _verify(runner, block_b, cache.length, cache, taps)

    fresh_cache = runner.new_state(64)
    runner.prefill(torch.tensor(ids + block_a[:2]), fresh_cache)
    fresh_vam, fresh_taps = _verify(runner, block_b, len(ids) + 2, fresh_cache, taps)
    assert torch.equal(vam, fresh_vam)
    # variable width: the kept rows' K/V came from GEMMs of other row counts than the fresh
    # prefill's, so they may sum in another order (fp32_bounds.py; the deepest tap chains 4 layers)
    assert rel_err(tapped, fresh_taps) < reorder_bound(*_per_layer(target, 64) * target.n_layers)
    assert cache.length == fresh_cache.length == len(ids) + 2 + len(block_b)

    ref = hf_logits(hf, ids + block_a[:2] + block_b).logits[0]
    assert torch.equal(vam, ref[-len(block_b):].argmax(-1))
    assert int(first) == int(ref[len(ids) - 1].argmax())


def test_forward_below_length_overwrites(models):
    """`start < cache.length` is an implicit rollback (what a re-verify after rollback does)."""
    target, _ = models["untied"]
    ids = prompt(12, 43)
    cache = target.new_state(16)
    target.forward(torch.tensor(ids), 0, cache)
    h1, _ = target.forward(torch.tensor(ids[8:]), 8, cache)
    assert cache.length == 12
    # 4 rows against 12 in one GEMM: another summation order, through every layer and the lm_head
    bound = reorder_bound(*_per_layer(target, len(ids)) * target.n_layers, target.hidden_size)
    assert rel_err(target.logits(h1), ours_logits(target, ids)[8:]) < bound
    with pytest.raises(ValueError, match="cannot roll a KV cache of length 12 back to 13"):
        cache.rollback(13)


def test_fixed_steps_commit_real_rows_and_roll_back_below_the_length(models):
    """The runner keeps only a fixed step's real rows (`state.commit`), and a step that starts
    below the length rolls the state back to its start first (an implicit rollback)."""
    target, _ = models["untied"]
    runner = StepRunner(target, 4)
    ids = prompt(12, 44)
    state = runner.new_state(16)
    runner.prefill(torch.tensor(ids[:6]), state)
    runner.step(torch.tensor(ids[6:12]), 6, state)  # 4 + 2 rows: the second step padded by 2
    assert state.length == 12
    again, _ = runner.step(torch.tensor(ids[9:12]), 9, state)
    assert state.length == 12
    assert rel_err(again, ours_logits(target, ids)[9:]) < 1e-5
    with pytest.raises(ValueError, match="cannot commit a KV cache of length 12 to 11"):
        state.commit(11)


# --------------------------------------------------------------------------- (f) refusals


def test_bad_prompts_are_refused_by_value(models):
    target, _ = models["untied"]
    with pytest.raises(PromptError, match="empty"):
        greedy_reference(target, [], 4)
    with pytest.raises(PromptError, match=r"id 512 at index 1 .*\[0, 512\)"):
        greedy_reference(target, [3, 512], 4)
    with pytest.raises(PromptError, match="id -1 at index 0"):
        greedy_reference(target, [-1], 4)
    with pytest.raises(PromptError, match="2000.*100.*2100.*max_position_embeddings 2048"):
        greedy_reference(target, [1] * 2000, 100)
    with pytest.raises(PromptError, match="max_new must be"):
        greedy_reference(target, [1], -1)
    runner = StepRunner(target)
    with pytest.raises(PromptError, match="KV cache length 4096"):
        runner.new_state(4096)
    cache = runner.new_state(10)
    with pytest.raises(PromptError, match="positions up to 11 exceed the KV cache \\(10"):
        target.forward(torch.arange(11), 0, cache)
    # (check_prompt's old `max_len=` bound is gone: the runner sizes each state from the
    # request itself, so a checked request always fits its state)
    with pytest.raises(ConfigError, match="tap layer id 4 .*\\[-1, 3\\]"):
        target.forward(torch.arange(3), 0, cache, taps=(0, 4))
    assert all(issubclass(e, MemraError) for e in (PromptError, ConfigError, CheckpointError))


def _rewrite(src, dst, edit):
    """Copy a tiny single-file checkpoint with its tensor dict passed through `edit`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = edit(load_file(str(src / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_bad_checkpoints_are_refused_by_name(tiny_dirs, tmp_path):
    src = tiny_dirs["untied"]
    name = "model.layers.1.mlp.up_proj.weight"
    missing = _rewrite(src, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=rf"'{name}' is missing \(expected shape \[128, 64\]"):
        Qwen3Target.from_dir(missing)
    wrong = _rewrite(src, tmp_path / "wrong", lambda t: {**t, name: t[name][:, :63].contiguous()})
    shape_msg = rf"'{name}' has shape \[128, 63\], expected shape \[128, 64\]"
    with pytest.raises(CheckpointError, match=shape_msg):
        Qwen3Target.from_dir(wrong)
    no_head = _rewrite(src, tmp_path / "nohead", lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(CheckpointError, match="'lm_head.weight' is missing.*tie_word_embeddings is false"):
        Qwen3Target.from_dir(no_head)
    # the same files with tie_word_embeddings true load (lm_head = embedding)
    cfg = json.loads((no_head / "config.json").read_text())
    (no_head / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert Qwen3Target.from_dir(no_head).lm_head_weight.shape == (VOCAB, 64)


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("vocab", [VOCAB, 3000])  # 3000 outruns the text's merges: fillers
def test_tiny_tokenizer_fits_the_model_vocab(tmp_path, vocab):
    tok = transformers.AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path, vocab))
    ids = special_token_ids(vocab)
    assert len(tok) == vocab
    assert tok.eos_token_id == ids["<|endoftext|>"] and tok.mask_token_id == ids["<|MASK|>"] == vocab - 1
    text = "The quick brown fox, 48 + 24 = 72."
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < vocab
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_prefill_and_greedy(tiny_dirs, dtype):
    path = tiny_dirs["yarn"]
    target = Qwen3Target.from_dir(path, dtype=dtype, device="cuda")
    hf = load_hf(path, dtype=dtype, device="cuda")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for n, seed in ((1, 0), (40, 2), (300, 3)):
        ids = prompt(n, seed)
        assert rel_err(ours_logits(target, ids), hf_logits(hf, ids).logits[0]) < tol, n
    # no host sync inside a forward: ids, cache and rope tables already live on the device
    runner = StepRunner(target)
    cache = runner.new_state(64)
    x = torch.tensor(prompt(20, 7), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        target.forward(x, 0, cache, taps=(-1, 1))
        logits, _ = runner.step(x[:5], 20, cache, taps=(2,))
        torch.argmax(logits, dim=-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    agree = []
    for n, seed in ((5, 10), (64, 11), (100, 13)):
        ids = prompt(n, seed)
        ours, ref = greedy_reference(target, ids, 256), hf_greedy(hf, ids, 256)
        same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ours))
        agree.append(same)
        if dtype == torch.float32:
            assert ours == ref, n
    print(f"\n[{dtype}] greedy agreement with HF (common prefix of 256): {agree}")

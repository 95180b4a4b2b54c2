"""The engine assembly (api.py) and the runtime's storage pool.

- `check_pair` / `Engine.arm` refuse a drafter whose vocabulary-indexed tables (own embed_tokens
  and lm_head, the markov tables) have another row count than the target's vocabulary, in either
  direction, from the headers alone (before any weight loads), naming the tensor and both sizes.
- `Engine.arm` warns about a drafter that taps the target's last layer.
- `StoragePool` keeps idle storages within its byte budget: least recently released evicted
  first, their CUDA graphs dropped with them, live storages never touched, a repeated release a
  no-op.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from memra_cli.engine.api import VOCAB_TABLES, ArmConfig, Engine, EngineConfig, check_pair
from memra_cli.engine.errors import ConfigError
from memra_cli.engine.formats.census import take_census
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.runtime.pool import StoragePool
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

from fp32_bounds import assert_close_at_scale, reorder_bound

VOCAB = 512  # the tiny target's
LAYERS = 4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("engine") / "target", vocab=VOCAB, layers=LAYERS)


@pytest.fixture(scope="module")
def engine(target_dir):
    return Engine.from_model(Qwen3Target.from_dir(target_dir))


@pytest.fixture
def no_drafter_load(monkeypatch):
    """A pair refusal must come from the headers: loading the drafter's weights is a failure."""
    from memra_cli.engine.models.drafter import Drafter

    def load(cls, path, *a, **k):
        raise AssertionError(f"{path}: the drafter loaded before the pair was checked")

    monkeypatch.setattr(Drafter, "load", classmethod(load))


# --------------------------------------------------------------------------- the vocabulary


@pytest.mark.parametrize("vocab", [1024, 256], ids=["drafter-larger", "drafter-smaller"])
def test_a_drafter_of_another_vocabulary_is_refused_before_it_loads(engine, target_dir, tmp_path, no_drafter_load,
                                                                     vocab):
    # a DeepSpec export: own embed_tokens / lm_head and a markov head, all `vocab` rows
    draft = make_tiny_draft(tmp_path / "d", "deepspec", vocab=vocab, mask_token_id=min(vocab, VOCAB) - 1,
                            markov_rank=16, confidence="markov")
    want = (f"drafter tensor 'embed_tokens.weight' has {vocab} vocabulary rows ({draft}) but the target's "
            f"vocabulary is {VOCAB} ({target_dir / 'config.json'}): a drafter must share its target's vocabulary")
    for mode in ("dspark", "dflash", "auto"):
        with pytest.raises(ConfigError) as e:
            engine.arm(ArmConfig(draft=draft, mode=mode))
        assert str(e.value) == want, mode
        with pytest.raises(ConfigError, match=re.escape(want)):
            engine.resolve(ArmConfig(draft=draft, mode=mode))  # headers only
    # without its own tables the markov head's table is the one named
    markov_only = make_tiny_draft(tmp_path / "m", "zlab", vocab=vocab, mask_token_id=min(vocab, VOCAB) - 1,
                                  markov_rank=16)
    with pytest.raises(ConfigError, match=rf"drafter tensor 'markov_head\.markov_w1\.weight' has {vocab} "
                                          rf"vocabulary rows .* target's vocabulary is {VOCAB} "):
        engine.arm(ArmConfig(draft=markov_only, mode="dspark"))


@pytest.mark.parametrize("name", VOCAB_TABLES)
@pytest.mark.parametrize("rows", [VOCAB + 88, VOCAB - 12])
def test_every_vocabulary_table_is_checked(engine, tmp_path, name, rows):
    """Each table on its own (the census keeps a real checkpoint's tables consistent with each
    other, so one table is made wrong in the census handed to check_pair)."""
    census = take_census(make_tiny_draft(tmp_path / "d", "deepspec", markov_rank=16, confidence="markov"))
    assert {t.name for t in census.tensors} >= set(VOCAB_TABLES)
    assert check_pair(engine.target, census) == []  # the same drafter at the target's vocabulary is fine
    tensors = tuple(dataclasses.replace(t, shape=(rows, *t.shape[1:])) if t.name == name else t
                    for t in census.tensors)
    with pytest.raises(ConfigError, match=rf"^drafter tensor '{re.escape(name)}' has {rows} vocabulary rows "
                                          rf".* target's vocabulary is {VOCAB} "):
        check_pair(engine.target, dataclasses.replace(census, tensors=tensors))


# --------------------------------------------------------------------------- warnings


def test_a_drafter_tapping_the_last_layer_is_warned_about(engine, tmp_path):
    last = LAYERS - 1
    arm = engine.arm(ArmConfig(draft=make_tiny_draft(tmp_path / "last", "zlab", target_layer_ids=(0, last)),
                               mode="dflash"))
    (warning,) = [w for w in arm.warnings if "last layer" in w]
    assert warning.startswith(f"drafter taps the target's last layer ({last}); memra's tap is that layer's raw output")
    assert "hidden_states[-1]" in warning
    assert arm.taps == (0, last) and arm.mode == "dflash"  # a warning, not a refusal
    inner = engine.arm(ArmConfig(draft=make_tiny_draft(tmp_path / "inner", "zlab", target_layer_ids=(0, last - 1)),
                                 mode="dflash"))
    assert not any("last layer" in w for w in inner.warnings)


def test_the_pool_budget_reaches_the_engine(target_dir):
    engine = Engine.load(EngineConfig(target=target_dir, device="cpu", pool_idle_bytes=12345))
    assert engine.pool.idle_budget == 12345 and engine.runner.pool is engine.pool


# --------------------------------------------------------------------------- the storage pool


class FakeStorage:
    """What the pool needs of a storage: its size and the graphs captured over it."""

    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes = name, nbytes
        self.graphs = {("step", ()): f"graph over {name}"}

    def __repr__(self) -> str:
        return self.name


def test_the_pool_evicts_least_recently_released_idle_storages_past_its_budget():
    pool = StoragePool(idle_budget=250)
    made = []

    def maker(name, nbytes=100):
        def make():
            made.append(FakeStorage(name, nbytes))
            return made[-1]
        return make

    a, b, c = (pool.acquire("k", maker(n)) for n in "abc")
    live = pool.acquire("other", maker("live", 10_000))  # far past the budget, but live
    assert [s.name for s in made] == ["a", "b", "c", "live"]
    assert (pool.live_count, pool.idle_count, pool.idle_bytes) == (4, 0, 0)

    pool.release(b)
    pool.release(a)  # idle, least recently released first: b, a
    assert (pool.live_count, pool.idle_count, pool.idle_bytes, pool.evictions) == (2, 2, 200, 0)
    pool.release(c)  # 300 bytes > 250: b (released first) goes, and its graphs with it
    assert (pool.idle_count, pool.idle_bytes, pool.evictions) == (2, 200, 1)
    assert b.graphs == {} and a.graphs and c.graphs and live.graphs

    # the most recently released idle storage of a key comes back first, graphs and all
    assert pool.acquire("k", maker("new")) is c and c.graphs
    assert (pool.live_count, pool.idle_count) == (2, 1) and len(made) == 4  # nothing new made
    pool.release(c)  # c is now the most recent again: idle a, c
    pool.release(a)  # a second release (a is idle): a no-op, a keeps its place
    pool.release(b)  # an evicted storage: a no-op
    pool.release(FakeStorage("stranger", 1))  # never handed out here: a no-op
    assert (pool.live_count, pool.idle_count, pool.idle_bytes, pool.evictions) == (1, 2, 200, 1)

    big = pool.acquire("big", maker("big", 200))
    pool.release(big)  # idle a, c, big = 400 bytes: a then c go (least recent first), big stays
    assert (pool.idle_count, pool.idle_bytes, pool.evictions) == (1, 200, 3)
    assert a.graphs == {} and c.graphs == {} and big.graphs
    assert pool.acquire("big", maker("x")) is big
    pool.release(big)

    huge = pool.acquire("k", maker("huge", 1000))
    pool.release(huge)  # larger than the whole budget: nothing idle may stay past it, itself included
    assert (pool.idle_count, pool.idle_bytes, pool.evictions) == (0, 0, 5) and huge.graphs == {}
    assert pool.acquire("k", maker("fresh")).name == "fresh"  # an evicted storage is never handed out again

    # the live storage was never evicted, whatever the idle bytes were
    assert live.graphs and pool.live_count == 2
    pool.release(live)  # 10 000 bytes idle > 250: evicted as soon as it is idle
    assert live.graphs == {} and pool.idle_count == 0


def test_the_pool_without_a_budget_keeps_everything_and_a_negative_budget_is_refused():
    pool = StoragePool(idle_budget=None)
    storages = [pool.acquire(("k", i), lambda i=i: FakeStorage(f"s{i}", 1 << 40)) for i in range(3)]
    for s in storages:
        pool.release(s)
    assert (pool.idle_count, pool.evictions) == (3, 0) and all(s.graphs for s in storages)
    pool.clear()
    assert pool.idle_count == 0
    with pytest.raises(ValueError, match="idle_budget must be >= 0"):
        StoragePool(idle_budget=-1)


def test_a_collected_owner_takes_its_idle_storages_and_its_token_is_never_reused():
    """Storage keys carry an owner token, not `id()`: a new drafter that reuses a freed one's
    address must never be handed the freed one's storage (its graphs read freed weights)."""
    import gc

    from memra_cli.engine.runtime.pool import StoragePool

    class Owner:
        pass

    class Store:
        def __init__(self):
            self.nbytes, self.graphs = 10, {"g": object()}

    pool = StoragePool(idle_budget=None)
    first = Owner()
    token = pool.owner_token(first)
    assert pool.owner_token(first) == token
    stored = pool.acquire((token, "draft", 256), Store)
    pool.release(stored)
    assert pool.idle_count == 1
    del first
    gc.collect()
    assert pool.idle_count == 0 and stored.graphs == {}
    tokens = {pool.owner_token(Owner()) for _ in range(50)}  # addresses get reused, tokens never
    assert token not in tokens and len(tokens) == 50


def test_a_pool_dies_with_its_runner_while_the_model_lives():
    """A runner's pool (its idle storages and their graphs' memory) is freed with the runner: the
    model's collection hook holds the pool weakly. (It held it strongly, so every Engine made
    on one model kept its pool, and a benchmark making several ran the GPU out of memory.)"""
    import gc
    import weakref

    from memra_cli.engine.runtime.pool import StoragePool

    class Owner:
        pass

    class Store:
        def __init__(self):
            self.nbytes, self.graphs = 10, {"g": object()}

    model = Owner()
    pool = StoragePool(idle_budget=None)
    pool.release(pool.acquire((pool.owner_token(model), "target", 256), Store))
    store = weakref.ref(pool._idle[next(iter(pool._idle))][1])
    dead = weakref.ref(pool)
    del pool
    gc.collect()
    assert dead() is None and store() is None
    del model  # the hook finds no pool and does nothing
    gc.collect()


def test_drafter_projections_are_fused_once_and_compute_what_the_separate_ones_do(tmp_path):
    """q/k/v and gate/up are one GEMM each for plain weights (k/v for context rows), the
    separate weights stay as views of the fused one; quantized weights of one qtype fuse the
    same way (test_precision.py checks them bit for bit against separate matmuls)."""
    from memra_cli.engine.models.drafter import Drafter
    from memra_cli.engine.quant.precision import weight_fn_for
    from memra_cli.tiny.draft import make_tiny_draft

    path = make_tiny_draft(tmp_path / "d", "zlab")
    d = Drafter.load(path)
    w = d.layers[0]
    assert w.wqkv is not None and w.w_gate_up is not None
    assert w.wq.data_ptr() == w.wqkv.data_ptr() and w.wkv.data_ptr() == w.wk.data_ptr()
    x = torch.randn(5, d.cfg.hidden_size)
    q, k, v = d._project_qkv(x, w)
    # a fused GEMM may sum over hidden in another order than a separate one (then the head norm
    # over head_dim): fp32_bounds.py
    bound = reorder_bound(d.cfg.hidden_size, d.cfg.head_dim)
    assert_close_at_scale(q, d._heads(x, w.wq, w.q_norm, d.cfg.num_attention_heads), bound, "q")
    assert_close_at_scale(k, d._heads(x, w.wk, w.k_norm, d.cfg.num_key_value_heads), bound, "k")
    assert_close_at_scale(v.reshape(5, -1), x @ w.wv.T, bound, "v")
    kc, vc = d._project_kv(x, w)
    assert_close_at_scale(kc, k, bound, "k/v k")
    assert_close_at_scale(vc, v, bound, "k/v v")
    gu = x @ w.w_gate.T, x @ w.w_up.T
    assert torch.allclose(d._mlp(x, w), (torch.nn.functional.silu(gu[0]) * gu[1]) @ w.w_down.T, atol=1e-5)
    quant = Drafter.load(path, weight_fn=weight_fn_for("q8")).layers[0]
    assert quant.wqkv.qtype == quant.w_gate_up.qtype == "q8_0"
    assert quant.wkv.raw.data_ptr() == quant.wk.raw.data_ptr() == quant.wqkv.raw[quant.wq.shape[0]].data_ptr()


def test_quantized_weights_are_packed_for_the_kernels_only_on_cuda():
    from memra_cli.engine.layers.quantized import for_device
    from memra_cli.engine.quant.blocks import QuantLinearRef

    ref = QuantLinearRef.from_float(torch.randn(8, 64), "q8_0")
    assert for_device(ref, torch.device("cpu")) is ref
    plain = torch.randn(3, 3)
    assert for_device(plain, torch.device("cuda")) is plain
    if torch.cuda.is_available():
        packed = for_device(ref.to("cuda"), torch.device("cuda"))
        x = torch.randn(4, 64, device="cuda")
        assert type(packed).__name__ == "QuantLinear"
        assert torch.allclose(packed(x), ref(x), rtol=1e-4, atol=1e-4)

"""The drafter's side of the round against its floor, in one process (Qwen3-8B shape, bf16).

Builds the random-weight Qwen3-8B-shape target (gpu_shapes.py `random_target`) and writes a
random 5-layer DFlash drafter (5 taps, block 16) to disk, so it loads through the real loader at
each precision (`--prec` policies as `engine.arm` applies them: bf16 = the weights at the compute
dtype, q8 / q4 = quantized at load and packed for the Triton kernels). With the engine's CUDA
defaults (16-row target steps and drafter rounds as CUDA graphs, Triton step ops) it measures:

- `copy_bw`: a device-to-device copy, bytes read + written per second (median; on CUDA the
  higher of a graph-replayed 1 GiB copy and an eager 2 GiB one, both recorded; benchmarks/timing.py);
- `drafter_bytes[prec]`, `lm_head_bytes`, `floor_ms[prec]` = (drafter weights + the target's
  lm_head, which the harvested rows go through) / copy_bw: the drafter's side at its floor;
- `plain_step_ms` (one real row in the fixed 16-row step), `verify_step_ms` (16 rows, taps on),
  at live context `--ctx`: the graphed steps as the runner replays them;
- `propose_ms[prec]`, `ingest_ms[prec]` (one kept row, as a random drafter's round keeps), and
  `draft_ingest_ms[prec]` = their sum: the drafter's side of one round;
- `round_ms` (bf16 drafter, verify window pinned at 16) and `plain_token_ms`: sessions timed as
  the round loop runs them; `round_over_plain` = round_ms / plain_token_ms; `round_phase_ms`;
- `launched_shapes[prec]`: `[out, in, glu]` of every quantized matmul the loaded drafter
  launches (fused at load: q/k/v, o, gate/up with its SwiGLU epilogue, down, the ingest's k/v,
  fc), and `matmul_launches[prec]`: its weight-matmul launches in one block forward and one ingest
  (4 and 1 a layer fused, 7 and 2 unfused; counted on the host);
- `quant_bw`: the q8_0 / q4_0 kernels on those shapes (then the five unfused ones the issue
  named) at M = 1, 16, 32 (graph replays over enough weight copies that L2 never holds the one
  being read, as benchmarks/gpu/kernels_quant.py), and `q8_0_bw_frac` / `q4_0_bw_frac`: the
  worst fraction of copy_bw at M = 16 over the launched shapes (`*_unfused_shapes`: over the five);
- `exact`: speculative == plain greedy over `--prompts` random prompts (bf16, graphs on, window
  pinned at 16);
- with `--profile` (CUDA): `profile[prec]` (bf16, q8), the kernels of one graphed proposal and
  one graphed ingest by name (count, GPU µs; with PDL on, an early-launched kernel is charged its
  wait: run with MEMRA_PDL=0 for kernel times), and `same_size_m16`, the yardsticks at each
  quantized shape: a device copy of its q8_0 bytes and cuBLAS's bf16 product at M = 16, timed
  as the kernels are.
- with `--quant-tuned F` (a `quant_linear_sweep.py --tuned` table): the quantized kernels run
  that table instead of the module's TUNED (recorded as `quant_tuned`); `--dense-tuned` likewise
  for the dense kernel.

Every section catches its own failure (`errors[section]`) and the JSON is rewritten after each
one, so a run cut short by a time limit keeps what it measured. Times are medians: CUDA events
around graph replays on the GPU, perf_counter on the CPU. `--tiny` runs the whole script on the
CPU at a tiny shape (float32, eager, torch step ops, kernel section skipped): a smoke test.

    python -m benchmarks.gpu.drafter_round [--json OUT.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks import timing
from benchmarks.gpu_shapes import SHAPES, random_target, run_arm
from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.layers.step_ops import select_step_ops
from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.engine.spec.proposer import DrafterProposer
from memra_cli.tiny.draft import make_tiny_draft

W = 16  # target step width = drafter block
PRECS = ("bf16", "q8", "q4")  # bf16: the weights at the compute dtype (no policy applied)
QUANT_SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (4096, 20480)]  # [out, in]
# the shapes a fused drafter layer runs (q/k/v, the ingest's k/v, gate/up stacked at load)
FUSED_SHAPES = [(6144, 4096), (2048, 4096), (24576, 4096)]
# [out, in, glu] of every quantized matmul the fused 8B-shape drafter launches (`launched_shapes`
# reads them off the loaded drafter; this is the fallback when no quantized drafter loaded):
# q/k/v, o, gate/up with its SwiGLU epilogue, down, the ingest's k/v, fc
LAUNCHED_8B = [(6144, 4096, False), (4096, 4096, False), (24576, 4096, True), (4096, 12288, False),
               (2048, 4096, False), (4096, 20480, False)]
QUANT_MS = (1, 16, 32)


def log(*a) -> None:
    print(*a, flush=True)


class Report:
    """The JSON being built: sections record into it, and it is rewritten after each one."""

    def __init__(self, path: Path | None, data: dict):
        self.path, self.data = path, data
        data.setdefault("errors", {})
        data.setdefault("section_s", {})

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)  # a reader never sees half a file

    @contextmanager
    def section(self, name: str):
        """Run a section: its failure is recorded (not raised) and the report written either way."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # one broken section must not cost the others
            self.data["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
        finally:
            self.data["section_s"][name] = round(time.perf_counter() - t0, 2)
            self.write()


def median_ms(fn, device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median ms of `fn()` (benchmarks/timing.py: CUDA events per call, perf_counter on the CPU)."""
    return timing.median_ms(fn, reps, warmup, device=device)


# ------------------------------------------------------------------------------- weight bytes


def weight_bytes(w) -> int:
    """Bytes a matmul reads for weight `w`: a plain tensor, a packed `QuantLinear` (int8 /
    nibbles + f16 scales) or a reference `QuantLinearRef` (its ggml blocks)."""
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    packed = getattr(w, "packed", None)
    if packed is not None:
        return int(packed.nbytes)
    raw = getattr(w, "raw", None)
    if isinstance(raw, torch.Tensor):
        return raw.numel() * raw.element_size()
    return int(getattr(raw, "nbytes", 0))


def drafter_bytes(drafter) -> dict:
    """The drafter's weights, split by what reads them: a proposal reads every layer's
    projections (and a markov w2), an ingest reads fc and every layer's k/v projections."""
    layers = kv = 0
    for w in drafter.layers:
        qkv = weight_bytes(w.wqkv) if w.wqkv is not None else sum(weight_bytes(x) for x in (w.wq, w.wk, w.wv))
        gu = weight_bytes(w.w_gate_up) if w.w_gate_up is not None else weight_bytes(w.w_gate) + weight_bytes(w.w_up)
        layers += qkv + weight_bytes(w.wo) + gu + weight_bytes(w.w_down)
        kv += weight_bytes(w.wkv) if w.wkv is not None else weight_bytes(w.wk) + weight_bytes(w.wv)
    fc, markov = weight_bytes(drafter.fc), weight_bytes(drafter.markov_w2)
    return {"layers": layers, "fc": fc, "markov_w2": markov, "ingest_kv": kv, "total": layers + fc + markov}


def launched_shapes(drafter) -> list[tuple[int, int, bool]]:
    """`[out, in, glu]` of every quantized weight matmul the drafter launches, in first-launch
    order, once each: a fused layer's q/k/v, o, gate/up (glu: with its SwiGLU epilogue, as the
    step ops' `swiglu` launches it), down and the ingest's k/v (the separate projections where a
    layer did not fuse), fc and a markov w2. Plain (bf16) weights are not listed."""
    out: list[tuple[int, int, bool]] = []

    def add(w, glu=False):
        if w is not None and getattr(w, "qtype", None) is not None:
            key = (int(w.shape[0]), int(w.shape[1]), glu)
            if key not in out:
                out.append(key)

    for w in drafter.layers:
        for x in ([w.wqkv] if w.wqkv is not None else [w.wq, w.wk, w.wv]):
            add(x)
        add(w.wo)
        if w.w_gate_up is not None:
            add(w.w_gate_up, glu=True)
        else:
            add(w.w_gate), add(w.w_up)
        add(w.w_down)
        add(w.wkv)
    add(drafter.fc)
    add(drafter.markov_w2)
    return out


def matmul_launches(drafter) -> dict:
    """The drafter's weight-matmul launches in one static (graphed) block forward and one static
    ingest, counted on the host: every step-op `linear` / `swiglu` / `linear_add_rms_norm` /
    `linear_rms_norm` / `qkv_rope_kv_write` call is one matmul launch on CUDA (the q8_0 / q4_0
    kernel for a quantized weight; the last three with or without their add + norm, norm or rope
    epilogue folded in). Fused at load, a layer's block forward
    is q/k/v, o, gate/up (+ SiLU·mul) and down (4), its ingest one k/v projection; unfused 7 and 2.
    Returns {"round", "ingest", "layers"}; runs the calls once on the drafter's device."""
    cfg, dev, ops = drafter.cfg, drafter.device, drafter.step_ops
    counts = {"linear": 0, "swiglu": 0, "linear_add_rms_norm": 0, "linear_rms_norm": 0, "qkv_rope_kv_write": 0}

    class Counting:
        def __getattr__(self, name):
            attr = getattr(ops, name)
            if name not in counts:
                return attr

            def call(*a, **k):
                counts[name] += 1
                return attr(*a, **k)

            return call

    b = cfg.block_size
    kv = drafter.new_cache(2 * b)
    taps = torch.zeros(b, cfg.n_taps * cfg.hidden_size, device=dev, dtype=drafter.dtype)
    noise = torch.zeros(b, cfg.hidden_size, device=dev, dtype=drafter.dtype)
    drafter.step_ops = Counting()
    try:
        drafter.static_ingest(kv, taps, torch.tensor(0, device=dev))
        ingest = sum(counts.values())
        drafter.static_round(kv, noise, torch.tensor(b, device=dev))
    finally:
        drafter.step_ops = ops
    return {"round": sum(counts.values()) - ingest, "ingest": ingest, "layers": len(drafter.layers)}


# ------------------------------------------------------------------------------- measurements


def target_steps(engine, ctx: int, taps, reps: int) -> tuple[float, float]:
    """(plain ms, verify ms): the fixed 16-row step at live context `ctx` (random K/V), one real
    row (padding repeats it) and 16 real rows with the drafter's taps, as the round runs them."""
    runner, device = engine.runner, engine.device
    state = runner.new_state(ctx + 4 * W)
    state.length = ctx  # the K/V of a ctx-token context: random bytes cost what real ones do
    ids = torch.randint(0, engine.target.vocab_size - 1, (W,), device=device)
    plain_ids = ids[:1].expand(W).clone()
    try:
        plain = median_ms(lambda: runner.fixed_step(plain_ids, ctx, state), device, reps)
        verify = median_ms(lambda: runner.fixed_step(ids, ctx, state, taps), device, reps)
    finally:
        runner.release(state)
    return plain, verify


@contextmanager
def primed_proposer(engine, arm, ctx: int):
    """`arm`'s drafter over a ctx-row draft context (random taps, the prompt ingested), as
    (propose, ingest_one): one proposal (block forward, harvest, lm_head, drafts) and one ingest
    of one kept row (the same row again each call), graphed as the engine runs them (the first
    calls capture)."""
    device, target, drafter = engine.device, engine.target, arm.drafter
    proposer = DrafterProposer(drafter, target, arm.program, graphs=engine.draft_graphs, pool=engine.pool)
    width = drafter.cfg.hidden_size * len(arm.taps)
    g = torch.Generator(device=device).manual_seed(7)
    taps = torch.randn(ctx + 1, width, generator=g, device=device, dtype=torch.float32).to(engine.dtype)
    proposer.reset(ctx + 8 * W)
    try:
        proposer.ingest(taps[:ctx], torch.arange(ctx, device=device))  # the prompt: eager chunks
        start = proposer.kv.length
        last = torch.tensor([11], device=device)
        one, pos = taps[ctx:], torch.arange(start, start + 1, device=device)

        def ingest_one():
            proposer.ingest(one, pos)
            proposer.kv.length -= 1  # the same row again next time

        yield (lambda: proposer.propose(last, start, False)), ingest_one
    finally:
        proposer.release()


def drafter_side(engine, arm, ctx: int, reps: int) -> tuple[float, float]:
    """(propose ms, ingest ms) of `arm`'s drafter (`primed_proposer`'s calls; captures outside
    the clock)."""
    with primed_proposer(engine, arm, ctx) as (propose, ingest_one):
        return median_ms(propose, engine.device, reps), median_ms(ingest_one, engine.device, reps)


def drafter_profile(engine, arm, ctx: int) -> dict:
    """Where the drafter's side goes: kernel tables (`benchmarks.timing.kernel_table`) of the calls
    `drafter_side` times."""
    from benchmarks.timing import kernel_table

    with primed_proposer(engine, arm, ctx) as (propose, ingest_one):
        return {"propose": kernel_table(propose, top=25), "ingest": kernel_table(ingest_one, top=25)}


def same_size_references(shapes, m: int = 16) -> list[dict]:
    """Yardsticks at each quantized shape, timed as the kernels are (graph replays over copies
    L2 cannot hold): a device copy of the q8_0 weight's bytes (what moving those bytes costs in
    one launch of that size) and cuBLAS's bf16 matmul of the same [out, in] at M rows."""
    from benchmarks.gpu import kernels_quant as kq

    rows = []
    for n, k in shapes:
        rec = {"out": n, "in": k}
        nbytes = n * k + n * (k // 32) * 2  # q8_0: int8 weights + f16 scales
        srcs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(kq.copies_for(nbytes))]
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        ms = timing.cycled_graph_ms(lambda i: dst.copy_(srcs[i]), len(srcs))
        rec["copy_q8_bytes_us"], rec["copy_q8_bytes_gbps"] = 1e3 * ms, 2 * nbytes / (ms * 1e-3) / 1e9
        del srcs, dst
        wb = n * k * 2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(kq.copies_for(wb))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ms = timing.cycled_graph_ms(lambda i: x @ ws[i].T, len(ws))
        rec["cublas_bf16_us"], rec["cublas_bf16_read_gbps"] = 1e3 * ms, wb / (ms * 1e-3) / 1e9
        del ws
        torch.cuda.empty_cache()
        rows.append(rec)
        log(f"  [{n}, {k}] same-size copy {rec['copy_q8_bytes_us']:.1f} us ({rec['copy_q8_bytes_gbps']:.0f} GB/s r+w), "
            f"cuBLAS bf16 M={m} {rec['cublas_bf16_us']:.1f} us ({rec['cublas_bf16_read_gbps']:.0f} GB/s read)")
    return rows


def timed_phases(engine, arm, ids, n) -> dict:
    s = engine.session(ids, n, arm, timed=True, eos_ids=())
    s.run()
    st = s.stats
    return {k: 1e3 * v / max(1, st.rounds) for k, v in st.phase_s.items() if k != "prefill"}


def quant_bandwidth(copy_bw: float, budget_end: float, launched: dict[str, list] | None = None) -> dict:
    """q8_0 / q4_0 kernels on the drafter's matrices: us and fraction of copy_bw per M (the
    kernel's default per-shape config), through kernels_quant.py's timing and checks. The shapes
    are those the loaded quantized drafter launches (`launched[qtype]`, `launched_shapes`; gate/up
    with its SwiGLU epilogue), marked `launched`, then the issue's five unfused shapes."""
    from benchmarks.gpu import kernels_quant as kq

    props = torch.cuda.get_device_properties(0)
    kq.L2_BYTES = getattr(props, "L2_cache_size", kq.L2_BYTES) or kq.L2_BYTES
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for qtype in ("q8_0", "q4_0"):
        rows = out[qtype] = []
        shapes = [tuple(x) for x in (launched or {}).get(qtype) or LAUNCHED_8B]
        shapes += [(n, k, False) for n, k in QUANT_SHAPES if (n, k, False) not in shapes]
        for n, k, glu in shapes:
            rec: dict = {"out": n, "in": k, "glu": glu, "fused": (n, k) in FUSED_SHAPES,
                         "launched": (n, k, glu) in [tuple(x) for x in (launched or {}).get(qtype) or LAUNCHED_8B]}
            rows.append(rec)
            if time.time() > budget_end:
                rec["error"] = "skipped: time budget spent"
                continue
            try:
                first = kq.random_packed(qtype, n, k, gen)
                copies = [first] + [kq.qp.Packed(qtype, (n, k), first.qweight.clone(), first.scales.clone())
                                    for _ in range(kq.copies_for(first.nbytes) - 1)]
                rec["check_ok"] = bool(kq.check(qtype, first, None, gen)["ok"])
                for m in QUANT_MS:
                    x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
                    ms = timing.cycled_graph_ms(lambda i: kq.ql.quant_linear(x, copies[i], glu=glu), len(copies))
                    rec[f"m{m}_us"] = 1e3 * ms
                    # bytes moved: the weight, x, and the output (half as wide with the epilogue)
                    moved = first.nbytes + m * k * 2 + m * (n // 2 if glu else n) * 2
                    rec[f"m{m}_frac"] = moved / (ms * 1e-3) / copy_bw
                log(f"  {qtype} [{n}, {k}]{' glu' if glu else ''}: " + ", ".join(
                    f"M={m} {rec[f'm{m}_us']:.1f} us ({rec[f'm{m}_frac']:.2f})" for m in QUANT_MS))
                del copies, first
                torch.cuda.empty_cache()
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  {qtype} [{n}, {k}] FAILED: {rec['error']}")
    return out


def worst_frac(rows: list[dict], m: int = 16, launched: bool = True) -> float | None:
    """The worst fraction over the shapes the drafter launches (`launched`), or over the issue's
    five unfused shapes; None unless every one was measured."""
    if launched:
        rows = [r for r in rows if r.get("launched")]
    else:
        rows = [r for r in rows if (r["out"], r["in"]) in QUANT_SHAPES and not r.get("glu")]
    fracs = [r[f"m{m}_frac"] for r in rows if f"m{m}_frac" in r]
    return min(fracs) if len(fracs) == len(rows) and fracs else None


# ------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (smoke test: eager, torch ops, no kernels)")
    p.add_argument("--ctx", type=int, default=None, help="live context of the timed steps and rounds (default 512; tiny 32)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the timed sessions (default 64; tiny 8)")
    p.add_argument("--prompts", type=int, default=3, help="random prompts of the exactness check")
    p.add_argument("--reps", type=int, default=None, help="timed calls per median (default 40; tiny 3)")
    p.add_argument("--budget-s", type=float, default=225.0, help="the kernel section is skipped past this")
    p.add_argument("--profile", action="store_true",
                   help="also: kernel tables of the bf16 / q8 drafter's proposal and ingest, and same-size copy "
                        "and cuBLAS yardsticks at the quantized shapes (CUDA only)")
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "drafter-round.json")
    p.add_argument("--dense-tuned", type=Path, default=None,
                   help="a dense_linear_sweep.py --tuned table to use as dense_linear.TUNED for this run")
    p.add_argument("--quant-tuned", type=Path, default=None,
                   help="a quant_linear_sweep.py --tuned table to use as quant_tuning.TUNED for this run")
    p.add_argument("--ab-precs", default="bf16",
                   help="drafter precisions --dense-ab times on cuBLAS too (comma-separated; bf16 always runs, last)")
    p.add_argument("--dense-ab", action="store_true",
                   help="also time the target steps, the bf16 drafter and a round with every weight matmul on "
                        "cuBLAS (dense_linear.TUNED emptied), in the same process, into d['cublas']")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="also time the drafter with a draft vocabulary of this many tokens (the first N ids; "
                        "spec/draft_vocab.py) at bf16 and q8: draft + ingest, the round, exactness (0: skip)")
    p.add_argument("--no-glu", action="store_true", help="the MLPs' gate/up matmul and SiLU·mul as two launches "
                   "(the swiglu step op unfused), to time the SwiGLU epilogue against")
    a = p.parse_args(argv)
    if a.no_glu:
        from memra_cli.engine.layers.triton_step_ops import TritonStepOps
        from memra_cli.engine.layers.unfused import unfused_swiglu

        TritonStepOps.swiglu = unfused_swiglu
    _dense = None
    if torch.cuda.is_available() and not a.tiny:
        from memra_kernels import dense_linear as _dense

        if a.dense_tuned:
            try:
                _dense.load_tuned(a.dense_tuned)  # before any launch
            except (OSError, ValueError, KeyError, TypeError) as exc:
                p.error(f"--dense-tuned {a.dense_tuned}: {exc}")
    if a.quant_tuned and a.tiny:
        p.error("--quant-tuned sets the GPU kernels' tiles: the --tiny run launches none")
    if a.quant_tuned:
        from memra_kernels import quant_tuning as _qt

        try:
            _qt.load_tuned(a.quant_tuned)  # before any launch: config_for caches per shape
        except (OSError, ValueError) as exc:
            p.error(f"--quant-tuned {a.quant_tuned}: {exc}")
    t_start = time.time()
    tiny = a.tiny
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not tiny:
        log("no CUDA device: run with --tiny for the CPU smoke test")
        return 1
    cuda = device.type == "cuda"
    if not cuda:  # tiny matmuls: a second thread only adds contention (tests/conftest.py)
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    s = SHAPES["small" if tiny else "8b"]
    ctx = a.ctx or (32 if tiny else 512)
    tokens = a.tokens or (8 if tiny else 64)
    reps = a.reps or (3 if tiny else 40)
    rep = Report(a.json, {
        "shape": "small" if tiny else "qwen3-8b", "dtype": str(dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "step_width": W, "ctx": ctx, "tokens": tokens, "prompts": a.prompts,
        "command": "python -m benchmarks.gpu.drafter_round " + " ".join(sys.argv[1:] if argv is None else argv),
    })
    d = rep.data
    if a.quant_tuned:  # the table this run's quantized kernels ran (load_tuned above)
        d["quant_tuned"] = {"path": str(a.quant_tuned), "table": json.loads(a.quant_tuned.read_text())}
    for key in ("draft_ingest_ms", "propose_ms", "ingest_ms", "drafter_bytes", "floor_ms", "draft_over_floor"):
        d[key] = {}
    for key in ("copy_bw", "plain_step_ms", "verify_step_ms", "round_ms", "plain_token_ms", "round_over_plain",
                "q8_0_bw_frac", "q4_0_bw_frac", "lm_head_bytes", "exact"):
        d[key] = None
    rep.write()

    with rep.section("copy_bw"):
        bw = 1e9 * timing.copy_gbps((1 << 30) if cuda else (64 << 20), reps=30 if cuda else 10,
                                    graphed=cuda, device=device)
        if cuda:
            # The graph-replayed copy reads lower than an eager 2 GiB one (docs/perf.md, "How to
            # measure"): fractions and floors divide by the higher, the one a kernel can reach.
            d["copy_bw_graph"], d["copy_bw_eager"] = bw, 1e9 * timing.copy_gbps(2 * timing.GIB)
            bw = max(bw, d["copy_bw_eager"])
        d["copy_bw"], d["copy_gbps"] = bw, bw / 1e9
        log(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s")

    torch.manual_seed(0)
    with torch.inference_mode():
        engine = arm = None
        with rep.section("build"):
            target = random_target(s, dtype, device)
            target.step_ops = select_step_ops(device)[0] if cuda else TorchStepOps()
            d["step_ops"] = target.step_ops.name
            tmp = Path(tempfile.mkdtemp(prefix="drafter_round_"))
            draft = make_tiny_draft(tmp / "draft", "zlab", hidden=s["hidden"], layers=s["d_layers"], heads=s["heads"],
                                    kv_heads=s["kv"], head_dim=s["hd"], intermediate=s["ffn"], vocab=s["vocab"],
                                    mask_token_id=s["vocab"] - 1, block_size=W, target_layer_ids=s["taps"],
                                    num_target_layers=s["layers"], dtype=torch.bfloat16, std=0.02)
            # the engine's defaults: fixed 16-row steps; on CUDA target steps and drafter rounds graphed
            engine = Engine.from_model(target, step_width=W, cuda_graphs=cuda, draft_graphs=cuda)
            d["lm_head_bytes"] = weight_bytes(target.lm_head_weight)
            log(f"built: target {d['shape']} ({d['step_ops']} step ops), drafter {s['d_layers']} layers; "
                f"graphs {'on' if cuda else 'off'}")

        def arm_for(prec: str):
            cfg = ArmConfig(draft=draft, mode="dflash", settings=PolicySettings(adapt="0"), verify_cap=W,
                            prec=None if prec == "bf16" else prec)
            return engine.arm(cfg)

        if engine is not None:
            with rep.section("target_steps"):
                taps = tuple(s["taps"])
                d["plain_step_ms"], d["verify_step_ms"] = target_steps(engine, ctx, taps, reps)
                log(f"target step at ctx {ctx}: plain {d['plain_step_ms']:.3f} ms, verify16 {d['verify_step_ms']:.3f} ms")

        prompts = [torch.randint(0, s["vocab"] - 1, (ctx,), generator=torch.Generator().manual_seed(1 + k)).tolist()
                   for k in range(max(1, a.prompts))]
        for prec in PRECS:
            if engine is None:
                break
            with rep.section(f"drafter_{prec}"):
                arm = arm_for(prec)
                sizes = drafter_bytes(arm.drafter)
                d["drafter_bytes"][prec] = sizes["total"]
                d.setdefault("drafter_bytes_parts", {})[prec] = sizes
                d.setdefault("launched_shapes", {})[prec] = launched_shapes(arm.drafter)
                d.setdefault("matmul_launches", {})[prec] = launches = matmul_launches(arm.drafter)
                log(f"drafter {prec}: {launches['round']} weight-matmul launches a block forward, "
                    f"{launches['ingest']} an ingest ({launches['layers']} layers)")
                if d["copy_bw"]:
                    d["floor_ms"][prec] = 1e3 * (sizes["total"] + d["lm_head_bytes"]) / d["copy_bw"]
                propose, ingest = drafter_side(engine, arm, ctx, reps)
                d["propose_ms"][prec], d["ingest_ms"][prec] = propose, ingest
                d["draft_ingest_ms"][prec] = propose + ingest
                if d["floor_ms"].get(prec):
                    d["draft_over_floor"][prec] = (propose + ingest) / d["floor_ms"][prec]
                log(f"drafter {prec}: propose {propose:.3f} ms + ingest {ingest:.3f} ms = {propose + ingest:.3f} ms; "
                    f"weights {sizes['total'] / 1e9:.3f} GB, floor {d['floor_ms'].get(prec, float('nan')):.3f} ms")
            if a.profile and cuda and arm is not None and prec in ("bf16", "q8"):
                with rep.section(f"profile_{prec}"):
                    d.setdefault("profile", {})[prec] = prof = drafter_profile(engine, arm, ctx)
                    for part, tab in prof.items():
                        log(f"profile {prec} {part}: {tab['kernels']} kernels, {tab['gpu_us']} us of GPU time")
                        for name, count, us in tab["top"][:12]:
                            log(f"    {us:8.1f} us  x{count:<4d} {name}")
            if prec == "bf16" and arm is not None:
                with rep.section("round"):
                    run_arm(engine, None, prompts[0], 8)  # warm-up: allocator, captures
                    run_arm(engine, arm, prompts[0], 8)
                    plain, t_plain = run_arm(engine, None, prompts[0], tokens)
                    spec, t_spec = run_arm(engine, arm, prompts[0], tokens)
                    d["plain_token_ms"] = 1e3 * t_plain / len(plain.tokens)
                    d["round_ms"] = 1e3 * t_spec / spec.stats.rounds
                    d["rounds"], d["tau"] = spec.stats.rounds, spec.stats.tau
                    d["round_over_plain"] = d["round_ms"] / d["plain_token_ms"]
                    log(f"round (bf16 drafter): {d['round_ms']:.3f} ms over {spec.stats.rounds} rounds; plain "
                        f"{d['plain_token_ms']:.3f} ms/token; round/plain {d['round_over_plain']:.2f}")
                with rep.section("round_phases"):
                    d["round_phase_ms"] = timed_phases(engine, arm, prompts[0], min(tokens, 16))
                with rep.section("exact"):
                    runs = exact_runs(engine, arm, prompts, tokens)
                    d["exact"] = all(runs)
                    d["exact_prompts"] = f"{sum(runs)}/{len(runs)}"
                    log(f"exact (speculative == plain greedy): {d['exact_prompts']}")
            arm = None  # the drafter goes before the next precision's loads
            if cuda:
                torch.cuda.empty_cache()
        if a.draft_vocab and engine is not None:
            with rep.section("draft_vocab"):
                d["draft_vocab"] = draft_vocab_section(engine, draft, a.draft_vocab, s["vocab"], prompts, ctx, reps,
                                                       tokens)
        if a.dense_ab and _dense is not None and engine is not None:
            with rep.section("cublas"):
                table = dict(_dense.TUNED)
                d["dense_tuned"] = {f"{n}x{k}": vars(c) for (n, k), c in table.items()}
                _dense.TUNED.clear()  # a new engine: its graphs capture cuBLAS for every matmul
                try:
                    engine = Engine.from_model(target, step_width=W, cuda_graphs=cuda, draft_graphs=cuda)
                    cb = d["cublas"] = {}
                    cb["plain_step_ms"], cb["verify_step_ms"] = target_steps(engine, ctx, tuple(s["taps"]), reps)
                    # bf16 last: its arm stays for the round below
                    for prec in [q for q in a.ab_precs.split(",") if q != "bf16"] + ["bf16"]:
                        arm = None  # the previous precision's drafter goes before this one loads
                        arm = arm_for(prec)
                        propose, ingest = drafter_side(engine, arm, ctx, reps)
                        cb.setdefault("draft_ingest_by_prec", {})[prec] = propose + ingest
                        log(f"cuBLAS for every matmul, drafter {prec}: propose {propose:.3f} + ingest {ingest:.3f} ms")
                    cb["propose_ms"], cb["ingest_ms"], cb["draft_ingest_ms"] = propose, ingest, propose + ingest
                    run_arm(engine, None, prompts[0], 8)
                    run_arm(engine, arm, prompts[0], 8)
                    plain, t_plain = run_arm(engine, None, prompts[0], tokens)
                    spec, t_spec = run_arm(engine, arm, prompts[0], tokens)
                    cb["plain_token_ms"] = 1e3 * t_plain / len(plain.tokens)
                    cb["round_ms"] = 1e3 * t_spec / spec.stats.rounds
                    cb["exact"] = spec.tokens == plain.tokens
                    log(f"cuBLAS for every matmul: steps {cb['plain_step_ms']:.3f} / {cb['verify_step_ms']:.3f} ms, "
                        f"bf16 draft + ingest {cb['draft_ingest_ms']:.3f} ms, round {cb['round_ms']:.3f} ms, "
                        f"plain token {cb['plain_token_ms']:.3f} ms, exact {cb['exact']}")
                finally:
                    _dense.TUNED.update(table)
                    arm = None

    with rep.section("quant_bw"):
        if not cuda:
            d["quant_bw"] = {"skipped": "no CUDA (the kernels are timed on the GPU only)"}
        else:
            launched = {q: d.get("launched_shapes", {}).get(p) for q, p in (("q8_0", "q8"), ("q4_0", "q4"))}
            d["quant_bw"] = quant_bandwidth(d["copy_bw"], t_start + a.budget_s, launched)
            for qtype in ("q8_0", "q4_0"):  # worst over what the drafter launches; and the unfused five
                d[f"{qtype}_bw_frac"] = worst_frac(d["quant_bw"][qtype])
                d[f"{qtype}_bw_frac_unfused_shapes"] = worst_frac(d["quant_bw"][qtype], launched=False)
    if a.profile and cuda:
        with rep.section("same_size"):
            d["same_size_m16"] = same_size_references(QUANT_SHAPES + FUSED_SHAPES)
    d["seconds"] = round(time.time() - t_start, 1)
    rep.write()
    print_table(d)
    return 0


def exact_runs(engine, arm, prompts, tokens: int) -> list[bool]:
    """Per prompt: the arm's stream equals plain greedy's (`tokens` new tokens each)."""
    return [run_arm(engine, arm, ids, tokens)[0].tokens == run_arm(engine, None, ids, tokens)[0].tokens
            for ids in prompts]


def draft_vocab_section(engine, draft: Path, n: int, vocab: int, prompts, ctx: int, reps: int, tokens: int) -> dict:
    """The drafter with a draft vocabulary of the first `n` ids (spec/draft_vocab.py), bf16 and q8:
    draft + ingest per round, the round against a plain token timed beside it, and speculative ==
    plain greedy over `prompts`. The drafts' ids do not matter to the time (the weights are
    random); the head the draft reads shrinks from `vocab` rows to `n`."""
    path = Path(tempfile.mkdtemp(prefix="draft_vocab_")) / "vocab.json"
    path.write_text(json.dumps(list(range(min(n, vocab)))))
    out: dict = {"size": min(n, vocab), "vocab_size": vocab}
    for key in ("draft_ingest_ms", "propose_ms", "ingest_ms", "round_ms", "round_over_plain", "exact_prompts"):
        out[key] = {}
    run_arm(engine, None, prompts[0], 8)  # warm-up
    plain, t_plain = run_arm(engine, None, prompts[0], tokens)
    out["plain_token_ms"] = 1e3 * t_plain / len(plain.tokens)
    runs = []
    for prec in ("bf16", "q8"):
        arm = None  # the previous precision's drafter goes before this one loads
        arm = engine.arm(ArmConfig(draft=draft, mode="dflash", settings=PolicySettings(adapt="0"), verify_cap=W,
                                   prec=None if prec == "bf16" else prec, draft_vocab=path))
        propose, ingest = drafter_side(engine, arm, ctx, reps)
        out["propose_ms"][prec], out["ingest_ms"][prec] = propose, ingest
        out["draft_ingest_ms"][prec] = propose + ingest
        run_arm(engine, arm, prompts[0], 8)
        spec, t_spec = run_arm(engine, arm, prompts[0], tokens)
        out["round_ms"][prec] = 1e3 * t_spec / spec.stats.rounds
        out["round_over_plain"][prec] = out["round_ms"][prec] / out["plain_token_ms"]
        mine = exact_runs(engine, arm, prompts, tokens)
        out["exact_prompts"][prec] = f"{sum(mine)}/{len(mine)}"
        runs += mine
        log(f"draft vocabulary {out['size']}/{vocab}, drafter {prec}: propose {propose:.3f} + ingest {ingest:.3f} ms; "
            f"round {out['round_ms'][prec]:.3f} ms, plain token {out['plain_token_ms']:.3f} ms, round/plain "
            f"{out['round_over_plain'][prec]:.3f}; exact {out['exact_prompts'][prec]}")
    out["exact"] = all(runs)
    return out


def print_table(d: dict) -> None:
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    log("")
    log(f"drafter round, {d['shape']} {d['dtype']} on {d['device']}, ctx {d['ctx']}, step ops {d.get('step_ops')}; "
        f"copy {f(d.get('copy_gbps'), '{:.0f}')} GB/s")
    log(f"  plain step {f(d['plain_step_ms'])} ms   verify16 step {f(d['verify_step_ms'])} ms   "
        f"round {f(d['round_ms'])} ms   plain/token {f(d['plain_token_ms'])} ms   round/plain {f(d['round_over_plain'], '{:.2f}')}")
    log(f"  {'prec':5s} {'propose ms':>10s} {'ingest ms':>10s} {'sum ms':>8s} {'floor ms':>9s} {'x floor':>8s} {'weights GB':>11s}")
    for prec in PRECS:
        b = d["drafter_bytes"].get(prec)
        log(f"  {prec:5s} {f(d['propose_ms'].get(prec)):>10s} {f(d['ingest_ms'].get(prec)):>10s} "
            f"{f(d['draft_ingest_ms'].get(prec)):>8s} {f(d['floor_ms'].get(prec)):>9s} "
            f"{f(d['draft_over_floor'].get(prec), '{:.2f}'):>8s} {f(None if b is None else b / 1e9):>11s}")
    q = d.get("quant_bw") or {}
    for qtype in ("q8_0", "q4_0"):
        for r in q.get(qtype, []) if isinstance(q, dict) else []:
            cells = "  ".join(f"M={m} {f(r.get(f'm{m}_us'), '{:.1f}')} us {f(r.get(f'm{m}_frac'), '{:.2f}')}" for m in QUANT_MS)
            tag = ("launched" if r.get("launched") else "unfused") + (" glu" if r.get("glu") else "")
            log(f"  {qtype} [{r['out']}, {r['in']}] {tag:12s} {cells}  {r.get('error', '')}")
    log(f"  worst frac of copy bandwidth at M=16 over the launched shapes (floor 1.0): q8_0 "
        f"{f(d['q8_0_bw_frac'], '{:.2f}')}, q4_0 {f(d['q4_0_bw_frac'], '{:.2f}')}; over the five unfused shapes: "
        f"{f(d.get('q8_0_bw_frac_unfused_shapes'), '{:.2f}')}, {f(d.get('q4_0_bw_frac_unfused_shapes'), '{:.2f}')}")
    for prec, n in (d.get("matmul_launches") or {}).items():
        log(f"  {prec}: {n['round']} weight-matmul launches a block forward, {n['ingest']} an ingest, {n['layers']} layers")
    log(f"  exact: {d['exact']} ({d.get('exact_prompts', '-')})   errors: {sorted(d['errors']) or 'none'}   "
        f"{d.get('seconds')} s")


if __name__ == "__main__":
    sys.exit(main())

"""The Qwen3.5 hybrid target's steps against their floor and transformers, in one process.

Builds a random-weight Qwen3.5-4B-shape text target in bf16 (32 layers = 24 Gated DeltaNet + 8
gated attention, every 4th layer full attention; hidden 2560, intermediate 9216, 16 query / 4 KV
heads of 256, DeltaNet 16 key / 32 value heads of 128, conv kernel 4, vocab 248320, tied
embeddings; the published Qwen3.5-4B text config as recalled, stated here because it was not
re-checked), writes it to a checkpoint dir and loads it through memra's real loader, then
measures, each section's failure caught and reported in the JSON:

- ``floor``: the cuBLAS chain of one step's weight matmuls (fused in-proj / qkv, out / o, gate-up,
  down per layer, then lm_head) at 1 and 16 rows, replayed as a CUDA graph;
- ``plain``: memra's plain decode, graphed, step ops as `select_step_ops` picks them (Triton on
  CUDA), at step width 1 (the engine's fastest plain) and 16 (one real row padded to 16, whose
  padding rows skip the recurrence; `width16_padded*`: the same with them run, for the A/B): the
  graph replay alone and a whole token (replay + commit + argmax) after a 512-token prompt, and
  the engine's greedy decode (`Session`, one round graph a token) with the next round queued
  before the host reads a token (the default) and without (`width1_round_unpipelined`);
- ``verify``: a 16-row verify step + `state.rollback(start + k)` per round, rollback modes
  replay (the CUDA default) and stash, each timed between syncs;
- ``rounds``: the same verify + rollback as the engine's pipelined speculative rounds run it:
  one graph a round (verify, argmax, settlement, the rollback re-run inside the graph), queued
  one ahead of the host's read, drafts from the plain stream with slot k wrong (k kept rows);
  and (`k1_window`, `k8_window`) with a ladder window of k rows known before the verify, whose
  rows past it skip the recurrence; `k8_unfused_picks` (and the plain section's
  `width1_round_unfused_picks`): the same with the lm_head and its argmax as two launches, the
  round before `static_step_picks`; `restore_ms_rows*` the in-graph restore alone (one launch)
  beside `restore_two_launches_ms_rows*` (the window and the replay apart, as before);
- ``transformers``: `Qwen3_5ForCausalLM` (eager attention; fla kernels if transformers finds them)
  greedy ms/token over a few dozen tokens after the same prompt;
- ``exact``: speculative == plain greedy in bf16 (graphs on), with a drafter stand-in that
  proposes the plain stream's next tokens with some slots corrupted, both rollback modes.

    python -m benchmarks.gpu.hybrid_step [--json OUT.json] [--ckpt DIR] [--tiny]
        [--gdn-tile BLOCK_V,WARPS[,LATE_PREP[,PREFETCH]]] [--attn-tile SPLIT,BLOCK_N,BLOCK_M,STAGES,WARPS]

`--gdn-tile` / `--attn-tile` replace, for this run only, the DeltaNet recurrence's tile / the
attention kernel's head_dim-256 tile (`attention.TILES[256]`; step_profile.py's `best_hd256` is
in this form) with a sweep's candidate, and the report header records them (`gdn_tile`,
`attn_tile_hd256`); the engine runs the modules' own.

`--tiny`: small shapes on the CPU, no graphs, torch ops (a smoke run for tests, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import timing

from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers.step_ops import select_step_ops
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import LADDER, Harvest
from memra_cli.engine.spec.proposer import Program, Proposal
from memra_cli.engine.spec.round_bodies import greedy_step
from memra_cli.engine.spec.session import Session
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

W = 16
FULL_EVERY = 4
SHAPE_4B = dict(vocab=248320, hidden=2560, intermediate=9216, heads=16, kv_heads=4, head_dim=256,
                layer_types=tuple("full_attention" if (i + 1) % FULL_EVERY == 0 else "linear_attention"
                                  for i in range(32)),
                linear_key_heads=16, linear_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                partial_rotary_factor=0.25, mrope_section=(11, 11, 10), rope_theta=1e7,
                max_position_embeddings=8192, tie=True)
SHAPE_TINY = dict(vocab=512, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=32,
                  layer_types=("linear_attention",) * 3 + ("full_attention",),
                  linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                  mrope_section=(2, 1, 1), max_position_embeddings=2048, tie=True)


class Report:
    """The JSON, written after every section (a later crash keeps the earlier numbers)."""

    def __init__(self, path: Path | None, head: dict):
        self.path, self.data = path, dict(head)
        self.write()

    def section(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            self.data[name] = fn()
        except Exception as exc:  # noqa: BLE001 - every section reports its own failure
            self.data[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        if isinstance(self.data[name], dict):
            self.data[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[{name}] {json.dumps(self.data[name])[:600]}", flush=True)
        self.write()

    def write(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=2))


def pdl_on(dev: torch.device) -> bool:
    """Whether the kernels launch with programmatic dependent launch here (memra_kernels._pdl)."""
    if dev.type != "cuda":
        return False
    from memra_kernels import _pdl

    return _pdl.enabled(dev)


sync = timing.sync
median = timing.median


def replay_ms(replay, reps: int) -> float:
    """Median ms of `replay()` (a CUDA graph's replay), timed with events."""
    return timing.median_ms(replay, reps, device="cuda")


def floor(target: Qwen35Target, reps: int) -> dict:
    """The weight matmuls of one step (every layer's mixer in/out, MLP gate-up/down, lm_head),
    captured as one CUDA graph, at 1 and 16 rows."""
    from memra_cli.engine.runtime import cuda_graphs

    dev, dt = target.device, target.dtype
    out = {}
    for rows in (1, W):
        h = torch.randn(rows, target.hidden_size, dtype=dt, device=dev)
        mids = {}

        def mid(n):
            if n not in mids:
                mids[n] = torch.randn(rows, n, dtype=dt, device=dev)
            return mids[n]

        def chain():
            for w in target.layers:
                if w.attn is not None:
                    F.linear(h, w.attn.wqkv)
                    F.linear(mid(w.attn.wo.shape[1]), w.attn.wo)
                else:
                    F.linear(h, w.gdn.w_in)
                    F.linear(mid(w.gdn.w_out.shape[1]), w.gdn.w_out)
                F.linear(h, w.w_gate_up)
                F.linear(mid(w.w_down.shape[1]), w.w_down)
            return F.linear(h, target.lm_head_weight)

        for n in (target.layers[0].w_down.shape[1],):
            mid(n)
        chain()  # allocate the inputs outside the capture
        graph, _ = cuda_graphs.capture(chain, dev)
        out[f"rows{rows}_ms"] = replay_ms(graph.replay, reps)
    weights = sum(t.numel() * t.element_size() for w in target.layers
                  for t in ([w.attn.wqkv, w.attn.wo] if w.attn is not None else [w.gdn.w_in, w.gdn.w_out])
                  + [w.w_gate_up, w.w_down]) + target.lm_head_weight.numel() * target.lm_head_weight.element_size()
    out["weight_gib"] = weights / 2**30
    return out


def make_runner(target: Qwen35Target, width: int, graphs: bool) -> StepRunner:
    return StepRunner(target, width, cuda_graphs=graphs)


def run_padding(state) -> None:
    """Make `state` run every row of its fixed steps through the recurrence, padding included
    (its `set_live_rows` ignored, the live count left at every row): the step as it ran before
    padding rows were skipped, timed beside it in the same process."""
    state.set_live_rows(None)
    state.set_live_rows = lambda n: None


@contextmanager
def unfused_picks():
    """A greedy round's lm_head and argmax as two step ops (`static_step(widen=False)`, then the
    step ops' argmax over the model-dtype logits): the round before `Qwen35Target.static_step_picks`
    fused them, timed beside it in the same process (`*_unfused_picks`)."""
    fused = Qwen35Target.__dict__["static_step_picks"]
    Qwen35Target.static_step_picks = None  # round_bodies.greedy_step then runs the two ops
    try:
        yield
    finally:
        Qwen35Target.static_step_picks = fused


def two_launch_restore(state) -> None:
    """A round's restore as two launches, the conv windows (`ring_window`) then the states
    (`gated_delta_replay_dev`): the form before `gated_delta_restore` made it one, timed beside it
    (every row kept, not a ladder's window: no live rows)."""
    ops, base, dst, params = state._ops, state._cur, 1 - state._cur, state.round_params
    ops.ring_window(state._conv2[base], state._xs_all, params, state._conv2[dst])
    ops.gated_delta_replay_dev(state._qkv_all, state._g_all, state._beta_all, state._rec2[base], state.n_k_heads,
                               params, state._rec2[dst])


def plain(target, prompt: list[int], graphs: bool, tokens: int, reps: int) -> dict:
    """Plain decode at width 1 and W (one real row padded to W: the padding rows skip the
    recurrence, `Qwen35State.set_live_rows`), and at W with the padding rows run (`width16_padded`,
    every row through the recurrence; the same tokens)."""
    dev = target.device
    out, streams = {}, {}
    for width, padded in ((1, False), (W, False), (W, True)):
        name = f"width{width}" + ("_padded" if padded else "")
        runner = make_runner(target, width, graphs)
        state = runner.new_state(len(prompt) + tokens + 8)
        if padded:
            run_padding(state)
        logits, _ = runner.prefill(torch.tensor(prompt, device=dev), state)
        last = logits.argmax(-1)
        times, stream = [], []
        for _ in range(tokens):  # a whole token: replay + commit + argmax, as greedy decode runs it
            sync(dev)
            t0 = time.perf_counter()
            logits, _ = runner.step(last.reshape(1), state.length, state)
            last = logits[-1].argmax()
            sync(dev)
            times.append(1e3 * (time.perf_counter() - t0))
            stream.append(last)
        row = {"token_ms": median(times), "token_ms_min": min(times)}
        streams[name] = torch.stack(stream).tolist()
        if graphs:
            graph = state.graphs[("step", ())]
            row["replay_ms"] = replay_ms(graph.graph.replay, reps)
        out[name] = row
        runner.release(state)
        # the engine's greedy decode with graphs on: each token one round graph, queued one ahead
        # of the host's read (the default) or read before the next is queued (MEMRA_PIPELINE=0);
        # at width 1 also with the lm_head and its argmax unfused (`unfused_picks`), queued ahead
        variants = ((True, False), (False, False)) + (((True, True),) if width == 1 else ())
        for pipelined, unfused in variants if graphs else ():
            with unfused_picks() if unfused else nullcontext():
                row = plain_rounds(runner, prompt, tokens, pipelined, padded)
            out[name + "_round" + ("" if pipelined else "_unpipelined") + ("_unfused_picks" if unfused else "")] = row
    # skipping the padding rows' recurrence changes no token: the same stream with them run
    out[f"width{W}_padded"]["exact"] = streams[f"width{W}_padded"] == streams[f"width{W}"]
    return out


def plain_rounds(runner, prompt: list[int], tokens: int, pipelined: bool, padded: bool) -> dict:
    """The engine's greedy decode as one round graph a token (`Session`), ms a token, and whether
    its stream is the step-by-step greedy one. The round graphs are captured afresh (a pooled
    storage keeps the graphs an earlier session captured over it: another variant's)."""
    session = Session(runner, prompt, tokens + 8, round_graphs=True, pipelined=pipelined)
    session.cache.graphs.clear()
    if padded:
        run_padding(session.cache)
    session.burst(4)  # prefill, the captures of both buffer arrangements, warm-up
    assert session.graphed_rounds and session.pipelined == pipelined
    got, times = [], []
    for _ in range(tokens):  # a burst of one token; pipelined, the next round is queued meanwhile
        t0 = time.perf_counter()
        got += session.burst(1)
        times.append(1e3 * (time.perf_counter() - t0))
    row = {"token_ms": median(times), "token_ms_min": min(times), "token_ms_mean": sum(times) / len(times),
           "tokens": len(got)}
    first = session.tokens[:len(session.tokens) - len(got)]
    session.close()
    truth = greedy_reference(runner, prompt, len(first) + len(got))  # step by step, no round graphs
    row["exact"] = truth == first + got
    return row


def verify(target, prompt: list[int], graphs: bool, reps: int) -> dict:
    """Rounds of a 16-row verify + a rollback to start + k (timed together and apart)."""
    dev = target.device
    out = {}
    for mode in ("replay", "stash"):
        target.set_rollback(mode)
        runner = make_runner(target, W, graphs)
        state = runner.new_state(len(prompt) + 4 * W * reps + 8)
        runner.prefill(torch.tensor(prompt, device=dev), state)
        block = torch.randint(0, target.vocab_size - 1, (W,), generator=torch.Generator().manual_seed(1)).to(dev)
        for k in (1, 8, W):
            step_t, back_t = [], []
            for _ in range(reps):
                start = state.length
                sync(dev)
                t0 = time.perf_counter()
                runner.step(block, start, state)
                sync(dev)
                t1 = time.perf_counter()
                state.rollback(start + k)
                sync(dev)
                t2 = time.perf_counter()
                step_t.append(1e3 * (t1 - t0))
                back_t.append(1e3 * (t2 - t1))
                if state.length + W + 8 > state.max_len - W:
                    runner.prefill(torch.tensor(prompt, device=dev), state)
            out[f"{mode}_k{k}"] = {"verify16_ms": median(step_t), "rollback_ms": median(back_t)}
        out[f"{mode}_state_mib"] = state.nbytes / 2**20
        runner.release(state)
        del runner, state
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    target.set_rollback("replay" if dev.type == "cuda" else "stash")
    return out


def verify_rounds(target, prompt: list[int], graphs: bool, rounds: int) -> dict:
    """A speculative round's target side as the engine's pipelined rounds run it: one graph per
    round (16-row verify, argmax, settlement, and the rollback inside the graph:
    `Qwen35State.restore_round`), each round queued before the host reads the previous one
    (`RoundChain`), rounds alternating the state's two buffer arrangements. The drafts are the
    plain stream's own tokens, read on the device from the round's start, with slot k wrong
    (k = 16: none), so every round keeps k rows and re-runs them (k < 16) from its base; the
    proposal costs a gather and a select. Exact when every round accepts k - 1 drafts and picks
    the plain stream's tokens. `k{k}_window`: the same rounds with a ladder window of k rows,
    known before the verify (as the engine's adapting ladder gives it), so the rows past it skip
    the recurrence (`live_rows_from`); the verify is still 16 rows. Without graphs (`--tiny`),
    the same body eagerly, read each round."""
    from memra_cli.engine.runtime.round_graphs import RoundChain, RoundGraph

    dev, ops = target.device, target.step_ops
    target.set_rollback("replay")  # the CUDA default (the CPU smoke run's default is stash)
    out = {"mode": target.rollback_mode, "rounds": rounds}
    runner = make_runner(target, W, graphs)
    cap = len(prompt) + W * (rounds + 4) + 8
    truth = greedy_reference(runner, prompt, W * (rounds + 2) + 1)
    seq = torch.tensor(prompt + truth, device=dev)
    # (k, windowed): windowed rounds have a ladder window of k rows, known before the verify, as
    # the engine's adapting ladder gives them: the rows past it skip the recurrence
    # (`live_rows_from`, computed from the round's inputs as spec/round_bodies.py does)
    # (k, windowed, unfused): `unfused` rounds run the lm_head and its argmax as two step ops
    # (`unfused_picks`), beside the same rounds fused
    runs = ((1, False, False), (8, False, False), (W, False, False), (1, True, False), (8, True, False),
            (8, False, True))
    for k, windowed, unfused in runs if graphs else runs[:3] + runs[4:]:  # the CPU smoke run: one windowed k
        name = f"k{k}" + ("_window" if windowed else "") + ("_unfused_picks" if unfused else "")
        state = runner.new_state(cap)
        runner.prefill(torch.tensor(prompt, device=dev), state)
        # positions up to the storage's end (the capture runs at its slack): the plain stream,
        # then filler
        tokens = torch.cat([seq, seq.new_zeros(state.max_len + W)])
        rows = torch.arange(W, device=dev)

        live = torch.zeros(1, dtype=torch.int32, device=dev)
        window = max(k, 2) if windowed else W  # settle_round's cap (at least 2); the first round's window is k

        def body(inputs, state=state, k=k, tokens=tokens, rows=rows, windowed=windowed, live=live, window=window):
            t_start = inputs[0]
            cand = tokens.index_select(0, rows + t_start)
            if k < W:  # slot k wrong: drafts 1..k-1 accepted, k rows kept
                cand = torch.where(rows == k, (cand + 1) % target.vocab_size, cand)
            if windowed:
                live.copy_(torch.minimum(inputs[3], inputs[4]).clamp(min=1).reshape(1))
            with state.live_rows_from(live) if windowed else nullcontext():  # as spec/round_bodies.py runs it
                sel, _ = greedy_step(target, cand, rows + t_start, state, None)
            packed = ops.settle_round(cand, sel, None, inputs, None, kind="ladder", cap=window, adapt=False,
                                      restore=state.round_params, ring=state.ring)
            state.restore_round(live if windowed else None)  # a kept window: no replay (replay mode)
            return packed

        start0 = state.length
        seed = (start0, 0, int(seq[start0]), k if windowed else W, 1 << 40)
        results, times = [], []
        if graphs:
            chain = RoundChain(dev, 5)
            slack = state.max_len - W
            for variant in range(2):
                with state.arranged_for_capture(variant), unfused_picks() if unfused else nullcontext():
                    chain.graphs[variant] = RoundGraph(body, (slack, 0, 0, seed[3], 1 << 40), dev, inputs=chain.inputs)
            variant = state.graph_variant
            sync(dev)
            t0 = time.perf_counter()
            ahead = chain.launch(variant, seed)
            for j in range(rounds):
                variant ^= 1
                nxt = chain.launch(variant) if j + 1 < rounds else None
                row = chain.read(ahead)
                results.append((state.length, [int(x) for x in row[W:2 * W]], int(row[-1])))
                state.settled_on_device(state.length + int(row[-1]) + 1)
                ahead = nxt
            sync(dev)
            times.append(1e3 * (time.perf_counter() - t0) / rounds)
        else:
            inputs = torch.tensor(seed, device=dev)
            t0 = time.perf_counter()
            for j in range(rounds):
                with unfused_picks() if unfused else nullcontext():
                    row = body(inputs).tolist()
                results.append((state.length, [int(x) for x in row[W:2 * W]], int(row[-1])))
                state.settled_on_device(state.length + int(row[-1]) + 1)
            times.append(1e3 * (time.perf_counter() - t0) / rounds)
        ok = True
        for start, sel, m in results:
            want = seq[start + 1: start + 1 + m + 1].tolist()
            ok &= m == min(k, W) - 1 and sel[:m + 1] == want
        # and the state the rounds left is, bit for bit, the one steps of another grouping (7
        # tokens a step, host rollbacks) leave after the same tokens: K/V, windows, states
        ref = runner.new_state(cap)
        runner.prefill(torch.tensor(prompt, device=dev), ref)
        while ref.length < state.length:
            n = min(7, state.length - ref.length)
            runner.step(seq[ref.length: ref.length + n], ref.length, ref)
        same = ref.length == state.length and all(
            torch.equal(x, y) for x, y in zip([*state.conv, *state.rec], [*ref.conv, *ref.rec]))
        same = same and torch.equal(state.kv[..., :state.length, :], ref.kv[..., :ref.length, :])
        runner.release(ref)
        out[name] = {"round_ms": times[0], "exact": bool(ok and same), "picks_exact": bool(ok),
                     "state_exact": bool(same), "rounds": len(results)}
        runner.release(state)
        del state
    out["all_exact"] = all(v["exact"] for v in out.values() if isinstance(v, dict))
    if graphs:  # the in-graph restore alone (windows + the kept rows' replay), a graph of its own
        from memra_cli.engine.runtime import cuda_graphs

        state = runner.new_state(cap)
        runner.prefill(torch.tensor(prompt, device=dev), state)
        runner.step(seq[state.length: state.length + W], state.length, state)  # a recorded step to re-run
        graph, _ = cuda_graphs.capture(state.restore_round, dev)
        two, _ = cuda_graphs.capture(lambda: two_launch_restore(state), dev)  # the form before, beside it
        for rows in (1, 8, -1):
            state.round_params.copy_(torch.tensor([0, rows], dtype=torch.int32))
            out[f"restore_ms_rows{rows}"] = replay_ms(graph.replay, 50)
            out[f"restore_two_launches_ms_rows{rows}"] = replay_ms(two.replay, 50)
        runner.release(state)
    target.set_rollback("replay" if dev.type == "cuda" else "stash")
    return out


def hf_greedy(path: Path, prompt: list[int], dev: torch.device, dtype, tokens: int) -> dict:
    from memra_cli.hf_compat import protect_kernels_name

    protect_kernels_name()  # the repository's kernels/ folder must not shadow Hugging Face's
    import transformers

    try:
        import fla  # noqa: F401
        fla_version = getattr(fla, "__version__", "?")
    except ImportError:
        fla_version = None
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(dev).eval()
    x = torch.tensor([prompt], device=dev)
    gc = model.generation_config
    gc.do_sample, gc.eos_token_id, gc.pad_token_id = False, None, 0

    def run(n):
        sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 generation_config=gc)
        sync(dev)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    run(2)  # warm-up
    # the fastest of three runs of each length: one run each let noise make the difference negative
    short = min(run(4)[0] for _ in range(3))
    longs = [run(4 + tokens) for _ in range(3)]
    long, stream = min(t for t, _ in longs), longs[0][1]
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"token_ms": 1e3 * (long - short) / tokens, "tokens": tokens, "fla": fla_version, "stream": stream}


class Stand_in:
    """A drafter stand-in: proposes the plain stream's next tokens, corrupted at a slot that moves
    round to round (so rounds accept 0..all drafts)."""

    def __init__(self, truth: list[int], prompt_len: int, n_drafts: int, vocab: int, dev):
        self.truth, self.p, self.nd, self.vocab, self.dev = truth, prompt_len, n_drafts, vocab, dev
        self.round = 0

    def reset(self, capacity):
        self.round = 0

    def release(self):
        pass

    def ingest(self, taps, positions):
        pass

    def propose(self, last, start, want_raws):
        i = start - self.p
        drafts = [self.truth[j] if j < len(self.truth) else 0 for j in range(i + 1, i + 1 + self.nd)]
        slot = (5 * self.round + 2) % (self.nd + 3)
        if slot < self.nd:
            drafts[slot] = (drafts[slot] + 1) % self.vocab
        self.round += 1
        return Proposal(torch.tensor(drafts, device=self.dev))


def exact(target, prompts: list[list[int]], graphs: bool, tokens: int) -> dict:
    dev = target.device
    runs, plain_stream = [], None
    block = W
    for mode in ("replay", "stash"):
        target.set_rollback(mode)
        runner = make_runner(target, W, graphs)
        for ids in prompts:
            truth = greedy_reference(runner, ids, tokens + block + 1)
            stand_in = Stand_in(truth, len(ids), block - 1, target.vocab_size, dev)
            program = Program(Harvest.DFLASH, LADDER, False, block, False, block)
            session = Session(runner, ids, tokens, proposer=stand_in, program=program, taps=(-1, 1))
            got = session.run()
            if mode == "replay" and ids is prompts[-1]:
                plain_stream = truth[:tokens]
            hist = session.stats.accept_hist
            runs.append({"mode": mode, "prompt_len": len(ids), "exact": got == truth[:tokens],
                         "rounds": session.stats.rounds, "accept_hist": {str(m): n for m, n in hist.items() if n}})
    target.set_rollback("replay" if dev.type == "cuda" else "stash")
    return {"runs": runs, "all_exact": all(r["exact"] for r in runs), "plain_stream": plain_stream}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "h200-hybrid-step.json")
    p.add_argument("--ckpt", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "memra-qwen35-4b-random")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU, no graphs (a smoke run)")
    p.add_argument("--gdn-tile", default="", help="BLOCK_V,WARPS[,LATE_PREP[,PREFETCH]] of the DeltaNet recurrence kernel (a sweep's "
                   "candidate; the engine's are memra_kernels.deltanet's constants)")
    p.add_argument("--attn-tile", default="", help="SPLIT,BLOCK_N,BLOCK_M,STAGES,WARPS of the attention "
                   "kernel at head_dim 256 (a sweep's candidate, e.g. step_profile.py's best_hd256; the "
                   "engine's is memra_kernels.attention.TILES[256])")
    p.add_argument("--skip-transformers", action="store_true", help="leave out the transformers section")
    p.add_argument("--no-pdl", action="store_true", help="launch the kernels in plain stream order (MEMRA_PDL=0) "
                   "instead of with programmatic dependent launch (the default on sm_90+)")
    p.add_argument("--dense-tuned", type=Path, default=None,
                   help="a dense_linear_sweep.py --tuned table as dense_linear.TUNED for this run; 'none' empties it "
                        "(every weight matmul on cuBLAS)")
    p.add_argument("--dense-prefetch", type=int, default=None,
                   help="dense_linear.PDL_PREFETCH for this run (weight tiles asked of L2 before the PDL wait)")
    p.add_argument("--no-glu", action="store_true", help="the MLP's gate/up matmul and SiLU·mul as two launches "
                   "(the swiglu step op unfused), to time the SwiGLU epilogue against")
    a = p.parse_args()
    if a.no_glu:
        from memra_cli.engine.layers.triton_step_ops import TritonStepOps
        from memra_cli.engine.layers.unfused import unfused_swiglu

        TritonStepOps.swiglu = unfused_swiglu
    if a.dense_prefetch is not None and not a.tiny:
        from memra_kernels import dense_linear as _dense

        _dense.PDL_PREFETCH = a.dense_prefetch
    if a.no_pdl:
        os.environ["MEMRA_PDL"] = "0"
    if a.dense_tuned and not a.tiny:
        from memra_kernels import dense_linear as _dense

        if str(a.dense_tuned) == "none":
            _dense.TUNED.clear()
        else:
            try:
                _dense.load_tuned(a.dense_tuned)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                p.error(f"--dense-tuned {a.dense_tuned}: {exc}")
    if a.gdn_tile:
        from memra_kernels import deltanet as _gdn
        try:
            parts = [int(x) for x in a.gdn_tile.split(",")]
            if len(parts) not in (2, 3, 4) or (len(parts) == 4 and parts[3] not in (1, 2)):
                raise ValueError
        except ValueError:
            p.error(f"--gdn-tile: expected BLOCK_V,WARPS[,LATE_PREP[,PREFETCH]] (two to four integers, PREFETCH 1 or 2), "
                    f"got {a.gdn_tile!r}")
        _gdn.BLOCK_V, _gdn.REC_WARPS = parts[:2]
        if len(parts) >= 3:
            _gdn.LATE_PREP = bool(parts[2])
        if len(parts) == 4:
            _gdn.PREFETCH = parts[3]
    if a.attn_tile:
        from memra_kernels import attention as _attn
        try:  # before any launch: decode_attention reads tile_for(256) -> TILES[256] at each call
            fields = [int(x) for x in a.attn_tile.split(",")]
            if len(fields) != 5:
                raise ValueError(f"{len(fields)} values")
            _attn.TILES[256] = _attn.Tile(*fields)  # checks it is a tile the kernel runs
        except ValueError as exc:
            p.error(f"--attn-tile: expected SPLIT,BLOCK_N,BLOCK_M,STAGES,WARPS (five integers), "
                    f"got {a.attn_tile!r}: {exc}")
    tiny = a.tiny
    dev = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    shape = SHAPE_TINY if tiny else SHAPE_4B
    ckpt = a.ckpt.with_name(a.ckpt.name + "-tiny") if tiny else a.ckpt
    prompt_len, tokens, reps = (24, 6, 3) if tiny else (512, 48, 30)
    graphs = not tiny
    report = Report(a.json, {"shape": "tiny" if tiny else "qwen3.5-4b (random weights)", "dims": {
        k: v for k, v in shape.items() if k != "layer_types"}, "layer_types": list(shape["layer_types"]),
        "dtype": str(dtype), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "step_width": W, "torch": torch.__version__, "gdn_tile": a.gdn_tile or "module constants",
        "attn_tile_hd256": a.attn_tile or "module table", "pdl": pdl_on(dev),
        "command": "python -m benchmarks.gpu.hybrid_step " + " ".join(sys.argv[1:])})
    t0 = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_tiny_qwen35(ckpt, dtype=dtype, seed=0, **shape)
    report.data["write_ckpt_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    target = Qwen35Target.from_dir(ckpt, dtype=dtype, device=dev)
    ops, note = select_step_ops(dev)
    target.step_ops = ops
    report.data.update({"load_s": round(time.perf_counter() - t0, 1), "step_ops": note,
                        "rollback_default": target.rollback_mode})
    report.write()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape["vocab"] - 1, (prompt_len,), generator=gen).tolist()

    with torch.inference_mode():
        if not tiny:
            report.section("floor", lambda: floor(target, reps))
        report.section("plain", lambda: plain(target, prompt, graphs, tokens, reps))
        report.section("verify", lambda: verify(target, prompt, graphs, max(3, reps // 3)))
        report.section("rounds", lambda: verify_rounds(target, prompt, graphs, 4 if tiny else 40))
        short = [prompt[:prompt_len // 4], prompt]
        report.section("exact", lambda: exact(target, short, graphs, tokens if tiny else 64))
    del target
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if not a.skip_transformers:
        report.section("transformers", lambda: hf_greedy(ckpt, prompt, dev, dtype, 4 if tiny else 32))
    d = report.data
    try:  # headline: memra's graphed plain token vs transformers', and vs the 16-row floor
        fastest = min(d["plain"][k]["token_ms"] for k in ("width1", "width1_round", "width1_round_unpipelined")
                      if k in d["plain"])
        summary = {"memra_plain_token_ms_w1": fastest,
                   "memra_plain_token_ms_w1_step": d["plain"]["width1"]["token_ms"],
                   "memra_plain_token_ms_w1_round": d["plain"].get("width1_round", {}).get("token_ms"),
                   "memra_plain_token_ms_w1_round_unpipelined":
                       d["plain"].get("width1_round_unpipelined", {}).get("token_ms"),
                   "memra_plain_token_ms_w16": d["plain"]["width16"]["token_ms"],
                   # one real row in a 16-row step: its padding rows' recurrence skipped / run (same process)
                   "w16_round_token_ms": d["plain"].get("width16_round", {}).get("token_ms"),
                   "w16_round_token_ms_padding_run": d["plain"].get("width16_padded_round", {}).get("token_ms"),
                   "w16_step_token_ms_padding_run": d["plain"]["width16_padded"]["token_ms"],
                   "transformers_token_ms": d.get("transformers", {}).get("token_ms"),
                   "exact": d["exact"]["all_exact"] and all(d["plain"][k].get("exact", True) for k in d["plain"]
                                                            if isinstance(d["plain"][k], dict)),
                   "rollback_default": d.get("rollback_default")}
        if "floor" in d:
            summary["floor_rows1_ms"] = d["floor"]["rows1_ms"]
            summary["floor_rows16_ms"] = d["floor"]["rows16_ms"]
            summary["plain_over_floor"] = summary["memra_plain_token_ms_w1"] / summary["floor_rows1_ms"]
            if summary["w16_round_token_ms"] and summary["w16_round_token_ms_padding_run"]:
                summary["w16_round_over_floor16"] = summary["w16_round_token_ms"] / summary["floor_rows16_ms"]
                summary["w16_round_padding_run_over_floor16"] = (summary["w16_round_token_ms_padding_run"]
                                                                 / summary["floor_rows16_ms"])
        for mode in ("stash", "replay"):  # a round's target side: 16-row verify + rollback, k = 8 kept
            row = d["verify"].get(f"{mode}_k8")
            if row:
                both = row["verify16_ms"] + row["rollback_ms"]
                summary[f"verify16_rollback_ms_{mode}"] = both
                summary[f"verify16_rollback_over_plain_{mode}"] = both / summary["memra_plain_token_ms_w1"]
        rounds = d.get("rounds", {})
        if "k8" in rounds:  # the same, as the engine's pipelined rounds run it (rollback in the graph)
            summary["verify16_round_ms_k8"] = rounds["k8"]["round_ms"]
            summary["verify16_round_over_plain"] = rounds["k8"]["round_ms"] / summary["memra_plain_token_ms_w1"]
            summary["verify16_round_over_plain_k16"] = rounds[f"k{W}"]["round_ms"] / summary["memra_plain_token_ms_w1"]
            if "k8_window" in rounds:  # a window of 8 known before the verify: rows 8..15 skip the recurrence
                summary["verify16_round_ms_k8_window8"] = rounds["k8_window"]["round_ms"]
                summary["verify16_round_window8_over_plain"] = (rounds["k8_window"]["round_ms"]
                                                                / summary["memra_plain_token_ms_w1"])
            if "k8_unfused_picks" in rounds and "width1_round_unfused_picks" in d["plain"]:
                # the same rounds and tokens with the lm_head and its argmax as two launches (same process)
                summary["verify16_round_ms_k8_unfused_picks"] = rounds["k8_unfused_picks"]["round_ms"]
                summary["plain_token_ms_w1_round_unfused_picks"] = d["plain"]["width1_round_unfused_picks"]["token_ms"]
                summary["verify16_round_over_plain_unfused_picks"] = (
                    rounds["k8_unfused_picks"]["round_ms"] / d["plain"]["width1_round_unfused_picks"]["token_ms"])
            summary["exact"] = summary["exact"] and rounds["all_exact"]
        ours, theirs = d["exact"]["plain_stream"], d.get("transformers", {}).get("stream", [])
        summary["transformers_agree_prefix"] = next(  # bf16: streams may part at a near-tie
            (i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
        d["summary"] = summary
    except (KeyError, TypeError) as exc:
        d["summary"] = {"error": f"a section failed: {exc!r}"}
    report.write()
    print(json.dumps(d["summary"], indent=1))


if __name__ == "__main__":
    main()

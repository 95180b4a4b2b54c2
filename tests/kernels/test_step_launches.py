"""benchmarks/step_launches.py counts a fixed-width step's kernel launches on the CPU: the count
of the 8B shape it derives is the GPU profiler's (328 for Qwen3-8B before the embedding fusion,
docs/perf.md), and the fused ops launch fewer kernels than their parts with the same logits."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


@pytest.mark.exhaustive  # four interpreted steps of a 4-layer target: about a minute
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_fused_step_launches_fewer_kernels(family):
    from benchmarks.step_launches import count_step

    fused, unfused = count_step(family), count_step(family, variant="unfused")
    # a layer: qkv with its (q/k norm +) rope + K/V write (one launch fused), attention's split and
    # combine, o, add + norm, gate/up (+ SiLU·mul: in the dense kernel's epilogue where the 8B
    # weight is TUNED, LLaMA's is not), down, add + norm. Fused, o and down add the residual and
    # the next matmul applies the norm where the 8B weights are TUNED: Qwen3's o, gate/up, down
    # and q/k/v (six launches); LLaMA's o, down and q/k/v, its gate/up on F.linear with its
    # SiLU·mul and the norm before it as their own launches (eight)
    per_layer = 9 if family == "qwen3" else 10
    assert unfused["per_layer"] == per_layer and fused["per_layer"] == (6 if family == "qwen3" else 8)
    if family == "llama":  # the small target's shapes stand for distinct 8B weights (no two roles share one)
        assert (2 * 256, 128) not in [tuple(s) for s in fused["routed_to_dense"]]  # gate/up: not TUNED at 8B
    # outside the layers: embedding + first norm (one launch fused), lm_head, the float32 widening
    assert fused["outside_layers"] == 3 and unfused["outside_layers"] == 4
    assert fused["triton"].get("_embed_kernel", 0) == 0 and unfused["triton"]["_embed_kernel"] == 1
    if family == "qwen3":  # 328 before: the GPU profiler's count of the same step (docs/perf.md)
        assert fused["launches_8b"] == 36 * 6 + 3 and unfused["launches_8b"] == 328
        assert fused["triton"]["_rms_norm_kernel"] == 1  # the first norm (with the embedding): every other is folded


@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", ["fused", "unfused"])
def test_a_greedy_step_fuses_the_argmax_into_the_lm_head(variant):
    """The round's step: fused, the lm_head's launch picks (its argmax epilogue) and nothing
    widens; unfused, the argmax's two launches at 151,936 columns (chunks and their fold)."""
    from benchmarks.step_launches import count_step

    got = count_step("qwen3", greedy=True, variant=variant)
    assert "to" not in got["torch"]  # no float32 logits in a greedy step
    if variant == "fused":
        assert "_row_argmax_kernel" not in got["triton"] and got["outside_layers"] == 2  # embedding + norm, lm_head
        assert got["launches_8b"] == 36 * 6 + 2
    else:
        assert got["triton"]["_row_argmax_kernel"] == 1 and got["outside_layers"] == 2 + 1 + 2
        assert got["launches_8b"] == 36 * 9 + 5


@pytest.mark.exhaustive  # three tiny hybrids' interpreted 16-row steps: about a minute
@pytest.mark.parametrize("mode", ["replay", "stash"])
def test_the_hybrid_round_verifies_in_nine_launches_a_layer_and_commits_in_one(mode):
    """benchmarks/hybrid_launches.py at the Qwen3.5-4B shape: a verify step launches 9 kernels a
    layer of either kind and 3 outside them (291 in all; 294 while the lm_head's argmax was two
    launches of its own and the embedding gather one apart from the first norm), and the commit of a
    round queued on the device is one launch, whether it
    re-runs kept rows or kept its whole window of live rows (4 while the windows, the replay and
    the window's mask were apart; stash mode's: 10, the window's launch and nine torch ops picking
    the stashed row); the host's rollback (replay mode, graphed) is the rows' copy and that launch."""
    from benchmarks.hybrid_launches import count_round

    got = count_round(mode)["sections"]
    verify = got["verify"]
    # a layer: its in projection, its mixer's own (conv + gates, recurrence, gated norm; or the q/k
    # prep and attention's split and combine), out projection, two add + norms, gate/up with
    # SiLU·mul, down; outside: the embedding with the first norm, the lm_head with its picks, positions % ring
    assert verify["per_deltanet_layer"] == 9 and verify["per_attention_layer"] == 9, verify
    assert verify["outside_layers"] == 3 and verify["at_4b"] == 291, verify
    assert "_row_argmax_kernel" not in verify["triton"] and "_embed_kernel" not in verify["triton"], verify
    assert verify["torch"] == {"remainder": 1}, verify
    restore = "_gdn_kernel" if mode == "replay" else "_stash_restore_kernel"
    for name in ("restore", "restore_window"):
        assert got[name]["triton"] == {restore: 1} and got[name]["torch"] == {}, (name, got[name])
    if mode == "replay":
        assert got["host_commit"]["triton"] == {"_gdn_kernel": 1} and got["host_commit"]["torch"] == {"copy_": 1}
    assert got["settle"]["launches"] == 1


@pytest.mark.exhaustive  # six interpreted steps of a 2-layer MoE target: several seconds
def test_an_moe_step_launches_per_layer():
    """A Qwen3-MoE plain decode step (16 rows, one live), routed as the A3B shape: per sparse
    layer the attention's launches (the q/k/v on the dense kernel with its rope in the epilogue),
    one launch for the router's matmul and its picks, and the MoE kernels, by name (what one more
    layer adds), and the A3B step's total from them; unfused, the rope, the router's matmul and
    the MoE combine's residual add and next norm are launches of their own."""
    from benchmarks.step_launches import count_step

    fused, unfused = count_step("qwen3_moe"), count_step("qwen3_moe", variant="unfused")
    attention = {
        "_dense_linear_kernel": 2,  # q/k/v with its q/k norm + rope + K/V write in the epilogue; o
        "_split_kernel": 1, "_combine_kernel": 1,  # the attention
        "_rms_norm_kernel": 1,  # the attention's residual add with the norm after it
    }
    moe = {"_moe_gate_up_kernel": 1, "_moe_down_kernel": 1, "_moe_combine_kernel": 1}
    assert fused["per_layer_kernels"] == {**attention, **moe, "_router_route_kernel": 1}
    # unfused: the rope + K/V write apart, the router's matmul apart, the combine's add + norm apart
    assert unfused["per_layer_kernels"] == {**attention, **moe, "_qk_norm_rope_kv_kernel": 1, "linear": 1,
                                            "_moe_route_kernel": 1, "_rms_norm_kernel": 2}
    assert fused["per_layer"] == 9 and unfused["per_layer"] == 12
    # outside the layers: embedding + first norm (one launch fused), lm_head, the float32 widening
    assert fused["outside_layers"] == 3 and unfused["outside_layers"] == 4
    assert fused["launches_8b"] == 48 * 9 + 3 and unfused["launches_8b"] == 48 * 12 + 4


@pytest.mark.exhaustive  # two interpreted steps of a tiny 4- (Qwen3.5) or 2-layer (Gemma 4) MoE target: ~20 s each
@pytest.mark.parametrize("family", ["qwen3_5_moe", "gemma4_moe"])
def test_the_other_moe_families_end_a_layer_in_the_combine(family):
    """A plain decode step (16 rows, one live) of the Qwen3.5 MoE hybrid and of MoE Gemma 4, every
    weight matmul on the dense kernel: what one more layer (the last: a gated attention layer, a
    Gemma full-attention layer) launches. Qwen3.5 MoE: the router's one launch, the three MoE
    kernels (the combine adding the gated shared expert and the residual and applying the next
    zero-centred norm), the shared expert's gate/up, down and gate matmuls (17 a layer before).
    Gemma 4: the router with its norm in one launch, the combine running the whole sandwich-norm
    layer end, the experts' input norm written by the attention's add + norm (51 a layer before)."""
    from benchmarks.step_launches import count_step

    got = count_step(family)
    moe = {"_router_route_kernel": 1, "_moe_gate_up_kernel": 1, "_moe_down_kernel": 1, "_moe_combine_kernel": 1}
    if family == "qwen3_5_moe":
        attention = {"_gated_qk_kernel": 1, "_split_kernel": 1, "_combine_kernel": 1, "_rms_norm_kernel": 1}
        # q/k/v/gate, o, the shared expert's gate/up (SiLU·mul epilogue) and down, its gate's logit
        assert got["per_layer_kernels"] == {**attention, **moe, "_dense_linear_kernel": 5}, got["per_layer_kernels"]
        assert got["per_layer"] == 13
    else:
        attention = {"_gemma_qkv_kernel": 1, "_split_kernel": 1, "_combine_kernel": 1, "_add_norm_kernel": 1}
        mlp = {"_dense_linear_kernel": 4, "_gelu_mul_kernel": 1}  # q/k/v, o, the MLP's gate/up and down; GELU·up
        # the attention's add + norm also writes the experts' input norm; no torch op is left
        assert got["per_layer_kernels"] == {**attention, **moe, **mlp}, got["per_layer_kernels"]
        assert got["per_layer"] == 13


@pytest.mark.exhaustive  # an interpreted round and plain step of the embedded pair: about 40 s
def test_a_dspark_round_makes_its_positions_candidates_and_block_once():
    """`--round dspark` on the embedded pair (its weight matmuls on the dense kernel, as shipped):
    besides the kernels, a round body launches one add (`Drafter.round_positions`: the verify
    step's positions, and the drafter block's with its attention's last positions and the
    ingest's span). The target writes each tap into its slice of the taps (no concatenation);
    the block's ids, its embedding and first norm are one launch; the candidates [last, drafts]
    and the confidence raws come from the chain's launch; the draft cache's position rows are not
    written (row index == position); a drafter layer's MLP norm, its final norm and the ingest's
    context norm fold into the projections (and the heads) after them; no weight matmul is left
    to cuBLAS."""
    from benchmarks.step_launches import count_round

    got = count_round("embedded", "dspark")
    assert got["round"]["torch"] == {"add": 1}, got["round"]["torch"]
    tri = got["round"]["triton"]
    # the chain's launch scores its slots (the confidence head's own launch gone)
    assert "_confidence_kernel" not in tri and tri["_markov_table_kernel"] == 1 and tri["_settle_kernel"] == 1
    assert "_embed_kernel" not in tri
    assert tri["_rms_norm_kernel"] == 2, tri  # the block's embedding + first norm, the target's first
    # the drafter's block attention over its draft cache of one split: no combine (the target's six layers combine)
    assert tri["_split_kernel"] == 8 and tri["_combine_kernel"] == 6, tri
    assert got["plain"]["launches"] == 40 and got["round"]["launches"] == 56


@pytest.mark.exhaustive  # an interpreted round of the embedded pair: about 40 s
def test_a_dflash_round_on_a_dense_target_writes_no_live_rows():
    """`--round dflash` on the embedded pair: the ladder's window is the settlement's business; a
    dense KV cache ignores a step's live rows (its step costs the same at any live count), so the
    round writes none (the minimum, clamp and copy a recurrent state or an MoE target needs), and
    its only ops outside the kernels are the positions' add and the candidates' concatenation."""
    from benchmarks.step_launches import count_round

    got = count_round("embedded", "dflash")
    assert got["round"]["torch"] == {"add": 1, "cat": 1}, got["round"]["torch"]
    assert got["plain"]["launches"] == 40 and got["round"]["launches"] == 63

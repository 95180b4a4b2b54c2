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
    # weight is TUNED, LLaMA's is not), down, add + norm
    per_layer = 9 if family == "qwen3" else 10
    assert unfused["per_layer"] == per_layer and fused["per_layer"] == per_layer - 1
    # outside the layers: embedding + first norm (one launch fused), lm_head, the float32 widening
    assert fused["outside_layers"] == 3 and unfused["outside_layers"] == 4
    assert fused["triton"].get("_embed_kernel", 0) == 0 and unfused["triton"]["_embed_kernel"] == 1
    if family == "qwen3":  # 328 before: the GPU profiler's count of the same step (docs/perf.md)
        assert fused["launches_8b"] == 36 * 8 + 3 and unfused["launches_8b"] == 328


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
        assert got["launches_8b"] == 36 * 8 + 2
    else:
        assert got["triton"]["_row_argmax_kernel"] == 1 and got["outside_layers"] == 2 + 1 + 2
        assert got["launches_8b"] == 36 * 9 + 5


@pytest.mark.exhaustive  # six interpreted steps of a 2-layer MoE target: several seconds
def test_an_moe_step_launches_per_layer():
    """A Qwen3-MoE plain decode step (16 rows, one live), routed as the A3B shape: per sparse
    layer the attention's launches, one launch for the router's matmul and its picks, and the
    MoE kernels, by name (what one more layer adds), and the A3B step's total from them;
    unfused, the router's matmul and the routing are two launches, and the MoE combine's
    residual add and next norm a third."""
    from benchmarks.step_launches import count_step

    fused, unfused = count_step("qwen3_moe"), count_step("qwen3_moe", variant="unfused")
    attention = {
        "linear": 1,  # q/k/v (not in the dense kernel's table at A3B)
        "_qk_norm_rope_kv_kernel": 1, "_split_kernel": 1, "_combine_kernel": 1,  # rope + K/V, attention
        "_dense_linear_kernel": 1,  # o
        "_rms_norm_kernel": 1,  # the attention's residual add with the norm after it
    }
    moe = {"_moe_gate_up_kernel": 1, "_moe_down_kernel": 1, "_moe_combine_kernel": 1}
    assert fused["per_layer_kernels"] == {**attention, **moe, "_router_route_kernel": 1}
    assert unfused["per_layer_kernels"] == {**attention, **moe, "linear": 2, "_moe_route_kernel": 1,
                                            "_rms_norm_kernel": 2}
    assert fused["per_layer"] == 10 and unfused["per_layer"] == 12
    # outside the layers: embedding + first norm (one launch fused), lm_head, the float32 widening
    assert fused["outside_layers"] == 3 and unfused["outside_layers"] == 4
    assert fused["launches_8b"] == 48 * 10 + 3 and unfused["launches_8b"] == 48 * 12 + 4

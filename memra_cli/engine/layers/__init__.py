"""The layer seam: linear, attention, norm and rope, shared by the target and the drafter.

`ops` holds the plain-torch reference (any device; numerics follow transformers' Qwen3);
`rope` builds cos/sin tables (full or partial rotary); `deltanet` holds the Gated DeltaNet
pieces of the Qwen3.5 hybrid (causal conv, delta-rule recurrence in sequential and chunked form,
zero-centred and gated RMSNorms). Model files call only these functions, so a fused Triton kernel
(`memra_kernels`) or a packed quantized weight plugs in here without touching model math.
"""

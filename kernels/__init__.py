"""memra's Triton kernels, installed as `memra_kernels`.

Each op has a plain-torch reference of the same signature beside it (`*_ref`); tests compare the
two on random inputs with awkward shapes, on the GPU and, in CI, through Triton's interpreter.
Every kernel is row-count invariant: a row's result never depends on the other rows of its step
or on the storage size, so fixed-width steps stay bit-exact.

- `norm`: RMSNorm, and RMSNorm fused with the residual add (also zero-centred, Qwen3.5's)
- `rope`: per-head q/k RMSNorm + RoPE (table-driven: default and YaRN) + the K/V cache write
- `activation`: SiLU(gate) * up
- `attention`: causal GQA attention over the live length only (or a sliding window's live keys),
  split over keys at a fixed size
- `quant_linear`: q8_0 / q4_0 weights dequantized in registers (`_quant_dequant`), small M; the
  weights repacked once at load (`quant_pack`, triton-free), tiles per shape (`quant_tuning`); the
  block codec `quant_pack` packs, byte-identical to llama.cpp's: `ggml_blocks_ref`, triton-free
- `dense_linear`: bf16 / f16 weights at small M (the step's weight matmuls on the shapes where it
  beats cuBLAS), split over `in` at a per-shape constant, partials summed in a fixed order
- `deltanet`: Gated DeltaNet's step (Qwen3.5): causal conv update + SiLU, and the gated delta rule
  over a step's rows (float32 state; final state and per-row stash on request)
- `qwen35`: Qwen3.5's fused elementwise work: gated attention's q/k norm + partial rope + K/V
  write and its output gate; the DeltaNet's gates (+ the rollback record) and gated RMSNorm
- `gemma4`: Gemma 4's step ops: q/k norm + rope + v norm + K/V write (k_eq_v), the sandwich
  norms' residual add + norm, GELU-tanh · up, the logits' softcap
- `argmax`: a greedy round's argmax over each row of its logits, one program per row
- `gather`: embedding rows, and DSpark's confidence head, one program per row
- `moe`: a step's routed experts (the MoE families): rows grouped by expert on the device, each
  routed expert's gate/up (SiLU·mul or GELU-tanh·mul epilogue) and down read once per 32 rows, the
  weighted combine in each row's own fixed order
- `moe_route`: a router's picks from its logits (softmax, top-k with ties to the lower index,
  renormalisation, per-expert scale, cast, padding rows, the expert count) in one launch

Every launched kernel except quant_linear's starts with `_pdl.pdl_wait(PDL)` (dense_linear's with a
helper that first asks L2 for weight lines, which no kernel writes, then waits) and is launched with
`**_pdl.pdl_args(x)`: programmatic dependent launch on sm_90+ (`MEMRA_PDL=0` turns it off).

Modules import triton at the top: import them only where a kernel will run (the engine's layer
seam does, for CUDA tensors); the CPU runtime never needs triton.
"""

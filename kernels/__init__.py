"""memra's Triton kernels, installed as `memra_kernels`.

Each op has a plain-torch reference of the same signature beside it; tests compare the two on
random inputs with awkward shapes. (Empty until the performance work lands: the engine's plain
torch path is the reference every kernel will be checked against.)
"""

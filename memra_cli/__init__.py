"""memra: a toolkit for block-diffusion speculative decoding (DFlash / DSpark drafters)."""

__version__ = "0.1.0"

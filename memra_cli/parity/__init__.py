"""`memra parity`'s pieces, built on the engine: the `memra-oracle/1` file format and its checks
(`oracle.py`), and the independent float64 oracle maker (`reference.py`, needs transformers).
Not part of the engine core: the engine never imports them."""

"""`memra bench`'s runner, built on the engine's API (`engine/api.py`): arms side by side over
prompt sets, interleaved, with the exactness gate. Not part of the engine core: the engine never
imports it."""

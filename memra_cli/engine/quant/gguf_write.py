"""Writing memra GGUF files: `write_gguf` is what `memra quantize` writes (read back by formats/gguf.py).

Layout (docs/quantize.md): one GGUF v3 file written with the `gguf` package's GGUFWriter.

- Tensors keep their checkpoint names. GGUF lists dimensions fastest-first (ggml `ne`), the
  reverse of torch: a `[out, in]` weight is stored with ne = [in, out]. Quantized tensors are
  the raw q8_0 / q4_0 blocks (rows of `in // 32` blocks, one row per output feature); float
  tensors are F32 / BF16 / F16 (F64 and integer types as stored).
- Metadata: `general.architecture` = "memra-drafter", `general.name`, `general.file_type`,
  `general.quantization_version`, and memra's own keys: `memra.format` ("memra-gguf/1"),
  `memra.version`, `memra.policy`, `memra.config_json` (the source config.json text, verbatim:
  the file is self-describing, census and the engine read the config from it).

The file is written to a temporary file in the destination directory, tensor by tensor (one
tensor in memory at a time), and renamed into place only when complete: an error or an
interrupt leaves nothing behind. `open_gguf` reads headers only (a memory map) and refuses a
GGUF without memra's config metadata, or a truncated / corrupt file, in one line.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from memra_cli import __version__
from memra_cli.engine.formats.gguf import (
    _BLOCK_BYTES, _PLAIN, _QUANT, ARCH, FILE_TYPE_Q4_0, FILE_TYPE_Q8_0, FORMAT, KEY_CONFIG, KEY_FORMAT, KEY_POLICY,
    KEY_VERSION,
)
from memra_cli.engine.errors import CheckpointError, MemraError
from memra_cli.engine.files import signals_held

if TYPE_CHECKING:
    import torch

class GGUFWriteError(MemraError):
    """The output GGUF cannot be written (exists, unwritable, not .gguf)."""


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class TensorRow:
    """One tensor of a quantize report."""

    name: str
    shape: tuple[int, ...]
    source_dtype: str
    gguf_type: str
    bytes_before: int
    bytes_after: int
    rel_rms: float  # ||written - source|| / ||source||, over the tensor's values
    why: str
    kept: bool = False  # the policy asked for a quantized type; rows are not whole blocks

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "source_dtype": self.source_dtype,
                "type": self.gguf_type, "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "rel_rms_error": self.rel_rms, "why": self.why, "kept_unquantized": self.kept}


@dataclass
class WriteReport:
    out: Path
    source: Path
    policy: str
    rows: list[TensorRow]
    seconds: float
    file_bytes: int

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.rows)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.rows)

    @property
    def ratio(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else float("inf")

    @property
    def kept(self) -> list[TensorRow]:
        return [r for r in self.rows if r.kept]

    def as_json(self) -> dict[str, Any]:
        types: dict[str, int] = {}
        for r in self.rows:
            types[r.gguf_type] = types.get(r.gguf_type, 0) + 1
        return {
            "out": str(self.out), "source": str(self.source), "policy": self.policy,
            "tensors": [r.as_json() for r in self.rows],
            "totals": {"n_tensors": len(self.rows), "types": types, "bytes_before": self.bytes_before,
                       "bytes_after": self.bytes_after, "file_bytes": self.file_bytes,
                       "ratio": self.ratio, "seconds": self.seconds},
            "kept_unquantized": [{"name": r.name, "why": r.why} for r in self.kept],
        }


def _gguf_type(decision: Any, source_dtype: str, name: str) -> str:
    if decision.storage == "q8_0":
        return "Q8_0"
    if decision.storage == "q4_0":
        return "Q4_0"
    if decision.storage == "bf16":
        return "BF16"
    if decision.storage == "f32":
        return "F32"
    if source_dtype in _PLAIN:  # "stored"
        return source_dtype
    raise CheckpointError(f"tensor '{name}' has dtype {source_dtype}, which GGUF cannot store as is")


def _nbytes(kind: str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    if kind in _QUANT:
        return n // 32 * _BLOCK_BYTES[kind]
    return n * _PLAIN[kind][1]


def _sumsq(x: np.ndarray) -> float:
    """Sum of squares of a float32 array, accurate to ~1e-9 relative at f32 speed: f32 dot
    products of 256-value pieces (short sums lose nothing that matters), added in float64. A
    plain f32 sum over a 50M-value tensor is off by ~0.1%; a float64 pass costs 10x more."""
    flat = x.reshape(-1)
    n = flat.size // 256 * 256
    head = flat[:n].reshape(-1, 256)
    total = float(np.einsum("ij,ij->i", head, head).sum(dtype=np.float64)) if n else 0.0
    tail = flat[n:].astype(np.float64)
    return total + float(tail @ tail)


def _rel(err_ss: float, ref_ss: float) -> float:
    """sqrt(err_ss / ref_ss); 0 when both are 0."""
    if ref_ss == 0.0:
        return 0.0 if err_ss == 0.0 else float("inf")
    return float(np.sqrt(err_ss / ref_ss))


_ERR_CHUNK_VALUES = 1 << 21  # values per chunk of rows when measuring the error (8 MiB of f32)


def _encode_quant(name: str, t: "torch.Tensor", qtype: str) -> tuple[np.ndarray, float]:
    """[out, in] float tensor -> (uint8 blocks [out, in // 32 * block_bytes], relative RMS error of
    the decoded blocks vs the source values). The error is measured on chunks of rows, so no
    tensor-sized temporaries are made beyond the f32 copy of the source."""
    import torch

    from memra_cli.engine.quant.blocks import dequantize, quantize

    x = t.to(torch.float32).numpy()  # one call: torch is slow on many small conversions
    out = quantize(x, qtype, name)  # refuses NaN/Inf, naming the tensor
    rows, k = x.shape
    step = max(1, _ERR_CHUNK_VALUES // max(k, 1))
    ref_ss = err_ss = 0.0
    for r0 in range(0, rows, step):
        xs = x[r0:r0 + step]
        err = dequantize(out[r0:r0 + step], qtype, xs.shape)
        np.subtract(err, xs, out=err)
        ref_ss += _sumsq(xs)
        err_ss += _sumsq(err)
    return out, _rel(err_ss, ref_ss)


_LOSSLESS = {("BF16", "F32"), ("F16", "F32"), ("F32", "F32"), ("BF16", "BF16"), ("F16", "F16")}


def _encode(name: str, t: "torch.Tensor", kind: str, source_dtype: str) -> tuple[np.ndarray, float]:
    """Source tensor -> (the array the writer stores, relative RMS error of the stored values)."""
    import torch

    from memra_cli.engine.quant.blocks import QuantError

    if kind in _QUANT:
        return _encode_quant(name, t, _QUANT[kind])
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise QuantError(f"tensor '{name}' has NaN/Inf values; refusing to write it")
    if kind == "BF16":
        stored = t.to(torch.bfloat16)
        arr = stored.contiguous().view(torch.int16).numpy().view(np.uint16)
    else:
        stored = t.to({"F32": torch.float32, "F16": torch.float16, "F64": torch.float64, "I8": torch.int8,
                       "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}[kind])
        arr = stored.contiguous().numpy()
    if (source_dtype, kind) in _LOSSLESS or not t.is_floating_point():
        return arr, 0.0
    src = t.to(torch.float32).numpy()
    err = stored.to(torch.float32).numpy() - src
    return arr, _rel(_sumsq(err), _sumsq(src))


_FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full


def _write_failure(exc: OSError, directory: Path) -> str:
    """Why a write failed, in words. An OSError with an errno says it ("No space left on
    device"); numpy's tofile reports a full disk as a short write ("N requested and M
    written") with no errno, so the free space left on the device says why."""
    if exc.strerror:
        return exc.strerror
    detail = str(exc) or type(exc).__name__
    try:
        full = shutil.disk_usage(directory).free < _FULL_BYTES
    except OSError:
        full = False
    return f"{os.strerror(errno.ENOSPC)}: {detail}" if full else detail


def _unwritable(out: Path, reason: str) -> GGUFWriteError:
    return GGUFWriteError(f"--out {out}: cannot write ({reason})")


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is not .gguf, or that the rule of every output refuses
    (`files.check_output`: a directory, an existing file unless `overwrite`, a missing or
    unwritable directory)."""
    from memra_cli.engine.files import check_output

    if out.suffix != ".gguf":
        raise GGUFWriteError(f"--out {out}: expected a .gguf file name (memra opens GGUF drafters by suffix)")
    try:
        check_output(out, "--out", force=overwrite)
    except MemraError as exc:
        raise GGUFWriteError(str(exc)) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_gguf(out_path: Path, src_ckpt_dir: Path, policy: str,
               progress_cb: Callable[[int, int, str], None] | None = None, *, overwrite: bool = False,
               census: Any = None) -> WriteReport:
    """Quantize the drafter checkpoint directory `src_ckpt_dir` under `policy` into `out_path`.

    `progress_cb(done, total, name)` is called after each tensor is written. Returns the
    per-tensor report. Refuses an existing `out_path` unless `overwrite`, an unwritable one, a
    source that fails its census, and NaN/Inf weights (naming the tensor); on any error or
    interrupt the temporary file is removed and `out_path` is untouched.
    """
    import gguf
    import torch

    from memra_cli.engine.formats.census import take_census
    from memra_cli.engine.formats.checkpoint import open_checkpoint
    from memra_cli.engine.quant.precision import FILE_POLICIES, check_policy, plan

    check_policy(policy, FILE_POLICIES, "--policy")
    src, out = Path(src_ckpt_dir), Path(out_path)
    if src.is_file() and src.suffix == ".gguf":
        raise CheckpointError(f"{src}: already a GGUF; quantize reads a safetensors drafter checkpoint directory")
    if not src.is_dir():
        raise CheckpointError(f"{src}: expected a drafter checkpoint directory (config.json + safetensors)")
    census = census or take_census(src)  # refuse a bad checkpoint before anything is written
    config_text = (src / "config.json").read_text(encoding="utf-8")
    ckpt = open_checkpoint(src)
    check_out(out, overwrite)
    decisions = plan(ckpt.tensors, policy)
    kinds = {name: _gguf_type(d, ckpt.tensors[name].dtype, name) for name, d in decisions.items()}

    t0 = time.perf_counter()
    tmp, writer = None, None
    try:
        with signals_held():  # a signal lands once `tmp` is known, so the cleanup below removes the file
            try:
                fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
            except OSError as exc:
                raise _unwritable(out, _write_failure(exc, out.parent)) from exc
            tmp = Path(tmp_name)
        os.close(fd)
        writer = gguf.GGUFWriter(tmp, ARCH)
        archs = census.config.architectures
        writer.add_name(archs[0] if archs else src.name)
        writer.add_file_type(FILE_TYPE_Q4_0 if policy == "q4" else FILE_TYPE_Q8_0)  # "mostly": norms stay f32
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_string(KEY_FORMAT, FORMAT)
        writer.add_string(KEY_VERSION, __version__)
        writer.add_string(KEY_POLICY, policy)
        writer.add_string(KEY_CONFIG, config_text)
        for name, info in ckpt.tensors.items():
            kind = kinds[name]
            if kind in _QUANT:  # declared as blocks of bytes; the writer derives ne from them
                rows = info.numel // info.shape[-1]
                writer.add_tensor_info(name, (rows, _nbytes(kind, info.shape) // rows) if rows else (0, 0),
                                       np.dtype(np.uint8), _nbytes(kind, info.shape),
                                       raw_dtype=gguf.GGMLQuantizationType[kind])
            else:
                raw_dtype = gguf.GGMLQuantizationType.BF16 if kind == "BF16" else None
                writer.add_tensor_info(name, info.shape, np.dtype(_PLAIN[kind][0]), _nbytes(kind, info.shape),
                                       raw_dtype=raw_dtype)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rows_out: list[TensorRow] = []
        total = len(ckpt.tensors)
        for i, (name, info) in enumerate(ckpt.tensors.items()):
            kind, d = kinds[name], decisions[name]
            with torch.inference_mode():
                arr, err = _encode(name, ckpt.load(name), kind, info.dtype)
            writer.write_tensor_data(arr)
            rows_out.append(TensorRow(name, info.shape, info.dtype, kind, info.nbytes, int(arr.nbytes), err, d.why, d.kept))
            del arr
            if progress_cb is not None:
                progress_cb(i + 1, total, name)
        writer.close()
        writer = None
        os.chmod(tmp, 0o666 & ~_umask())
        if out.exists() and not overwrite:  # appeared while we were writing
            raise GGUFWriteError(f"--out {out}: file exists (pass --force to overwrite)")
        os.replace(tmp, out)
    except BaseException as exc:
        if writer is not None:
            try:
                writer.close()
            except Exception:
                pass
        # disk full, permissions changed under us, ...: the reason is read before the temporary
        # file goes (removing it frees the space that says the disk was full)
        reason = _write_failure(exc, out.parent) if isinstance(exc, OSError) else None
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if reason is not None:
            raise _unwritable(out, reason) from exc  # MEMRA_DEBUG=1 shows the OSError behind it
        raise
    return WriteReport(out, src, policy, rows_out, time.perf_counter() - t0, out.stat().st_size)

"""safetensors header reading: single, sharded, truncated, corrupt, pickle refusal."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from memra_cli.engine.formats.checkpoint import open_checkpoint, read_safetensors_header
from memra_cli.engine.errors import CheckpointError


def _write(path, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_single_file_headers_and_load(tmp_path):
    _write(tmp_path / "model.safetensors", {"a": torch.randn(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)})
    ck = open_checkpoint(tmp_path)
    assert ck.format == "safetensors"
    assert (ck.tensors["a"].dtype, ck.tensors["a"].shape, ck.tensors["a"].nbytes) == ("F32", (3, 4), 48)
    assert (ck.tensors["b"].dtype, ck.tensors["b"].nbytes) == ("BF16", 10)
    assert ck.total_bytes == 58
    assert torch.equal(ck.load("b", torch.float32), torch.ones(5))


def test_sharded_index(tmp_path):
    _write(tmp_path / "s1.safetensors", {"a": torch.randn(2, 2)})
    _write(tmp_path / "s2.safetensors", {"b": torch.randn(3)})
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = open_checkpoint(tmp_path)
    assert ck.format == "safetensors-sharded" and set(ck.tensors) == {"a", "b"}
    assert ck.tensors["b"].file.name == "s2.safetensors"
    index["weight_map"]["c"] = "s3.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard 's3.safetensors' is listed but missing"):
        open_checkpoint(tmp_path)
    index["weight_map"] = {"a": "s1.safetensors", "zz": "s1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="tensor 'zz' is in the index but not in the shard"):
        open_checkpoint(tmp_path)


def test_truncated_file_is_named(tmp_path):
    p = _write(tmp_path / "model.safetensors", {"w": torch.randn(64, 64)})
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated: tensor 'w'"):
        open_checkpoint(tmp_path)
    p.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        read_safetensors_header(p)


def test_corrupt_header(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 8)
    with pytest.raises(CheckpointError, match="not JSON"):
        read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="corrupt or truncated safetensors header"):
        read_safetensors_header(p)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(CheckpointError, match="declares 12 bytes for shape \\[4\\] F32"):
        read_safetensors_header(p)


def test_pickle_checkpoints_are_refused_without_unpickling(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 this would be a pickle")
    with pytest.raises(CheckpointError, match="memra never unpickles"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="pickle checkpoint refused"):
        open_checkpoint(tmp_path / "pytorch_model.bin")


def test_no_weights_and_ambiguous_files(tmp_path):
    with pytest.raises(CheckpointError, match="no weights file"):
        open_checkpoint(tmp_path)
    _write(tmp_path / "x.safetensors", {"a": torch.zeros(1)})
    _write(tmp_path / "y.safetensors", {"b": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="2 .safetensors files but no model.safetensors.index.json"):
        open_checkpoint(tmp_path)

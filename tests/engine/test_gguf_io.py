"""memra GGUF files: bytes against the gguf package on whole tiny checkpoints, the layout and
metadata, census of the GGUF == census of the source, a drafter from the GGUF == the same drafter
quantized at load (bit for bit in f32), refusals, and nothing half-written on errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from memra_cli.engine.quant import gguf_write as gguf_io
from memra_cli.engine.formats.census import take_census
from memra_cli.engine.formats.checkpoint import open_checkpoint
from memra_cli.engine.models.drafter import Drafter
from memra_cli.engine.errors import CheckpointError
from memra_cli.engine.formats.gguf import open_gguf
from memra_cli.engine.quant.gguf_write import GGUFWriteError, write_gguf
from memra_cli.engine.quant.precision import plan, weight_fn_for
from memra_cli.engine.quant.blocks import QuantError, QuantLinearRef, dequantize
from memra_cli.tiny.draft import make_tiny_draft

GG = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
DSPARK = dict(markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3), yarn=True,
              layer_types=("full_attention", "sliding_attention"), sliding_window=6)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {
        "deepspec-bf16": make_tiny_draft(root / "ds-bf16", "deepspec", dtype=torch.bfloat16, seed=1, **DSPARK),
        "deepspec-f32": make_tiny_draft(root / "ds-f32", "deepspec", seed=2, **DSPARK),
        "zlab-bf16": make_tiny_draft(root / "zl-bf16", "zlab", dtype=torch.bfloat16, seed=3, layers=3),
    }


@pytest.fixture(scope="module")
def written(sources, tmp_path_factory):
    """(source, policy) -> (gguf path, report), every source under every file policy."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, src in sources.items():
        for policy in ("q8", "mixed", "fc", "q4"):
            path = root / f"{name}-{policy}.gguf"
            out[name, policy] = (path, write_gguf(path, src, policy))
    return out


def _values_f32(ckpt, name) -> np.ndarray:
    return ckpt.load(name, torch.float32).numpy()


@pytest.mark.parametrize("policy", ["q8", "mixed", "fc", "q4"])
@pytest.mark.parametrize("source", ["deepspec-bf16", "deepspec-f32", "zlab-bf16"])
def test_every_tensor_against_the_gguf_package(sources, written, source, policy):
    path, report = written[source, policy]
    src = open_checkpoint(sources[source])
    decisions = plan(src.tensors, policy)
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    assert list(by_name) == list(src.tensors)  # checkpoint names, checkpoint order
    n_quant = 0
    for name, info in src.tensors.items():
        t, d = by_name[name], decisions[name]
        assert tuple(int(x) for x in t.shape) == tuple(reversed(info.shape)), name  # ggml ne order
        values = _values_f32(src, name)
        if d.quantized:
            n_quant += 1
            assert t.tensor_type == GG[d.storage]
            want = gguf.quants.quantize(values, GG[d.storage])
            assert np.array_equal(np.asarray(t.data).reshape(-1), want.reshape(-1)), name
            back = gguf.quants.dequantize(np.asarray(t.data), GG[d.storage])
            assert np.array_equal(back, dequantize(want, d.storage, info.shape))
        elif d.storage == "bf16" or (d.storage == "stored" and info.dtype == "BF16"):
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16, name
            bits = torch.from_numpy(np.asarray(t.data).copy().view(np.int16).reshape(info.shape)).view(torch.bfloat16)
            assert torch.equal(bits.float(), torch.from_numpy(values).bfloat16().float()), name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
            assert np.array_equal(np.asarray(t.data).reshape(info.shape), values), name
    assert n_quant == sum(r.gguf_type in ("Q8_0", "Q4_0") for r in report.rows) > 0
    # the report: one row per tensor, bytes before/after, error of the stored values
    assert [r.name for r in report.rows] == list(src.tensors)
    assert report.bytes_after < report.bytes_before or source.endswith("bf16") and policy == "mixed"
    for r in report.rows:
        assert r.bytes_before == src.tensors[r.name].nbytes and r.bytes_after == by_name[r.name].n_bytes
        if r.gguf_type == "Q8_0":
            assert 1e-3 < r.rel_rms < 1.5e-2
        elif r.gguf_type == "Q4_0":
            assert 3e-2 < r.rel_rms < 0.2
        elif r.gguf_type == "BF16" and r.source_dtype == "F32":
            assert 0 < r.rel_rms < 2.0 ** -8
        else:
            assert r.rel_rms == 0.0


def test_metadata_and_checkpoint_view(sources, written):
    path, _ = written["deepspec-bf16", "mixed"]
    reader = gguf.GGUFReader(path)
    fields = {k: reader.fields[k].contents() for k in reader.fields if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "memra-drafter"
    assert fields["general.name"] == "Qwen3DSparkModel"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert fields["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    assert fields["memra.format"] == "memra-gguf/1" and fields["memra.policy"] == "mixed"
    src_text = (sources["deepspec-bf16"] / "config.json").read_text()
    assert fields["memra.config_json"] == src_text  # verbatim
    ck = open_gguf(path)
    assert ck.format == "gguf" and ck.policy == "mixed" and ck.embedded_config == json.loads(src_text)
    assert ck.files == (path,) and ck.metadata["memra.policy"] == "mixed"
    assert ck.tensors["layers.0.mlp.up_proj.weight"].dtype == "Q8_0"
    assert ck.tensors["layers.0.mlp.up_proj.weight"].shape == (128, 64)
    assert ck.tensors["layers.0.mlp.up_proj.weight"].nbytes == 128 * 2 * 34
    assert ck.tensors["layers.0.self_attn.q_proj.weight"].dtype == "BF16"
    assert ck.tensors["norm.weight"].dtype == "F32"
    # load: floats as stored (then cast), quantized dequantized; raw: the stored blocks
    src = open_checkpoint(sources["deepspec-bf16"])
    assert ck.load("norm.weight").dtype == torch.float32 and torch.equal(ck.load("norm.weight"), src.load("norm.weight", torch.float32))
    q = ck.load("layers.0.self_attn.q_proj.weight")
    assert q.dtype == torch.bfloat16 and torch.equal(q, src.load("layers.0.self_attn.q_proj.weight"))
    qtype, raw, shape = ck.raw("layers.0.mlp.up_proj.weight")
    assert (qtype, raw.shape, shape) == ("q8_0", (128, 68), (128, 64))
    assert np.array_equal(ck.load("layers.0.mlp.up_proj.weight", torch.float32).numpy(), dequantize(raw, "q8_0", shape))
    assert ck.is_quantized("fc.weight") is False and ck.is_quantized("layers.1.mlp.down_proj.weight") is True
    with pytest.raises(CheckpointError, match="'norm.weight' is not a quantized tensor"):
        ck.raw("norm.weight")
    with pytest.raises(CheckpointError, match="tensor 'nope' is missing"):
        ck.load("nope")
    q4 = open_gguf(written["deepspec-bf16", "q4"][0])
    assert q4.metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0


@pytest.mark.parametrize("source", ["deepspec-bf16", "zlab-bf16"])
def test_census_of_the_gguf_equals_the_source(sources, written, source):
    src = take_census(sources[source])
    for policy in ("q8", "q4"):
        path, _ = written[source, policy]
        g = take_census(path)
        assert g.checkpoint_format == "gguf" and g.files == (path,) and g.path == path
        assert g.config == dataclasses.replace(src.config, source=f"{path}:config.json")
        for f in ("kind", "markov", "confidence", "rope", "layers", "unknown_tensors", "own_embed_tokens",
                  "own_lm_head", "n_params", "warnings"):
            assert getattr(g, f) == getattr(src, f), f
        assert [(t.name, t.shape) for t in g.tensors] == [(t.name, t.shape) for t in src.tensors]
        assert g.n_bytes < src.n_bytes  # types aside


def _taps(cfg, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.n_taps * cfg.hidden_size, generator=gen)


@pytest.mark.parametrize("policy", ["q8", "mixed", "q4"])
@pytest.mark.parametrize("source", ["deepspec-bf16", "deepspec-f32"])
def test_drafter_from_gguf_equals_load_time_quantization(sources, written, source, policy):
    path, _ = written[source, policy]
    a = Drafter.load(path)
    b = Drafter.load(sources[source], weight_fn=weight_fn_for(policy))
    assert a.dtype == b.dtype == torch.float32
    for la, lb in zip(a.layers, b.layers):
        for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "ln_in", "ln_post", "q_norm", "k_norm"):
            x, y = getattr(la, f), getattr(lb, f)
            assert type(x) is type(y), f
            if isinstance(x, QuantLinearRef):
                assert x.qtype == y.qtype and x.shape == y.shape and torch.equal(x.raw, y.raw), f
            else:
                assert x.dtype == y.dtype and torch.equal(x, y), f
    assert isinstance(a.markov_w2, QuantLinearRef) and torch.equal(a.markov_w2.raw, b.markov_w2.raw)
    cfg = a.cfg
    ctx, block = 19, cfg.block_size
    taps = _taps(cfg, ctx, 0)
    noise = torch.randn(block, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(ctx + block)
    with torch.inference_mode():
        fa, fb = a.forward_full(taps, noise, pos), b.forward_full(taps, noise, pos)
        assert torch.equal(fa.hidden_out, fb.hidden_out) and torch.equal(fa.layer_out, fb.layer_out)
        ka, kb = a.new_cache(ctx), b.new_cache(ctx)
        a.ingest(ka, taps, pos[:ctx]), b.ingest(kb, taps, pos[:ctx])
        ra, rb = a.forward_round(ka, noise, pos[ctx:]), b.forward_round(kb, noise, pos[ctx:])
        assert torch.equal(ra.hidden_out, rb.hidden_out)
        logits = ra.hidden_out @ a.own_lm_head.T
        anchor = torch.tensor(3)
        chain = a.markov_chain(logits, anchor)
        assert torch.equal(chain, b.markov_chain(logits, anchor))
        prev = torch.cat([anchor.reshape(1), chain[:-1]])
        assert torch.equal(a.confidence_raw(ra.hidden_out, prev), b.confidence_raw(rb.hidden_out, prev))
    # and it is really quantized: the float drafter differs
    with torch.inference_mode():
        plain = Drafter.load(sources[source]).forward_full(taps, noise, pos).hidden_out
    assert not torch.equal(plain, fa.hidden_out)


def _drafter_round_bench():
    """benchmarks/gpu/drafter_round.py as a module (its launch counter is the one its JSON reports)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "drafter_round.py"
    spec = importlib.util.spec_from_file_location("drafter_round_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("policy", ["q8", "q4"])
def test_gguf_drafter_fuses_its_block_rows_and_launches_fewer_matmuls(sources, written, policy, monkeypatch):
    """A q8_0 / q4_0 GGUF drafter stacks each layer's q/k/v and gate/up at load as the file's own
    block rows, byte for byte (ggml rows are independent blocks); its static round then launches
    4 weight matmuls a layer instead of 7 and its ingest 1 instead of 2, and every output is the
    unfused drafter's bit for bit (the reference dequantizes row by row)."""
    from memra_cli.engine.models.drafter import DraftLayer

    path, _ = written["zlab-bf16", policy]
    fused = Drafter.load(path)
    with monkeypatch.context() as m:
        m.setattr(DraftLayer, "fuse", lambda self: self)
        unfused = Drafter.load(path)
    qtype = {"q8": "q8_0", "q4": "q4_0"}[policy]
    ck = open_checkpoint(path)
    for i, w in enumerate(fused.layers):
        p = f"layers.{i}."
        for stack, names in ((w.wqkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             (w.w_gate_up, ("mlp.gate_proj", "mlp.up_proj")), (w.wkv, ("self_attn.k_proj", "self_attn.v_proj"))):
            raws = [ck.raw(p + n + ".weight") for n in names]
            assert isinstance(stack, QuantLinearRef) and stack.qtype == qtype and all(r[0] == qtype for r in raws)
            file_rows = torch.cat([torch.as_tensor(np.asarray(r[1])).reshape(r[2][0], -1) for r in raws])
            assert torch.equal(stack.raw, file_rows)
    bench = _drafter_round_bench()
    n = len(fused.layers)
    assert bench.matmul_launches(fused) == {"round": 4 * n, "ingest": n + 1, "layers": n}  # + fc in the ingest
    assert bench.matmul_launches(unfused) == {"round": 7 * n, "ingest": 2 * n + 1, "layers": n}
    cfg = fused.cfg
    taps, block = _taps(cfg, 7, 3), cfg.block_size
    noise = torch.randn(block, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(7 + block)
    with torch.inference_mode():
        fa, fb = fused.forward_full(taps, noise, pos), unfused.forward_full(taps, noise, pos)
        assert torch.equal(fa.hidden_out, fb.hidden_out) and torch.equal(fa.ctx_features, fb.ctx_features)
        ka, kb = fused.new_cache(2 * block), unfused.new_cache(2 * block)
        fused.static_ingest(ka, taps[:block], torch.tensor(0)), unfused.static_ingest(kb, taps[:block], torch.tensor(0))
        ra = fused.static_round(ka, noise, torch.tensor(block))
        assert torch.equal(ra, unfused.static_round(kb, noise, torch.tensor(block)))
        assert torch.equal(ka.k, kb.k) and torch.equal(ka.v, kb.v)


def test_rows_not_whole_blocks_kept_as_stored(tmp_path):
    src = make_tiny_draft(tmp_path / "r16", "deepspec", markov_rank=16, confidence="markov",
                          target_layer_ids=(-1, 1, 3), dtype=torch.bfloat16)
    report = write_gguf(tmp_path / "r16.gguf", src, "q4")
    kept = report.kept
    assert [r.name for r in kept] == ["markov_head.markov_w2.weight"]
    assert kept[0].gguf_type == "BF16" and "rows of 16 values are not a multiple of 32" in kept[0].why
    assert report.as_json()["kept_unquantized"] == [{"name": kept[0].name, "why": kept[0].why}]
    d = Drafter.load(tmp_path / "r16.gguf")
    assert isinstance(d.markov_w2, torch.Tensor) and isinstance(d.layers[0].w_up, QuantLinearRef)


# --------------------------------------------------------------------------- refusals


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def _finish(w) -> None:
    """Write a hand-made GGUF (header, metadata, tensors) and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_foreign_gguf_is_refused(tmp_path):
    p = tmp_path / "foreign.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_tensor("fc.weight", np.zeros((4, 32), dtype=np.float32))
    _finish(w)
    with pytest.raises(CheckpointError) as e:
        open_gguf(p)
    assert "without memra metadata 'memra.config_json'" in _one_line(e)
    with pytest.raises(CheckpointError, match="without memra metadata"):
        take_census(p)


def test_unsupported_tensor_type_is_refused(tmp_path, sources):
    p = tmp_path / "q41.gguf"
    w = gguf.GGUFWriter(p, "memra-drafter")
    w.add_string("memra.config_json", (sources["zlab-bf16"] / "config.json").read_text())
    w.add_tensor("fc.weight", np.zeros((4, 20), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    _finish(w)
    with pytest.raises(CheckpointError) as e:
        open_gguf(p)
    assert "tensor 'fc.weight' has GGUF type Q4_1; memra reads" in _one_line(e)


@pytest.mark.parametrize("cut", ["empty", "header", "metadata", "data", "last-byte"])
def test_truncated_or_corrupt_gguf_is_refused(written, tmp_path, cut):
    data = written["zlab-bf16", "q8"][0].read_bytes()
    n = {"empty": 0, "header": 16, "metadata": 200, "data": len(data) // 2, "last-byte": len(data) - 1}[cut]
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(CheckpointError) as e:
        open_gguf(p)
    msg = _one_line(e)
    assert str(p) in msg and ("truncated" in msg or "corrupt" in msg)


def test_garbage_gguf_is_refused(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"NOTAGGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError) as e:
        open_gguf(p)
    assert "corrupt or truncated GGUF file" in _one_line(e)


def test_bad_config_metadata_is_refused(tmp_path):
    p = tmp_path / "badcfg.gguf"
    w = gguf.GGUFWriter(p, "memra-drafter")
    w.add_string("memra.config_json", "{not json")
    _finish(w)
    with pytest.raises(CheckpointError, match="metadata 'memra.config_json' is not a JSON object"):
        open_gguf(p)


def test_nan_weights_refused_by_name_and_nothing_left(tmp_path):
    bad = torch.randn(128, 64)
    bad[5, 7] = float("nan")
    src = make_tiny_draft(tmp_path / "nan", "zlab", extra_tensors={"layers.1.mlp.up_proj.weight": bad})
    with pytest.raises(QuantError) as e:
        write_gguf(tmp_path / "nan.gguf", src, "q8")
    assert "tensor 'layers.1.mlp.up_proj.weight' has NaN/Inf values" in _one_line(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan"]
    # NaN in a tensor kept as floats is refused too
    norm = torch.ones(64)
    norm[0] = float("inf")
    src2 = make_tiny_draft(tmp_path / "inf", "zlab", extra_tensors={"norm.weight": norm})
    with pytest.raises(QuantError, match="tensor 'norm.weight' has NaN/Inf values"):
        write_gguf(tmp_path / "inf.gguf", src2, "q8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inf", "nan"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError, OSError])
def test_interrupted_write_leaves_nothing(sources, tmp_path, monkeypatch, exc):
    real = gguf.GGUFWriter.write_tensor_data
    calls = []

    def flaky(self, tensor, *a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise exc(28, "No space left on device") if exc is OSError else exc("stop")
        return real(self, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", flaky)
    out = tmp_path / "x.gguf"
    expected = GGUFWriteError if exc is OSError else exc
    with pytest.raises(expected) as e:
        write_gguf(out, sources["zlab-bf16"], "q8")
    if exc is OSError:
        assert "cannot write (No space left on device)" in _one_line(e)
    assert len(calls) == 5 and list(tmp_path.iterdir()) == []
    # an existing file overwritten with --force survives a failed write untouched
    out.write_bytes(b"keep me")
    calls.clear()
    with pytest.raises(expected):
        write_gguf(out, sources["zlab-bf16"], "q8", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"] and out.read_bytes() == b"keep me"


def test_out_refusals(sources, tmp_path):
    src = sources["zlab-bf16"]
    (tmp_path / "exists.gguf").write_bytes(b"x")
    (tmp_path / "afile").write_bytes(b"x")
    cases = [
        (tmp_path / "exists.gguf", "file exists (pass --force to overwrite)"),
        (tmp_path / "missing" / "x.gguf", "does not exist (memra creates no directories)"),
        (tmp_path / "afile" / "x.gguf", "is not a directory"),
        (tmp_path / "x.bin", "expected a .gguf file name"),
        (tmp_path, "expected a .gguf file name"),
    ]
    for out, match in cases:
        with pytest.raises(GGUFWriteError) as e:
            write_gguf(out, src, "q8")
        assert match in _one_line(e), out
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(GGUFWriteError, match="is a directory"):
        write_gguf(tmp_path / "dir.gguf", src, "q8", overwrite=True)
    assert (tmp_path / "exists.gguf").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dir.gguf", "exists.gguf"]


def test_source_refusals(sources, written, tmp_path):
    with pytest.raises(CheckpointError, match="already a GGUF"):
        write_gguf(tmp_path / "y.gguf", written["zlab-bf16", "q8"][0], "q8")
    with pytest.raises(gguf_io.MemraError, match="--policy: unknown precision policy 'bf16'"):
        write_gguf(tmp_path / "y.gguf", sources["zlab-bf16"], "bf16")
    assert list(tmp_path.iterdir()) == []


def test_progress_callback(sources, tmp_path):
    seen = []
    write_gguf(tmp_path / "p.gguf", sources["zlab-bf16"], "q4", lambda done, total, name: seen.append((done, total, name)))
    names = list(open_checkpoint(sources["zlab-bf16"]).tensors)
    assert seen == [(i + 1, len(names), n) for i, n in enumerate(names)]


def test_a_gguf_loads_as_written(sources, written):
    path, _ = written["deepspec-bf16", "q4"]
    with pytest.raises(CheckpointError) as e:
        Drafter.load(path, weight_fn=weight_fn_for("q8"))
    assert "written under precision policy q4 loads as written; precision q8 cannot apply" in _one_line(e)
    with pytest.raises(CheckpointError, match="precision of the given weight_fn cannot apply"):
        Drafter.load(path, weight_fn=lambda name, ckpt, dtype, device: ckpt.load(name, dtype, device))
    same = Drafter.load(path, weight_fn=weight_fn_for("q4"))  # repeating the file's policy is a no-op
    assert torch.equal(same.layers[0].wq.raw, Drafter.load(path).layers[0].wq.raw)

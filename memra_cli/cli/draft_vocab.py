"""`memra draft-vocab`: rank a target's tokens by how often they occur, and write the top N as a
draft vocabulary (`--draft-vocab` of generate, `vocab=` of a bench arm; docs/draft-vocab.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from memra_cli.cli.common import DeviceOpt, DtypeOpt, JsonOpt, at_least, refusals
from memra_cli.engine.errors import MemraError


class DraftVocabCommandError(MemraError):
    """A draft-vocab request that cannot run as asked (output exists, --top too large)."""


@refusals
def draft_vocab(
    out: Path = typer.Argument(..., help="The JSON file to write (the ids ascending, and what they were counted over)."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target model directory (its tokenizer.json counts the text). Default: the embedded target."),
    prompts: List[str] = typer.Option(..., "--prompts", help="humaneval | mbpp | stdlib | a JSONL file; repeat to count over several sets. Count the text your users send, never a set you will bench on."),
    top: int = typer.Option(32768, "--top", callback=at_least(1), help="How many tokens to keep: the most frequent, ties to the smaller id."),
    n: Optional[int] = typer.Option(None, "--n", callback=at_least(1), help="Only the first N prompts of each set."),
    max_new: int = typer.Option(0, "--max-new", callback=at_least(0), help="Also count the target's own greedy continuation of each prompt, this many tokens (what the drafts must match; 0: the prompts' text only)."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Write a draft vocabulary: the TOP most frequent tokens of the target's tokenizer over prompt
    sets (and, with --max-new, over the target's own continuations of them).

    With the file, `memra generate --draft-vocab OUT` and a bench arm `dspark:vocab=OUT` draft only
    from those tokens, so the draft reads only their rows of the lm_head (at a 152k vocabulary the head is the largest single matrix a drafter's round reads). The target still verifies every token: the output
    is the same stream; a token outside the set can still be committed, as the target's own pick,
    but never drafted, which costs acceptance. Measure it with `memra bench` before relying on it.
    """
    from memra_cli.engine.defaults import default_models
    from memra_cli.engine.prompts import load_prompts
    from memra_cli.engine.spec.draft_vocab import rank_tokens
    from memra_cli.engine.text import TextCodec

    if out.exists() and not force:
        raise DraftVocabCommandError(f"{out} exists (use --force to overwrite)")
    target, _, note = default_models(target, None, "off")
    if note and not json_out:
        print(f"note: {note}", file=sys.stderr, flush=True)
    codec = TextCodec(target)
    vocab_size = _vocab_size(target)
    if top > vocab_size:
        raise DraftVocabCommandError(f"--top {top}: the target's vocabulary has {vocab_size} tokens")
    sets = [load_prompts(p, n) for p in prompts]
    streams = [codec.encode(text) for s in sets for text in s.texts]
    started = time.perf_counter()
    if max_new:
        streams += _continuations(target, streams, max_new, dtype, device, quiet=json_out)
    ids, summary = rank_tokens(streams, vocab_size, top)
    record = {"ids": ids, "vocab_size": vocab_size, "top": top, "target": str(target),
              "prompts": [{"set": s.name, "source": s.source, "n": len(s.texts)} for s in sets],
              "max_new": max_new, **summary}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, out)  # never a half-written vocabulary
    if json_out:
        print(json.dumps({k: v for k, v in record.items() if k != "ids"}))
        return
    print(f"wrote {out}: {len(ids)} of {vocab_size} tokens, covering {100 * summary['coverage']:.2f}% of "
          f"{summary['tokens_counted']} tokens counted ({summary['distinct_seen']} distinct seen)"
          + (f"; continuations {time.perf_counter() - started:.0f} s" if max_new else ""))


def _vocab_size(target: Path) -> int:
    """The target's vocabulary (its lm_head's rows): `vocab_size` of config.json, at the top or
    under `text_config` (Qwen3.5, Gemma 4)."""
    from memra_cli.engine.formats.config import read_json_object

    raw = read_json_object(target / "config.json")
    for scope in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        size = scope.get("vocab_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    raise DraftVocabCommandError(f"{target / 'config.json'}: no vocab_size (at the top or under text_config)")


def _continuations(target: Path, streams: list[list[int]], max_new: int, dtype: str, device: str,
                   quiet: bool) -> list[list[int]]:
    """The target's greedy continuation of each prompt, `max_new` tokens, on the device's fastest
    plain decoding (`Engine.fastest_plain`: a count of tokens needs no fixed-width bits)."""
    import torch

    from memra_cli.engine.api import Engine, EngineConfig

    out = []
    with torch.inference_mode():
        engine = Engine.load(EngineConfig(target=target, device=device, dtype=dtype)).fastest_plain()
        for i, ids in enumerate(streams):
            if not ids:
                continue
            out.append(engine.session(ids, max_new).run())
            if not quiet and (i + 1) % 50 == 0:
                print(f"continued {i + 1}/{len(streams)} prompts", file=sys.stderr, flush=True)
    return out

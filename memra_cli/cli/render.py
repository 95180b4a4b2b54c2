"""Rendering: rich reports for people, one JSON object for scripts. Only cli/ prints."""

from __future__ import annotations

import errno
import json
import sys
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

class PipeAwareConsole(Console):
    """rich's Console, except that a closed pipe raises BrokenPipeError for the CLI's boundary
    to end quietly with the closed-pipe code (rich's own answer is exit 1, a failure's code)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")


console = PipeAwareConsole(highlight=False)
err_console = PipeAwareConsole(stderr=True, highlight=False)


def unwrapped(target: Console) -> bool:
    """Whether `target` prints a line as one line: when it is not a terminal (a file or a pipe is
    read by programs: no breaks added). On a terminal rich wraps at word boundaries, where the
    terminal itself would break a long line mid-word."""
    return not target.is_terminal


def emit_json(obj: Any) -> None:
    """One JSON object on stdout (and nothing else there)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def print_receipts(lines: list[str], to_stderr: bool = False) -> None:
    """The two receipt lines, verbatim (no markup, no highlighting)."""
    target = err_console if to_stderr else console
    for line in lines:
        target.print(line, markup=False, highlight=False, soft_wrap=unwrapped(target))


def note(message: str) -> None:
    """An informational line on stderr (defaults applied, files written)."""
    err_console.print(f"[dim]note:[/dim] {message}", soft_wrap=unwrapped(err_console), highlight=False)


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {message}", soft_wrap=unwrapped(err_console))


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    return table


def census_report(c: Any, receipts: Any) -> None:
    """The human census report, ending with the two receipt lines."""
    cfg = c.config
    strategy = "DSpark (shifted labels, all rows)" if c.kind == "dspark" else "DFlash (mask-fill, rows 1..b-1)"
    dtypes = ", ".join(f"{k}×{v}" for k, v in Counter(t.dtype for t in c.tensors).most_common())
    console.print(f"[bold]memra census[/bold] {c.path}")
    console.print(_kv_table("checkpoint", [
        ("exporter", f"{cfg.exporter} ({', '.join(cfg.architectures) or 'no architectures'})"),
        ("strategy", f"{strategy}; strategy_dspark={str(c.strategy_dspark).lower()}"),
        ("format", f"{c.checkpoint_format}, {len(c.files)} file(s)"),
        ("size", f"{human_count(c.n_params)} params, {human_bytes(c.n_bytes)} ({dtypes})"),
    ]))
    taps = list(cfg.target_layer_ids)
    tap_note = " (defaulted: z-lab spread rule)" if cfg.target_layer_ids_defaulted else ""
    console.print(_kv_table("geometry", [
        ("layers", f"{cfg.num_hidden_layers} × hidden {cfg.hidden_size}, ffn {cfg.intermediate_size}"),
        ("backbone", _backbone(cfg)),
        ("attention", f"{cfg.num_attention_heads} q heads / {cfg.num_key_value_heads} kv heads × {cfg.head_dim}"),
        ("block", f"{cfg.block_size} (mask token {cfg.mask_token_id})"),
        ("target taps", f"{taps}{tap_note}" + ("  (-1 = embedding output)" if -1 in taps else "")),
    ]))
    console.print(_kv_table("heads", [
        ("markov", f"{c.markov.type}, rank {c.markov.rank}" if c.markov else "none"),
        ("confidence", f"in_dim {c.confidence.in_dim}, with_markov={str(c.confidence.with_markov).lower()}" if c.confidence else "none"),
        ("own tables", ", ".join(n for n, on in (("embed_tokens", c.own_embed_tokens), ("lm_head", c.own_lm_head)) if on) or "none (uses the target's)"),
    ]))
    r = c.rope
    rope_rows = [("type", r.type), ("theta", r.theta)]
    if r.type == "yarn":
        rope_rows += [
            ("factor", r.factor), ("original ctx", r.original_max_position_embeddings),
            ("beta fast/slow", f"{r.beta_fast}/{r.beta_slow}"), ("mscale", f"{r.mscale:.6f}"),
            ("divisors", f"{r.divisors[0]:.4g} … {r.divisors[-1]:.4g} over {len(r.divisors)} dims"),
        ]
    if r.type == "proportional":
        rope_rows += [("partial rotary", r.partial_rotary_factor), ("factor", r.factor)]
    if r.type == "llama3":
        rope_rows += [("factor", r.factor), ("original ctx", r.original_max_position_embeddings),
                      ("low/high freq factor", f"{r.low_freq_factor}/{r.high_freq_factor}")]
    console.print(_kv_table("rope", rope_rows))
    layout = Table(title="attention layout", title_justify="left")
    for col in ("layer", "attention", "window", "causal in block", "rule"):
        layout.add_column(col)
    for lay in c.layers:
        layout.add_row(str(lay.index), lay.attention, str(lay.window or "-"), "yes" if lay.causal_in_block else "no", lay.rule)
    console.print(layout)
    console.print(_kv_table("tensor census", [
        ("tensors", f"{len(c.tensors)} (all consumed or named)" if not c.unknown_tensors else f"{len(c.tensors)}"),
        ("unknown", ", ".join(c.unknown_tensors) or "none"),
    ]))
    for w in c.warnings:
        warn(w)
    print_receipts(receipts.lines())


def _backbone(cfg: Any) -> str:
    """The drafter's layer family in words (a Gemma 4 drafter's switches and the defaults applied)."""
    g = cfg.gemma4
    if g is None:
        return "Qwen3 layers (RMSNorm, SwiGLU, q/k norm, 1/sqrt(head_dim))"
    words = ("Gemma 4 layers (sandwich norms, layer_scalar, q/k/v norms, scaling 1.0, GELU-tanh"
             + (", k_eq_v" if g.attention_k_eq_v else "") + "); own √hidden-scaled embedding; "
             + (f"logits softcapped at {g.final_logit_softcapping:g}" if g.final_logit_softcapping else "no softcap"))
    return words + "".join(f"; {note}" for note in g.notes)


def census_json(c: Any, receipts: Any) -> dict:
    cfg, r = c.config, c.rope
    return {
        "path": str(c.path),
        "kind": c.kind,
        "strategy_dspark": c.strategy_dspark,
        "exporter": cfg.exporter,
        "architectures": list(cfg.architectures),
        "checkpoint": {"format": c.checkpoint_format, "files": [str(f) for f in c.files]},
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "target_layer_ids_defaulted": cfg.target_layer_ids_defaulted,
        "n_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "backbone": cfg.backbone,
        "gemma4": None if cfg.gemma4 is None else {
            "attention_k_eq_v": cfg.gemma4.attention_k_eq_v,
            "final_logit_softcapping": cfg.gemma4.final_logit_softcapping, "notes": list(cfg.gemma4.notes)},
        "markov": None if c.markov is None else {"rank": c.markov.rank, "type": c.markov.type},
        "confidence": None if c.confidence is None else {"in_dim": c.confidence.in_dim, "with_markov": c.confidence.with_markov},
        "rope": {
            "type": r.type, "theta": r.theta, "factor": r.factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
            "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "mscale": r.mscale,
            "divisors": list(r.divisors) if r.divisors else None,
            **({"low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor}
               if r.type == "llama3" else {}),
            **({"partial_rotary_factor": r.partial_rotary_factor} if r.type == "proportional" else {}),
        },
        "layers": [
            {"index": l.index, "attention": l.attention, "window": l.window, "causal_in_block": l.causal_in_block, "rule": l.rule}
            for l in c.layers
        ],
        "own_embed_tokens": c.own_embed_tokens,
        "own_lm_head": c.own_lm_head,
        "n_tensors": len(c.tensors),
        "unknown_tensors": list(c.unknown_tensors),
        "n_params": c.n_params,
        "n_bytes": c.n_bytes,
        "warnings": list(c.warnings),
        "receipts": receipts.as_json(),
        "receipt_lines": receipts.lines(),
    }


def stream_out(text: str) -> None:
    """Generated text, as it commits (stdout, flushed, no markup)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def generate_summary(mode: str, s: dict) -> None:
    """The final stats line of `memra generate` (stderr, so stdout stays the text)."""
    phases = " ".join(f"{k}={v:.1f}" for k, v in s["phase_ms"].items())
    tok_s = f"{s['tok_per_s']:.1f}" if s["tok_per_s"] else "-"
    acceptance = "-" if s["acceptance"] is None else f"{s['acceptance']:.3f}"
    err_console.print(
        f"[{mode}] tokens={s['tokens']} rounds={s['rounds']} tau={s['tau']:.2f} "
        f"acceptance={acceptance} tok/s={tok_s} phase_ms: {phases}",
        markup=False, highlight=False, soft_wrap=unwrapped(err_console),
    )

"""Prompt text <-> token ids with the target directory's own tokenizer (`tokenizers`), and its
chat template (jinja2) for `--chat`: tokenizer_config.json's `chat_template` (a string, or the
named list whose "default" entry is used), else a `chat_template.jinja` file; plus the
incremental decoder that streams text."""

from __future__ import annotations

import json
from pathlib import Path

from memra_cli.engine.errors import ConfigError, PromptError

# the variables chat templates switch reasoning with: Qwen3 / Qwen3.5 / GLM-4.5 `enable_thinking`,
# DeepSeek-V3.1 `thinking` (each template's own name is what it is passed as)
THINKING_SWITCHES = ("enable_thinking", "thinking")


class TextCodec:
    """tokenizer.json (+ tokenizer_config.json's chat_template) of a model directory."""

    def __init__(self, directory: Path):
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no tokenizer.json (use --prompt-ids, or a target directory with a tokenizer)")
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise ConfigError(f"{path}: not a readable tokenizers file ({str(exc).splitlines()[0]})") from None
        self.template, self.cfg_path = None, directory / "tokenizer_config.json"
        if self.cfg_path.is_file():
            try:
                template = json.loads(self.cfg_path.read_text()).get("chat_template")
            except ValueError:
                raise ConfigError(f"{self.cfg_path}: not valid JSON") from None
            if isinstance(template, list):  # named templates (transformers' format): the default one
                template = next((t.get("template") for t in template
                                 if isinstance(t, dict) and t.get("name") == "default"), None)
            self.template = template
        jinja = directory / "chat_template.jinja"  # where newer exports (Qwen3.5's included) keep it
        if self.template is None and jinja.is_file():
            self.template, self.cfg_path = jinja.read_text(encoding="utf-8"), jinja

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            text = self.apply_chat_template(text)
        return self.tok.encode(text, add_special_tokens=False).ids

    def check_chat(self) -> None:
        """Refuse `--chat` up front when this directory has no chat template that renders."""
        self.apply_chat_template("")

    def apply_chat_template(self, user_text: str) -> str:
        """`--chat`: one user turn through the template, refused in lines that name the flag."""
        if not isinstance(self.template, str):
            where = self.cfg_path if self.cfg_path.is_file() else f"{self.cfg_path.parent} (no {self.cfg_path.name})"
            raise PromptError(f"--chat: the target has no chat template (no chat_template in {where}, nor a "
                              "chat_template.jinja beside it); --chat needs a target made for chat: drop it for a raw "
                              "code model such as the embedded one")
        try:
            return self.render_chat([{"role": "user", "content": user_text}])
        except PromptError as exc:
            raise PromptError(f"--chat: {exc}") from None

    def thinking_switch(self) -> str | None:
        """The variable this directory's chat template switches thinking with (the first of
        THINKING_SWITCHES it reads from outside), or None: no template, or one without a switch."""
        if not isinstance(self.template, str):
            return None
        import jinja2
        from jinja2 import meta

        try:
            names = meta.find_undeclared_variables(self._env().parse(self.template))
        except jinja2.TemplateSyntaxError as exc:
            raise PromptError(f"the chat template in {self.cfg_path} failed ({exc})") from None
        return next((name for name in THINKING_SWITCHES if name in names), None)

    def _env(self):
        import jinja2

        def raise_exception(message: str) -> None:  # what transformers gives templates to refuse with
            raise PromptError(f"the chat template in {self.cfg_path} refused: {message}")

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env

    def render_chat(self, messages: list[dict], variables: dict | None = None) -> str:
        """A conversation (`[{"role", "content"}]`) through the chat template, ready for the
        assistant's turn; `variables` are passed to the template too (a thinking switch). Needs a
        template (`self.template`); a template that refuses (its `raise_exception`) or fails is a
        PromptError."""
        import jinja2

        try:
            return self._env().from_string(self.template).render(messages=messages, add_generation_prompt=True,
                                                                 bos_token="", eos_token="", **(variables or {}))
        except jinja2.TemplateError as exc:
            raise PromptError(f"the chat template in {self.cfg_path} failed ({exc})") from None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


class StreamDecoder:
    """Turns a growing id list into printable text deltas (a token may end mid-character)."""

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.printed = codec, [], ""

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self.printed = text[len(self.printed):], text
        return delta

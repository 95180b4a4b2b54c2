"""Typed refusals.

Every error a user can cause derives from `MemraError`; its message is one line that names the
file, key or value at fault and what was expected. The CLI prints it as `error: <message>` and
exits non-zero; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping


class MemraError(Exception):
    """A refusal the user can act on (bad file, bad flag, unsupported variant)."""

    exit_code = 2


class ConfigError(MemraError):
    """config.json is missing, malformed, or holds a value we do not accept."""


class CheckpointError(MemraError):
    """A weights file is missing, truncated, corrupt, unsafe (pickle) or inconsistent."""


class CensusError(MemraError):
    """The checkpoint's tensors do not match what its config declares."""


class PolicyError(MemraError):
    """A setting is unknown or contradicts another (harvest, verify window, precision, ...);
    `SettingError` names which."""


class UnsupportedError(MemraError):
    """A real variant the engine recognizes but does not implement (refused by name)."""


class PromptError(MemraError):
    """A prompt / generation request the target cannot serve (empty, out of vocab, too long)."""


class SettingError(PolicyError):
    """A setting's value is refused. The engine names settings, never the flag or the variable
    that carried them (`step_width='x': ...`): only a front end knows how a value was given, and
    words it itself through `render(label)` (`flag_message(flag)` for a plain flag).

    A message that names several settings (a contradiction), or names one inside its sentence,
    passes `settings`: every setting it names, mapped to its value. `detail` is then the whole
    message, with `{name}` where setting `name` goes (`{vt} together with {adapt} is
    contradictory`) and `{name=value}` for the same setting with another value (a suggestion:
    `use {spec=dspark}`). `flag_text` is the whole message as a front end with flags words it;
    it may hold the same placeholders.
    """

    def __init__(self, setting: str, value: object, detail: str, *, quote: bool = True,
                 flag_text: str | None = None, settings: Mapping[str, object] | None = None):
        self.setting, self.value, self.detail = setting, value, detail
        self.quote = quote
        self.value_text = repr(value) if quote else str(value)
        self.flag_text = flag_text
        self.settings = dict(settings) if settings is not None else None
        if self.settings is not None:
            self.settings.setdefault(setting, value)
        super().__init__(self.render(self.engine_label))

    def engine_label(self, name: str, value: object) -> str:
        """How the engine names a setting: `step_width='x'`."""
        return f"{name}={value!r}" if self.quote else f"{name}={value}"

    def render(self, label: Callable[[str, object], str], *, front_end: bool = False) -> str:
        """The message with every setting written as `label(name, value)` says. A front end
        (`front_end=True`) gets `flag_text` when there is one."""
        template = self.flag_text if front_end and self.flag_text else self.detail
        if self.settings is None and not (front_end and self.flag_text):
            return f"{label(self.setting, self.value)}: {self.detail}"
        values = self.settings if self.settings is not None else {self.setting: self.value}

        def fill(m: re.Match) -> str:
            name, other = m.group(1), m.group(2)
            if name not in values:
                return m.group(0)
            return label(name, values[name] if other is None else other)

        return _PLACEHOLDER.sub(fill, template)

    def flag_message(self, flag: str) -> str:
        """The message with this setting named as flag `flag` (`--step-width 0: ...`)."""

        def label(name: str, value: object) -> str:
            if name != self.setting:
                return self.engine_label(name, value)
            return flag if value is True else f"{flag} {_plain(value)}"

        return self.render(label, front_end=True)


_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)(?:=([^{}]*))?\}")


def _plain(value: object) -> str:
    """A value as a user would type it (no quotes; booleans as 1/0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)

"""Typed refusals.

Every error a user can cause derives from `MemraError`; its message is one line that names the
file, key or value at fault and what was expected. The CLI prints it as `error: <message>` and
exits non-zero; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


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
    """A harvest / verify-window setting is unknown or contradicts another."""


class UnsupportedError(MemraError):
    """A real variant the engine recognizes but does not implement (refused by name)."""


class PromptError(MemraError):
    """A prompt / generation request the target cannot serve (empty, out of vocab, too long)."""


class SettingError(MemraError):
    """A setting's value is refused. The engine names the setting (`step_width='x': ...`); a
    front end that knows which flag or variable carried it may say that instead (`flag_message`).
    """

    def __init__(self, setting: str, value: object, detail: str, *, quote: bool = True,
                 flag_text: str | None = None):
        self.setting, self.value, self.detail = setting, value, detail
        self.value_text = repr(value) if quote else str(value)
        self.flag_text = flag_text  # the whole message as a front end with flags words it
        super().__init__(f"{setting}={self.value_text}: {detail}")

    def flag_message(self, flag: str) -> str:
        return self.flag_text or f"{flag} {self.value_text}: {self.detail}"

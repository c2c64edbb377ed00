"""The chat's settings and where each one came from: sampling (`/set`), the context-overflow policy, `/think`,
`/logprobs` and `/set schema`, and the sampling a turn runs with.

Sampling resolves CLI flag > `/set` > the session's saved settings > models.toml > defaults (the one rule of
`settings.resolve_sampling`). Per-session values live in `Session.settings`, so every method takes the
session it applies to; what is not per session (the flags, the schema) lives here.
"""

from __future__ import annotations

import codecs
import json

from pagedchat.chat import alternatives
from pagedchat.chat.session import Session
from pagedchat.engine.core.sampling_params import SETTING_KEYS, SETTING_TYPES
from pagedchat.errors import UserError
from pagedchat.settings import OVERFLOW_POLICIES, SamplingOptions, check_overflow, resolve_sampling

SET_KEYS = SETTING_KEYS     # /set takes exactly the sampling settings SamplingParams declares (and speculate, schema)
CHAT_KEYS = {"context_overflow": OVERFLOW_POLICIES}   # /set keys of the chat itself, not of sampling
ALL_SET_KEYS = (*SET_KEYS, *CHAT_KEYS)
THINK_MODES = ("show", "hide", "off")
FORK_TEMPERATURE = 0.8      # /fork and /regen at temperature 0 would only repeat the greedy reply


class ChatOptions:
    def __init__(self, entry, backend, templater, cli: SamplingOptions | None = None,
                 context_overflow: str | None = None, overflow_default: str = "stop"):
        self.entry, self.backend, self.templater = entry, backend, templater
        self.cli = cli or SamplingOptions()
        self.cli_overflow = check_overflow(context_overflow, "--context-overflow")
        self.overflow_default = overflow_default    # the REPL drops the oldest turns; `run --session` stops
        self.schema: tuple[str, object] | None = None   # (/set schema FILE, its GrammarSpec): replies follow it

    # -- sampling -------------------------------------------------------------------------------------------
    def sampling(self, s: Session, n: int = 1):
        """(SamplingParams, sources) for session `s`: CLI > /set > session > model > defaults."""
        set_now = {k: v for k, v in s.settings.items() if k in s.set_keys and k in SET_KEYS}
        from_file = {k: v for k, v in s.settings.items() if k not in s.set_keys and k in SET_KEYS}
        params, sources = resolve_sampling(self.entry, self.cli, {**set_now, "__source__": "/set"},
                                           {**from_file, "__source__": f"session {s.name}"})
        return params.with_(n=n), sources

    def turn_params(self, s: Session, n: int, vary: bool = False, beam_width: int = 0):
        """(SamplingParams, notes) for a turn. Variants (n > 1) and regenerations (vary) at temperature 0 would
        all be the same reply, so they sample at the model's own temperature (or FORK_TEMPERATURE) and say so."""
        self.apply_think(s)     # the session's /think decides what the template is asked
        params, _ = self.sampling(s, n)
        params = params.with_(grammar=self.schema[1] if self.schema else None,
                              logprobs=alternatives.TOP_ALTERNATIVES if self.logprobs_on(s) else None)
        notes = []
        if beam_width:    # deterministic (no temperature to raise); hypotheses carry scores, not alternatives
            return params.with_(n=1, beam_width=beam_width, logprobs=None), notes
        if (n > 1 or vary) and params.temperature == 0:
            lower = self.entry.sampling_defaults().get("temperature")
            temperature = lower.value if lower is not None and lower.value else FORK_TEMPERATURE
            params = params.with_(temperature=float(temperature))
            what = f"the {n} variants would be identical" if n > 1 else "/regen would repeat the same reply"
            notes.append(f"temperature is 0, so {what}: sampling at temperature {temperature:g}")
        return params, notes

    # -- /set -----------------------------------------------------------------------------------------------
    def set_option(self, s: Session, key: str, value: str) -> str:
        """`/set KEY VALUE`: validated like SamplingParams; `default` removes the override."""
        if key == "speculate":  # an engine setting, not a sampling one: it applies from the next turn
            self.backend.set_speculation(value.strip().lower())
            return f"speculate = {value.strip().lower()}"
        if key == "schema":     # a grammar for the replies, not a sampling setting
            return self.set_schema(value.strip())
        if key in CHAT_KEYS:
            return self._set_overflow(s, key, value)
        if key not in SET_KEYS:
            raise UserError(f"unknown setting {key!r}; keys: {', '.join(ALL_SET_KEYS)}, speculate, schema")
        if value.strip().lower() == "default":
            s.settings.pop(key, None)
            s.set_keys.discard(key)
            params, sources = self.sampling(s)
            return f"{key} = {_show(getattr(params, key))} (from {sources.get(key, 'built-in default')})"
        parsed = _parse_value(key, value)
        trial = dict(s.settings, **{key: parsed})
        resolve_sampling(self.entry, SamplingOptions(), trial)  # raises the SamplingParams message if invalid
        s.settings[key] = parsed
        s.set_keys.add(key)
        message = f"{key} = {_show(parsed)}"
        if key in self.cli.given():
            message += f" (but --{key.replace('_', '-')} {_show(self.cli.given()[key])} on the command line wins)"
        return message

    def _set_overflow(self, s: Session, key: str, value: str) -> str:
        value = value.strip().lower()
        if value == "default":
            s.settings.pop(key, None)
        else:
            s.settings[key] = check_overflow(value, key)
        policy, source = self.overflow_policy(s)
        message = f"{key} = {policy}" + (f" (from {source})" if value == "default" else "")
        if self.cli_overflow is not None and value != "default":
            message += f" (but --context-overflow {self.cli_overflow} on the command line wins)"
        return message

    def overflow_policy(self, s: Session) -> tuple[str, str]:
        """(policy, where it came from) for a branch that outgrows the context: CLI > /set or session >
        models.toml > this front end's default."""
        if self.cli_overflow is not None:
            return self.cli_overflow, "command-line flag"
        if "context_overflow" in s.settings:
            return s.settings["context_overflow"], f"session {s.name}"
        entry = self.entry.get("context_overflow")
        if entry.value is not None:
            return check_overflow(entry.value, f"context_overflow in {entry.source}"), entry.source
        return self.overflow_default, "default"

    def set_schema(self, path: str) -> str:
        """`/set schema FILE`: every reply is constrained to this JSON schema (checked now, so an unsupported
        one is refused here); `/set schema default` (or off) lifts it."""
        if path.lower() in ("default", "off"):
            self.schema = None
            return "schema off: replies are free text"
        from pagedchat.engine.core.grammar import GrammarSpec

        spec = GrammarSpec.from_schema_file(path)
        self.backend.check_grammar(spec)
        self.schema = (path, spec)
        return f"schema = {path}: every reply is JSON valid for it"

    # -- /think ---------------------------------------------------------------------------------------------
    def think_mode(self, s: Session) -> str:
        """/think: show (reasoning in full), hide (collapsed to one line once done; the default) or off (the
        template is asked not to think, where it takes enable_thinking)."""
        return s.settings.get("think", "hide")

    def set_think(self, s: Session, mode: str) -> str:
        if mode not in THINK_MODES:
            raise UserError(f"usage: /think {'|'.join(THINK_MODES)}")
        s.settings["think"] = mode
        self.apply_think(s)
        if mode == "off" and not self.templater.takes("enable_thinking"):
            return ("think off: this model's template has no enable_thinking switch, so replies may still "
                    "reason; their reasoning is collapsed")
        return {"show": "reasoning is shown in full", "hide": "reasoning is collapsed to one line once done",
                "off": "the template is asked not to think (enable_thinking false)"}[mode]

    def apply_think(self, s: Session) -> None:
        """off passes enable_thinking=False to the template; show/hide leave the template its own default."""
        if self.think_mode(s) == "off":
            self.templater.kwargs["enable_thinking"] = False
        else:
            self.templater.kwargs.pop("enable_thinking", None)
            self.templater.kwargs.update(self.entry.table.get("chat_template_kwargs") or {})

    # -- /logprobs ------------------------------------------------------------------------------------------
    def logprobs_on(self, s: Session) -> bool:
        return bool(s.settings.get("logprobs", False))

    def set_logprobs(self, s: Session, mode: str) -> str:
        """`/logprobs on|off`: replies from now on keep their tokens' alternatives (stored in the session)."""
        if mode not in ("on", "off"):
            raise UserError("usage: /logprobs on|off (/logprobs alone lists the head reply's alternatives)")
        if mode == "on" and self.backend.describe() is not None:
            raise UserError("/logprobs needs the local engine (the alternatives of each token): not available "
                            "with --server")
        s.settings["logprobs"] = mode == "on"
        if mode == "off":
            return "logprobs off: new replies keep no alternatives (stored ones stay)"
        return (f"logprobs on: each reply shows where the model hesitated, with up to "
                f"{alternatives.TOP_ALTERNATIVES - 1} alternatives; /branch INDEX ALT continues from one")


def _parse_value(key: str, value: str):
    kind = SETTING_TYPES[key]
    value = value.strip()
    if kind is list:
        if value.lower() == "none":
            return []
        if value.startswith("["):
            try:
                items = json.loads(value)
            except ValueError:
                raise UserError('stop: give one string, or a JSON list like ["\\n\\n", "User:"]') from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise UserError("stop: the JSON list must hold strings")
            return items
        return [codecs.decode(value, "unicode_escape") if "\\" in value and value.isascii() else value]
    try:
        return kind(value)
    except ValueError:
        raise UserError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (list, str)) else str(value)

"""Tool calls: the request's tools go to the model's chat template; the reply is parsed back per model family.

Families, told apart by what the chat template writes (so a template is the single source of truth):
- "hermes" (Qwen 2.5/3, Hermes, most ChatML tool templates): `<tool_call>{"name", "arguments"}</tool_call>`,
  one block per call, after optional text.
- "mistral": `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}.
- "llama3" (Llama 3.1+ JSON tool calling): the whole reply is `{"name", "parameters"}` (several separated by
  `;`), optionally after `<|python_tag|>`.
With tool_choice "required" or a named function the reply is grammar-constrained to that family's format with
each call's arguments matching the tool's JSON schema, so it always parses; with "auto" it is parsed if it
looks like a call and is plain content otherwise.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedchat.engine.core.grammar import GrammarSpec
from pagedchat.serve.protocol import APIError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def family_of(template: str | None) -> str:
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


# -- request side -----------------------------------------------------------------------------------------------
def checked_tools(tools: list | None) -> list[dict]:
    """The request's tools, each {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    out = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        out.append(tool)
    return out


def chosen_tools(tools: list[dict], tool_choice) -> tuple[list[dict], bool]:
    """(the tools the reply may call, must it call one). tool_choice: none | auto | required | a function."""
    if tool_choice in (None, "auto"):
        return tools, False
    if tool_choice == "none":
        return [], False
    if tool_choice == "required":
        if not tools:
            raise APIError(400, "tool_choice \"required\" needs tools", param="tool_choice")
        return tools, True
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    match = [t for t in tools if t["function"]["name"] == name]
    if not match:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return match, True


def call_grammar(tools: list[dict], family: str, parallel: bool) -> GrammarSpec:
    """A Lark grammar for one (or, with parallel calls, several) calls in the family's format, each call's
    arguments matching its tool's parameter schema."""
    key = "parameters" if family == "llama3" else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  key: t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = {"anyOf": options} if len(options) > 1 else options[0]
    call = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})   # compact, as in json_schema
    if family == "mistral":
        many = '"[" call ("," call)* "]"' if parallel else '"[" call "]"'
        body = f'start: "[TOOL_CALLS]" {many}'
    elif family == "llama3":
        body = 'start: call (";" call)*' if parallel else "start: call"
    else:
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        body = f"start: {block} (\"\\n\" {block})*" if parallel else f"start: {block}"
    return GrammarSpec("lark", f"{body}\ncall: %json {call}\n")


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI assistant tool_calls carry arguments as JSON text; chat templates expect a mapping."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                function = dict(c.get("function") or {})
                try:
                    function["arguments"] = json.loads(function.get("arguments") or "{}")
                except (TypeError, ValueError):
                    pass
                calls.append({**c, "function": function})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# -- reply side -------------------------------------------------------------------------------------------------
def parse_reply(text: str, family: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished reply; no calls when it does not parse as the family's format."""
    if family == "hermes":
        calls = [_call(json.loads(m)) for m in _HERMES.findall(text) if _is_json(m)]
        if calls and all(calls):
            return text[:text.index("<tool_call>")].strip() or None, calls
    elif family == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if marker and _is_json(rest.strip()):
            items = json.loads(rest.strip())
            calls = [_call(item) for item in (items if isinstance(items, list) else [items])]
            if calls and all(calls):
                return head.strip() or None, calls
    else:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        parts = [p for p in body.split(";") if p.strip()]
        if parts and all(_is_json(p) for p in parts):
            calls = [_call(json.loads(p)) for p in parts]
            if all(calls):
                return None, calls
    return text, []


def holds_back(text: str, family: str) -> int:
    """Where streamed content must stop: from the start of what is (or could become) a tool call on."""
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(family)
    if marker is None:   # llama3: a call is the whole reply, so it is known only at the end
        return 0 if text.lstrip()[:1] in ("{", "<") or not text.strip() else len(text)
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):   # a partial marker at the end
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class CallStream:
    """One choice's tool calls while they are generated, as OpenAI streams them: a call's index, id and name
    as soon as its name is complete, then its arguments' JSON text piece by piece as tokens arrive.

    It reads calls written name first (`{"name": ..., "arguments"|"parameters": {...}}`: what the family
    templates ask for and what the call grammar generates); anything else stops it, and the calls it has not
    streamed are sent whole when the reply ends (`rest`)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls: list[ToolCall] = []      # begun, in order: call i is index i
        self.args: list[str] = []            # the arguments text streamed of each
        self.pos = 0                         # where the next call may start in the held text
        self.scan: _JsonScan | None = None   # the arguments value being streamed
        self.stopped = False

    def feed(self, text: str) -> list[dict]:
        """`text`: all the held tool-call text so far (it only grows). Returns the deltas it adds."""
        deltas = []
        while not self.stopped:
            if self.scan is None:
                if self.calls and not self.parallel:
                    break
                start = text.find("{", self.pos)
                if start < 0:
                    break
                state, name, end = _call_head(text, start)
                if state == "partial":
                    break
                if state == "no":
                    self.stopped = True
                    break
                self.calls.append(ToolCall(name, ""))
                self.args.append("")
                deltas.append({"index": len(self.calls) - 1, "id": self.calls[-1].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self.scan = _JsonScan(end)
            piece, done = self.scan.advance(text)
            if piece:
                self.args[-1] += piece
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            if not done:
                break
            self.calls[-1].arguments, self.pos, self.scan = self.args[-1], self.scan.pos, None
        return deltas

    def rest(self, calls: list[ToolCall]) -> tuple[list[ToolCall], bool]:
        """(the finished reply's calls not streamed yet, was every streamed call one of them): the final
        parse decides; a streamed call it does not confirm (a reply cut inside it) stays as sent."""
        done = len(self.calls) if self.scan is None else len(self.calls) - 1
        confirmed = all(i < len(calls) and calls[i].name == c.name and _same_json(calls[i].arguments, c.arguments)
                        for i, c in enumerate(self.calls[:done]))
        for call, streamed in zip(calls, self.calls):
            call.id = streamed.id
        return calls[len(self.calls):], confirmed


class _JsonScan:
    """Finds where a JSON object or array that starts at `pos` ends, reading the text as it grows."""

    def __init__(self, pos: int):
        self.pos = pos
        self.depth, self.in_string, self.escaped = 0, False, False

    def advance(self, text: str) -> tuple[str, bool]:
        """(the value's text added since the last call, has the value ended)."""
        begin = self.pos
        while self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return text[begin:self.pos], True
        return text[begin:self.pos], False


def _call_head(text: str, at: int) -> tuple[str, str, int]:
    """Reads `{"name": "N", "arguments": ` (or "parameters") from the `{` at `at`: ("ok", N, where the
    arguments value starts), ("partial", "", 0) while the text so far could still become one, else ("no", ...)."""
    pos, name = at + 1, ""
    for expect in ('"name"', ":", "string", ",", ('"arguments"', '"parameters"'), ":", "value"):
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        rest = text[pos:]
        if expect == "string":
            end = _string_end(text, pos) if rest[:1] == '"' else -1
            if end is None:
                return "partial", "", 0
            if end < 0:
                return ("partial" if not rest else "no"), "", 0
            name, pos = json.loads(text[pos:end]), end
        elif expect == "value":
            if not rest:
                return "partial", "", 0
            return ("ok", name, pos) if rest[0] in "{[" else ("no", "", 0)
        else:
            words = expect if isinstance(expect, tuple) else (expect,)
            word = next((w for w in words if rest.startswith(w)), None)
            if word is None:
                return ("partial" if any(w.startswith(rest) for w in words) else "no"), "", 0
            pos += len(word)
    raise AssertionError("unreachable")


def _string_end(text: str, start: int) -> int | None:
    """Just past the JSON string whose quote is at `start`, or None if it has not ended yet."""
    escaped = False
    for p in range(start + 1, len(text)):
        if escaped:
            escaped = False
        elif text[p] == "\\":
            escaped = True
        elif text[p] == '"':
            return p + 1
    return None


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _call(item) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True

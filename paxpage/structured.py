"""Structured outputs: what a request asks its text to match, as an llguidance grammar.

`StructuredOutputs` is the user-facing spec (vLLM's `structured_outputs` / `guided_*` options):
exactly one of a JSON schema, any JSON object, a regex, a list of choices or a Lark grammar. It
is frozen and hashable (a schema dict is kept as compact JSON text) and validates itself at
construction, so a bad spec fails with ValueError before a request reaches the engine. The
per-token machinery (matchers, bitmasks) is in structured_backend.py.

llguidance compiles all five kinds to one grammar format: JSON schemas and regexes become
lexer-level rules, Lark grammars its own CFG, choices a Lark alternation of string literals.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from paxpage.structured_regex import ascii_classes

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one field set. A dict passed to SamplingParams(structured_outputs=...) is read
    as these keyword arguments."""

    json_schema: str | Mapping[str, Any] | None = None  # normalised to compact JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output must match (re.fullmatch semantics)
    choice: Sequence[str] | None = None  # normalised to tuple[str, ...]
    grammar: str | None = None  # Lark (llguidance dialect) or GBNF
    # regex only: \d \w \s are ASCII (0-9, [0-9A-Za-z_], [\t\n\v\f\r ]) unless this is True,
    # which gives them Rust's Unicode meaning (structured_regex.py says why ASCII is the default)
    unicode_regex: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.json_schema is not None:
            set_("json_schema", _schema_text(self.json_schema))
        for name in ("json_object", "unicode_regex"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {value!r} ({type(value).__name__})")
            if value == "":
                raise ValueError(f"{name} must not be empty")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise TypeError(f"choice must be a list of str, got {self.choice!r}")
            if not self.choice:
                raise ValueError("choice must list at least one string")
            for c in self.choice:
                if not isinstance(c, str):
                    raise TypeError(f"choice must contain only str, got {c!r} in {list(self.choice)!r}")
                if not c:
                    raise ValueError(f"choice must not contain empty strings, got {list(self.choice)!r}")
            set_("choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(KINDS)}, got "
                             f"{given or 'none'}")
        if self.unicode_regex and self.regex is None:
            raise ValueError(f"unicode_regex applies to a regex constraint only, not to {given[0]}")
        message = _validate(self.to_grammar())
        if message:
            raise ValueError(f"structured_outputs {self.kind} is invalid: {message.strip()}")

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputs | None:
        """None, a StructuredOutputs or a dict of its fields -> StructuredOutputs | None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            names = (*KINDS, "unicode_regex")
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise TypeError(f"unknown structured_outputs field(s) {unknown}; valid names are "
                                f"{list(names)}")
            return cls(**value)
        raise TypeError(f"structured_outputs must be a StructuredOutputs, a dict or None, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON grammar format) for this spec."""
        from llguidance import LLMatcher, grammar_from

        if self.json_schema is not None:
            return LLMatcher.grammar_from_json_schema(self.json_schema)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex if self.unicode_regex else ascii_classes(self.regex))
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        try:  # Lark, or GBNF converted to Lark
            return grammar_from("grammar", self.grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs grammar is invalid: {e}") from None


def _schema_text(schema: Any) -> str:
    """A JSON schema (dict or JSON text) -> compact JSON text, rejecting what is no object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs json_schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):  # true / false are valid JSON schemas, but not useful ones
        raise ValueError(f"structured_outputs json_schema must be a JSON object, got {schema!r}")
    if not isinstance(schema, Mapping):
        raise TypeError(f"json_schema must be a dict or a JSON string, got {schema!r:.80}")
    try:
        # key order kept: llguidance emits properties in the order the schema lists them
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise TypeError(f"json_schema is not JSON-serialisable: {e}") from None


def _validate(grammar: str) -> str:
    """'' when llguidance accepts the grammar, else its error message."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)

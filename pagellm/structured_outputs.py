"""A request's constraint on its output text (vLLM's ``structured_outputs``), as ``SamplingParams`` carries it (no
grammar library here: ``sample/structured.py`` compiles it where the tokens are sampled)."""

from __future__ import annotations

import msgspec


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Exactly one constraint on the output text (vLLM's ``structured_outputs``).

    ``json`` is a JSON schema (a dict or its JSON text); ``json_object`` asks for any JSON object; ``regex`` a
    regular expression the whole output matches; ``choice`` one of the listed strings; ``grammar`` an EBNF
    grammar (xgrammar's dialect, GBNF-like, with a ``root`` rule); ``structural_tag`` (a dict or its JSON text)
    leaves the output free except between tags: ``{"structures": [{"begin": "<f>", "schema": {...}, "end": "</f>"}],
    "triggers": ["<f"]}`` (vLLM's form) or xgrammar's own ``{"type": "structural_tag", "format": {...}}``.

    ``begin_after`` (ours) holds the constraint back until the output contains these token ids: the tokens up to and
    including them are free, the rest follow the constraint. The server sets it to ``</think>`` for a reasoning
    model, which thinks first and then answers in the schema (vLLM does the same inside its reasoning backend).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None
    begin_after: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar or "
                             f"structural_tag; got {given or 'none'}.")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.begin_after is not None and (not self.begin_after or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.begin_after)):
            raise ValueError("structured_outputs.begin_after must be a non-empty list of token ids.")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar (the compile cache's key)."""
        import json as _json

        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        if self.structural_tag is not None:
            tag = self.structural_tag
            return "structural_tag", tag if isinstance(tag, str) else _json.dumps(tag, sort_keys=True)
        return "grammar", self.grammar or ""

"""StructuredOutputsParams -> an llguidance grammar (its JSON text). No tokenizer needed here;
the grammar is checked when the engine compiles it against its tokenizer (manager.py)."""
from __future__ import annotations

import json

from jaxbatch.sampling_params import StructuredOutputsParams


def _llmatcher():
    """llguidance, imported when a grammar is first built: an engine that never sees one (and
    the GPU check's bare machine, which lacks the package) runs without it."""
    from llguidance import LLMatcher
    return LLMatcher

# No free whitespace and compact separators: with llguidance's flexible default (like vLLM's) a
# small model at temperature 1 can emit newlines between tokens until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def json_schema_grammar(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    return _llmatcher().grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def choice_grammar(choices: list[str]) -> str:
    # JSON string literals are Lark string literals (same escapes).
    return _llmatcher().grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def grammar_for(p: StructuredOutputsParams) -> str:
    if p.json is not None:
        return json_schema_grammar(p.json)
    if p.json_object:
        return json_schema_grammar({"type": "object"})
    if p.regex is not None:
        return _llmatcher().grammar_from_regex(p.regex)
    if p.choice is not None:
        return choice_grammar(list(p.choice))
    return _llmatcher().grammar_from_lark(p.grammar)

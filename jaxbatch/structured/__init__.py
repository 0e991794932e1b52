"""Structured outputs: grammars (JSON schema, regex, choice, Lark) compiled by llguidance and
matched per sequence on the host; the sampler applies the packed bitmask they fill
(jaxbatch/worker/sampler.py). Host side, no JAX."""
from jaxbatch.structured.grammar import grammar_for, json_schema_grammar
from jaxbatch.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager", "grammar_for", "json_schema_grammar"]

"""Reasoning models: where a thought (`<think> ... </think>`) ends and the answer begins, in
text (the thought goes to `reasoning`, the rest stays `text`) and in tokens (a grammar starts
after the thought). Host side, no JAX."""
from jaxbatch.reasoning.parser import (REASONING_PARSERS, Phase, ReasoningParser,
                                       get_reasoning_parser)
from jaxbatch.reasoning.split import ReasoningSplit

__all__ = ["REASONING_PARSERS", "Phase", "ReasoningParser", "ReasoningSplit",
           "get_reasoning_parser"]

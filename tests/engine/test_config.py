"""One option list: EngineConfig's fields are exactly the engine flags of `jaxbatch serve`, with
the same defaults, and exactly the rows of the README's option table; bad values are refused
by name before anything loads."""
from __future__ import annotations

import argparse
import pathlib

import pytest

from jaxbatch.engine.config import (OPTIONS, EngineConfig, engine_kwargs_from_args, flag_name,
                                    options_markdown)
from jaxbatch.entrypoints.cli import _parser

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_option_is_a_serve_flag_with_the_same_default():
    serve = _serve_parser()
    by_dest = {a.dest: a for a in serve._actions}
    for name, field in OPTIONS.items():
        assert name in by_dest, f"option {name} has no serve flag"
        action = by_dest[name]
        if not field.metadata["positional"]:
            assert flag_name(name) in action.option_strings, (name, action.option_strings)
        assert action.default == field.default, (name, action.default, field.default)
    assert engine_kwargs_from_args(_parser().parse_args(["serve"])) == EngineConfig().as_kwargs()


def test_every_engine_looking_serve_flag_is_an_option():
    # The serve command's own flags (HTTP, limits, shutdown); anything else must be an option.
    server_only = {"help", "host", "port", "served_model_name", "max_num_queued_reqs", "api_key",
                   "shutdown_timeout", "log_level", "max_prompts_per_request",
                   "max_request_body_bytes", "max_concurrent_requests", "timeout_header_read",
                   "timeout_keep_alive", "trust_request_chat_template",
                   "enable_auto_tool_choice", "tool_call_parser", "lora_modules"}
    dests = {a.dest for a in _serve_parser()._actions}
    assert dests - set(OPTIONS) - server_only == set()


def test_flags_reach_the_options():
    args = _parser().parse_args(["serve", "some/dir", "--max-num-seqs", "4", "--no-warmup",
                                 "--kv-cache-dtype", "int8", "--speculative-config",
                                 '{"method": "ngram"}'])
    kw = engine_kwargs_from_args(args)
    assert (kw["model"], kw["max_num_seqs"], kw["warmup"], kw["kv_cache_dtype"]) == (
        "some/dir", 4, False, "int8")
    assert kw["speculative_config"] == {"method": "ngram"}


def test_the_readme_table_is_the_generated_one():
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- options:begin -->")[1].split("<!-- options:end -->")[0].strip()
    assert table == options_markdown(), "regenerate the README table from options_markdown()"


@pytest.mark.parametrize("kwargs, words", [
    (dict(block_size=0), "block_size=0 must be a positive integer"),
    (dict(max_num_seqs="4"), "max_num_seqs='4' must be a positive integer"),
    (dict(warmup="yes"), "warmup='yes' must be True or False"),
    (dict(scheduling_policy="lifo"), "scheduling_policy='lifo'; choose one of"),
    (dict(seed=-1), "seed=-1 must be >= 0"),
])
def test_bad_values_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_options_are_refused():
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_kwargs(max_num_seq=4)


def test_serve_refuses_a_bad_option_value_before_loading(capsys):
    from jaxbatch.entrypoints.cli import main
    assert main(["serve", "--scheduling-policy", "fcfs", "--speculative-config",
                 '{"method": "medusa"}', "--port", "0"]) == 2
    assert "speculative_config" in capsys.readouterr().err

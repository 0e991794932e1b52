"""Every engine kind takes `lora_request` and the adapter calls (issue 54), so callers never
pass it conditionally and the server never reaches into an engine's LoRA manager; what one
thread or process asks of an engine travels as small frozen records, not tuples."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import pickle

import pytest

from jaxbatch import LoRARequest, SamplingParams
from jaxbatch.engine.commands import AbortRequest, AddRequest, ResetPrefixCache
from jaxbatch.engine.data_parallel import DataParallelEngine
from jaxbatch.engine.interface import EngineBase, EngineClient
from jaxbatch.engine.llm_engine import LLMEngine
from jaxbatch.engine.multihost import MultiHostEngine, Release, Stop

ADAPTER_CALLS = ("add_lora", "remove_lora", "list_loras")


@pytest.mark.parametrize("kind", [LLMEngine, DataParallelEngine, MultiHostEngine])
def test_every_engine_kind_takes_lora_request_and_the_adapter_calls(kind):
    for method in ("add_request", "validate_request"):
        assert "lora_request" in inspect.signature(getattr(kind, method)).parameters, method
    for method in ADAPTER_CALLS:
        assert callable(getattr(kind, method))
    for member in ADAPTER_CALLS:
        assert member in dir(EngineClient)


def test_an_engine_without_lora_refuses_adapter_calls():
    engine = EngineBase()
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_lora(LoRARequest("a", 1, "/x"))
    with pytest.raises(ValueError, match="enable_lora"):
        engine.remove_lora("a")
    assert engine.list_loras() == set()


class RecordingEngine:
    def __init__(self):
        self.calls = []

    def add_request(self, *args, **kwargs):
        self.calls.append(("add", args, kwargs))

    def abort_request(self, request_id):
        self.calls.append(("abort", request_id))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))
        return True


def test_the_server_loads_and_unloads_adapters_through_the_engine_client():
    from jaxbatch.entrypoints.openai.lora_routes import LoRARegistry
    done = []

    class Engine:          # only EngineClient's adapter calls: no LoRA manager to reach into
        def add_lora(self, request):
            done.append(("add", request.lora_name))
            return True

        def remove_lora(self, name):
            done.append(("remove", name))
            return True

    class FakeLLM:
        async def call(self, fn):
            return fn(Engine())
    registry = LoRARegistry("base", True, {"a": "/peft/a"})
    registry.check_at_start(Engine())
    asyncio.run(registry.load(FakeLLM(), "b", "/peft/b"))
    asyncio.run(registry.unload(FakeLLM(), "a"))
    assert done == [("add", "a"), ("add", "b"), ("remove", "a")]


def test_multi_process_commands_are_frozen_records_that_replay_alike():
    leader_engine, follower_engine = RecordingEngine(), RecordingEngine()
    leader = MultiHostEngine.__new__(MultiHostEngine)        # (no jax.distributed here)
    leader.engine, leader.is_leader, leader._commands = leader_engine, True, []
    lora = LoRARequest("a", 1, "/peft/a")
    params = SamplingParams(max_tokens=3)
    leader.add_request("r", [1, 2, 3], params, 0, 5.0, lora_request=lora)
    leader.abort_request("r")
    leader._commands.append(ResetPrefixCache())
    commands = leader._commands
    assert commands == [AddRequest("r", [1, 2, 3], params, 0, 5.0, lora), AbortRequest("r"),
                        ResetPrefixCache()]
    for command in commands + [Release(), Stop()]:
        assert dataclasses.is_dataclass(command) and not isinstance(command, tuple)
        with pytest.raises(dataclasses.FrozenInstanceError):
            command.request_id = "other"
    for command in pickle.loads(pickle.dumps(commands)):      # what a follower receives
        command.apply(follower_engine)
    assert follower_engine.calls[0] == leader_engine.calls[0]
    assert follower_engine.calls[0][2]["lora_request"] == lora
    assert follower_engine.calls[1:] == [("abort", "r"), ("reset",)]


def test_the_engine_thread_receives_records_and_passes_lora_request_always():
    from jaxbatch.entrypoints.async_llm import AsyncLLM, EngineCall
    engine = RecordingEngine()
    engine.has_unfinished_requests = lambda: False
    engine.step = lambda: []
    engine.stats = lambda: {}
    engine.tokenizer = None

    async def main():
        llm = AsyncLLM(lambda: engine)
        llm.start()
        while llm.engine is None:
            await asyncio.sleep(0.01)
        stream = await llm.add_request("r", [1, 2], SamplingParams(max_tokens=2))
        assert await llm.call(lambda e: e is engine)
        llm.reset_prefix_cache()
        stream.abort()
        kinds = {type(c) for c in llm._commands}
        assert kinds <= {AddRequest, AbortRequest, ResetPrefixCache, EngineCall}
        await llm.shutdown()
    asyncio.run(main())
    add = engine.calls[0]
    assert add[0] == "add" and add[2]["lora_request"] is None

"""One engine over several processes (hosts) joined by `jax.distributed`.

Every process builds the same LLMEngine over the global mesh (its devices are a slice of every
process's) and runs the same compiled step: JAX is multi-controller, each process dispatches
the program for its own devices and the collectives meet across processes. What must agree is
the host side: every process has to make the same schedule, step after step, or the programs
diverge (and hang in a collective). The scheduler is deterministic given the same requests
added and aborted in the same order between the same steps, so:

    process 0 (leader)   owns the request queue: add_request / abort_request apply to its
                         engine at once and are recorded; each step() first broadcasts the
                         recorded commands, then steps
    processes 1.. (followers)  loop in `follow()`: receive the step's commands, apply them in
                         the same order (with the leader's arrival times), step

Sampled tokens are replicated, so each process reads its own copy and updates its scheduler
the same way; only the leader hands outputs to callers. The broadcast is JAX's own
(`multihost_utils.broadcast_one_to_all`): the pickled commands as a byte array.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import signal
import threading
import time

import jax
import numpy as np

from jaxbatch.engine.commands import AbortRequest, AddRequest, ResetPrefixCache
from jaxbatch.engine.interface import EngineBase

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Release:
    """The leader left its step loop (LLM.generate returned): followers return."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """The leader is shutting down: followers return and do not come back."""


def initialize(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize`, before anything touches a device. Idempotent."""
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if coordinator_address is None:
        raise ValueError("num_processes > 1 needs coordinator_address='HOST:PORT' (process 0's)")
    if jax.distributed.is_initialized():
        return
    # jax.distributed's preemption notifier takes SIGTERM over (in C++), after which a SIGTERM
    # is only logged: the server would never drain and a script never stop. Python's handler
    # goes back (which only the main thread may do; `jaxbatch serve` initializes there first).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    if main_thread:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _broadcast(payload: bytes | None) -> bytes:
    """The leader's bytes, on every process: the length, then the bytes padded to a power of
    two (each padded size compiles its broadcast once)."""
    from jax.experimental import multihost_utils
    is_leader = jax.process_index() == 0
    size = np.array([len(payload) if is_leader else 0], np.int64)
    size = int(multihost_utils.broadcast_one_to_all(size)[0])
    padded = 1 << max(6, (size - 1).bit_length())
    buf = np.zeros(padded, np.uint8)
    if is_leader:
        buf[:size] = np.frombuffer(payload, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf))[:size].tobytes()


class MultiHostEngine(EngineBase):
    """The engine interface over this process's engine; see the module doc."""

    def __init__(self, engine):
        self.engine = engine
        self.is_leader = jax.process_index() == 0
        self._commands: list[AddRequest | AbortRequest | ResetPrefixCache] = []
        self.tokenizer, self.model_config, self.config = (engine.tokenizer, engine.model_config,
                                                          engine.config)
        self.eos_token_ids = engine.eos_token_ids

    # Questions every process can answer alike.
    def validate_request(self, request_id, prompt, params=None, priority: int = 0,
                         lora_request=None):
        return self.engine.validate_request(request_id, prompt, params, priority, lora_request)

    def has_pending_outputs(self) -> bool:
        return self.engine.has_pending_outputs()

    def get_num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def cached_prefix_tokens(self, prompt_token_ids, params) -> int:
        return self.engine.cached_prefix_tokens(prompt_token_ids, params)

    def warmup(self) -> float:
        return self.engine.warmup()

    def prepare_for_serving(self) -> None:
        self.engine.prepare_for_serving()

    def stats(self) -> dict:
        return self.engine.stats()

    # ---- leader: requests ------------------------------------------------------------------
    def _leader_only(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"{what}: only process 0 takes requests; process "
                               f"{jax.process_index()} follows it (MultiHostEngine.follow)")

    def add_request(self, request_id, prompt, params=None, priority: int = 0,
                    arrival_time: float | None = None, lora_request=None) -> None:
        self._leader_only("add_request")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        command = AddRequest(request_id, prompt, params, priority, arrival_time, lora_request)
        command.apply(self.engine)
        # Recorded only once accepted: a rejected request changes no process's state.
        self._commands.append(command)

    def abort_request(self, request_id) -> None:
        self._leader_only("abort_request")
        self.engine.abort_request(request_id)
        self._commands.append(AbortRequest(request_id))

    def reset_prefix_cache(self) -> bool:
        """Every process forgets its cached prefixes at the same point (their schedulers must
        keep making the same decisions)."""
        self._leader_only("reset_prefix_cache")
        self._commands.append(ResetPrefixCache())
        return self.engine.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self):
        self._leader_only("step")
        commands, self._commands = self._commands, []
        _broadcast(pickle.dumps(commands))
        return self.engine.step()

    def release(self) -> None:
        """Ends the followers' current `follow()` (LLM.generate calls it when its batch is done)."""
        self._leader_only("release")
        _broadcast(pickle.dumps(Release()))

    def shutdown(self) -> None:
        if self.is_leader:
            _broadcast(pickle.dumps(Stop()))

    # ---- followers -------------------------------------------------------------------------
    def follow(self) -> bool:
        """Steps as the leader steps until it releases (True) or stops (False)."""
        if self.is_leader:
            raise RuntimeError("process 0 leads; it does not follow")
        while True:
            commands = pickle.loads(_broadcast(None))
            if isinstance(commands, (Release, Stop)):
                return isinstance(commands, Release)
            for command in commands:     # in the leader's order, with its arrival times
                command.apply(self.engine)
            # Outputs are the leader's to hand out; this process only keeps in step.
            self.engine.step()

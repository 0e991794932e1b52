"""What a caller of AsyncLLM meets before and around the engine thread: its errors, and the
admission ticket that counts an HTTP request from the admission check until it is done."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; this server cannot serve any more requests."""


class EngineUnavailableError(RuntimeError):
    """Not admitting now (starting, draining, or the queue cap is reached); retry later."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Ticket:
    """One admitted HTTP request, counted (as `cost` sequences: prompts x n) from the admission
    check until `release()`."""

    def __init__(self, llm: "AsyncLLM", cost: int = 1):
        self._llm, self._held, self.cost = llm, True, cost

    def release(self) -> None:
        if self._held:
            self._held = False
            self._llm._release(self.cost)

"""LoRA adapters over HTTP (vLLM's surface): the name -> adapter registry and its routes.

A request selects an adapter by naming it in `"model"`; `/v1/models` lists each adapter with
the base model as `parent`; `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}` change the set at run time.

The registry lives on the event loop only. Adapters are read and checked by the engine
(`EngineClient.add_lora` / `remove_lora`) on the engine thread (`AsyncLLM.call`), so a bad
adapter gets the reader's message. Unloading an adapter that an admitted request still holds is refused (400), never
deferred: each request holds its adapter from the moment its "model" is resolved (in the same
event-loop tick as its admission) until its response is done, so an unload cannot slip in
between a request's resolution and its add_request. lora_int_ids are never reused: the prefix
cache's salt includes the id, so a reloaded adapter never meets KV of an old one.
"""
from __future__ import annotations

import collections
import itertools

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai.errors import APIError
from jaxbatch.lora.request import LoRARequest


class LoRAModelCard(P.ModelCard):
    parent: str | None = None


class LoadLoRAAdapterRequest(P._Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(P._Request):
    lora_name: str


def parse_lora_modules(items: list[str] | None) -> dict[str, str]:
    """`--lora-modules NAME=PATH ...` -> {name: path}; ValueError for a malformed or repeated one."""
    modules: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        if name in modules:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        modules[name] = path
    return modules


class _Hold:
    """An admission ticket that also holds the request's adapter until it is released."""

    def __init__(self, ticket, registry: "LoRARegistry", name: str):
        self._ticket, self._registry, self._name, self.cost = ticket, registry, name, ticket.cost
        registry.in_use[name] += 1

    def release(self) -> None:
        if self._registry is not None:
            self._registry.in_use[self._name] -= 1
            self._registry = None
        self._ticket.release()


class LoRARegistry:
    def __init__(self, base_name: str, enabled: bool = False,
                 modules: dict[str, str] | None = None):
        self.base_name, self.enabled = base_name, enabled
        if modules and not enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        if base_name in (modules or {}):
            raise ValueError(f"--lora-modules: {base_name!r} is the base model's name")
        self._ids = itertools.count(1)
        self.adapters: dict[str, LoRARequest] = {
            name: LoRARequest(name, next(self._ids), path) for name, path in (modules or {}).items()}
        self.in_use: collections.Counter[str] = collections.Counter()
        self._loading: set[str] = set()

    def check_at_start(self, engine) -> None:
        """On the engine thread, once the engine is built: a bad --lora-modules adapter raises
        the reader's ValueError, so the server refuses to start saying why."""
        for request in self.adapters.values():
            engine.add_lora(request)

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter `"model"` names; None for the base model (or no name); 404 otherwise."""
        if name is None or name == self.base_name:
            return None
        request = self.adapters.get(name)
        if request is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return request

    def hold(self, ticket, request: LoRARequest | None):
        return ticket if request is None else _Hold(ticket, self, request.lora_name)

    def cards(self) -> list[LoRAModelCard]:
        return [LoRAModelCard(id=name, root=r.lora_path, parent=self.base_name)
                for name, r in self.adapters.items()]

    async def load(self, llm, name: str, path: str) -> None:
        self._check_enabled()
        if name == self.base_name or name in self.adapters or name in self._loading:
            raise APIError(400, f"The lora adapter `{name}` has already been loaded.", "lora_name")
        request = LoRARequest(name, next(self._ids), path)
        self._loading.add(name)        # a second load of the same name meanwhile: 400
        try:
            await llm.call(lambda engine: engine.add_lora(request))
        except ValueError as e:
            raise APIError(400, str(e), "lora_path") from None
        finally:
            self._loading.discard(name)
        self.adapters[name] = request

    async def unload(self, llm, name: str) -> None:
        self._check_enabled()
        request = self.adapters.get(name)
        if request is None:
            raise APIError(404, f"The lora adapter `{name}` cannot be found.", "lora_name")
        if self.in_use[name]:
            raise APIError(400, f"The lora adapter `{name}` is in use by {self.in_use[name]} "
                                "request(s); unload it once they finish.", "lora_name")
        del self.adapters[name]        # from now on, requests naming it get 404
        try:
            await llm.call(lambda engine: engine.remove_lora(name))
        except ValueError as e:        # the engine still runs a request with it: keep it
            self.adapters[name] = request
            raise APIError(400, str(e), "lora_name") from None

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise APIError(400, "LoRA adapters need a server started with --enable-lora",
                           "lora_name")


def lora_router(registry: LoRARegistry, llm, require_ready) -> APIRouter:
    """The two routes; under /v1, so behind the API key like the others (app.py)."""
    router = APIRouter()

    def _check_fields(req):
        bad = P.check_fields(req)
        if bad:
            raise APIError(400, bad[1], bad[0])

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        require_ready()
        _check_fields(req)
        await registry.load(llm, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        require_ready()
        _check_fields(req)
        await registry.unload(llm, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router


def models_response(base_card: P.ModelCard, registry: LoRARegistry) -> JSONResponse:
    data = [base_card.model_dump()] + [c.model_dump() for c in registry.cards()]
    return JSONResponse({"object": "list", "data": data})

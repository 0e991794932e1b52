"""The package's shape, checked from the source: rooms import only rooms below them, no import
cycle anywhere (lazy imports inside functions included), no file past ~400 lines, docs without
merge-conflict markers or paths outside the repository."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxbatch"

# Lower numbers are lower rooms. A module may import its own room and rooms of a lower or
# equal rank; docs/architecture.md draws the same picture.
RANKS = {
    "records": 0,          # jaxbatch/sampling_params.py, pooling_params.py, outputs.py: plain records; cache_dir.py
    "core": 1,             # host: scheduler, KV cache manager, requests, plans
    "structured": 1,       # host: grammar matchers and bitmasks
    "kv_events": 1,        # host: the prefix cache's observer, vLLM's KV events over ZMQ
    "reasoning": 1,        # host: a reasoning model's thought tags (text split, grammar gate)
    "model": 2, "parallel": 2,
    "worker": 3,
    "lora": 3,
    "spec_decode": 4,
    "engine": 5,
    "benchmarks": 6,
    "entrypoints": 7,
}
HOST_ROOMS = ("records", "core", "structured", "kv_events", "reasoning")
FRONT = {"jaxbatch", "jaxbatch.__main__"}     # the package's lazy front door may name anything


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "jaxbatch" or module in FRONT:
        return None
    if len(parts) == 2 and parts[1] in ("sampling_params", "pooling_params", "outputs", "cache_dir"):
        return "records"
    return parts[1]


def imports_of(path: pathlib.Path) -> set[str]:
    """Every jaxbatch module this file imports, at module level or inside a function."""
    tree = ast.parse(path.read_text())
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxbatch")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("jaxbatch"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    return {module_name(f): imports_of(f) for f in files}


def test_every_room_has_a_rank():
    rooms = {room_of(m) for m in graph()} - {None}
    assert rooms <= set(RANKS), f"rooms without a rank: {rooms - set(RANKS)}"


def test_no_room_imports_a_room_above_it():
    bad = []
    for module, targets in graph().items():
        source = room_of(module)
        for target in targets:
            dest = room_of(target)
            if source and dest and RANKS[dest] > RANKS[source]:
                bad.append(f"{module} ({source}) imports {target} ({dest})")
    assert not bad, "\n".join(bad)


def test_host_rooms_import_no_jax():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if room_of(module_name(path)) not in HOST_ROOMS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.split(".")[0] in ("jax", "jaxlib", "pallas_kernels")]
    assert not bad, bad


# Benchmarks that run transformers' PyTorch models: the HF comparison, and the families
# benchmark, which writes random checkpoints with save_pretrained.
TORCH_ALLOWED = {"jaxbatch/benchmarks/hf_baselines.py", "jaxbatch/benchmarks/hf_offline.py",
                 "jaxbatch/benchmarks/families.py"}


def test_only_hf_benchmarks_import_torch():
    """The runtime needs no torch (GGUF files: model/gguf_reader.py); a lazy import counts."""
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if str(path.relative_to(ROOT)) in TORCH_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.split(".")[0] in ("torch", "accelerate")]
    assert not bad, bad


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in edges:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    edges = {m: {t for t in ts if t not in FRONT} for m, ts in graph().items() if m not in FRONT}
    # A package's __init__ importing its own modules is not a cycle through them.
    for m in edges:
        edges[m] = {t for t in edges[m] if not m.startswith(t + ".")}
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_past_400_lines(path):
    assert len(path.read_text().splitlines()) <= 420, f"{path} has grown past ~400 lines: split it"


DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_have_no_conflict_markers_or_outside_paths(doc):
    text = doc.read_text()
    markers = re.findall(r"^(?:<<<<<<< |>>>>>>> |=======$).*", text, re.M)
    assert not markers, f"{doc.name}: merge-conflict markers {markers[:3]}"
    outside = re.findall(r"\.\./[\w./-]+", text)
    assert not outside, f"{doc.name} points outside the repository: {outside[:3]}"

"""The child process of template_render.py: renders request-supplied chat templates.

Run as a script (`python -I this_file MAX_EXTRA_BYTES`), so it imports neither jaxbatch nor
transformers nor JAX: it starts in a fraction of a second and is cheap to kill and replace.
Its address space is capped at start, so a template that builds a huge string fails here with
MemoryError instead of growing the server. Requests and replies are length-prefixed JSON on
stdin/stdout. The environment mirrors transformers' chat-template one (sandboxed, immutable,
trim_blocks/lstrip_blocks, loopcontrols, tojson, raise_exception, strftime_now).
"""
import json
import resource
import struct
import sys
from datetime import datetime


def _limit_memory(extra: int) -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))


def _environment():
    from jinja2 import ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return json.loads(stream.read(n))


def _write(stream, obj) -> None:
    data = json.dumps(obj).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _render(env, req) -> dict:
    max_chars, size, parts = req["max_chars"], 0, []
    try:
        for piece in env.from_string(req["template"]).generate(**req["context"]):
            size += len(piece)
            if size > max_chars:
                return {"error": f"the rendered chat template is longer than {max_chars} "
                                 f"characters (more than max_model_len tokens)"}
            parts.append(piece)
        return {"text": "".join(parts)}
    except MemoryError:
        return {"error": "rendering the chat template needs more memory than allowed"}
    except Exception as e:   # noqa: BLE001 - the template's own error, for the 400
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    _limit_memory(int(sys.argv[1]))
    env = _environment()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        req = _read(stdin)
        if req is None:
            return
        _write(stdout, _render(env, req))


if __name__ == "__main__":
    main()

"""Multi-LoRA serving: PEFT adapters read from disk (`adapter.py`), a fixed-shape pool of
adapter slots on the device (`pool.py`), which adapters are resident (`manager.py`, the
scheduler's admission seam) and the runner that adds the pool to every model call
(`runner.py`). `LoRARequest` (`request.py`) is plain data, importable without JAX."""
from jaxbatch.lora.request import LoRARequest

__all__ = ["LoRARequest"]

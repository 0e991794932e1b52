"""Scale-out: tensor parallelism over a jax Mesh (`mesh.py`, `sharding.py`), one engine over
several processes joined by jax.distributed (`multihost.py`), and data-parallel replicas
(`data_parallel.py`). The single-device engine does not import any of it."""

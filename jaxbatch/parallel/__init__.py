"""Tensor parallelism over a jax Mesh (`mesh.py`, `sharding.py`): what the runner needs to split
one model over several devices. The engines that span replicas or processes are engines, in
`jaxbatch/engine/` (`data_parallel.py`, `multihost.py`). The single-device engine does not
import any of it."""

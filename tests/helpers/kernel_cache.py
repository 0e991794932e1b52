"""A test's own JAXBATCH_CACHE (its tiny checkpoint's weights and executables stay out of the
user's cache) that shares the user's built C++ kernels: without them every process on such a
cache, a server's included, runs the compiler over each kernel again."""
from __future__ import annotations

import os

from jaxbatch.cache_dir import cache_root


def cache_sharing_kernels(path: str) -> str:
    """`path` made a cache whose cpu_kernels/ is the current cache's; call it before setting
    JAXBATCH_CACHE to it."""
    kernels = os.path.join(cache_root(), "cpu_kernels")
    os.makedirs(kernels, exist_ok=True)
    os.makedirs(path, exist_ok=True)
    link = os.path.join(path, "cpu_kernels")
    if not os.path.lexists(link):
        os.symlink(kernels, link)
    return path

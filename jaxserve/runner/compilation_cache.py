"""JAX's persistent compilation cache: a restart reuses the compiled buckets."""
from __future__ import annotations

import os


def enable_compilation_cache(path: str | None = None) -> None:
    """Point JAX at a persistent cache folder (default: $JAXSERVE_JAX_CACHE_DIR, else
    jax_cache/ under jaxserve's cache root) and cache every program, however small."""
    import jax

    from models.default_model import cache_root

    path = path or os.environ.get("JAXSERVE_JAX_CACHE_DIR") or str(cache_root() / "jax_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import atexit
import os
import shutil
import tempfile

# Tests run on the CPU; eight host devices (issue 10: tp up to 8, dp x tp) let sharding tests build real meshes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# One persistent compilation cache for the whole run, empty at the start (hermetic):
# the many engines built on the same tiny configs compile each program once. Engines
# that enable jaxserve's own cache (the default model's tests) point it here too, and
# so do the servers and processes the tests start (they inherit the variable).
# `make test` runs two pytest-xdist workers: each gets a cache of its own, because JAX
# writes an entry in place and one process could read another's half-written file.
_CACHE = tempfile.mkdtemp(prefix="jaxserve-test-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAXSERVE_JAX_CACHE_DIR", _CACHE)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["JAXSERVE_JAX_CACHE_DIR"] = os.path.join(os.environ["JAXSERVE_JAX_CACHE_DIR"],
                                                        os.environ["PYTEST_XDIST_WORKER"])

from jaxserve.runner.compilation_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ["JAXSERVE_JAX_CACHE_DIR"])

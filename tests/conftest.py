import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The project's packages, not test folders of the same names (tests/models, tests/server,
# tests/pallas_kernels): a namespace package found first on sys.path shadows them, and
# a test then fails far from the cause. pyproject.toml's `pythonpath` prevents it; this
# says so at once if it comes back (.ci/collect_each.py collects each file alone).
_ROOT = Path(__file__).resolve().parent.parent
for _name in ("jaxserve", "models", "pallas_kernels", "server"):
    _spec = importlib.util.find_spec(_name)
    _origin = Path(_spec.origin).resolve().parent if _spec is not None and _spec.origin else None
    if _origin != _ROOT / _name:
        raise ImportError(f"{_name!r} resolves to {_origin or list(_spec.submodule_search_locations or [])}, "
                          f"not {_ROOT / _name}: run pytest from the repository root (pyproject.toml's pythonpath)")

# Tests run on the CPU; eight host devices (issue 10: tp up to 8, dp x tp) let sharding tests build real meshes.
HOST_DEVICES = 8
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_host_device_count(xla_flags: str, n: int = HOST_DEVICES) -> str:
    """``xla_flags`` with ``--xla_force_host_platform_device_count=n`` appended, unless it
    already sets a device count (a developer's own XLA_FLAGS are kept, and so is their count)."""
    if any(flag.split("=", 1)[0] == _DEVICE_COUNT_FLAG for flag in xla_flags.split()):
        return xla_flags
    return f"{xla_flags} {_DEVICE_COUNT_FLAG}={n}".strip()


os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Appended, not setdefault: with the developer's own XLA_FLAGS (say a fast-math switch)
# and no device count, every tp / dp test would find one device.
os.environ["XLA_FLAGS"] = with_host_device_count(os.environ.get("XLA_FLAGS", ""))
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


def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): needs n JAX devices; fails (never skips) with fewer")


def pytest_runtest_setup(item):
    """A test marked ``devices(n)`` fails when there are fewer than n devices: a skip would
    hide that the run tested no sharding at all (XLA_FLAGS above sets the count)."""
    needed = max((m.args[0] for m in item.iter_markers("devices")), default=0)
    if needed:
        import jax

        have = len(jax.devices())
        if have < needed:
            pytest.fail(f"needs {needed} JAX devices, found {have} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}, "
                        f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}); tests/conftest.py asks for "
                        f"{HOST_DEVICES} host devices unless XLA_FLAGS sets {_DEVICE_COUNT_FLAG}", pytrace=False)

import os

# Tests run on the CPU; eight host devices (issue 10: tp up to 8, dp x tp) let sharding tests build real meshes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

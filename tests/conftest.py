import os

# Tests run on the CPU; several host devices let sharding tests build real meshes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

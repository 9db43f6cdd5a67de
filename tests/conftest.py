"""Test-wide setup: several JAX CPU devices, set before JAX is first imported."""

import os

# JAX reads this once, at its first import; 8 devices cover world sizes 1..8.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

"""Test-wide setup: several JAX CPU devices, set before JAX is first imported."""

import gc
import os

# JAX reads this once, at its first import; 8 devices cover world sizes 1..8.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_collection_finish(session: object) -> None:
    """What collecting imported (torch, JAX, every test module: some 250,000 objects the
    cycle collector tracks) is frozen: the test process's full collections, which JAX's
    tracing makes frequent, no longer walk it (about a second in forty of JAX tests).
    What the tests themselves make is collected as before."""
    gc.freeze()

"""What the DDP waits on: which failures of a hook's future are the hook's own.

The waits themselves, with real ranks that raise, die and freeze, are in
``test_torch_ddp_failure.py`` (comm hooks, buckets) and ``test_torch_ddp_spin.py``.
"""

from __future__ import annotations

from xgrad.torch_backend.ddp_watched import _hook_raised

CALLBACK = "Got the following error when running the callback: "


def test_a_hooks_own_exception_is_its_own_and_a_transfer_failure_is_not() -> None:
    assert _hook_raised(ValueError("boom"))  # raised by the hook before any future
    assert _hook_raised(RuntimeError(CALLBACK + "ValueError: boom in the then chain"))
    assert _hook_raised(RuntimeError(CALLBACK + "KeyError: 'x'"))
    # gloo's transfer failures, raised through the chain or directly: a peer's doing
    assert not _hook_raised(RuntimeError(CALLBACK + "RuntimeError: Connection closed by peer"))
    assert not _hook_raised(RuntimeError(CALLBACK + "DistBackendError: Connection reset"))
    assert not _hook_raised(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    assert not _hook_raised(RuntimeError(CALLBACK + "no class name here"))

"""How the single-machine launchers start a rank: forked from a server that has torch loaded.

A ``spawn`` child is a fresh interpreter that imports torch again, 1.2-2 s of CPU per rank
on a small machine, which a launch of two ranks on two cores pays in full before either
rank runs a line. A ``forkserver`` child is forked from one server process per launcher
process, started at the first launch with torch already imported (``set_forkserver_preload``),
so a rank starts in tens of milliseconds. The server holds no threads and has run no
torch operation, so forking it is as safe as a fresh interpreter. Where there is no
``forkserver`` (Windows), ranks are spawned as before.

What a forked child does not get from its parent, and a spawned one does, is the parent's
environment as it is *now* (the server keeps the one it started with): so the function and
its arguments travel pickled, and the child first takes the parent's environment, then
unpickles them, so that a module they import reads the same variables as under ``spawn``
(the modules the server imports for every rank read none; see ``PRELOAD``).
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["METHOD_ENV", "STORE_ENV", "Packed", "context", "init_method", "pack"]

#: which store the launchers rendezvous through by default: ``file`` or ``tcp``.
STORE_ENV = "XGRAD_SPAWN_STORE"

#: what the server imports once, for every rank it forks. ``torch._dynamo`` too: a DDP
#: rank imports it at its first forward pass (PyTorch's DDP does as well, through
#: ``torch._disable_dynamo``), 1.2-2 s of CPU per rank on a small machine, the most of a
#: short rank's run. Imported once here, a launcher whose ranks never run a DDP pays it
#: once, at the server's start, and every DDP rank saves it (the test suite's ranks: a
#: file of thirteen 2-rank DDP launches went from 23 s to 11 s). ``__main__`` too, as
#: multiprocessing's own default has it: a child re-imports the parent's main script
#: unless the server already did, and under the ``pytest`` script that is pytest itself,
#: 0.1-0.2 s of CPU per rank at every launch. (A main module run with ``-m`` is not
#: re-imported, preloaded or not.) And the launchers' own modules, whose child functions
#: each rank unpickles first: they import ``xgrad`` (some 60 modules, 0.08 s of CPU per
#: rank at every launch, half a two-rank launch's time). They read no environment
#: variable and start no thread when imported (the launcher's tests check both), so the
#: server's environment and the launching process's give the same modules.
LAUNCHER_MODULES = ("xgrad.torch_backend.gather", "xgrad.torch_backend.spawn")
PRELOAD = ("__main__", "torch", "torch.distributed", "torch._dynamo", *LAUNCHER_MODULES)


#: environment variable that picks the start method (``spawn``: fresh interpreters).
METHOD_ENV = "XGRAD_START_METHOD"


def context() -> Any:
    """The multiprocessing context ranks start in: ``forkserver`` with torch preloaded, or
    ``$XGRAD_START_METHOD`` (``forkserver`` or ``spawn``).

    Raises:
        ValueError: ``$XGRAD_START_METHOD`` names another method.
    """
    import torch.multiprocessing as mp

    method = os.environ.get(METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{METHOD_ENV}={method!r}: expected 'forkserver' or 'spawn'")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class Packed:
    """A rank's function and arguments, with the launching process's environment.

    Args:
        env: the environment to set in the child before anything is unpickled.
        payload: ``pickle.dumps((fn, args))``.
    """

    __slots__ = ("env", "payload")

    def __init__(self, env: Mapping[str, str], payload: bytes) -> None:
        self.env = dict(env)
        self.payload = payload

    def unpack(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """In the child: take the parent's environment, then the function and arguments.

        First, what the child holds from its start (the fork server's imports: some 300,000
        objects tracked by the cycle collector) is frozen (``gc.freeze()``): no collection
        walks it again. Each full collection in a rank walked all of it, 0.2-0.4 s, and a
        rank makes one at each DDP built after a dropped one not yet collected
        (:func:`~.weak_hooks.collect_dropped`); the rank's own objects are collected as
        before.
        """
        gc.freeze()
        os.environ.clear()
        os.environ.update(self.env)
        fn, args = pickle.loads(self.payload)
        return fn, tuple(args)


def pack(
    fn: Callable[..., Any], args: Sequence[Any], env: Mapping[str, str] | None = None
) -> Packed:
    """``fn`` and ``args`` for a child, with this process's environment (plus ``env``).

    Raises:
        pickle.PicklingError, AttributeError, TypeError: ``fn`` or ``args`` cannot be
            pickled (a lambda, a local function), here in the parent, where the message
            reaches the caller, instead of in each child.
    """
    return Packed({**os.environ, **(env or {})}, pickle.dumps((fn, tuple(args))))


def init_method(tmpdir: str, store: str | None = None) -> str:
    """The ``init_method`` of a launch: a file store in ``tmpdir`` (``"file"``, no port to
    race for), or a TCPStore on a free port of 127.0.0.1 that rank 0's process hosts
    (``"tcp"``, as ``init_process_group`` starts one without ``torchrun``: what a frozen or
    dead rank 0 takes with it). Default: ``XGRAD_SPAWN_STORE``, else ``"file"`` (the suite
    can be run on TCPStores by setting it)."""
    store = (os.environ.get(STORE_ENV) or "file") if store is None else store
    if store == "file":
        return "file://" + os.path.join(tmpdir, "store")
    if store != "tcp":
        raise ValueError(f"store={store!r} must be 'file' or 'tcp' (or set {STORE_ENV})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"

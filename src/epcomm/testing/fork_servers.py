"""Fork servers for ``launcher.parallel_launch``: processes that imported torch and epcomm once and fork ranks.

A spawned rank is a fresh interpreter that imports torch itself, about 2 s of CPU. After ``fork_from_server()``
(the test suite calls it, ``tests/conftest.py``) a launch forks its ranks from a server process that imported
torch, epcomm and the modules its caller named once (multiprocessing's forkserver), as long as the launch's
environment differs from the server's in nothing but variables the rank reads itself (epcomm's, pytest's,
Triton's, TorchInductor's; not the start-up hook's ``EPCOMM_AS_DEEP_EP``); a launch with any other variable set
since (which the interpreter's start-up or torch's import may read) spawns.

Servers of their own, by name (``fork_from_server(name=...)``; a launch asks with ``parallel_launch(server=...)``),
hold more set-up: the tests' ranks that run the kernels under the Triton interpreter start with it set up
(``epcomm.testing.interp_server``), Megatron-Core's ranks with the switch on and Megatron-Core imported. Such a
server starts at its first launch; its variables (``environ``) are set for its start, and a launch matches it when
its environment has them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any

import torch.multiprocessing as mp

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# A server ran the interpreter's start-up and imported torch, epcomm and the modules its caller named, nothing
# else: the variables of epcomm and pytest (which they read when called, never at import) and of the packages
# it did not import (Triton, TorchInductor: tests and torch.compile set some) are read in the rank, after it
# takes the launch's environment; but the switch that epcomm's start-up hook (epcomm_as_deep_ep.pth) reads.
# Any other variable set or changed since makes the launch spawn.
_READ_IN_RANK = ("EPCOMM_", "PYTEST_", "TRITON_", "TORCHINDUCTOR_")
_START_UP = "EPCOMM_AS_DEEP_EP"
# read when used, never at import, and set by torch itself at its first use (TorchInductor's cache_dir())
_READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)


@dataclasses.dataclass
class _Server:
    modules: list
    read_at_import: tuple = ()  # prefixes of variables its imports read: a change of one since makes a launch spawn
    environ: dict = dataclasses.field(default_factory=dict)  # set for its start
    process: Any = None  # multiprocessing's ForkServer of a named server (None: the module's own, the default)
    env: dict | None = None  # the environment it started in, once started


# "" is the default server (multiprocessing's own); the others are ForkServer instances. multiprocessing reaches its
# server through ``forkserver.connect_to_new_process`` when a process starts: that name is given a function that
# asks the server this thread starts ranks from (``starting``), else the default one. Starting a server holds the
# lock.
_SERVERS: dict[str, _Server] = {}
_LOCK = threading.Lock()
_THREAD = threading.local()  # .server: the named server whose ranks this thread starts now


def _read_in_rank(name: str, read_at_import: tuple[str, ...] = ()) -> bool:
    return name.startswith(_READ_IN_RANK) and name != _START_UP and (
        not name.startswith(read_at_import) or name in _READ_WHEN_USED)


def fork_from_server(preload: tuple[str, ...] = (), name: str = "", read_at_import: tuple[str, ...] = (),
                     environ: dict | None = None) -> bool:
    """From now on, a launch whose environment is this one (see the module doc) forks its ranks from a server
    process that has imported torch, epcomm's package and launcher, and the modules in ``preload`` (none may
    read the environment at import: Triton reads ``TRITON_INTERPRET``, which a rank sets), instead of spawning
    interpreters that each import them; a rank still starts with the launch's environment and ``sys.path``,
    and unpickles its target by module name. False where the platform has no forkserver: launches spawn.

    ``name``: a server of its own instead, started at the first launch that asks for it
    (``parallel_launch(server=name)``), whose ``preload`` may set up its process (``epcomm.testing.interp_server``);
    ``read_at_import``: prefixes of the variables its imports read (``TORCHINDUCTOR_`` where TorchInductor is among
    them): a launch with one changed since spawns; ``environ``: variables set for its start (the start-up hook's
    switch), which a launch's environment must have too. A named server needs the default one (without it its
    launches spawn, as all do)."""
    if "forkserver" not in mp.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    modules = ["torch", "epcomm", "epcomm.testing.launcher", *preload]
    if name:
        if "" not in _SERVERS or not hasattr(forkserver, "ForkServer"):
            return False  # (no default server, or a multiprocessing not written against: launches spawn)
        _SERVERS[name] = _Server(modules, tuple(read_at_import), dict(environ or {}))
        if not hasattr(forkserver.connect_to_new_process, "default"):
            forkserver.connect_to_new_process = _connect_through(forkserver.connect_to_new_process)
        return True
    os.environ.update(SAFE_ENV)  # as every launch sets them
    mp.get_context("forkserver").set_forkserver_preload(modules)
    forkserver.ensure_running()
    _SERVERS[""] = _Server(modules, env=dict(os.environ))
    return True


def running(name: str = "") -> bool:
    """Whether launches may fork from the server ``name`` (registered; a named one starts at its first launch)."""
    return name in _SERVERS and "" in _SERVERS


def _start(server: _Server) -> None:
    """A named server's process, with its variables set for its start (this process's environment is put back)."""
    from multiprocessing import forkserver

    saved = {k: os.environ.get(k) for k in server.environ}
    os.environ.update(server.environ)
    try:
        server.env = dict(os.environ)
        server.process = forkserver.ForkServer()
        server.process.set_forkserver_preload(server.modules)
        server.process.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_method(environ: dict, name: str = "") -> tuple[str, Any]:
    """("forkserver", the server) where the server ``name`` (or the default) runs, starting a named one now, and
    ``environ`` differs from the one it started in in variables that the rank reads itself at most, else ("spawn",
    None)."""
    with _LOCK:
        # (a name never registered: the default server's, where there is one)
        server = (_SERVERS.get(name) or _SERVERS[""]) if "" in _SERVERS else None
        if server is None:
            return "spawn", None
        if server.env is None:
            _start(server)
    now, then = ({k: v for k, v in env.items() if not _read_in_rank(k, server.read_at_import)}
                 for env in (environ, server.env))
    return ("forkserver", server) if now == then else ("spawn", None)


def _connect_through(default):
    def connect_to_new_process(fds):
        server = getattr(_THREAD, "server", None)
        return (default if server is None else server.process.connect_to_new_process)(fds)

    connect_to_new_process.default = default
    return connect_to_new_process


@contextlib.contextmanager
def starting(server: _Server | None):
    """Process starts in this thread, through ``server`` where it is a named one."""
    _THREAD.server = server if server is not None and server.process is not None else None
    try:
        yield
    finally:
        _THREAD.server = None

"""What a process that runs the kernels under the Triton interpreter sets up before its first kernel, done once:
import this in a fork server (``launcher.fork_from_server(name=..., preload=(__name__,))``) and the ranks forked from
it start with it done (``parallel_launch(server=...)``), instead of each doing it again (0.3-0.4 s of CPU a rank,
1.5 s in one that imports TorchDynamo).

- The interpreter (``epcomm.testing.interp``: ``TRITON_INTERPRET=1``, before Triton loads; a rank sets it too).
- Every module of ``epcomm.kernels`` and ``epcomm.backends``, the CPU stand-ins (``cpu_nvlink``, ``cpu_internode``)
  and the cases the tests run: as a rank that set up the interpreter imports them (nothing of them reads the
  environment at import but ``TRITON_INTERPRET``). ``cpu_nvlink.install`` still runs in the rank: it replaces
  torch's symmetric memory and CUDA calls by stand-ins, which the backends look up when called.
- Each kernel's source rewritten for the interpreter (Triton does it at a function's first call and keeps it per
  process: ``InterpretedFunction.rewrite``).
- TorchDynamo, which torch's own wrappers import at a first call (a torch function mode's, for one:
  ``epcomm.testing.torch_calls.HostCount``), about 2 s of CPU; it imports Triton, so only after the interpreter.
"""

import importlib
import pkgutil

from . import interp  # (TRITON_INTERPRET=1: first, before anything below imports Triton)

MODULES = [importlib.import_module(name) for name in (
    "torch._dynamo", "epcomm.testing.cpu_nvlink", "epcomm.testing.cpu_internode", "epcomm.testing.gpu_cases",
    "epcomm.testing.elastic_cases", *(f"epcomm.{pkg}.{m.name}" for pkg in ("kernels", "backends")
                                      for m in pkgutil.iter_modules(importlib.import_module(f"epcomm.{pkg}").__path__)))]
# (a list of each module's values first: rewriting puts the interpreter's names into the kernel's module)
REWRITTEN = sorted({fn.rewrite().__name__ for mod in MODULES for fn in list(vars(mod).values())
                    if isinstance(fn, interp._interp.InterpretedFunction)})

"""Imports the modules named in ``EPCOMM_TEST_PRELOAD`` (comma-separated), with their warnings silenced and an
``ImportError`` ignored (whoever imports them later sees it): a fork server's preload
(``fork_servers.fork_from_server(preload=(..., __name__), environ={"EPCOMM_TEST_PRELOAD": ...})``).
multiprocessing's server imports its preload by name from its own ``sys.path``, not its parent's, so a module
beside the tests cannot be named there; and a package that warns at import (Megatron-Core without Transformer
Engine and Apex) would write to the session's terminal."""

import importlib
import os
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in filter(None, os.environ.get("EPCOMM_TEST_PRELOAD", "").split(",")):
        try:
            importlib.import_module(_name.strip())
        except ImportError:
            pass

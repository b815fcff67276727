"""``python -m epcomm``: the ``epcomm`` command line (bench, env, check)."""

from .cli import main

raise SystemExit(main())

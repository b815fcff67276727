"""One rank of a two-rank gloo job, as its own ``python`` process (``test_timeout_exit.py`` starts them):
``python timeout_rank.py RANK INIT_FILE ROLE``. ``EPCOMM_TIMEOUT_S`` comes from the environment.

Roles of rank 0 (the one that waits):
- ``caught``: dispatches, catches the ``PeerTimeoutError``, writes it to stderr, calls ``destroy()`` and
  ``dist.destroy_process_group()``, and ends normally (exit code 0);
- ``uncaught``: dispatches and lets the error end the script (exit code 1);
- ``build``: builds its Buffer (the rank exchange), the error uncaught.
Roles of rank 1 (the peer): ``idle`` builds its Buffer and sleeps; ``dies`` builds its Buffer and exits at
once (``os._exit``); ``absent`` joins the process group only, and sleeps.

Rank 0 writes ``waiting at <time.time()>`` to stderr just before the call that waits.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from epcomm import Buffer
from epcomm.testing.inputs import Case, make_topk, make_x

CASE = Case(2, (6, 7), hidden=128, num_topk=2, num_experts=4, seed=1, no_expert_token=False, drop_prob=0.0)


def main(rank: int, init_file: str, role: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if role == "absent":
        time.sleep(300)
        return
    if role == "build":
        print(f"waiting at {time.time()}", file=sys.stderr, flush=True)
        Buffer(dist.group.WORLD)
        return
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, explicitly_destroy=True)
    if role == "idle":
        time.sleep(300)
        return
    if role == "dies":
        os._exit(0)
    idx, w = make_topk(CASE, rank)
    x = make_x(CASE, rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, CASE.num_experts)
    print(f"waiting at {time.time()}", file=sys.stderr, flush=True)
    try:
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=idx, topk_weights=w)
    except TimeoutError as e:
        if role == "uncaught":
            raise
        print(f"caught {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        buf.destroy()
        dist.destroy_process_group()
        print(f"torn down at {time.time()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])

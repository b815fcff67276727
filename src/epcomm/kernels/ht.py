"""High-throughput intranode kernels (Triton) over symmetric memory.

Letters: ``T`` tokens, ``H`` hidden (elements of the row dtype), ``K`` top-k, ``E`` experts, ``R``
ranks, ``L = E/R``, ``C`` channels, ``N`` received rows, ``P`` programs.

The kernels live in one module per phase (ht_layout, ht_notify, ht_transfer, ht_receive; shared device
helpers in ht_common); this module is their namespace (the nvlink backend binds ``_layout_kernel`` and
``_dispatch_notify_kernel`` from their modules directly).

Pieces (see backends/nvlink.py for the orchestration and the buffer layout):
- ``layout`` (``get_dispatch_layout``): tokens per rank and per expert, and ``is_token_in_rank``, in one
  launch.
- ``dispatch_notify``: ``notify`` and the handle's prefix sums (``handle``) in one launch; the counts
  go straight to pinned host memory. ``_notify_kernel`` / ``_handle_kernel`` stay separate for the
  internode backend.
- ``notify``: program ``j`` compacts the tokens for rank ``j`` (send list, channel prefix, relative
  send_head) and writes counts + list into rank ``j``'s buffer, raises a flag, then waits for rank
  ``j``'s counts and copies them into local arrays.
- ``ce_wait`` / ``ce_signal``: one-program kernels around the copy-engine bulk copies (wait for
  the receivers to free their staging slots; raise the data flags after the copies).
- ``gather``: receiver side of dispatch: rows from local x or the staging slots into ``recv_x``
  in (source rank, token) order, top-k ids rewritten to local experts. With ``PUSH`` (the SM
  transfer of a non-cached dispatch) it also does the push: push and own block first, then the
  peers' rows.
- ``reduce``: owner side of combine: float32 sum, rank by rank, of the rows every rank returned;
  ``combine`` pushes this rank's rows and reduces in one launch (the SM transfer).

Example (R = 2, me = 0, T = 3, is_token_in_rank[:, 1] = [1, 0, 1]): notify program 1 writes the
send list [0, 2] into rank 1's buffer and send_head_rel[:, 1] = [0, -1, 1].
"""

from .ht_common import CCONSUMED, CDATA, DCONSUMED, DDATA, NOTIFY  # noqa: F401
from .ht_notify import _handle_kernel, _notify_kernel  # noqa: F401
from .ht_receive import _dispatch_impl_kernel, _reduce_kernel  # noqa: F401
from .ht_transfer import (  # noqa: F401
    _ce_flag_value_kernel,
    _ce_signal_kernel,
    _ce_wait_kernel,
)

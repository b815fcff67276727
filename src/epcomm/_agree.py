"""The arguments every rank must pass alike, compared across the group once per kind of call.

The ranks of a dispatch or combine exchange data whose sizes follow from some of the call's arguments (the
hidden size, the number of experts, top-k, the dtypes, ``num_max_dispatch_tokens_per_rank``, the Config's
SMs). Where ranks disagree, those exchanges do not match: a gloo collective then aborts the process in C++
("Received data size doesn't match expected size") and its peers lose it; device kernels read a peer's area
in another layout. So the first call of each *collective kind* (a call's name and those arguments; not the
token count, in which ranks differ by design) meets every rank first: a fixed-size all-gather of the kind
(``deadline.all_gather_ints``, bounded and naming a missing rank, phase ``<call>/arguments``), compared on
every rank. A disagreement is a ``ValueError`` on every rank naming the argument and each rank's value
(``num_experts=16 on rank 0 but 32 on rank 1``); a repeat of an agreed kind exchanges nothing.

Not compared: calls made while a CUDA graph is captured (no host exchange can be captured), and
low-latency calls of a shrink-enabled buffer (a masked rank may never arrive). Nor is a rank that changes an
argument after the ranks agreed on it while its peers repeat the agreed kind: its exchange of arguments meets
their call's own exchange (as every mismatch did before); a repeat is never compared, so that it costs nothing.

Example: rank 0 calls ``dispatch`` with a 16-expert layout, rank 1 with a 32-expert one; both raise
"num_experts=16 on rank 0 but 32 on rank 1: it must be the same on every rank (dispatch)" (rank 1's
message names its own value first).
"""

from __future__ import annotations

import zlib

import torch

from .backends import deadline

# the calls compared (their names travel as CRC-32s: a rank decodes another rank's call with this list)
CALLS = ("dispatch", "dispatch with a handle", "combine", "low_latency_dispatch", "ElasticBuffer.dispatch",
         "ElasticBuffer.dispatch with a handle", "ElasticBuffer.combine")
_MAX_FIELDS = 10
_WORDS = 2 + 2 * _MAX_FIELDS  # the call, the number of fields, then a (kind, value) pair a field
_INT, _NONE, _DTYPE, _BOOL = 0, 1, 2, 3
_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64, torch.float16,
           torch.uint8, torch.int8, torch.bool, torch.float64, torch.int16)
_MAX_KINDS = 4096


def _code(call: str) -> int:
    return zlib.crc32(call.encode()) & 0x7FFFFFFF


def _encode(call: str, fields: tuple) -> list[int]:
    """``[call, n, kind_0, value_0, ...]`` padded to ``_WORDS`` ints. Example: ``("dispatch", (("num_experts",
    16), ("topk_idx.shape[1]", None)))`` -> ``[crc("dispatch"), 2, 0, 16, 1, 0, 0, ...]``."""
    assert len(fields) <= _MAX_FIELDS, fields
    out = [_code(call), len(fields)]
    for _, v in fields:
        if v is None:
            out += [_NONE, 0]
        elif isinstance(v, torch.dtype):
            out += [_DTYPE, _DTYPES.index(v) if v in _DTYPES else -1]
        elif isinstance(v, bool):
            out += [_BOOL, int(v)]
        else:
            out += [_INT, int(v)]
    return out + [0] * (_WORDS - len(out))


def _show(kind: int, value: int) -> str:
    if kind == _NONE:
        return "None"
    if kind == _DTYPE:
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else "another dtype"
    if kind == _BOOL:
        return str(bool(value))
    return str(value)


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def disagreement(call: str, fields: tuple, rows: list[list[int]], me: int) -> str | None:
    """What the ranks' encoded kinds ``rows`` (by rank) disagree on, from rank ``me``'s view (its value first),
    or None. Example: "num_experts=32 on rank 1 but 16 on rank 0: it must be the same on every rank (dispatch)"."""
    names = {_code(c): c for c in CALLS}
    other = next((r for r, row in enumerate(rows) if row[0] != rows[me][0]), None)
    if other is not None:
        return (f"rank {me} calls {call} but rank {other} calls {names.get(rows[other][0], 'another operation')}: "
                "every rank must make the same calls in the same order")
    said = []
    for i, (name, _) in enumerate(fields):
        vals = [(row[2 + 2 * i], row[3 + 2 * i]) for row in rows]
        if len(set(vals)) < 2:
            continue
        others: dict = {}
        for r, v in enumerate(vals):
            if v != vals[me]:
                others.setdefault(v, []).append(r)
        said.append(f"{name}={_show(*vals[me])} on rank {me} but "
                    + " and ".join(f"{_show(*v)} on {_ranks(rs)}" for v, rs in others.items()))
    if not said:
        return None
    return "; ".join(said) + f": it must be the same on every rank ({call})"


class Agreement:
    """A buffer's collective kinds agreed so far; :meth:`check` meets the group for a new one."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self._agreed: set = set()

    def check(self, call: str, fields: tuple, timeout_s) -> None:
        """``fields``: ``((argument, value), ...)`` of ``call`` that every rank must pass alike (ints, bools, None
        or dtypes). The first time this rank sees them, every rank's are gathered (within ``timeout_s``: seconds,
        or a function giving them, asked only then) and compared; ``ValueError`` on every rank where they differ
        (:func:`disagreement`)."""
        key = (call, fields)
        if key in self._agreed:
            return
        wait_s = timeout_s() if callable(timeout_s) else timeout_s
        rows = deadline.all_gather_ints(self.group, _encode(call, fields), self.rank, f"{call}/arguments", wait_s)
        why = disagreement(call, fields, rows, self.rank)
        if why is not None:
            raise ValueError(why)
        if len(self._agreed) >= _MAX_KINDS:  # bounded, whatever the callers vary
            self._agreed.clear()
        self._agreed.add(key)

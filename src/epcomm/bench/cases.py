"""Named benchmark cases and how command-line overrides reshape them.

Letters: ``T`` tokens per rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks, ``M`` the
low-latency ``num_max_dispatch_tokens_per_rank`` (the benchmark uses ``M = T``).

A high-throughput (``ht``) case yields three rows: dispatch BF16, dispatch FP8, combine BF16. A
low-latency (``ll``) case yields dispatch FP8 and combine BF16 rows, plus, with ``hook``, the send
and receive halves of each (``return_recv_hook=True``) timed separately.
"""

from __future__ import annotations

import dataclasses

MODES = ("ht", "ll")


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One shape to benchmark. ``name`` groups rows (a sweep shares one name across ``tokens``)."""

    name: str
    mode: str          # "ht" | "ll"
    tokens: int        # T per rank (and M for low-latency)
    hidden: int        # H
    topk: int          # K
    experts: int       # E
    hook: bool = False       # low-latency: also time send and receive halves separately
    drop_prob: float = 0.0   # chance that a top-k slot is -1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for f in ("tokens", "hidden", "topk", "experts"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r} (case {self.name})")
        if self.hidden % 128 != 0:
            raise ValueError(f"hidden must be a multiple of 128 (FP8 rows use 128-channel scales), "
                             f"got {self.hidden} (case {self.name})")
        if self.topk > self.experts:
            raise ValueError(f"topk={self.topk} is larger than experts={self.experts} (case {self.name})")
        if not 0.0 <= self.drop_prob < 1.0:
            raise ValueError(f"drop_prob must be in [0, 1), got {self.drop_prob} (case {self.name})")

    def ops(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """``(op, dtype, phases)`` for each timed operation of this case, in run order."""
        if self.mode == "ht":
            return [("dispatch", "bf16", ("total",)), ("dispatch", "fp8", ("total",)),
                    ("combine", "bf16", ("total",))]
        out = [("dispatch", "fp8", ("total",)), ("combine", "bf16", ("total",))]
        if self.hook:
            out += [("dispatch", "fp8", ("send", "recv")), ("combine", "bf16", ("send", "recv"))]
        return out

    def peer_ops(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """The operations the peer baseline (bench/a2a.py) is timed on for this case."""
        if self.mode == "ht":
            return self.ops()
        return [("dispatch", "fp8", ("total",)), ("combine", "bf16", ("total",))]


_DSV3 = {"hidden": 7168, "topk": 8, "experts": 256}
_SWEEP_HT = tuple(4 ** i for i in range(8))        # 1 .. 16384
_SWEEP_LL = tuple(2 ** i for i in range(9))        # 1 .. 256 (the low-latency buffer grows as L*R*M*H)
_SMALL_SWEEP_HT = tuple(4 ** i for i in range(6))  # 1 .. 1024
_SMALL_SWEEP_LL = tuple(4 ** i for i in range(4))  # 1 .. 64
_SMALL_SWEEP_SHAPE = {"hidden": 512, "topk": 8, "experts": 64}

CASE_SETS: dict[str, tuple[BenchCase, ...]] = {
    "ht-dsv3": (BenchCase("ht-dsv3", "ht", 4096, **_DSV3),),
    "ll-dsv3": (BenchCase("ll-dsv3", "ll", 128, **_DSV3, hook=True),),
    "ll-dsv3-288": (BenchCase("ll-dsv3-288", "ll", 128, 7168, 8, 288, hook=True),),
    "sweep": tuple(BenchCase("sweep", "ht", t, **_DSV3) for t in _SWEEP_HT)
    + tuple(BenchCase("sweep", "ll", t, **_DSV3) for t in _SWEEP_LL),
    "sweep-small": tuple(BenchCase("sweep-small", "ht", t, **_SMALL_SWEEP_SHAPE) for t in _SMALL_SWEEP_HT)
    + tuple(BenchCase("sweep-small", "ll", t, **_SMALL_SWEEP_SHAPE) for t in _SMALL_SWEEP_LL),
    "small": (BenchCase("small", "ht", 64, 256, 4, 16, drop_prob=0.1),
              BenchCase("small", "ll", 32, 256, 4, 16, hook=True, drop_prob=0.1)),
}
ALIASES: dict[str, tuple[str, ...]] = {
    "dsv3": ("ht-dsv3", "ll-dsv3", "ll-dsv3-288"),
    "all": ("small", "ht-dsv3", "ll-dsv3", "ll-dsv3-288", "sweep"),
}
DEFAULT_GPU = ("ht-dsv3", "ll-dsv3", "ll-dsv3-288")
DEFAULT_CPU = ("small", "sweep-small")


def case_names() -> list[str]:
    return list(CASE_SETS) + list(ALIASES)


def resolve_cases(names: list[str] | tuple[str, ...], *, world_size: int, mode: str = "both",
                  tokens: list[int] | None = None, hidden: int | None = None, topk: int | None = None,
                  experts: int | None = None) -> list[BenchCase]:
    """Expand case-set names and apply overrides.

    ``tokens`` (a list) replaces every case's token count by each value in turn; ``hidden``,
    ``topk``, ``experts`` replace the shape; ``mode`` (``ht``/``ll``/``both``) filters. Duplicates
    are dropped, order is kept. Raises ``ValueError`` for unknown names or shapes the ranks cannot
    split (``E % R != 0``).
    """
    if mode not in ("ht", "ll", "both"):
        raise ValueError(f"mode must be ht, ll or both, got {mode!r}")
    expanded: list[str] = []
    for n in names:
        if n in ALIASES:
            expanded += ALIASES[n]
        elif n in CASE_SETS:
            expanded.append(n)
        else:
            raise ValueError(f"unknown case {n!r}; known: {', '.join(case_names())}")
    out: list[BenchCase] = []
    seen: set[BenchCase] = set()
    for n in expanded:
        for c in CASE_SETS[n]:
            if mode != "both" and c.mode != mode:
                continue
            shape = {}
            if hidden is not None:
                shape["hidden"] = hidden
            if topk is not None:
                shape["topk"] = topk
            if experts is not None:
                shape["experts"] = experts
            for t in (tokens or [c.tokens]):
                nc = dataclasses.replace(c, tokens=t, **shape)
                if nc.experts % world_size != 0:
                    raise ValueError(f"case {nc.name}: experts={nc.experts} must be divisible by the world "
                                     f"size {world_size}")
                if nc not in seen:
                    seen.add(nc)
                    out.append(nc)
    if not out:
        raise ValueError(f"no case left after --mode {mode} filtered {', '.join(names)}")
    return out

"""The rows the cost model is checked against (DeepEP V1's published H800 tables, DeepEP and epcomm
measured on nvidia-h200-x2), the calibration of its two efficiencies on two of them, and the check
of every other row (docs/model.md shows the table).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from .core import PRESETS, Links, Workload, predict, routing_stats

DEEPEP_SOURCE = ("DeepEP V1's published performance tables (deepseek-ai/DeepEP, its README at 0aaa674; in its docs "
                 "since 0297fc8), transcribed below; the README's news lines date them after PRs #130 (HT, 2025-04-22) and #173 (LL uses NVLink, "
                 "2025-06-05)")
EPCOMM_SOURCE = "BENCHMARKS.md, nvidia-h200-x2 2-rank tables (benchmarks/2026-11-22/h200x2-0653-ht-dsv3.jsonl, -0701-ll)"
DEEPEP_H200_SOURCE = ("benchmarks/anchors/deepep-v1-h200x2-2026-11-23: DeepEP V1 1.2.1 (567632dd) built from source, "
                      "its own tests on nvidia-h200-x2, 2 ranks; HT: deepep_intranode.log (best tuned time at 24 SMs), "
                      "LL: deepep_ll_128tok.log (the larger of the two ranks' averages)")


class Reference(NamedTuple):
    """A published or measured figure the model is checked against. HT figures from DeepEP's README are its
    "bottleneck bandwidth" (GB/s of ``Prediction.deepep_bytes``); the others are µs per call."""

    who: str
    machine: str              # a PRESETS key
    mode: str
    op: str
    ep: int
    tokens: int
    experts: int
    value: float
    unit: str                 # "GB/s" | "us"
    routing: str              # how the publisher routed: "uniform" | "node-limited"
    workload: dict            # Workload fields other than tokens and experts


REFERENCE_ROWS = [
    *[Reference("DeepEP V1", "h800-cx7", "ht", op, ep, 4096, 256, v, "GB/s", "uniform" if ep == 8 else "node-limited",
                {}) for ep, d, c in ((8, 153, 158), (16, 43, 43), (32, 58, 57), (64, 51, 50))
      for op, v in (("dispatch", d), ("combine", c))],
    *[Reference("DeepEP V1", "h800-cx7", "ll", op, ep, 128, 256, v, "us", "uniform", {"ll_kernels": 1})
      for ep, d, c in ((8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314), (128, 192, 369),
                       (256, 194, 360)) for op, v in (("dispatch", d), ("combine", c))],
    # epcomm (CUDA-graph replays; HT dispatch with its layout, num_worst_tokens; LL one message per rank)
    *[Reference("epcomm", "h200-x2", "ht", op, 2, 4096, 256, v, "us", "uniform", {"dtype": dt, "cached": False})
      for op, dt, v in (("dispatch", "bf16", 370.2), ("dispatch", "fp8", 293.2), ("combine", "bf16", 348.9))],
    *[Reference("epcomm", "h200-x2", "ll", op, 2, t, 256, v, "us", "uniform", {"messages": "rank", "ll_kernels": 2})
      for t, op, v in ((128, "dispatch", 26.7), (128, "combine", 44.6), (1, "dispatch", 17.2), (1, "combine", 21.8))],
    *[Reference("DeepEP V1", "h200-x2", "ht", op, 2, 4096, 256, v, "us", "uniform", {"dtype": dt})
      for op, dt, v in (("dispatch", "bf16", 344.48), ("dispatch", "fp8", 244.40), ("combine", "bf16", 399.41))],
    *[Reference("DeepEP V1", "h200-x2", "ll", op, 2, 128, 288, v, "us", "uniform", {"ll_kernels": 1})
      for op, v in (("dispatch", 29.88), ("combine", 40.16))],
]
# the rows that set the two efficiencies (calibrate); every other row is a check
CALIBRATION = {("DeepEP V1", "h800-cx7", "ht", "dispatch", 8): "nvlink_efficiency",
               ("DeepEP V1", "h800-cx7", "ht", "dispatch", 64): "nic_efficiency"}


def _role(ref: Reference) -> str:
    return CALIBRATION.get((ref.who, ref.machine, ref.mode, ref.op, ref.ep), "check")


def _reference_case(ref: Reference, links: Links, samples: int, seed: int):
    work = Workload(tokens=ref.tokens, experts=ref.experts, **ref.workload)
    stats = routing_stats(ref.routing, ref.ep, links, work, samples=samples, seed=seed)
    pred = predict(links, work, stats, ref.mode, ref.op)
    published_us = ref.value if ref.unit == "us" else pred.deepep_bytes / ref.value / 1e3
    return work, stats, pred, published_us


def calibrate(samples: int = 8192, seed: int = 0) -> dict[str, float]:
    """The two efficiencies that make the CALIBRATION rows exact, everything else at its default: each solves
    ``published = leg bytes / (peak * eff) + the rest`` for its leg."""
    out = {}
    links = PRESETS["h800-cx7"]
    for ref in REFERENCE_ROWS:
        key = _role(ref)
        if key == "check":
            continue
        _, _, p, published_us = _reference_case(ref, links, samples, seed)
        leg = "nvlink" if key == "nvlink_efficiency" else "nic"
        nbytes = p.nvlink_bytes if leg == "nvlink" else p.nic_bytes * links.port_factor()
        rest = p.time_us - max(p.nic_us, p.nvlink_us)
        out[key] = nbytes / (getattr(links, f"{leg}_gbps") * (published_us - rest)) / 1e3
    return out


def check_rows(links_by_machine: dict[str, Links] | None = None, samples: int = 8192, seed: int = 0) -> list[dict]:
    """Every reference row with its prediction and the error ``predicted / published - 1``."""
    links_by_machine = links_by_machine or PRESETS
    rows = []
    for ref in REFERENCE_ROWS:
        work, stats, p, published_us = _reference_case(ref, links_by_machine[ref.machine], samples, seed)
        source = {"DeepEP V1": DEEPEP_SOURCE if ref.machine == "h800-cx7" else DEEPEP_H200_SOURCE,
                  "epcomm": EPCOMM_SOURCE}[ref.who]
        rows.append({
            "who": ref.who, "machine": ref.machine, "mode": ref.mode, "op": ref.op, "dtype": p.dtype, "ep": ref.ep,
            "nodes": p.nodes, "tokens": ref.tokens, "experts": ref.experts, "routing": stats.source,
            "published": ref.value, "unit": ref.unit, "published_us": published_us, "predicted_us": p.time_us,
            "error": p.time_us / published_us - 1, "bottleneck": p.bottleneck, "nic_us": p.nic_us,
            "nvlink_us": p.nvlink_us, "local_us": p.local_us, "fixed_us": p.fixed_us, "role": _role(ref),
            "source": source, "workload": dataclasses.asdict(work)})
    return rows

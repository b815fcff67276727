"""A cost model for dispatch and combine at scale: the time of one call, predicted from byte counts,
link rates and latencies, at any EP size. ``epcomm model`` prints it; docs/model.md checks it against
DeepEP's published tables and our own measurements.

``core``: links, workloads, routing statistics, ``predict`` and ``sweep``; ``check``: the reference rows,
``calibrate`` and ``check_rows``; ``report``: ``assumptions``, tables, ``write_rows`` and ``plot``. Every
public name of the three is importable from ``epcomm.model``.
"""

from .check import (
    CALIBRATION,
    DEEPEP_H200_SOURCE,
    DEEPEP_SOURCE,
    EPCOMM_SOURCE,
    REFERENCE_ROWS,
    Reference,
    calibrate,
    check_rows,
)
from .core import (
    DTYPES,
    PRESETS,
    Links,
    Prediction,
    RoutingStats,
    Workload,
    node_limited_ids,
    predict,
    routing_stats,
    stats_from_ids,
    sweep,
    uniform_stats,
)
from .report import assumptions, plot, render_check, render_table, write_rows

__all__ = ["CALIBRATION", "DEEPEP_H200_SOURCE", "DEEPEP_SOURCE", "DTYPES", "EPCOMM_SOURCE", "PRESETS",
           "REFERENCE_ROWS", "Links", "Prediction", "Reference", "RoutingStats", "Workload", "assumptions",
           "calibrate", "check_rows", "node_limited_ids", "plot", "predict", "render_check", "render_table",
           "routing_stats", "stats_from_ids", "sweep", "uniform_stats", "write_rows"]

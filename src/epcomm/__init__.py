"""epcomm: Mixture-of-Experts dispatch and combine across GPUs, a drop-in for DeepEP's ``Buffer`` (V1) and
``ElasticBuffer`` (V2).

``import epcomm as deep_ep`` keeps DeepEP code working. Importing defines names only.
"""

from __future__ import annotations

from .buffer import Buffer
from .config import Config
from .elastic import ElasticBuffer, EPHandle, topk_idx_t
from .event import EventOverlap
from .layout import DispatchHandle, LowLatencyHandle

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "DispatchHandle", "EPHandle", "ElasticBuffer", "EventOverlap", "LowLatencyHandle", "__version__",
           "topk_idx_t"]

"""epcomm: Mixture-of-Experts dispatch and combine across GPUs, a drop-in for DeepEP's ``Buffer``.

``import epcomm as deep_ep`` keeps DeepEP code working. Importing defines names only.
"""

from __future__ import annotations

import torch

from .buffer import Buffer
from .config import Config
from .event import EventOverlap
from .layout import DispatchHandle, LowLatencyHandle

__version__ = "0.1.0"

topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "LowLatencyHandle", "topk_idx_t", "__version__"]

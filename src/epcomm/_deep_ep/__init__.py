"""``deep_ep``, as epcomm provides it under the switch ``EPCOMM_AS_DEEP_EP=1``.

Frameworks written for DeepEP V1 (Megatron-Core, vLLM, SGLang, ...) import ``deep_ep`` and
``deep_ep.utils``; with the switch on, ``_epcomm_as_deep_ep.DeepEPFinder`` loads this directory under
the name ``deep_ep``, so they get epcomm's classes (the very same objects as ``epcomm.Config`` etc.;
``Buffer`` is ``epcomm.Buffer`` with DeepEP's device rule: ``deep_ep.buffer``).
The names here are the ones DeepEP's package exports: V1's, and V2's ``ElasticBuffer``, ``EPHandle`` and
the domain-size helpers (``deep_ep.elastic``). DeepEP's ``HybridEPBuffer`` (its hybrid-ep
branch) is deliberately absent: ``from deep_ep import HybridEPBuffer`` raises ``ImportError``, which
is how clients detect that it is not there.

Importing defines names only. Do not import this package as ``epcomm._deep_ep`` in your own code:
use ``epcomm`` itself.
"""

from epcomm import __version__, topk_idx_t
from epcomm.config import Config

from . import buffer, elastic, utils
from .buffer import Buffer
from .elastic import ElasticBuffer, EPHandle, get_logical_domain_size, get_physical_domain_size
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "__version__", "buffer",
           "elastic", "get_logical_domain_size", "get_physical_domain_size", "topk_idx_t", "utils"]

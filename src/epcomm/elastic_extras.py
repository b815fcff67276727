"""DeepEP V2's experimental calls beside dispatch and combine, as ``ElasticBuffer`` methods (this mixin): Engram
(``engram_write``, ``engram_fetch``), pipeline send/recv (``pp_set_config``, ``pp_send``, ``pp_recv``), the AGRS
all-gather session (``agrs_set_config``, ``create_agrs_session``, ``destroy_agrs_session``, ``agrs_new_session``,
``agrs_get_inplace_tensor``, ``all_gather``) and their size hints (static).

Each call is its checks, then its plan's ``run`` (``backends/engram.py``, ``pp.py``, ``agrs.py``: a plan a
configuration, made by the backend's ``engram_plan`` / ``pp_plan`` / ``agrs_plan``). Bad arguments raise
``ValueError`` / ``TypeError`` naming the argument and its value before anything moves; a call in the wrong state
(a fetch before any write, a send before ``pp_set_config``, an all-gather outside a session) raises
``RuntimeError`` naming it. The configuring calls (``engram_write``, ``pp_set_config``, ``agrs_set_config``) are
collective: the ranks first exchange their arguments, so that one rank's bad arguments, or arguments that differ
between ranks, raise on every rank. docs/v2.md says what each backend does.

The mixin uses its host class's ``group``, ``rank_idx``, ``num_ranks``, ``device``, ``num_bytes``,
``num_cpu_bytes``, ``num_allocated_qps``, ``num_cpu_timeout_secs``, ``get_comm_stream()``, ``_check_alive()`` and
``_backend`` (:meth:`ElasticExtras._x_backend`).

Letters: ``R`` ranks, ``N`` Engram entries a rank, ``H`` hidden, ``T`` tokens, ``PE`` entries a token, ``PK`` scale
packs an entry.
"""

from __future__ import annotations

import contextlib
import math

import torch

from . import _env
from . import _validate as V
from .backends import deadline

ALIGNMENT = 2 << 20  # DeepEP's buffer alignment (elastic_layout.ALIGNMENT)
MAX_ALL_GATHERS = 32  # DeepEP's kNumMaxInflightAGRS
ENGRAM_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                             dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """``(GPU bytes, CPU bytes)``, both 2 MiB-aligned: the receive area for ``num_max_tokens_per_rank`` fetched rows
    and the storage of ``num_entries`` rows, each row ``hidden`` elements of ``dtype`` aligned up to 32 bytes.

    Example: ``engram_storage_size_hint(524288, 128, 512 * 24) == (4 MiB, 128 MiB)`` (BF16: 256-byte rows)."""
    V.int_arg("num_entries", num_entries, 0)
    V.int_arg("hidden", hidden, 0)
    V.int_arg("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    row = align(hidden * dtype.itemsize, 32)
    return align(row * num_max_tokens_per_rank, ALIGNMENT), align(row * num_entries, ALIGNMENT)


def pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """2 MiB-aligned bytes for pipeline send/recv: send and receive slots for both ring neighbours, of
    ``num_max_tensor_bytes`` aligned up to 32. Example: ``pp_buffer_size_hint(4096 * 7168 * 2, 4) == 896 MiB``."""
    V.int_arg("num_max_tensor_bytes", num_max_tensor_bytes, 0)
    V.int_arg("num_max_inflight_tensors", num_max_inflight_tensors, 0)
    return align(align(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 2 * 2, ALIGNMENT)


def agrs_session_bytes(num_ranks: int, shapes, dtype: torch.dtype) -> int:
    """The bytes a session of all-gathers of ``shapes`` (one shape, or a sequence of shapes) takes: each
    tensor's ``R * numel * itemsize`` aligned up to 32. Example: ``agrs_session_bytes(4, [(3, 5)] * 2, bf16) ==
    256`` (each 120 bytes, aligned to 128)."""
    shapes, _ = _shapes("shapes", shapes)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return sum(align(num_ranks * math.prod(s) * dtype.itemsize, 32) for s in shapes)


def _shapes(name: str, shapes) -> tuple[list[tuple[int, ...]], bool]:
    """``(the shapes, batched)``: one shape (a tuple of ints or ``torch.Size``) or a non-empty sequence of them
    (DeepEP's rule: batched when the first element is itself a tuple)."""
    if not isinstance(shapes, (tuple, list, torch.Size)) or not len(shapes):
        raise TypeError(f"{name} must be a shape or a non-empty sequence of shapes, got {shapes!r}")
    batched = isinstance(shapes[0], (tuple, list))
    out = []
    for s in (shapes if batched else (shapes,)):
        if not isinstance(s, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                        for d in s):
            raise TypeError(f"{name} must hold shapes of non-negative ints, got {s!r}")
        out.append(tuple(s))
    return out, batched


def _device_tensor(buf, name: str, t) -> torch.Tensor:
    """``t``: a contiguous tensor on the buffer's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != buf.device.type:
        raise ValueError(f"{name} must be on {buf.device}, got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t


class ElasticExtras:
    """``ElasticBuffer``'s Engram, pipeline send/recv and AGRS calls (module docstring)."""

    _x_engram = None        # the Engram plan (backends/engram.py), made by the first engram_write of a shape
    _x_pp = None            # the pipeline send/recv plan, made by pp_set_config
    _x_agrs = None          # the AGRS plan, made by agrs_set_config
    _x_in_session = False
    _x_session = 0          # sessions created
    _x_offset = 0           # bytes of the session buffer taken by this session's all-gathers
    _x_slot = 0             # all-gathers in this session

    # ------------------------------------------------------------------ size hints (static)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
        """``(num_gpu_bytes, num_cpu_bytes)`` for Engram (:func:`engram_storage_size_hint`): make the buffer with
        ``num_bytes = gpu + cpu`` and ``num_cpu_bytes = cpu``."""
        return engram_storage_size_hint(num_entries, hidden, num_max_tokens_per_rank, dtype)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """``num_bytes`` for pipeline send/recv (:func:`pp_buffer_size_hint`)."""
        return pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)

    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype: torch.dtype) -> int:
        """The bytes one session of all-gathers of ``shapes`` takes (:func:`agrs_session_bytes`; ``group``: its
        size is ``R``)."""
        return agrs_session_bytes(group.size(), shapes, dtype)

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int) -> int:
        """``num_bytes`` for sessions of ``num_max_session_bytes``: aligned up to 2 MiB."""
        V.int_arg("num_max_session_bytes", num_max_session_bytes, 0)
        return align(num_max_session_bytes, ALIGNMENT)

    # ------------------------------------------------------------------ shared

    def _x_backend(self):
        """The backend whose plans these calls run."""
        return self._backend

    def _x_wait_s(self) -> float:
        return _env.timeout_s(float(self.num_cpu_timeout_secs))

    def _x_agree(self, call: str, check, values: list[int]) -> None:
        """The configuring calls' first step, collective: ``check()`` (this rank's argument checks), then every
        rank's verdict and ``values`` exchanged (after the device finished this rank's earlier work, so that
        peers are done reading what the call replaces). A rank whose checks failed raises its own error; every
        other rank raises ``ValueError`` naming it; values that differ between ranks raise on every rank."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        err = None
        try:
            check()
        except (TypeError, ValueError) as e:
            err = e
        n = len(values)
        mine = [0 if err is None else 1] + (values if err is None else [0] * n)
        rows = deadline.all_gather_ints(self.group, mine, self.rank_idx, f"{call}/arguments", self._x_wait_s())
        if err is not None:
            raise err
        bad = [r for r, row in enumerate(rows) if row[0]]
        if bad:
            raise ValueError(f"{call}: rank(s) {bad} were given bad arguments (raised there); nothing was changed")
        if any(row != rows[0] for row in rows):
            raise ValueError(f"{call}: the ranks' arguments differ: " + ", ".join(
                f"rank {r}: {row[1:]}" for r, row in enumerate(rows)))

    def _x_meet(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        deadline.barrier(self.group, self.rank_idx, phase, self._x_wait_s())

    def _x_release(self) -> None:
        """Free the plans' memory (``destroy``, every rank at once: NVSHMEM's free is collective). A pipeline
        plan first waits for its sends in flight (the reference's; a deadline naming the peer)."""
        for name in ("_x_engram", "_x_pp", "_x_agrs"):
            plan = getattr(self, name)
            if plan is not None:
                plan.release()
                setattr(self, name, None)
        self._x_in_session = False

    # ------------------------------------------------------------------ Engram

    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        """Write this rank's Engram storage ``[N, H]`` (BF16, or FP8 e4m3 with ``sf [R * N, PK]``: every entry's
        4-byte scale packs, replicated on every rank) where every rank can fetch it. Collective: the ranks meet
        before (their earlier fetches done) and after (every storage written); ``N``, ``H``, the dtype and ``PK``
        must be the same on every rank. ``sf`` is kept, not copied (as DeepEP)."""
        self._check_alive()
        from .backends.engram import EngramConfig

        got = {}

        def check():
            got["storage"] = _device_tensor(self, "storage", storage)
            if storage.dtype not in ENGRAM_DTYPES:
                raise TypeError(f"storage must be torch.bfloat16 or torch.float8_e4m3fn, got {storage.dtype}")
            if storage.dim() != 2:
                raise ValueError(f"storage must be 2-D [num_entries, hidden], got shape {tuple(storage.shape)}")
            fp8 = storage.dtype == torch.float8_e4m3fn
            if fp8 != (sf is not None):
                raise ValueError(f"sf must be given exactly when storage is FP8 (storage {storage.dtype}, sf "
                                 f"{'given' if sf is not None else 'None'})")
            if sf is not None:
                _device_tensor(self, "sf", sf)
                if sf.dim() != 2 or sf.element_size() != 4 or sf.shape[0] != self.num_ranks * storage.shape[0]:
                    raise ValueError(f"sf must be [R * num_entries = {self.num_ranks * storage.shape[0]}, packs] of "
                                     f"4-byte elements, got {sf.dtype}{tuple(sf.shape)}")
            if not self.num_cpu_bytes or storage.numel() * storage.element_size() > self.num_cpu_bytes:
                raise ValueError(f"storage of {storage.numel() * storage.element_size()} bytes exceeds num_cpu_bytes="
                                 f"{self.num_cpu_bytes} (get_engram_storage_size_hint sizes it)")
            got["cfg"] = EngramConfig(
                num_ranks=self.num_ranks, num_entries=storage.shape[0], hidden=storage.shape[1], dtype=storage.dtype,
                num_sf_packs=0 if sf is None else sf.shape[1], storage_bytes=self.num_cpu_bytes,
                recv_bytes=self.num_bytes - self.num_cpu_bytes, num_allocated_qps=self.num_allocated_qps)

        shape = list(storage.shape) if isinstance(storage, torch.Tensor) and storage.dim() == 2 else [0, 0]
        code = ENGRAM_DTYPES.index(storage.dtype) if isinstance(storage, torch.Tensor) and \
            storage.dtype in ENGRAM_DTYPES else -1
        packs = sf.shape[1] if isinstance(sf, torch.Tensor) and sf.dim() == 2 else 0
        self._x_agree("engram_write", check, [*shape, code, packs])
        cfg, plan = got["cfg"], self._x_engram
        if plan is None or plan.cfg != cfg:
            if plan is not None:
                plan.release()
            self._x_engram = None
            plan = self._x_engram = self._x_backend().engram_plan(cfg, self.get_comm_stream())
        plan.write(storage, sf)
        self._x_meet("engram_write/written")

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        """Fetch Engram entries: ``indices int32[T, PE]`` of global entries (entry ``i`` is rank ``i // N``'s row
        ``i % N``). Returns a hook; calling it makes the current stream wait for the data and returns ``(data
        [T, PE * H], sf [T, PE * PK] or None)`` (FP8 scales from the ``sf`` of ``engram_write``, row-major or, with
        ``use_tma_aligned_col_major_sf``, strides ``(1, align(T, 4))``). One-sided: no peer calls anything.
        ``num_qps``: the programs the fetch may take (0: ``num_allocated_qps``)."""
        self._check_alive()
        plan = self._x_engram
        if plan is None:
            raise RuntimeError("engram_fetch before engram_write: there is no Engram storage to fetch from")
        V.tensor("indices", indices, torch.int32, dim=2, device=self.device)
        V.int_arg("num_qps", num_qps, 0)
        if num_qps > self.num_allocated_qps:
            raise ValueError(f"num_qps must be <= num_allocated_qps={self.num_allocated_qps}, got {num_qps}")
        if use_tma_aligned_col_major_sf not in (True, False, 0, 1):
            raise TypeError(f"use_tma_aligned_col_major_sf must be a bool, got {use_tma_aligned_col_major_sf!r}")
        cfg = plan.cfg
        need = indices.numel() * cfg.row_bytes
        if need > cfg.recv_bytes:
            raise ValueError(f"engram_fetch of {indices.shape[0]} x {indices.shape[1]} entries needs {need} bytes, "
                             f"more than num_bytes - num_cpu_bytes = {cfg.recv_bytes}")
        if not plan.checks_on_device and indices.numel():
            lo, hi = (int(v) for v in torch.aminmax(indices))
            for v in (lo, hi):
                if not 0 <= v < cfg.total:
                    raise ValueError(f"indices holds {v}, outside [0, {cfg.total}) (R * num_entries)")
        return plan.run(indices, num_qps, bool(use_tma_aligned_col_major_sf))

    # ------------------------------------------------------------------ pipeline send/recv

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Configure pipeline send/recv: tensors of at most ``num_max_tensor_bytes``, at most
        ``num_max_inflight_tensors`` in flight a direction. Collective (the same values on every rank). Every
        tensor sent before must have been received."""
        self._check_alive()
        from .backends.pp import PPConfig

        def check():
            V.int_arg("num_max_tensor_bytes", num_max_tensor_bytes, 1)
            V.int_arg("num_max_inflight_tensors", num_max_inflight_tensors, 1)
            if self.num_ranks < 2:
                raise ValueError(f"pipeline send/recv needs a group of at least 2 ranks, got {self.num_ranks}")
            need = align(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 4
            if need > self.num_bytes:
                raise ValueError(f"num_max_tensor_bytes={num_max_tensor_bytes} x num_max_inflight_tensors="
                                 f"{num_max_inflight_tensors} needs num_bytes >= {need}, got num_bytes="
                                 f"{self.num_bytes} (get_pp_buffer_size_hint sizes it)")

        ints = [v if isinstance(v, int) else -1 for v in (num_max_tensor_bytes, num_max_inflight_tensors)]
        self._x_agree("pp_set_config", check, ints)
        if self._x_pp is not None:
            self._x_pp.release()
            self._x_pp = None
        cfg = PPConfig(num_ranks=self.num_ranks, rank=self.rank_idx,
                       num_max_tensor_bytes=align(num_max_tensor_bytes, 32),
                       num_max_inflight_tensors=num_max_inflight_tensors)
        self._x_pp = self._x_backend().pp_plan(cfg)
        self._x_meet("pp_set_config/ready")

    def _x_pp_args(self, call: str, t, peer_name: str, peer, num_sms):
        plan = self._x_pp
        if plan is None:
            raise RuntimeError(f"{call} before pp_set_config")
        _device_tensor(self, "t", t)
        n = t.numel() * t.element_size()
        if n > plan.cfg.num_max_tensor_bytes:
            raise ValueError(f"{call}: t has {n} bytes, more than num_max_tensor_bytes="
                             f"{plan.cfg.num_max_tensor_bytes} (pp_set_config)")
        V.int_arg(peer_name, peer)
        cfg = plan.cfg
        if peer not in (cfg.prev, cfg.next):
            raise ValueError(f"{call}: {peer_name}={peer} is not a ring neighbour of rank {cfg.rank} (previous "
                             f"{cfg.prev}, next {cfg.next})")
        V.int_arg("num_sms", num_sms, 0)
        return plan

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Send ``t`` (contiguous, at most ``num_max_tensor_bytes``) to ``dst_rank_idx``, a ring neighbour (the
        previous or the next rank). Waits while ``num_max_inflight_tensors`` sends to it are not yet received.
        ``num_sms``: the SMs it may take (0: every SM, as DeepEP)."""
        self._check_alive()
        self._x_pp_args("pp_send", t, "dst_rank_idx", dst_rank_idx, num_sms).send(t, dst_rank_idx, num_sms)

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receive the next tensor ``src_rank_idx`` (a ring neighbour) sent into ``t`` (contiguous, as many bytes
        as were sent), bit-exact, in stream order."""
        self._check_alive()
        self._x_pp_args("pp_recv", t, "src_rank_idx", src_rank_idx, num_sms).recv(t, src_rank_idx, num_sms)

    # ------------------------------------------------------------------ AGRS session

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Configure the all-gather sessions: at most ``num_max_session_bytes`` gathered a session
        (``get_agrs_num_max_session_bytes``) and ``num_max_all_gathers_per_session`` all-gathers (at most 32).
        Collective (the same values on every rank); not inside a session."""
        self._check_alive()
        from .backends.agrs import AGRSConfig

        if self._x_in_session:
            raise RuntimeError("agrs_set_config inside an AGRS session: call destroy_agrs_session first")

        def check():
            V.int_arg("num_max_session_bytes", num_max_session_bytes, 1)
            V.int_arg("num_max_all_gathers_per_session", num_max_all_gathers_per_session, 1)
            if self.num_ranks < 2:
                raise ValueError(f"the AGRS all-gather needs a group of at least 2 ranks, got {self.num_ranks}")
            if num_max_session_bytes > self.num_bytes:
                raise ValueError(f"num_max_session_bytes={num_max_session_bytes} exceeds num_bytes={self.num_bytes} "
                                 "(get_agrs_buffer_size_hint sizes it)")
            if num_max_all_gathers_per_session > MAX_ALL_GATHERS:
                raise ValueError(f"num_max_all_gathers_per_session must be <= {MAX_ALL_GATHERS}, got "
                                 f"{num_max_all_gathers_per_session}")

        ints = [v if isinstance(v, int) else -1 for v in (num_max_session_bytes, num_max_all_gathers_per_session)]
        self._x_agree("agrs_set_config", check, ints)
        if self._x_agrs is not None:
            self._x_agrs.release()
            self._x_agrs = None
        cfg = AGRSConfig(num_ranks=self.num_ranks, rank=self.rank_idx,
                         num_max_session_bytes=align(num_max_session_bytes, 32),
                         num_max_all_gathers_per_session=num_max_all_gathers_per_session)
        self._x_agrs = self._x_backend().agrs_plan(cfg, self.get_comm_stream())
        self._x_meet("agrs_set_config/ready")

    def create_agrs_session(self) -> None:
        """Begin an all-gather session (pair it with :meth:`destroy_agrs_session`)."""
        self._check_alive()
        if self._x_agrs is None:
            raise RuntimeError("create_agrs_session before agrs_set_config")
        if self._x_in_session:
            raise RuntimeError("create_agrs_session inside an AGRS session: call destroy_agrs_session first")
        self._x_in_session, self._x_offset, self._x_slot = True, 0, 0
        self._x_session += 1

    def destroy_agrs_session(self) -> None:
        """End the session: its gathered tensors are no longer valid; every rank waits (on its communication
        stream, after its current stream) until every peer has ended it too."""
        self._check_alive()
        if not self._x_in_session:
            raise RuntimeError("destroy_agrs_session outside an AGRS session")
        self._x_in_session = False
        self._x_agrs.end()

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """``create_agrs_session`` ... ``destroy_agrs_session`` around the block (nothing if not ``enabled``)."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def _x_session_plan(self, call: str):
        if not self._x_in_session:
            raise RuntimeError(f"{call} outside an AGRS session (create_agrs_session or agrs_new_session first)")
        plan = self._x_agrs
        if self._x_slot >= plan.cfg.num_max_all_gathers_per_session:
            raise ValueError(f"{call}: this session already holds num_max_all_gathers_per_session="
                             f"{plan.cfg.num_max_all_gathers_per_session} all-gathers; end it "
                             "(destroy_agrs_session) first")
        return plan

    def _x_room(self, call: str, plan, nbytes: list[int]) -> list[int]:
        """The offsets of all-gathers of ``nbytes`` each from the session's current offset (ValueError where the
        session buffer cannot hold them)."""
        offs, off, r_ = [], self._x_offset, self.num_ranks
        for n in nbytes:
            offs.append(off)
            off += align(n * r_, 32)
        if off > plan.cfg.num_max_session_bytes:
            raise ValueError(f"{call}: this session would gather {off} bytes, more than num_max_session_bytes="
                             f"{plan.cfg.num_max_session_bytes} (agrs_set_config); end the session first")
        return offs

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """This rank's part of the next all-gather's place in the session buffer, as ``dtype`` tensors of
        ``shapes`` (one shape: one tensor; a sequence: a tuple); an all-gather of exactly these tensors, in this
        order, copies nothing of this rank's part."""
        self._check_alive()
        plan = self._x_session_plan("agrs_get_inplace_tensor")
        shapes, batched = _shapes("shapes", shapes)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        sizes = [math.prod(s) * dtype.itemsize for s in shapes]
        offs = self._x_room("agrs_get_inplace_tensor", plan, sizes)
        me = self.rank_idx
        out = tuple(plan.local[o + n * me:o + n * me + n].view(dtype).view(s) if n else
                    torch.empty(s, dtype=dtype, device=self.device) for o, n, s in zip(offs, sizes, shapes))
        return out if batched else out[0]

    def all_gather(self, t):
        """All-gather ``t`` (a tensor, or a sequence of tensors: one all-gather) inside a session: returns
        ``(gathered [R, ...], wait)``, or ``(*gathered, wait)`` for a sequence; ``wait()`` makes the current stream
        wait for the data. The gathered tensors live in the session buffer until the session ends."""
        self._check_alive()
        plan = self._x_session_plan("all_gather")
        batched = not isinstance(t, torch.Tensor)
        tensors = list(t) if batched and isinstance(t, (tuple, list)) else [t]
        if batched and not tensors:
            raise ValueError("all_gather needs at least one tensor, got an empty sequence")
        for k, x in enumerate(tensors):
            _device_tensor(self, f"t[{k}]" if batched else "t", x)
        sizes = [x.numel() * x.element_size() for x in tensors]
        offs = self._x_room("all_gather", plan, sizes)
        base, me, inplace = plan.local.data_ptr(), self.rank_idx, []
        for k, (x, o, n) in enumerate(zip(tensors, offs, sizes)):
            at = x.data_ptr() - base
            inside = n > 0 and 0 <= at < plan.cfg.num_max_session_bytes
            if inside and at != o + n * me:
                raise ValueError(f"all_gather: t{f'[{k}]' if batched else ''} lies in the session buffer but not at "
                                 "this all-gather's place: pass the tensors agrs_get_inplace_tensor gave, in order")
            inplace.append(inside)
        wait = plan.run(tensors, offs, self._x_slot, inplace)
        self._x_slot += 1
        self._x_offset = offs[-1] + align(sizes[-1] * self.num_ranks, 32)
        r_ = self.num_ranks
        outs = [plan.local[o:o + r_ * n].view(x.dtype).view(r_, *x.shape) if n else
                torch.empty((r_, *x.shape), dtype=x.dtype, device=self.device) for x, o, n in zip(tensors, offs, sizes)]
        session = self._x_session

        def handle():
            if not self._x_in_session or self._x_session != session:
                raise RuntimeError("an all_gather's wait after its session ended (call it before "
                                   "destroy_agrs_session)")
            wait()
        return (*outs, handle) if batched else (outs[0], handle)

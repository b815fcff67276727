"""``ElasticBuffer``'s calls as native chains (``native.Chain``: a call's outputs made and its launches made in one
C++ call, from the second call of a kind on), and the results of a merged chain by position.

- :func:`expanded_tail`: an eager no-sync expanded dispatch's scatter as the last step of its merged chain
  (``Kernels.merged``'s ``tail``), and :func:`tail_rows`, the call's rows from its outputs;
- :class:`FlatResults`: a merged chain's call results made straight from its outputs;
- :func:`combine_chain`: a combine (contiguous, or expanded with each token's local rows summed) as one chain.

The chains find the arguments of the launches a call just made among that call's tensors (:func:`_sources`) and
give the chain's source for each; where one is not found (or, for :class:`FlatResults`, a result is not found among
the chain's outputs) the kind keeps its Python path (``elastic_engine``, which plans every call and asks here).
"""

from __future__ import annotations

import operator

import torch

from . import native
from .kernels.launch import Launcher


class FlatResults:
    """A merged chain's call results assembled from its outputs by position.

    Why: an eager no-sync dispatch whose work is one chain (``Kernels.merged``) spends most of its remaining host time
    in Python making its results from the chain's outputs: the backend's ``DispatchResult`` and handle, recv_meta's
    ``RecvMeta``, then the call's tuple, fields and ``DispatchState`` (``run``'s ``finish``), a few frames each.
    What lands where depends only on the kind of call, so after two calls made that way (:meth:`record`: their
    chain outputs, inputs and results) ``build(made, inputs)`` makes the same results straight from the outputs:
    each tensor of the results is the chain's output ``i`` in both calls, or the call's input ``j`` in both, or the
    same object in both (the plan's own: kept scratch, constants), or output ``i`` viewed as another dtype of the
    same size in both (UE8M0 packs: that view made each call); ints and None the same in both; the handle's list
    of counts an empty list in both (a new one each call). Any other result (another view made per call, a
    non-empty list) and it never builds: every call then takes the Python path. ``record`` keeps the two calls'
    results only until the second."""

    __slots__ = ("build", "seen")

    def __init__(self, wanted: bool) -> None:
        self.build = None
        self.seen = [] if wanted else None

    def record(self, made: tuple, ins: tuple, out: tuple) -> None:
        if self.seen is None:
            return
        self.seen.append((made, ins, out))
        if len(self.seen) == 2:
            (m1, i1, o1), (m2, i2, o2) = self.seen
            self.seen = None
            self.build = _flat_build(m1, i1, o1, m2, i2, o2)


def _flat_leaves(out):
    """The leaves of a dispatch plan's results ``(x, sf, ids, w, fields, state)`` in :func:`_flat_build`'s order
    (fields without their list of counts, at 3), or None where they are not of that shape."""
    if len(out) != 6 or len(out[4]) != 9 or type(out[4][3]) is not list or out[4][3]:
        return None
    st, f = out[5], out[4]
    return (*out[:4], *f[:3], *f[4:], *st.v1, st.local, st.gid, st.meta, st.source, st.num_rows, st.num_expanded,
            st.device_sms, st.num_topk)


def _flat_build(m1, i1, o1, m2, i2, o2):
    """``build(made, ins)`` of :class:`FlatResults`, from two calls' outputs, inputs and results; None where a
    result is not found the same way in both."""
    a, b = _flat_leaves(o1), _flat_leaves(o2)
    if a is None or b is None or len(a) != len(b) or type(o1[5]) is not type(o2[5]) or (
            type(o1[5].v1) is not type(o2[5].v1)):
        return None
    nm, ni = len(m1), len(i1)
    consts, at, views = [], [], []
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            pos = next((i for i in range(nm) if m1[i] is x and m2[i] is y), None)
            if pos is None:
                pos = next((nm + j for j in range(ni) if i1[j] is x and i2[j] is y), None)
            if pos is None:  # (an output viewed as another dtype, a view made per call: made so each call)
                pos = next((i for i in range(nm) if _dtype_view(x, m1[i]) and _dtype_view(y, m2[i])), None)
                if pos is not None:
                    views.append((len(at), x.dtype))
            if pos is None and x is not y:
                return None
        elif x is None and y is None or type(x) is int and type(y) is int and x == y:
            pos = None
        else:
            return None
        if pos is None:
            pos = nm + ni + len(consts)
            consts.append(x)
        at.append(pos)
    get, consts, v1_type, nv1 = operator.itemgetter(*at), tuple(consts), type(o1[5].v1), len(o1[5].v1)
    state_type = type(o1[5])  # (the plan's DispatchState)
    e = 10 + nv1  # (x, sf, ids, w; fields' eight; the backend's handle; the state's eight)

    def build(made, ins):
        v = get(made + ins + consts)
        if views:
            v = list(v)
            for i, dt in views:
                v[i] = v[i].view(dt)
        return (v[0], v[1], v[2], v[3], (v[4], v[5], v[6], [], *v[7:12]),
                state_type(v1_type(*v[12:e + 2]), *v[e + 2:]))
    return build


def _dtype_view(x: torch.Tensor, base: torch.Tensor) -> bool:
    """``x`` is ``base`` viewed as another dtype of the same size: ``base.view(x.dtype)`` (the same bytes, shape and
    strides)."""
    return (x.dtype != base.dtype and x.element_size() == base.element_size() and x.data_ptr() == base.data_ptr()
            and x.shape == base.shape and x.stride() == base.stride())


def _sources(vals, consts=()):
    """``src(v)``: the source a ``native.Chain`` has for argument ``v`` of a launch planned on a call's tensors: an int,
    or one of ``consts`` (tensors that are the same at every call), as a constant; a tensor by identity among ``vals``
    (``(tensor, source)`` pairs, those with either None left out); None where it has none."""
    vals = [(t, s_) for t, s_ in vals if t is not None and s_ is not None]

    def src(v):
        if type(v) is int or any(v is c_ for c_ in consts):
            return native.const(v)
        return next((s_ for t, s_ in vals if v is t), None)
    return src


def tail_rows(x_rows: int, p: int, tma_sf: bool, made: tuple):
    """``(recv_x, recv_sf, None, recv_topk_weights)`` of an expanded dispatch from its scatter's outputs in a merged
    chain (:func:`expanded_tail`: x, then the scale packs (``p`` a row: 2-D) and the weights (1-D) where the call has
    them; the packs of ``tma_sf`` made as the ``[P, X aligned to 4]`` block of their column-major layout)."""
    ex, esf, ew = made[0], None, None
    for t in made[1:]:
        if t.dim() == 2:
            esf = t.as_strided((x_rows, p), (1, t.shape[1])) if tma_sf else t
        else:
            ew = t
    return ex, esf, None, ew


def expanded_tail(v2, res, _rm, out, pay, zero_pad: bool, tma_sf: bool, k: int, has_w: bool):
    """An eager no-sync expanded dispatch's scatter (``Kernels.copy_epilogue``) as the last step of its merged
    chain (``Kernels.merged``'s ``tail``), from the call that just ran it (``res``, ``_rm``: the backend's and
    recv_meta's results, the latter read through the state; ``out``: the call's, its ``DispatchState`` last;
    ``pay``: the payload's kind; ``has_w``:
    the call's top-k weights given): each argument of that launch found among the call's tensors and given the
    source the chain has for it (the dispatch's rows, scales and weights, recv_meta's sources and slots, the
    scatter's own outputs). None where it cannot be: a packed payload, no rows, a launch that is not bound, a
    tensor not found."""
    kern, state = v2.kernels, out[-1]
    if pay.packed:
        return None
    recv_w = res.recv_topk_weights if has_w else None
    x, sf, w = pay.rows(res.recv_x, res.recv_x_scales, recv_w)
    slots = state.slots
    planned = kern.copy_epilogue(state.source, k, zero_pad, state.device_sms, x, pay.x_dtype, pay.h, sf, pay.sf_dtype,
                                 pay.p, tma_sf, w, slots=slots, plan=True)
    if planned is None or slots.data_ptr() - state.meta.data_ptr() != 8:
        return None
    call, ex, esf, ew = planned.launch, planned.out, planned.out_sf, planned.out_w
    d = kern.launched(call.name, call.key)
    if getattr(d, "step", None) is None:
        return None
    made = [t for t in (ex, esf, ew) if t is not None]
    # (tma_sf: the packs' column-major block, [P, X aligned to 4], as the stand-in's strides say)
    specs = [((t.shape[1], t.stride(1)) if t is esf and tma_sf else tuple(t.shape), t.dtype) for t in made]

    def tail(srcs, meta_out, own):
        src = _sources([(res.recv_x, srcs["x"]), (res.recv_x_scales, srcs["s"]), (recv_w, srcs["w"]),
                        (state.source, meta_out("source")), (slots, meta_out("meta", 8)),
                        *((t, own(i)) for i, t in enumerate(made))])
        holes = tuple(src(v) for v in call.args)
        if None in holes:
            return None
        one = native.const(1)
        step = d.step((native.const(call.grid[0]), one, one), holes)
        return None if step is None else (specs, [], step)

    return tail


def combine_chain(v2, x, state, topk_idx, num_experts, m, topk_weights, bias, num_sms: int = 0,
                  expand: bool = False):
    """A combine of this kind (its call just made by :func:`combine`, which bound its launches) as one
    ``native.Chain``: contiguous, the transport's two launches (``NVLinkBackend.row_parts_kind``) and the reduction's
    (``Kernels.reduce(plan=True)``); ``expand`` (each token's local rows summed, ``allow_multiple_reduction``), the
    pack (``Kernels.pack(plan=True)``: its rows an output of the chain), the transport's two
    (``NVLinkBackend.rows_kind``) and the reduction's; its outputs made in the same C++ call. ``go(x, topk_weights,
    bias, state, topk_idx) -> (combined_x, combined_topk_weights or None)`` for calls of this kind (the same shapes,
    dtypes, alignment, biases and ``num_sms``: ``elastic_args.combine_key``), with no event to wait for between the
    transport and the reduction. None where it cannot be one: another backend, rows that do not move in place
    (contiguous), a launch that is not bound or cannot be a step (``kernels/launch.Direct.step``), a tensor argument
    that is not one of the call's (a bias made contiguous)."""
    kern, be = v2.kernels, v2.backend
    kind_of = be.rows_kind if expand else be.row_parts_kind
    if kern is None:
        return None
    t, k = topk_idx.shape
    h = x.shape[1]
    with_w = topk_weights is not None
    a, o, c = native.addr, native.out, native.const
    specs, vals, pack = [], [], None
    if expand:  # (the pack's rows: the chain's first output)
        planned = kern.pack(x, state.meta, topk_weights, 1, plan=True)
        if planned is None:
            return None
        p_call, rows = planned.launch, planned.rows
        pack = kern.launched(p_call.name, p_call.key)
        if getattr(pack, "step", None) is None:
            return None
        kind = kind_of(rows, m, num_sms)
        specs, vals, own, last = [(tuple(rows.shape), rows.dtype)], [(rows, o(0))], None, state.meta
    else:
        kind = kind_of(x, topk_weights, m, num_sms, skip_self=True)
        last = state.v1.send_head
        own = (x, topk_weights, last, v2.rank, v2.num_ranks)
    if kind is None:
        return None
    direct, area, n = kind.go.direct, kind.go.area, kind.n
    impl, arrive, grid = direct.impl, direct.arrive, direct.grid
    first = len(specs)  # (the combined rows and weights after the pack's rows)
    specs += [((t, h), torch.bfloat16)] + ([((t, k), torch.float32)] if with_w else [])
    # (the reduction's launch on stand-ins of the outputs: their places among its arguments)
    red = kern.reduce(area.area, topk_idx, num_experts // v2.num_ranks, m, h, bias, (0, k), True, with_w,
                      self_rows=own, plan=True)
    r_call, outs = red.launch, (red.out, red.out_w)
    steps = [getattr(d, "step", None) for d in (impl, arrive, kern.launched(r_call.name, r_call.key))]
    if None in steps or not t:
        return None
    # the chain's values: x, the weights (x where none), the destinations, topk_idx, the biases, send_head (contiguous)
    # or the handle's metadata (expanded)
    vals += [(x, a(0)), (topk_weights, a(1)), (state.gid, a(2)), (topk_idx, a(3)),
             *((b, a(4 + i)) for i, b in enumerate(bias)), (last, a(6)),
             *((t_, o(first + i)) for i, t_ in enumerate(outs))]
    src = _sources(vals, (area.area,))
    one = c(1)
    built = []
    if pack is not None:
        holes = [src(v) for v in p_call.args]
        built.append(None if None in holes else pack.step(tuple(c(g) for g in p_call.grid), tuple(holes)))
    r_src = [src(v) for v in r_call.args]
    if None in r_src:
        return None
    if expand:
        rows_src = (o(0), o(0), a(2), c(n))
    else:
        rows_src = (a(0), a(1) if with_w else a(0), a(2), c(n)) if n else (c(area.flags), c(area.flags), a(2), c(0))
    built += [steps[0]((c(grid[0]), one, one), rows_src), steps[1]((one, one, one), ()),
              steps[2](tuple(c(g) for g in r_call.grid), tuple(r_src))]
    if None in built:
        return None
    chain = native.Chain(x.device, specs, c(0), built, 7, stream=impl.p.chain_stream())
    run, stream, sdev = chain.run, chain.get_stream, chain.dev
    check = be._check_error
    nb, launches = len(bias), len(built)

    def go(x, topk_weights, bias, state, topk_idx):
        check()
        b = (*bias, None, None)
        made = run(stream(sdev), x, topk_weights, state.gid, topk_idx, b[0], b[1],
                   state.meta if expand else state.v1.send_head)
        Launcher.launches += launches
        return made[first], (made[first + 1] if with_w else None)

    go.chain, go.biases = chain, nb
    return go

"""``ElasticBuffer``'s dispatch epilogue as native chains (``native.Chain``: a call's outputs made and its launches
made in one C++ call): :func:`meta_chain`, ``recv_meta``'s outputs and launches (``elastic_kernels.Kernels``'
plan of it) as one chain; :func:`merged`, that chain joined to the backend's dispatch chain (the plan's
``run.native`` parts, ``backends/ht_dispatch_plan.py``), so that an eager no-sync dispatch is one C++ call.

Letters: ``T`` tokens, ``K`` top-k, ``R`` ranks, ``LE = E/R``, ``N`` contiguous rows, ``X`` expanded rows.
"""

from __future__ import annotations

from .. import elastic_layout as EL
from .. import native
from ..kernels.launch import Launcher
from ..native import ROWS


def meta_chain(go_rows, grid: int, specs, at: tuple, has_cum: bool, copy_topk: bool, part, ticket, ones,
               go_layout=None, le: int = 0, x_rows: int = 0):
    """``recv_meta``'s outputs and launches as one ``native.Chain`` call: ``(chain, part, (specs, packed, steps,
    finish, named))``, its values ``(rpm, recv_src_idx, recv_local, send_head, topk_idx, cum)``, its outputs where
    ``at`` says (``elastic_kernels._outputs_at``; ``named``: the same by ``RecvMeta`` field), ``finish(outputs) -> RecvMeta``
    (the parts: ``merged`` joins the steps to the dispatch's chain). A contiguous layout is one step (``ones``: its empty source); an expanded one
    (``go_layout``, on ``le`` programs) two, its ``x_rows`` sources made by the chain. None where a launch
    cannot be a chain's step (``Direct.step``)."""
    a, o, c = native.addr, native.out, native.const
    ci, pi, ri, mi, di, li, loi, ti, gi, si = at  # (a contiguous layout has every one but topk_copy's maybe)
    expand = go_layout is not None
    one = c(1)
    steps = [getattr(go_rows, "step", None), getattr(go_layout, "step", None)]  # (the tests' recording go has none)
    if steps[0] is None or (expand and steps[1] is None):
        return None
    steps = [steps[0]((c(grid), one, one), (a(0), a(1), a(2), o(li), o(li if expand else loi), o(mi), o(gi), o(ci),
                                             o(pi), o(ri), a(5) if has_cum else o(ci), a(4),
                                             o(ti) if copy_topk else a(4), a(3), o(di), c(part), c(ticket)))]
    if expand:  # (counts, local, rpm, meta, source)
        steps.append(go_layout.step((c(le), one, one), (o(ci), o(li), a(0), o(mi), o(si))))
    if None in steps:
        return None
    packed = range(len(specs))
    specs = [(tuple(x_rows if v == ROWS else v for v in shape), dt) for shape, dt in specs]  # (sizes of its own)

    def finish(made) -> EL.RecvMeta:
        return EL.RecvMeta(made[ri], made[gi], made[li], None if loi is None else made[loi], made[mi], made[ci],
                           made[pi], made[si] if expand else ones, made[di], None if ti is None else made[ti])

    named = dict(zip(("counts", "psum", "psum_rank", "meta", "dst", "local", "local_out", "topk", "gid", "source"),
                     at))
    return (native.Chain(part.device, specs, c(0), steps, 6, packed=packed, stream=go_rows.p.chain_stream()),
            part, (specs, packed, steps, finish, named))

def merged(ht_native, meta_chain, dry: bool = False, tail=None):
    """A no-sync dispatch's two chains as one: the backend's dispatch (``ht_native``: the plan's ``run.native``
    parts, ``backends/ht_dispatch_plan.py``) and ``recv_meta``'s launches on its outputs (``meta_chain``:
    :func:`meta_chain`'s). ``go(x, scales, topk_idx, w, cum) -> (DispatchResult, RecvMeta, tail's outputs)``,
    one ``native.Chain`` call; None where either is missing or cannot be a chain. ``tail`` (an expanded
    layout's scatter, ``elastic_chains.expanded_tail``): ``tail(sources, meta_out) -> (specs, packed, step)`` or
    None, its launch after the others on their outputs (``sources``: the dispatch's, ``rpm``, ``send_head``,
    ``src``, ``out_k``, ``x``, ``s``, ``w``; ``meta_out(name, offset=0)``: recv_meta's output ``name``, a field of
    ``RecvMeta``; ``own(i)``: the tail's output ``i``), its outputs after theirs (``packed`` counts from its
    first). ``dry``: a dry chain (tests)."""
    if ht_native is None or meta_chain is None:
        return None
    chain_parts, start, result, n_worst, prepared = ht_native
    got = chain_parts()
    if got is None or got[3]["out_k"] is None:
        return None
    specs, packed, steps, srcs = got
    m_specs, m_packed, m_steps, finish, m_at = meta_chain[2]
    nh, nm = len(specs), len(m_specs)
    # recv_meta's values (rpm, recv_src_idx, recv_local, send_head, topk_idx, cum) -> the dispatch's outputs,
    # its topk_idx (value 2) and cum (value 8, after the dispatch's eight)
    to = {0: srcs["rpm"], 1: srcs["src"], 2: srcs["out_k"], 3: srcs["send_head"], 4: native.addr(2),
          5: native.addr(8)}

    def remap(p):
        kind, idx, value, size = p
        if kind == 1:
            assert value == 0, p  # (whole tensors: no offset to add)
            return native.param(to[idx], size)
        if kind == 2:
            return (2, nh + idx, value, size)
        assert kind == 0, p
        return p

    more = [(fn, [remap(g) for g in grid], block, smem, [remap(p) for p in params])
            for fn, grid, block, smem, params in m_steps]
    t_specs, t_packed = [], []
    if tail is not None:
        made = tail(srcs, lambda name, offset=0: native.out(nh + m_at[name], offset),
                    lambda i: native.out(nh + nm + i))
        if made is None:
            return None
        t_specs, t_packed, t_step = made
        more.append(t_step)
    nt = len(t_specs)
    chain = native.Chain(meta_chain[1].device, specs + m_specs + t_specs, native.const(n_worst), [*steps, *more],
                         9, packed=[*packed, *(nh + i for i in m_packed), *(nh + nm + i for i in t_packed)],
                         dry=dry, stream=prepared.chain_stream())

    run, stream, sdev = chain.run, chain.get_stream, chain.dev  # (no Chain.__call__ frame: the hottest call)
    n_steps = len(steps) + len(more)

    def raw(x, scales, topk, w, cum):
        made = run(stream(sdev), x, scales, topk, w, None, None, None, start(), cum)
        Launcher.launches += n_steps
        return made

    def parts(made):
        return result(made[:nh], None), finish(made[nh:nh + nm]), made[nh + nm:] if nt else ()

    def go(x, scales, topk, w, cum):
        return parts(raw(x, scales, topk, w, cum))

    # (raw: the chain's call, its outputs as made; parts: the results of those, as go gives them)
    go.chain, go.raw, go.parts = chain, raw, parts
    return go

"""Tier 1: ``epcomm.native``: a call's output tensors made by one call into a C++ extension (``Outputs``), as
``torch.empty`` makes them (shape, dtype, device, contiguous, each its own storage, 16-byte aligned), a ``ROWS``
dimension taking the call's rows; ``EPCOMM_NATIVE`` turns it off, or on for CPU devices. Built on this machine's
compiler (torch.utils.cpp_extension); the tier-2 checks run the backends' plans with it."""
import itertools
import os
import shutil

import pytest
import torch

from epcomm import native

SPECS = [((native.ROWS, 7), torch.bfloat16), ((3, 3), torch.int32), ((native.ROWS,), torch.int64),
         ((2, native.ROWS, 4), torch.float32), ((5,), torch.bool), ((0, 8), torch.int32)]


def _want(rows):
    return [(tuple(rows if v < 0 else v for v in s), d) for s, d in SPECS]


def test_native_outputs_are_torch_empty_alike():
    mod = native.module()
    assert mod is not None, f"the extension was not built here: {native._state.get('why')}"
    outs = native.Outputs(torch.device("cpu"), SPECS, True)
    assert outs.native
    for rows in (0, 1, 13):
        got = outs(rows)
        assert [(tuple(t.shape), t.dtype) for t in got] == _want(rows)
        assert all(t.device.type == "cpu" and t.is_contiguous() for t in got)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in got if t.numel())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans  # no two overlap
        assert all(t.data_ptr() % 16 == 0 for t in got if t.numel())
        assert len({t.untyped_storage().data_ptr() for t in got if t.numel()}) == sum(1 for t in got if t.numel())


def test_python_fallback_makes_the_same():
    outs = native.Outputs(torch.device("cpu"), SPECS, False)
    assert not outs.native
    assert [(tuple(t.shape), t.dtype) for t in outs(4)] == _want(4)


@pytest.mark.parametrize("how, cuda, cpu", [("1", True, False), ("all", True, True), ("0", False, False)])
def test_wanted(monkeypatch, how, cuda, cpu):
    monkeypatch.setenv("EPCOMM_NATIVE", how)
    assert native.wanted(torch.device("cuda", 0)) is cuda
    assert native.wanted(torch.device("cpu")) is cpu
    assert native.wanted(torch.device("cuda", 0), False) is False  # (the caller's own condition)


def test_off_means_torch_empty(monkeypatch):
    monkeypatch.setenv("EPCOMM_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert native.module() is None and not native.Outputs(torch.device("cpu"), SPECS, True).native


def test_packed_outputs_are_views_of_one_allocation():
    outs = native.Outputs(torch.device("cpu"), SPECS, True, packed=(0, 1, 3, 4, 5))
    assert outs.native
    for rows in (0, 1, 13):
        got = outs(rows)
        assert [(tuple(t.shape), t.dtype) for t in got] == _want(rows)
        assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in got)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in got if t.numel())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans  # no two overlap
        storages = [t.untyped_storage().data_ptr() for t in got]
        assert len({storages[i] for i in (0, 1, 3, 4, 5)}) == 1  # one allocation for the packed ones
        assert storages[2] not in storages[:2] + storages[3:]  # the other its own
        for i, t in enumerate(got):  # each written alone keeps its values
            t.fill_(i + 1)
        assert all(torch.equal(t, torch.full_like(t, i + 1)) for i, t in enumerate(got))


def _signature_cases():
    """Tensors that differ in one of shape, dtype, device index, 16-byte alignment, contiguity each, and None."""
    base = torch.zeros(64, dtype=torch.float32)
    sq = torch.zeros(4, 4, dtype=torch.float32)
    return {"none": None, "sq": sq, "sq.t": sq.t(), "sq bf16": torch.zeros(4, 4, dtype=torch.bfloat16),
            "sq int32": torch.zeros(4, 4, dtype=torch.int32), "5x4": torch.zeros(5, 4), "16": base[:16],
            "16 at 4 B": base[1:17], "16 at 16 B": base[4:20], "16 at 8 B": base[2:18],
            "4x4 from flat": base[:16].view(4, 4),
            "strided": base[::4], "3-D": torch.zeros(2, 2, 4)}


def test_native_signatures_tell_apart_what_python_does():
    """The extension's ``signatures`` (a buffer's kind of call in one C++ call: ``native.key_functions``) puts two
    tensor arguments in one kind exactly where ``_validate.signatures`` does, argument by argument and in order, and
    refuses a non-tensor."""
    from epcomm import _validate as A

    mod = native.module()
    assert mod is not None, f"the extension was not built here: {native._state.get('why')}"
    cases = _signature_cases()
    for (na, a), (nb, b) in itertools.product(cases.items(), repeat=2):
        assert (mod.signatures(a) == mod.signatures(b)) is (A.signatures(a) == A.signatures(b)), (na, nb)
    # pairs of arguments against pairs: one flat signature for several tensors must keep where each one ends
    pairs = {(na, nb): (mod.signatures(a, b), A.signatures(a, b))
             for (na, a), (nb, b) in itertools.product(cases.items(), repeat=2)}
    for (p, (nat_p, py_p)), (q, (nat_q, py_q)) in itertools.product(pairs.items(), repeat=2):
        assert (nat_p == nat_q) is (py_p == py_q), (p, q)
    assert mod.signatures() == b"" and hash(mod.signatures(cases["sq"], None)) is not None
    for bad in (3, "x", [torch.zeros(1)]):
        with pytest.raises(TypeError):
            mod.signatures(cases["sq"], bad)


def test_native_row_signatures_tell_apart_what_python_does():
    """The extension's ``row_signatures`` (Buffer's combine and cached dispatch: a tensor's kind without its row
    count) as ``_validate.rows_signature``: tensors that differ only in their rows are one kind, any other difference two."""
    from epcomm import _validate as V

    mod = native.module()
    assert mod is not None, f"the extension was not built here: {native._state.get('why')}"
    cases = {k: v for k, v in _signature_cases().items() if v is not None}
    cases.update({"6x4": torch.zeros(6, 4), "0x4": torch.zeros(0, 4), "6x5": torch.zeros(6, 5)})
    for (na, a), (nb, b) in itertools.product(cases.items(), repeat=2):
        same = V.rows_signature(a) == V.rows_signature(b)
        assert (mod.row_signatures(a) == mod.row_signatures(b)) is same, (na, nb)
    assert mod.row_signatures(cases["5x4"]) == mod.row_signatures(cases["6x4"]) != mod.row_signatures(cases["6x5"])


def test_cache_is_named_by_content_not_by_path(monkeypatch):
    """The extension's cache folder (``native.cache_name``) follows the source's bytes and torch's version, never
    where they lie: two checkouts of one source share a build, a changed source or torch builds anew."""
    with open(native.SOURCE, "rb") as f:
        source = f.read()
    name = native.cache_name()
    assert name == native.cache_name(source) and name.startswith(native._NAME + "_")
    assert native.cache_name(source + b"\n") != name
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert native.cache_name(source) != name
    monkeypatch.undo()
    monkeypatch.setattr(native, "SOURCE", "/elsewhere/epcomm/native.cpp")  # (never read: the bytes are given)
    assert native.cache_name(source) == name


def test_a_built_extension_is_imported_not_built_again(monkeypatch, tmp_path):
    """Once built in the cache, a later process imports it from there without calling torch's ``load`` (which
    rebuilt it whenever the source's path or the virtualenv differed); a build cut short (a file that does not
    load) is built again, from a copy of the source in the cache folder (one path for every checkout)."""
    from torch.utils import cpp_extension

    if native.module() is None:
        pytest.skip(f"the extension was not built here: {native._state.get('why')}")
    # this session's build, copied as a finished build into another cache root
    name = native.cache_name()
    built = tmp_path / name / (name + ".so")
    os.makedirs(built.parent)
    shutil.copy(native.module().__file__, built)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls, imports = [], []

    def load(*a, **k):
        calls.append((a, k))
        return "built"

    def imported(n, path):  # (this process has the module already: Python would hand back that one)
        imports.append((n, path))
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise ImportError(f"{path}: invalid ELF header")
        return native.module()

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_import", imported)
    assert native._load() is native.module() and calls == [] and imports == [(name, str(built))]
    built.write_bytes(b"not a library")
    assert native._load() == "built" and len(calls) == 1
    (a, kw) = calls[0]
    assert a == (name,) and kw["build_directory"] == str(built.parent)
    assert kw["sources"] == [str(built.parent / "native.cpp")]
    with open(kw["sources"][0], "rb") as f, open(native.SOURCE, "rb") as g:
        assert f.read() == g.read()

"""``assert_meta``: two ``elastic_layout.RecvMeta`` bitwise, field by field (for the sims that run
``recv_meta``'s kernels: ``sim_elastic.py``, ``sim_ht_v2meta.py``; run as scripts: this directory is on their
path)."""
from epcomm import elastic_layout as EL
from epcomm.testing.compare import assert_bitwise


def assert_meta(got: EL.RecvMeta, want: EL.RecvMeta, what: str, stats=None) -> None:
    """Every field of ``got`` equals ``want``'s bitwise (None where ``want``'s is None); ``stats``: a pair of
    cumulative statistics that must be equal too."""
    for name in EL.RecvMeta._fields:
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, f"{what}: {name} should be None"
        else:
            assert_bitwise(a, b, f"{what}: {name}")
    if stats is not None:
        assert_bitwise(stats[0], stats[1], f"{what}: cumulative stats")

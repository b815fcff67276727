"""Tier 1: the barrier hazards of ``sims/ptx_barriers.py`` in the sm_90 PTX of ``common.wait_ge`` and the
internode high-throughput kernels (Triton's compiler, no GPU): no barrier in a spin loop that reads the
clock, no word loaded by every thread and then stored by thread 0 alone before a barrier. Both hung the
internode combine on an H100 (the deadline could not end the hang) and neither shows under the
interpreter, which runs a program as one thread. The checks themselves run first on PTX excerpts of the
code that hung."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sims")

# wait_ge before the fix (sm_90, 16 warps): the spin loop polls by a one-thread atomic between two barriers
# and leaves by a per-thread clock and error word
OLD_SPIN = """
\tmov.u64 %rd3, %globaltimer;
$L__BB0_2:                              // %.lr.ph
\tbar.sync \t0;
\t@%p14 ld.global.sys.acquire.b32 %r5, [ %rd2 + 0 ];
\t@%p14 st.shared.b32 [ %r3 + 0 ], %r5;
\tbar.sync \t0;
\tld.shared.b32 \t%r16, [global_smem];
\tld.volatile.global.b32 { %r17 }, [ %rd4 + 0 ];
\tmov.u64 %rd5, %globaltimer;
\tsub.s64 \t%rd6, %rd5, %rd3;
\tsetp.lt.s64 \t%p6, %rd6, %rd1;
\t@%p8 bra \t$L__BB0_2;
"""
# the combine's final before the fix: every thread loads the counter's base, thread 0 stores the new one
OLD_BASE = """
\tmov.u32 \t%r282, %tid.x;
\tand.b32 \t%r25, %r282, 511;
\tsetp.eq.b32 \t%p191, %r25, 0;
$L__BB0_63:
\tld.global.b32 { %r185 }, [ %rd362 + 0 ];
\tshfl.sync.bfly.b32 \t%r191, %r190, 8, 31, -1;
\tadd.s32 \t%r210, %r198, %r196;
\t@%p191 st.global.b32 [ %rd362 + 0 ], { %r210 };
\tbar.sync \t0;
"""


def _lints():
    sys.path.insert(0, SIMS)
    try:
        import ptx_barriers
    finally:
        sys.path.remove(SIMS)
    return ptx_barriers


def test_the_checks_find_the_code_that_hung():
    pb = _lints()
    assert pb.clock_loops_with_barriers(OLD_SPIN) == ["$L__BB0_2: bar.sync \t0;"] * 2
    assert len(pb.one_thread_stores_after_loads(OLD_BASE)) == 1
    # a barrier between the load and the store, or none in the loop: nothing to report
    assert pb.one_thread_stores_after_loads(OLD_BASE.replace("\tshfl", "\tbar.sync \t0;\n\tshfl")) == []
    assert pb.clock_loops_with_barriers(OLD_SPIN.replace("bar.sync", "add.s32")) == []


def test_kernels_have_no_barrier_hazards():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # Triton's compiler itself, for sm_90
    proc = subprocess.run([sys.executable, os.path.join(SIMS, "ptx_barriers.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    plans = [int(line.split()[1]) for line in lines if line.startswith("plan ")]
    oks = [line for line in lines if line.startswith("ok")]
    assert proc.returncode == 0 and len(plans) == 1 and len(oks) == plans[0] > 0, \
        proc.stdout[-4000:] + proc.stderr[-4000:]

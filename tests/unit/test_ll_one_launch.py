"""Tier 1: the send programs of the one-launch LL dispatch (``nvlink_ll.one_launch_sends``): at most
``TUNE["both_sends"]`` of them where the groups allow, fewer groups a program otherwise (the measured H100
rule: 256 send programs at 128 DSv3 tokens instead of 896)."""
from epcomm.backends import nvlink_ll as N


def test_one_launch_sends_rule():
    g = 56  # DSv3: H = 7168
    assert N.one_launch_sends(128, g) == (32, 8)
    assert N.one_launch_sends(64, g) == (16, 8)
    assert N.one_launch_sends(16, g) == (8, 4)
    assert N.one_launch_sends(1, g) == (8, 4)
    assert N.one_launch_sends(0, g) == (8, 4)
    assert N.one_launch_sends(4096, g) == (64, 8)  # one program a token: no wider
    for t in range(0, 300, 7):
        gc, _ = N.one_launch_sends(t, g)
        assert gc & (gc - 1) == 0 and 8 <= gc <= 64
        assert max(t, 1) * ((g + gc - 1) // gc) <= N.TUNE["both_sends"] or gc == 64
        if gc > 8:  # the smallest width that fits
            assert max(t, 1) * ((g + gc // 2 - 1) // (gc // 2)) > N.TUNE["both_sends"]


def test_one_launch_sends_overrides():
    saved = dict(N.TUNE)
    try:
        N.TUNE.update(both_gc=16, both_warps=2)
        assert N.one_launch_sends(128, 56) == (16, 2)
        N.TUNE.update(both_gc=0, both_warps=0, both_sends=0)  # no cap: send_gc, as the separate send kernel
        assert N.one_launch_sends(128, 56) == (8, 4)
    finally:
        N.TUNE.clear()
        N.TUNE.update(saved)

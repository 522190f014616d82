"""udp:// sends: how a flush's packets are cut into GSO runs (link_udp.gso_run, per run) is
the per-packet rule: packets of the first one's size, then maybe one shorter, within the
segment and byte limits of one UDP_SEGMENT send."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshgate.mesh.link_udp import GSO_MAX_BYTES, GSO_MAX_SEGMENTS, gso_run


def _rule(sizes: list[int], i: int) -> int:
    """The rule packet by packet."""
    size, total, j = sizes[i], sizes[i], i + 1
    while (j < len(sizes) and j - i < GSO_MAX_SEGMENTS and sizes[j - 1] == size and sizes[j] <= size
           and total + sizes[j] <= GSO_MAX_BYTES):
        total += sizes[j]
        j += 1
    return j


# mostly runs of full-size packets (the bulk case), with shorter, longer and tiny ones between
_SIZES = st.lists(st.sampled_from([1472, 1472, 1472, 1472, 1046, 1500, 200, 90, 13]), min_size=1,
                  max_size=200)


@given(_SIZES, st.data())
def test_runs_follow_the_per_packet_rule(sizes: list[int], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(sizes) - 1))
    j = gso_run(sizes, i)
    assert j == _rule(sizes, i)
    assert sum(sizes[i:j]) <= GSO_MAX_BYTES or j == i + 1


def test_whole_flushes() -> None:
    full = [1472] * 100 + [700]
    cuts = []
    i = 0
    while i < len(full):
        j = gso_run(full, i)
        cuts.append(j - i)
        i = j
    per = GSO_MAX_BYTES // 1472
    assert cuts == [per, per, 100 - 2 * per + 1]  # the short last packet ends the last run
    assert gso_run([1472, 1472, 1500, 1472], 0) == 2  # a bigger one starts its own run
    assert gso_run([1472, 200, 1472], 0) == 2  # a shorter one ends it
    assert gso_run([300] * 300, 0) == GSO_MAX_SEGMENTS  # small packets: the segment limit

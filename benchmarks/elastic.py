"""`make bench` section: elastic recovery on a fresh two-host namespace rig, a rank killed and then a
link taken down, timed as tests/integration/test_elastic.py times them (tests/support/elastic.py)."""

from __future__ import annotations

from tests.support.elastic import killed_rank, lost_link
from tests.support.rig import Rig


def main() -> None:
    with Rig(hosts=2) as rig:
        killed = killed_rank(rig)
        link = lost_link(rig)
    print(f"{'fault':<28}{'trains on after':>18}{'full size again after':>24}")
    print(f"{'rank killed':<28}{killed.resumed_s:>16.1f} s{killed.regrown_s:>22.1f} s")
    print(f"{'link down, then back':<28}{link.resumed_s:>16.1f} s{link.regrown_s:>22.1f} s")

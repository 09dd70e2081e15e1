"""What others took of this process's cores: /proc/stat's busy time less our own CPU time."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmserve.runtime import core_company
from mmserve.runtime.core_company import CoreCompany

# cpuN user nice system idle iowait irq softirq steal guest guest_nice (ticks of 10 ms)
STAT = """cpu  {all} 0 0 900 0 0 0 0 0 0
cpu0 {c0} 0 0 400 0 0 0 {s0} 0 0
cpu1 {c1} 0 0 400 3 0 0 0 0 0
cpu2 {c2} 0 0 100 0 0 0 0 0 0
intr 1 2 3
ctxt 12345
"""


class FakeTime:
    def __init__(self) -> None:
        self.wall, self.own = 0.0, 0.0

    def perf_counter(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.own


def write(path: Path, c0: int, c1: int, c2: int, steal0: int = 0) -> None:
    path.write_text(STAT.format(all=c0 + c1 + c2, c0=c0, c1=c1, c2=c2, s0=steal0))


def test_others_are_the_cores_busy_time_less_our_own_per_second_of_wall(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(core_company, "time", fake)
    monkeypatch.setattr(core_company, "_ticks_per_second", lambda: 100)
    stat = tmp_path / "stat"
    write(stat, 1000, 2000, 5000)
    company = CoreCompany({0, 1}, stat)  # cpu2 is not ours: its load never counts
    company.start()
    # 2 s of wall: our process ran 1.5 s of CPU; cores 0 and 1 were busy 1.2 + 1.0 s, and core 0 lost 0.3 s
    # to the hypervisor (steal): others had 1.2 + 1.0 + 0.3 - 1.5 = 1.0 core-seconds, 0.5 of a core
    fake.wall, fake.own = 2.0, 1.5
    write(stat, 1120, 2100, 9000, steal0=30)
    assert company.others() == pytest.approx(0.5)
    fake.own = 5.0  # more than the cores' busy time (a coarse tick): none, not negative
    assert company.others() == 0.0
    fake.own, fake.wall = 0.0, 2.0 + 1e-9
    write(stat, 9000, 9000, 9000)  # never more than every core we have
    assert company.others() == 2.0


def test_unknown_without_proc_stat_and_an_error_before_start(tmp_path: Path) -> None:
    company = CoreCompany({0}, tmp_path / "missing")
    with pytest.raises(RuntimeError, match="before start"):
        company.others()
    company.start()
    assert company.others() is None


@pytest.mark.skipif(not core_company.PROC_STAT.exists(), reason="no /proc/stat (not Linux)")
def test_a_process_spinning_beside_us_is_seen() -> None:
    company = CoreCompany()
    spin = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # NOTE: its interpreter's start-up is not what is measured
        company.start()
        time.sleep(1.0)
        others = company.others()
    finally:
        spinner.kill()
        spinner.wait()
    assert others is not None and others >= 0.5  # one spinning process: most of a core (and whatever else ran)

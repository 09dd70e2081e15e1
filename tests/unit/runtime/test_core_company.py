"""What others took of this process's cores: /proc/stat's busy time less our own CPU time, over marked work."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmserve.runtime import core_company
from mmserve.runtime.core_company import CoreCompany, cgroup_quota_cores, cgroup_quota_files, usable_cores

NO_QUOTA = (Path("/nonexistent/cpu.max"),)


class FakeTime:
    def __init__(self) -> None:
        self.wall, self.own = 0.0, 0.0

    def perf_counter(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.own


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    clock = FakeTime()
    monkeypatch.setattr(core_company, "time", clock)
    monkeypatch.setattr(core_company, "_ticks_per_second", lambda: 100)
    return clock


def write(path: Path, busy: dict[int, int], *, steal0: int = 0, idle: int = 400, nice: int = 0) -> None:
    """/proc/stat with cpuN's user ticks `busy[N]`; idle, iowait, nice and guest (inside user) as given."""
    lines = [f"cpu  {sum(busy.values())} 0 0 900 0 0 0 0 0 0"]
    for n, user in busy.items():
        steal = steal0 if n == 0 else 0
        lines.append(f"cpu{n} {user} {nice} 0 {idle} {idle // 2} 0 0 {steal} {user // 3} 0")
    path.write_text("\n".join([*lines, "intr 1 2 3", "ctxt 12345", ""]))


def test_others_are_the_cores_busy_time_less_our_own_over_the_marked_work(tmp_path: Path, fake: FakeTime) -> None:
    stat = tmp_path / "stat"
    write(stat, {0: 1000, 1: 2000, 2: 5000})
    company = CoreCompany({0, 1}, stat, NO_QUOTA)  # cpu2 is not ours: its load never counts
    company.start()
    # 2 s of wall: we ran 1.5 s of CPU; cores 0 and 1 were busy 1.2 + 1.0 s, and core 0 lost 0.3 s to the
    # hypervisor (steal); idle, iowait and niced time moved too, and count for nothing
    fake.wall, fake.own = 2.0, 1.5
    write(stat, {0: 1120, 1: 2100, 2: 9000}, steal0=30, idle=900, nice=500)
    company.stop()
    assert company.others() == pytest.approx(0.5)  # (1.2 + 1.0 + 0.3 - 1.5) / 2 s
    # a second interval adds to the first; what happens between the two does not count
    write(stat, {0: 5000, 1: 5000, 2: 9000}, steal0=30)
    fake.wall, fake.own = 10.0, 3.0
    company.start()
    fake.wall, fake.own = 11.0, 3.5
    write(stat, {0: 5050, 1: 5050, 2: 9000}, steal0=30)
    company.stop()
    assert company.others() == pytest.approx((1.0 + 0.5) / 3.0)  # ((2.5 - 1.5) + (1.0 - 0.5)) / (2 + 1) s


def test_clamped_to_none_and_to_every_core(tmp_path: Path, fake: FakeTime) -> None:
    stat = tmp_path / "stat"
    write(stat, {0: 1000, 1: 1000})
    company = CoreCompany({0, 1}, stat, NO_QUOTA)
    company.start()
    fake.wall, fake.own = 1.0, 5.0  # more CPU of ours than the cores' busy time (a coarse tick): none
    company.stop()
    assert company.others() == 0.0
    many = CoreCompany({0, 1}, stat, NO_QUOTA)
    many.start()
    fake.wall = 1.5
    write(stat, {0: 9000, 1: 9000})
    many.stop()
    assert many.others() == 2.0  # never more than every core we have


def test_unknown_where_the_counts_cannot_be_ours(tmp_path: Path, fake: FakeTime) -> None:
    def measured(company: CoreCompany) -> float | None:
        company.start()
        fake.wall += 1.0
        company.stop()
        return company.others()

    stat = tmp_path / "stat"
    write(stat, {0: 1000, 1: 1000})
    assert measured(CoreCompany({0, 1}, tmp_path / "missing", NO_QUOTA)) is None  # not Linux
    assert measured(CoreCompany({4, 5}, stat, NO_QUOTA)) is None  # a container's renumbered view of the cores
    quota = tmp_path / "cpu.max"
    quota.write_text("50000 100000\n")  # half a core of a host that /proc/stat counts whole
    assert measured(CoreCompany({0, 1}, stat, (quota,))) is None
    quota.write_text("max 100000\n")
    assert measured(CoreCompany({0, 1}, stat, (quota,))) == 0.0
    assert CoreCompany({0}, stat, NO_QUOTA).others() is None  # nothing marked
    short = CoreCompany({0, 1}, stat, NO_QUOTA)
    short.start()
    fake.wall += core_company.MIN_WALL_S * 0.9  # too short: the 10 ms ticks, not the company
    short.stop()
    assert short.others() is None
    with pytest.raises(RuntimeError, match="before start"):
        CoreCompany({0}, stat, NO_QUOTA).stop()


def test_cgroup_quotas_v2_and_v1(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "cpu.max", tmp_path / "cpu.cfs_quota_us"
    v2.write_text("250000 100000\n")
    assert cgroup_quota_cores((v2,)) == 2.5
    v1.write_text("150000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota_cores((tmp_path / "missing", v1)) == 1.5
    v1.write_text("-1\n")
    assert cgroup_quota_cores((v1,)) is None
    assert cgroup_quota_cores(NO_QUOTA) is None


def test_the_tightest_quota_over_the_process_counts_its_own_cgroup_and_those_above(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/job.scope\n")  # v2: systemd's CPUQuota on the job's own scope
    scope = tmp_path / "system.slice" / "job.scope"
    scope.mkdir(parents=True)
    files = cgroup_quota_files(proc, tmp_path)
    assert files == (tmp_path / "cpu.max", tmp_path / "cpu" / "cpu.cfs_quota_us", scope / "cpu.max",
                     tmp_path / "system.slice" / "cpu.max")
    assert cgroup_quota_cores(files) is None
    (scope / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "system.slice" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota_cores(cgroup_quota_files(proc, tmp_path)) == 3.0
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a tighter one at the mount's root: the container's
    assert cgroup_quota_cores(cgroup_quota_files(proc, tmp_path)) == 1.5
    # v1: only the cpu controller's line; its `cpu` link first, as the line may order the controllers otherwise
    proc.write_text("12:cpuacct,cpu:/system.slice/mm.service\n5:memory:/system.slice/mm.service\n")
    assert cgroup_quota_files(proc, tmp_path)[2:] == tuple(
        tmp_path / mount / "system.slice" / leaf / "cpu.cfs_quota_us" for mount in ("cpu", "cpuacct,cpu")
        for leaf in ("mm.service", ""))
    (tmp_path / "bad").write_bytes(b"0::/\xff\n")  # a cgroup named in bytes that are not UTF-8
    assert len(cgroup_quota_files(tmp_path / "bad", tmp_path)) == 2
    assert cgroup_quota_files(tmp_path / "missing", tmp_path) == (tmp_path / "cpu.max",
                                                                tmp_path / "cpu" / "cpu.cfs_quota_us")


def test_usable_cores_are_the_affinity_bounded_by_the_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_company, "affinity", lambda: set(range(64)))  # a big host's cores, all in view
    quota = tmp_path / "cpu.max"
    assert usable_cores(NO_QUOTA) == 64
    for limit, cores in (("250000 100000", 2), ("50000 100000", 1), ("max 100000", 64), ("9600000 100000", 64)):
        quota.write_text(limit + "\n")  # 2.5 CPUs: 2 threads never throttled; half a CPU: still one thread
        assert usable_cores((quota,)) == cores, limit


def test_a_process_spinning_beside_us_is_seen() -> None:
    company = CoreCompany()
    spin = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # NOTE: its interpreter's start-up is not what is measured
        company.start()
        time.sleep(1.0)
        company.stop()
        others = company.others()
    finally:
        spinner.kill()
        spinner.wait()
    if others is None:
        pytest.skip("this machine does not tell (no /proc/stat of our cores, or a CPU quota)")
    assert others >= 0.5  # one spinning process: most of a core (and whatever else ran)

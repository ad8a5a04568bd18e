"""CPU seconds of process trees, read from /proc (user + system, the process and its live descendants).

``CpuMeter({"client": pid, ...})`` snapshots at construction; ``per_message(n)`` gives each tree's CPU
milliseconds per message since then. A tree stops at the other roots: the benchmark's own process, whose
children are the nodes it measures on their own, counts without them. Children that exited meanwhile are not
counted (PostgreSQL backends of pooled connections live through a run; the error is the CPU of connections
opened and closed in it).
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _tree(root: int, others: frozenset[int] = frozenset()) -> dict[int, float]:
    """CPU seconds of ``root`` and every live descendant, by pid; the trees of ``others`` left out."""
    stats = {pid: s for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if (s := _stat(pid))}
    wanted, found = {root}, {}
    changed = True
    while changed:
        changed = False
        for pid, (parent, _) in stats.items():
            if parent in wanted and pid not in wanted and pid not in others:
                wanted.add(pid)
                changed = True
    for pid in wanted:
        if pid in stats:
            found[pid] = stats[pid][1]
    return found


class CpuMeter:
    def __init__(self, roots: dict[str, int | None]):
        self.roots = {name: pid for name, pid in roots.items() if pid}
        self.start = {name: _tree(pid, self._others(pid)) for name, pid in self.roots.items()}

    def _others(self, pid: int) -> frozenset[int]:
        return frozenset(self.roots.values()) - {pid}

    def per_message(self, messages: int) -> dict[str, float]:
        """CPU milliseconds per message of each tree since the meter was made."""
        out = {}
        for name, pid in self.roots.items():
            now, before = _tree(pid, self._others(pid)), self.start[name]
            used = sum(cpu - before.get(p, 0.0) for p, cpu in now.items())
            out[name] = round(1000 * used / max(messages, 1), 3)
        return out


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of ``pid``, by thread id."""
    out = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def thread_names(pid: int, spy: str) -> dict[int, str]:
    """Python's name of each thread of ``pid`` (``py-spy dump``), a pool's numbered threads grouped ("qtp-http_3"
    -> "qtp-http pool"), with the function the thread runs where the name says nothing ("Thread-12 (_work)")."""
    import re
    import subprocess

    dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    names = {}
    for tid, name in re.findall(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump, re.M):
        names[int(tid)] = re.sub(r"_\d+$", " pool", re.sub(r"^Thread-\d+ ", "", name))
    return names

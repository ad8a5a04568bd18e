"""The crash campaign: kill a transferring process again and again, recover, and check every property.

One driver process imports everything once and then *forks* each crashing child (a fork starts in a few
milliseconds, where a fresh interpreter takes a third of a second), so hundreds of kills fit in a minute
on two cores. Each kill is one cycle on one database pair (pairs take turns):

1. fork a child: it starts a TransactionManager from the pair's qtp.toml, whose start-up recovery resolves
   what the previous cycle left when that cycle chose the "auto" route, and reports ``READY``;
2. when recovery was due, check the pair now (see ``_workload``) before letting the child work;
3. let it transfer, and end it: a SIGKILL from outside after a random delay (scenario ``sigkill``; a few
   land during start-up, i.e. during recovery), or a failpoint set to ``crash`` (scenario = its name);
4. wait until the dead child's database sessions have ended, then recover: through ``recover_node`` (the
   code of ``qtp recover``, in a forked process so that the ``recovery_after_action`` crash kills only it)
   and check at once ("cli" route), or leave it to the next child's start-up ("auto" route).

A recovery pass that reports a problem (a branch still busy in a dying session, say) is run again, up to
five times, as an operator would; the attempts are counted. Violations are any property that fails.

``python -m qtp.testing.crash_campaign --pairs pg+pg,pg+maria --kills 200 --json out.json`` (the servers and
databases are created under ``--workdir``; see benchmarks/crash_campaign.py for the long run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from qtp.config import load_config
from qtp.coordinator import failpoints
from qtp.testing.crash_child import child_main
from qtp.recovery._node import recover_node
from qtp.testing.crash_workload import check_pair, drain, setup_database, write_config

FAILPOINT_SCENARIOS = ("before_prepare", "after_prepare_0", "after_prepare_1", "after_decision_forced",
                       "after_commit_0", "after_commit_1", "before_end_record", "recovery_after_action")
# With Logging Last Resource (``--llr``) one branch is prepared and the other (the last resource) commits the
# decision in its own COMMIT: the points around that COMMIT replace the file log's.
LLR_FAILPOINT_SCENARIOS = ("before_prepare", "after_prepare_0", "llr_before_last_commit", "llr_after_last_commit",
                           "after_commit_0", "before_end_record", "recovery_after_action")
EXPECTED = {  # the crashed transfer's outcome each failpoint forces (presumed abort before the decision)
    "before_prepare": "rolled back", "after_prepare_0": "rolled back", "after_prepare_1": "rolled back",
    "after_decision_forced": "committed", "after_commit_0": "committed", "after_commit_1": "committed",
    "before_end_record": "committed", "recovery_after_action": "committed",
    "llr_before_last_commit": "rolled back", "llr_after_last_commit": "committed",
}


def decision_point(llr: bool) -> str:
    """The first instant at which the transaction is decided (commit) and a branch is still prepared."""
    return "llr_after_last_commit" if llr else "after_decision_forced"


@dataclass
class Pair:
    name: str
    url_a: str
    url_b: str
    node_id: str
    config: Path


@dataclass
class Child:
    pid: int
    out: int
    inp: int
    buffer: bytes = b""
    lines: list[str] = field(default_factory=list)

    def read(self, timeout: float) -> str | None:
        """The next line, or None on timeout / end of output."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sel = selectors.DefaultSelector()
            sel.register(self.out, selectors.EVENT_READ)
            ready = sel.select(left)
            sel.close()
            if not ready:
                return None
            chunk = os.read(self.out, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        text = line.decode()
        self.lines.append(text)
        return text

    def send(self, command: str) -> None:
        os.write(self.inp, (command + "\n").encode())

    def kill(self) -> int:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.reap()

    def reap(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                deadline = None
            time.sleep(0.005)
        self.drain_output()
        for fd in (self.out, self.inp):
            try:
                os.close(fd)
            except OSError:
                pass
        return os.waitstatus_to_exitcode(status)

    def drain_output(self) -> None:
        try:
            os.set_blocking(self.out, False)
            while True:
                chunk = os.read(self.out, 65536)
                if not chunk:
                    break
                self.buffer += chunk
        except (BlockingIOError, OSError):
            pass
        *complete, self.buffer = self.buffer.split(b"\n")
        self.lines += [c.decode() for c in complete]


def fork_child(config: Path, spec: str | None, seed: int) -> Child:
    """Fork a transferring child that waits for ``go``."""
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(out_r)
            os.close(in_w)
            code = child_main(str(config), out_w, in_r, None, seed, spec=spec or "")
        except BaseException as exc:  # reported on the pipe; the driver treats it as a failed start
            try:
                os.write(out_w, f"ERROR {type(exc).__name__}: {exc}\n".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(in_r)
    return Child(pid, out_r, in_w)


def fork_recovery(config: Path, spec: str | None) -> tuple[int, dict | None]:
    """Run ``recover_node`` (what ``qtp recover`` runs) in a forked process; (exit code, report or None)."""
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(out_r)
            failpoints.configure(spec or "")
            report = recover_node(load_config(config), workers=4)
            os.write(out_w, json.dumps(report.to_dict(), default=str).encode())
            code = 0
        except BaseException as exc:  # reported to the driver as a failed recovery
            os.write(out_w, json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(code)
    os.close(out_w)
    data = b""
    while chunk := os.read(out_r, 1 << 20):
        data += chunk
    os.close(out_r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), (json.loads(data) if data else None)


# ---------------------------------------------------------------------------------------------- one cycle


class Campaign:
    def __init__(self, pairs: list[Pair], seed: int = 1, scenarios: tuple[str, ...] = ("sigkill",),
                 max_delay_s: float = 0.25, log=print, llr: bool = False):
        self.llr = llr
        self.pairs = pairs
        self.rng = random.Random(seed)
        self.scenarios = scenarios
        self.max_delay_s = max_delay_s
        self.log = log
        self.kills: list[dict] = []
        self.pending: dict[str, list[dict]] = {p.name: [] for p in pairs}  # kills awaiting their auto recovery
        self.done: dict[str, set[str]] = {p.name: set() for p in pairs}
        self.started: dict[str, set[str]] = {p.name: set() for p in pairs}
        self.recovery_runs = 0
        self.recovery_retries = 0
        self.recovery_seconds: list[float] = []

    def run(self, kills: int, deadline_s: float | None = None) -> dict:
        began = time.monotonic()
        for n in range(kills):
            if deadline_s is not None and time.monotonic() - began > deadline_s:
                self.log(f"time budget of {deadline_s:.0f} s reached after {n} kills")
                break
            self.cycle(self.pairs[n % len(self.pairs)])
            if (n + 1) % 100 == 0:
                bad = sum(1 for r in self.kills if r["violations"])
                self.log(f"{n + 1} kills, {time.monotonic() - began:.0f} s, {bad} with violations")
        for pair in self.pairs:
            self.settle(pair)
        return self.summary(time.monotonic() - began)

    def cycle(self, pair: Pair) -> None:
        scenario = self._scenario()
        route = self.rng.choice(("cli", "auto"))
        record = {"pair": pair.name, "scenario": scenario, "route": route, "violations": []}
        spec = None
        if scenario == "recovery_after_action":
            spec = f"{decision_point(self.llr)}=crash@{self.rng.randint(1, 3)}"
        elif scenario != "sigkill":
            spec = f"{scenario}=crash@{self.rng.randint(1, 3)}"
        child = fork_child(pair.config, spec, self.rng.randrange(1 << 30))
        early = scenario == "sigkill" and self.rng.random() < 0.1
        if early:  # a kill that lands during start-up, which may be in the middle of recovery
            time.sleep(self.rng.uniform(0.0, 0.08))
            ready = None
        else:
            ready = self._ready(child, pair, record)
        if ready is not None:
            child.send("go")
            if scenario == "sigkill":
                time.sleep(self.rng.uniform(0.0, self.max_delay_s))
        code = child.kill() if scenario == "sigkill" or ready is None else child.reap(timeout=30)
        record["child_exit"] = code
        if scenario != "sigkill" and code != -signal.SIGKILL:
            record["violations"].append(f"failpoint {scenario} did not crash the child (exit {code})")
        self._note_transfers(pair, child, record)
        drain(pair.url_a)
        drain(pair.url_b)
        if scenario == "recovery_after_action":
            self._crash_recovery(pair, record, route)
        self.pending[pair.name].append(record)
        if route == "cli":  # also settles earlier kills whose next start was itself killed before recovering
            self._recover_cli(pair, record, spec=None)
            self._check(pair, self.pending[pair.name])
            self.pending[pair.name] = []
        self.kills.append(record)

    def _scenario(self) -> str:
        """Half the kills are random SIGKILLs (when enabled), the rest spread evenly over the failpoints."""
        points = [s for s in self.scenarios if s != "sigkill"]
        if not points or ("sigkill" in self.scenarios and self.rng.random() < 0.5):
            return "sigkill"
        return self.rng.choice(points)

    def _ready(self, child: Child, pair: Pair, record: dict) -> dict | None:
        """Wait for READY; run the pending auto-route check; retry recovery passes that were not clean."""
        line = child.read(timeout=60)
        if line is None or not line.startswith("READY "):
            record["violations"].append(f"child did not start: {line or child.lines[-1:]}")
            return None
        report = json.loads(line[6:])
        pending = self.pending[pair.name]
        if pending:
            self.recovery_runs += 1
            attempts = 1
            while not report["ok"] and attempts < 6:
                time.sleep(0.2)
                child.send("recover")
                report = json.loads((child.read(timeout=60) or "READY {}")[6:] or "{}") or {"ok": False}
                attempts += 1
            self.recovery_retries += attempts - 1
            self.recovery_seconds.append(report.get("duration_s", 0.0))
            pending[-1]["recovery"] = report
            if not report.get("ok"):
                pending[-1]["violations"].append(f"start-up recovery not clean: {report.get('reasons')}")
            self._check(pair, pending)
            self.pending[pair.name] = []
        return report

    def _crash_recovery(self, pair: Pair, record: dict, route: str) -> None:
        """The scenario ``recovery_after_action``: the recovery itself dies after its first action."""
        spec = "recovery_after_action=crash"
        if route == "cli":
            code, _ = fork_recovery(pair.config, spec)
        else:
            child = fork_child(pair.config, spec, 0)
            child.read(timeout=60)  # READY, if the start-up pass had nothing to act on
            code = child.kill()
        record["recovery_crash_exit"] = code

    def _recover_cli(self, pair: Pair, record: dict, spec: str | None) -> None:
        self.recovery_runs += 1
        for attempt in range(6):
            code, report = fork_recovery(pair.config, spec)
            if code == 0 and report is not None and report.get("ok"):
                break
            self.recovery_retries += 1
            time.sleep(0.2)
        record["recovery"] = {k: report.get(k) for k in ("ok", "committed", "rolled_back", "ended", "duration_s",
                                                         "reasons")} if report else None
        if report is None or not report.get("ok"):
            record["violations"].append(f"recovery not clean after 6 runs: {report and report.get('reasons')}")
        else:
            self.recovery_seconds.append(report["duration_s"])

    def _note_transfers(self, pair: Pair, child: Child, record: dict) -> None:
        started = [line[2:] for line in child.lines if line.startswith("T ")]
        done = {line[2:] for line in child.lines if line.startswith("D ")}
        self.started[pair.name].update(started)
        self.done[pair.name].update(done)
        record["transfers"] = len(done)
        record["in_progress"] = started[-1] if started and started[-1] not in done else None
        failed = [line for line in child.lines if line.startswith("F ")]
        if failed:
            record["failed"] = failed[:3]

    def _check(self, pair: Pair, records: list[dict]) -> None:
        """Check the pair once after recovery; classify the transfer each of ``records`` (kills) cut off."""
        check = check_pair(pair.url_a, pair.url_b, pair.node_id, self.done[pair.name], self.started[pair.name])
        for record in records:
            record["violations"] += check.violations
            record["update_s"] = round(check.update_s, 4)
            tid = record.get("in_progress")
            record["outcome"] = "no transfer in progress" if tid is None else (
                "committed" if check.committed(tid) else "rolled back")
            expected = EXPECTED.get(record["scenario"])
            if expected and tid is not None and record["outcome"] != expected:
                record["violations"].append(f"crash at {record['scenario']}: transfer {record['outcome']}, "
                                            f"expected {expected}")
            if record["violations"]:
                self.log(f"VIOLATION {json.dumps(record)}")

    def settle(self, pair: Pair) -> None:
        """Recover the pair's last kill if it waits for an automatic start-up recovery."""
        if not self.pending[pair.name]:
            return
        child = fork_child(pair.config, None, 0)
        if self._ready(child, pair, {"violations": []}) is not None:
            child.send("exit")
        child.reap(timeout=30)

    def summary(self, seconds: float) -> dict:
        per = {}
        for record in self.kills:
            key = record["scenario"]
            entry = per.setdefault(key, Counter())
            entry[record.get("outcome", "not checked")] += 1
            entry["kills"] += 1
            entry["violations"] += bool(record["violations"])
        prepared_left = {}
        for pair in self.pairs:
            final = check_pair(pair.url_a, pair.url_b, pair.node_id, self.done[pair.name], self.started[pair.name])
            prepared_left[pair.name] = final.prepared
            if final.violations:
                self.kills.append({"pair": pair.name, "scenario": "final check", "violations": final.violations})
        violations = [r for r in self.kills if r["violations"]]
        return {
            "llr": self.llr,
            "kills": sum(1 for r in self.kills if r["scenario"] != "final check"),
            "seconds": round(seconds, 1),
            "violations": len(violations),
            "violation_records": violations[:20],
            "per_scenario": {k: dict(v) for k, v in sorted(per.items())},
            "per_pair": dict(Counter(r["pair"] for r in self.kills)),
            "routes": dict(Counter(r.get("route") for r in self.kills)),
            "transfers_acknowledged": {p: len(d) for p, d in self.done.items()},
            "prepared_left": prepared_left,
            "recovery_runs": self.recovery_runs,
            "recovery_retries": self.recovery_retries,
            "recovery_s_mean": round(sum(self.recovery_seconds) / max(1, len(self.recovery_seconds)), 4),
            "recovery_s_max": round(max(self.recovery_seconds, default=0.0), 4),
        }


# ---------------------------------------------------------------------------------------------- set-up


def make_pairs(names: list[str], pg_url, maria_url, workdir: Path, tag: str, llr: bool = False) -> list[Pair]:
    """Create the databases and qtp.toml of each named pair (``pg+pg``, ``pg+maria``, ``maria+maria``).

    ``pg_url(db)`` / ``maria_url(db)`` create a database and return its URL.
    """
    pairs = []
    for name in names:
        kinds = name.split("+")
        slug = name.replace("+", "_")
        urls = [(pg_url if kind == "pg" else maria_url)(f"{tag}_{slug}_{side}") for kind, side in zip(kinds, "ab")]
        for url in urls:
            setup_database(url)
        node = f"{tag}-{slug}"[:30]
        config = write_config(workdir / f"{slug}.toml", node, workdir / "logs", urls[0], urls[1], interval=0,
                              llr=llr)
        pairs.append(Pair(name, urls[0], urls[1], node, config))
    return pairs


def main(argv: list[str] | None = None) -> int:
    from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres

    parser = argparse.ArgumentParser(prog="python -m qtp.testing.crash_campaign")
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--pairs", default="pg+pg,pg+maria,maria+maria")
    parser.add_argument("--scenarios", default="sigkill", help="comma list: sigkill and/or failpoint names, or 'all'")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--pg-root", type=Path, help="an EmbeddedPostgres root to use (default: workdir/pg)")
    parser.add_argument("--maria-root", type=Path, help="an EmbeddedMariaDB root to use (default: workdir/maria)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new kills after this long")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--tag", default="camp")
    parser.add_argument("--llr", action="store_true", help="commit with Logging Last Resource (default: file log)")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    points = LLR_FAILPOINT_SCENARIOS if args.llr else FAILPOINT_SCENARIOS
    scenarios = ("sigkill", *points) if args.scenarios == "all" else tuple(args.scenarios.split(","))
    names = args.pairs.split(",")
    pg = maria = None
    if any("pg" in n for n in names):
        pg = EmbeddedPostgres(args.pg_root or args.workdir / "pg")
        pg.start()
    if any("maria" in n for n in names):
        maria = EmbeddedMariaDB(args.maria_root or args.workdir / "maria")
        maria.start()
    pairs = make_pairs(names, pg and pg.create_database, maria and maria.create_database, args.workdir, args.tag,
                       llr=args.llr)
    campaign = Campaign(pairs, seed=args.seed, scenarios=scenarios, llr=args.llr)
    summary = campaign.run(args.kills, args.budget_s)
    text = json.dumps(summary, indent=2, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0 if summary["violations"] == 0 and not any(summary["prepared_left"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

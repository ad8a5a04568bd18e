"""A Spark standalone cluster on loopback (one master, one worker, from the installed pyspark's own scripts):
``qtp reconcile --master spark://...`` runs its JDBC reads on the worker's executor, with nothing set up by
hand on the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest
from test_reconcile_integration import _server_rows, anomalous_tables  # noqa: F401  (fixture)

from qtp.embedded import free_port

# long tests (a quick run leaves them out: -m 'not slow')
pytestmark = pytest.mark.slow

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"


class Daemon:
    """One ``spark-class`` process, its log in a file; ``wait_for`` polls the log for a line."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str]):
        self.name, self.log = name, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen([str(SPARK_CLASS), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_for(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"the Spark {self.name} did not log {text!r}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def standalone_cluster(tmp_path) -> Iterator[tuple[str, Path]]:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_HOME": str(SPARK_CLASS.parents[1]),
           "SPARK_LOG_DIR": str(tmp_path), "PYSPARK_PYTHON": sys.executable}
    port = free_port()
    master_url = f"spark://127.0.0.1:{port}"
    work = tmp_path / "worker-work"
    master = Daemon("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                               "--webui-port", str(free_port())], tmp_path / "master.log", env)
    worker = None
    try:
        master.wait_for("I have been elected leader")
        worker = Daemon("worker", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                   "--webui-port", str(free_port()), "--cores", "1", "--memory", "1g",
                                   "--work-dir", str(work), master_url], tmp_path / "worker.log", env)
        worker.wait_for("Successfully registered with master")
        yield master_url, work
    finally:
        for daemon in (worker, master):
            if daemon is not None:
                daemon.stop()
    assert master.proc.poll() is not None and (worker is None or worker.proc.poll() is not None)


def test_reconcile_runs_on_a_standalone_cluster(anomalous_tables, standalone_cluster, tmp_path):  # noqa: F811
    client_url, server_url = anomalous_tables
    master_url, work = standalone_cluster
    report = tmp_path / "r.json"
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, "-m", "qtp.reconcile", "--quiet", "--master", master_url,
         "--conf", "spark.executor.memory=512m", "--conf", "spark.driver.memory=512m",
         "--conf", "spark.ui.enabled=false", "--mode", "full",
         "--client-url", client_url, "--client-table", "outbox", "--server-url", server_url,
         "--server-table", "applied", "--key", "id=msg_id", "--columns", "amount=amt,note",
         "--client-status-column", "status", "--json", str(report)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,  # not the repo: qtp comes by pip
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["counts"] == {
        "ok": 287, "lost": 3, "duplicated": 3, "unexpected": 2, "mismatched": 3, "applied_but_aborted": 2,
        "in_doubt": 2, "compensated": 0, "committed_but_compensated": 0,
    }
    assert data["metadata"]["server"]["rows"] == len(list(_server_rows()))
    assert data["metadata"]["spark"]["master"] == master_url
    # the executor ran on the worker, which was given the JDBC jars and qtp's code by the driver
    shipped = {path.name for path in work.glob("app-*/*/*")}
    assert {"postgresql.jar", "mariadb-java-client.jar", "qtp.zip"} <= shipped, sorted(shipped)
    executor_log = "".join(p.read_text(errors="replace") for p in work.glob("app-*/*/stderr"))
    assert "Running task" in executor_log

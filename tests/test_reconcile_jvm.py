"""The driver JVM's class archive: recorded by the first run, promoted once finished, then mapped at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qtp.reconcile import _jvm

# long tests (a quick run leaves them out: -m 'not slow')
pytestmark = pytest.mark.slow

pytest.importorskip("pyspark", reason="qtp[spark] is installed by make; the test suite requires it")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QTP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(_jvm.ENV_SWITCH, raising=False)
    jar = tmp_path / "driver.jar"
    jar.write_bytes(b"jar")
    return tmp_path / "spark-class-archive", [str(jar)]


def test_the_first_start_records_an_archive_for_this_set_of_jars(cache):
    folder, jars = cache
    options, what = _jvm.options(jars)
    key = _jvm.archive_key(jars)
    assert what == "recording"
    assert f"-XX:ArchiveClassesAtExit={folder / f'{key}.jsa.{os.getpid()}.part'}" in options.split()


def test_a_finished_recording_is_promoted_and_mapped(cache):
    folder, jars = cache
    key = _jvm.archive_key(jars)
    folder.mkdir(parents=True)
    (folder / f"{key}.jsa.123.part").write_bytes(_jvm.MAGIC + b"\0" * 64)
    options, what = _jvm.options(jars)
    assert what == "used" and f"-XX:SharedArchiveFile={folder / f'{key}.jsa'}" in options.split()
    assert sorted(p.name for p in folder.iterdir()) == [f"{key}.jsa"]


def test_a_recording_cut_short_is_deleted_and_one_being_written_is_left_alone(cache):
    folder, jars = cache
    key = _jvm.archive_key(jars)
    folder.mkdir(parents=True)
    writing = folder / f"{key}.jsa.7.part"
    writing.write_bytes(b"\0" * 64)  # no header yet: the JVM writes it last
    assert _jvm.options(jars) == ("", "off")  # another run's JVM may still be writing: neither used nor raced
    assert writing.exists()
    old = time.time() - _jvm.WRITING - 10
    os.utime(writing, (old, old))
    options, what = _jvm.options(jars)
    assert what == "recording" and not writing.exists()


def test_other_jars_or_a_changed_jar_get_their_own_archive(cache):
    folder, jars = cache
    key = _jvm.archive_key(jars)
    Path(jars[0]).write_bytes(b"a newer jar")
    assert _jvm.archive_key(jars) != key
    assert _jvm.archive_key([*jars, jars[0] + ".other"]) != _jvm.archive_key(jars)


def test_old_archives_are_pruned_and_the_switch_turns_it_all_off(cache, monkeypatch):
    folder, jars = cache
    folder.mkdir(parents=True)
    for i in range(6):
        old = folder / f"old{i}.jsa"
        old.write_bytes(_jvm.MAGIC)
        os.utime(old, (1000 + i, 1000 + i))
    key = _jvm.archive_key(jars)
    (folder / f"{key}.jsa").write_bytes(_jvm.MAGIC)
    assert _jvm.options(jars)[1] == "used"
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{key}.jsa", "old5.jsa", "old4.jsa", "old3.jsa"])
    monkeypatch.setenv(_jvm.ENV_SWITCH, "off")
    assert _jvm.options(jars) == ("", "off")


CHILD = """
import json, os
from qtp.reconcile._job import DRIVER_JVM, spark_session
spark = spark_session("local[1]", {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                                   "spark.driver.extraJavaOptions": os.environ.get("EXTRA_JAVA", "")},
                      {"postgresql"}, light=True)
df = spark.range(1000)
assert df.groupBy((df.id % 7).alias("m")).count().count() == 7
args = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
print(json.dumps({**DRIVER_JVM[spark.sparkContext.applicationId], "args": [str(a) for a in args]}))
"""


def _child(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_real_driver_jvm_records_the_archive_at_exit_and_the_next_one_maps_it(tmp_path):
    env = {**os.environ, "QTP_CACHE_DIR": str(tmp_path)}
    env.pop(_jvm.ENV_SWITCH, None)
    first = _child(env)
    assert first["class_archive"] == "recording" and first["compiler"] == "C1 only"
    assert any(a.startswith("-XX:ArchiveClassesAtExit=") for a in first["args"])
    assert "-XX:TieredStopAtLevel=1" in first["args"]
    folder = tmp_path / "spark-class-archive"
    deadline = time.time() + 240  # the JVM writes the archive after the Python process has gone
    while time.time() < deadline and not any(_jvm._finished(p) for p in folder.glob("*.part")):
        time.sleep(0.1)
    loaded = tmp_path / "class-load.log"
    second = _child({**env, "EXTRA_JAVA": f"-Xlog:class+load=info:file={loaded}"})
    assert second["class_archive"] == "used"
    archive = next(folder.glob("*.jsa"))
    assert f"-XX:SharedArchiveFile={archive}" in second["args"]
    # the JVM really mapped it: Spark's own classes came from the dynamic archive ("top" layer), not the jars
    spark_classes = [line for line in loaded.read_text().splitlines() if " org.apache.spark." in line]
    from_archive = [line for line in spark_classes if "source: shared objects file (top)" in line]
    assert len(spark_classes) > 1000 and len(from_archive) > 0.5 * len(spark_classes)  # lambdas are not archived

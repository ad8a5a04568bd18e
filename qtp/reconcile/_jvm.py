"""A class-data-sharing archive for the Spark driver's JVM, so that a reconciliation starts in seconds.

Most of a local Spark start is the JVM loading and verifying some 15,000 classes from Spark's jars. Java 17
can record the classes an application loaded into a dynamic CDS archive when it exits
(``-XX:ArchiveClassesAtExit``) and map that archive at the next start (``-XX:SharedArchiveFile``), which skips
the parsing and verification. On the 2-core benchmark machine the SparkSession start fell from 7.6 s to
3.4 s and the first job from 3.3 s to 1.4 s (benchmarks/RESULTS.md, issue 12).

The first run that finds no archive records one: its JVM writes ``<key>.jsa.<pid>.part`` when it exits (some
tens of seconds after the job, in the JVM's own exit). A later run renames a finished part to ``<key>.jsa``
and uses it. The key hashes what the archive depends on (the java binary, pyspark, the extra jars); the JVM
checks the class path and the jars' sizes and times itself and ignores an archive that does not match. A
part is finished when its header, which the JVM writes last, carries the dynamic archive's magic number. ``QTP_SPARK_CLASS_ARCHIVE=off`` turns all of this off; the archives live in
``$QTP_CACHE_DIR`` (default ``$XDG_CACHE_HOME/qtp`` or ``~/.cache/qtp``), in ``spark-class-archive``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

ENV_SWITCH = "QTP_SPARK_CLASS_ARCHIVE"
MAGIC = (0xF00BABA8).to_bytes(4, "little")  # a dynamic CDS archive's header starts with it (JDK 17, x86/ARM)
WRITING = 300  # seconds: a part changed this recently may still be being written
KEEP = 4  # archives kept per cache folder (one per set of jars and java); older ones are deleted
QUIET = "-Xlog:cds=off,cds+dynamic=off"  # recording lists every class it skips; nothing the user can act on


def cache_dir() -> Path:
    base = os.environ.get("QTP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "qtp")
    return Path(base) / "spark-class-archive"


def archive_key(jars: Sequence[str]) -> str:
    """A name for the archive of this java, this pyspark and these jars."""
    import pyspark

    home = os.environ.get("JAVA_HOME")
    java = shutil.which("java", path=os.path.join(home, "bin") if home else None)  # as spark-submit finds it
    parts = [os.path.realpath(java) if java else "java?", pyspark.__version__, os.path.dirname(pyspark.__file__),
             *sorted(jars)]
    for path in parts[:1] + list(jars):
        try:
            stat = os.stat(path)
            parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            parts.append("missing")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _finished(part: Path) -> bool:
    try:
        with part.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def options(jars: Sequence[str]) -> tuple[str, str]:
    """(JVM options, what they do: ``used``, ``recording`` or ``off``) for a driver JVM about to start."""
    if os.environ.get(ENV_SWITCH, "").lower() in ("0", "off", "false", "no"):
        return "", "off"
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return "", "off"
    key = archive_key(jars)
    final = folder / f"{key}.jsa"
    recording = False
    for part in sorted(folder.glob(f"{key}.jsa.*.part")):
        try:
            if not final.exists() and _finished(part):
                os.replace(part, final)
            elif time.time() - part.stat().st_mtime < WRITING:
                recording = True  # a JVM is writing it now
            else:
                part.unlink()  # cut short, or superseded
        except OSError:
            continue  # another run moved or removed it first
    if final.exists():
        _prune(folder, keep=final)
        return f"-XX:SharedArchiveFile={final} {QUIET}", "used"
    if recording:
        return "", "off"
    return f"-XX:ArchiveClassesAtExit={folder / f'{key}.jsa.{os.getpid()}.part'} {QUIET}", "recording"


def _prune(folder: Path, keep: Path) -> None:
    archives = sorted(folder.glob("*.jsa"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [a for a in archives if a != keep][KEEP - 1:]:
        old.unlink(missing_ok=True)

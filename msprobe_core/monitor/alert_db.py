"""``alert.inform`` with ``recipient: database``: anomalies in an SQLite table, queryable while training runs.

Standard library only (``sqlite3``). Every rank opens the same file; the database is put in WAL mode
(readers never block the writers, writers queue on a busy timeout instead of failing), and each step's
anomalies are written in one short transaction, so a crash loses at most the step in flight. Tables::

    anomalies(id, run, session, rank, event, step, micro_step, stage, call_id, kind, name, module, metric,
              value, baseline, rule, pp_stage, reached, last_step, description, created_at, updated_at,
              capture)
    skipped_steps(id, run, session, rank, step, origin, overflowed, created_at)

``run`` groups the ranks of one training run (``TORCHELASTIC_RUN_ID`` under torchrun, else the monitor's
output folder); ``session`` is one process (host:pid:start time), so a new run never overwrites an old
one's rows. ``event`` numbers a rank's events; a row is updated (``reached``, ``last_step``) while its
fault spreads. NaN values are stored as NULL (SQLite has no NaN), Inf as SQLite's infinity. Example::

    sqlite3 anomalies.db "SELECT step, rank, kind, name, metric, value, reached FROM anomalies ORDER BY step"
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sqlite3
import time
from datetime import datetime, timezone
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from msprobe_core.errors import ConfigError, MonitorInputError
from msprobe_core.monitor.anomaly import Anomaly
from msprobe_core.monitor.detector import SkippedStep

logger = logging.getLogger("msprobe_core.monitor")

BUSY_TIMEOUT_S = 60.0
"""How long a writer waits for another rank's transaction before giving up on a step's rows."""

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS anomalies (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run TEXT NOT NULL, session TEXT NOT NULL, rank INTEGER NOT NULL, event INTEGER NOT NULL,
        step INTEGER NOT NULL, micro_step INTEGER, stage TEXT NOT NULL, call_id INTEGER NOT NULL,
        kind TEXT NOT NULL, name TEXT NOT NULL, module TEXT NOT NULL, metric TEXT NOT NULL,
        value REAL, baseline REAL, rule TEXT NOT NULL, pp_stage INTEGER NOT NULL,
        reached INTEGER NOT NULL, last_step INTEGER, description TEXT NOT NULL,
        created_at TEXT NOT NULL, updated_at TEXT NOT NULL,
        UNIQUE (session, event))""",
    "CREATE INDEX IF NOT EXISTS anomalies_run_step ON anomalies (run, step, rank)",
    """CREATE TABLE IF NOT EXISTS skipped_steps (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run TEXT NOT NULL, session TEXT NOT NULL, rank INTEGER NOT NULL, step INTEGER NOT NULL,
        origin TEXT NOT NULL, overflowed TEXT NOT NULL, created_at TEXT NOT NULL)""",
)
_COLUMNS = ("run", "session", "rank", "event", "step", "micro_step", "stage", "call_id", "kind", "name", "module",
            "metric", "value", "baseline", "rule", "pp_stage", "reached", "last_step", "description",
            "created_at", "updated_at", "capture")
_ADDED_COLUMNS = {"capture": "TEXT"}
"""Columns added after the first schema: a database written by an older version gets them when opened."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _real(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else v


def run_label(output_dir: str | os.PathLike) -> str:
    """The label the ranks of one run share: torchrun's run id, else the monitor's output folder."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or str(Path(output_dir).resolve())


class AnomalyDatabase:
    """One rank's connection to the anomaly database."""

    def __init__(self, path: str | os.PathLike, run: str, rank: int, connection_str: str | None = None):
        self.path = Path(path)
        self.run = run
        self.rank = rank
        self.session = f"{socket.gethostname()}:{os.getpid()}:{time.time():.6f}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
            self._conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = NORMAL")
            with self._transaction():
                for statement in _SCHEMA:
                    self._conn.execute(statement)
                have = {r[1] for r in self._conn.execute("PRAGMA table_info(anomalies)")}
                for column, sql_type in _ADDED_COLUMNS.items():
                    if column not in have:
                        self._conn.execute(f"ALTER TABLE anomalies ADD COLUMN {column} {sql_type}")
        except (OSError, sqlite3.Error) as e:
            raise ConfigError("alert.inform.connection_str", connection_str or str(path),
                              f"an SQLite database file this process can create and write ({e})") from None

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: it takes the write lock at once, so ranks queue instead of deadlocking."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def write(self, opened: Iterable[Anomaly], grew: Iterable[Anomaly], skipped: SkippedStep | None = None) -> None:
        """Insert new events, update grown ones, record a skipped step: one transaction. Never raises."""
        opened, grew = list(opened), list(grew)
        if not opened and not grew and skipped is None:
            return
        now = _now()
        try:
            with self._transaction() as conn:
                for a in opened:
                    row = (self.run, self.session, a.rank, a.event, a.step, a.micro_step, a.stage, a.call_id, a.kind,
                           a.name, a.module, a.metric, _real(a.value), _real(a.baseline), a.rule, a.pp_stage,
                           a.reached, a.last_step, a.describe(), now, now, a.capture)
                    conn.execute(f"INSERT OR REPLACE INTO anomalies ({', '.join(_COLUMNS)}) "
                                 f"VALUES ({', '.join('?' * len(_COLUMNS))})", row)
                for a in grew:
                    conn.execute("UPDATE anomalies SET reached = ?, last_step = ?, description = ?, updated_at = ? "
                                 "WHERE session = ? AND event = ?",
                                 (a.reached, a.last_step, a.describe(), now, self.session, a.event))
                if skipped is not None:
                    conn.execute("INSERT INTO skipped_steps (run, session, rank, step, origin, overflowed, created_at) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?)", (self.run, self.session, self.rank, skipped.step,
                                                                  skipped.origin, ",".join(skipped.overflowed), now))
        except sqlite3.Error as e:  # a locked or full disk must not stop training; the log and files still have it
            logger.error("monitor: writing anomalies to %s failed: %s", self.path, e)

    def close(self) -> None:
        try:
            self._conn.close()
        except sqlite3.Error:  # pragma: no cover
            pass


def read_anomalies(path: str | os.PathLike) -> list[Anomaly]:
    """Every anomaly in a database written by ``AnomalyDatabase`` (all runs and ranks), unordered.

    Raises ``MonitorInputError`` when the file is not such a database."""
    fields = ("rank", "step", "micro_step", "stage", "call_id", "kind", "name", "module", "metric", "value", "baseline",
              "rule", "pp_stage", "event", "reached", "last_step")
    try:
        con = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            if "capture" in {r[1] for r in con.execute("PRAGMA table_info(anomalies)")}:
                fields += ("capture",)
            rows = con.execute(f"SELECT {', '.join(fields)} FROM anomalies ORDER BY id").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        raise MonitorInputError(f"anomaly database '{path}' is not readable: {e}") from None
    out = []
    for r in rows:
        d = dict(zip(fields, r))
        d["value"] = math.nan if d["value"] is None else d["value"]
        out.append(Anomaly(**d))
    return out

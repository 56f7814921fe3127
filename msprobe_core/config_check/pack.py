"""The config_check pack: one zip file, written atomically, shared by every rank of a run.

Layout (all JSON)::

    config_check_pack.zip
    ├── pack.json              schema, framework, run id, hash algorithm, what was collected
    ├── env.json               {"process": {VAR: value}, "script": {VAR: value exported by the launch scripts}}
    ├── pip.json               {"python": ..., "packages": {name: version}}
    ├── hyperparameters.json   msprobe_core.hparams' document (normalized names, raw sections, unparsed lines)
    └── rank{R}/
        ├── step{S}/weights.json   per parameter: dtype, shape, max, min, mean, norm, hash (micro-step S)
        ├── step{S}/dataset.json   per forward input of micro-step S: the same statistics and hash
        └── random.json            random-number API call sites with their stacks, per micro-step

Every update (rank 0's static part, each rank's micro-step) takes an exclusive ``flock`` on the pack's
folder, copies the current zip with the new members into a temporary file next to it and renames it over
the pack, so a reader never sees a half-written zip and no rank overwrites another's members. The pack
belongs to one run (``pack.json``'s ``run_id``); a pack another run wrote is never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Mapping, Optional

from msprobe_core import __version__
from msprobe_core.config_check.exceptions import PackInputError, PackPathError

SCHEMA = "msprobe_core.config_check_pack/1"
DEFAULT_PACK = "config_check_pack.zip"
META = "pack.json"
ENV = "env.json"
PIP = "pip.json"
HYPERPARAMETERS = "hyperparameters.json"
RANDOM = "random.json"
WEIGHTS = "weights.json"
DATASET = "dataset.json"
HASH_ALGORITHM = "sha1"


def step_member(rank: int, step: int, name: str) -> str:
    """``rank{R}/step{S}/{name}``."""
    return f"rank{rank}/step{step}/{name}"


def rank_member(rank: int, name: str) -> str:
    return f"rank{rank}/{name}"


def to_json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=1, ensure_ascii=False, default=str) + "\n").encode("utf-8")


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def run_identity(world_size: int) -> str:
    """Who may add to a pack: the same value on every rank of one run and a new one for the next run.

    ``MSPROBE_CONFIG_CHECK_RUN_ID`` when set; else torchelastic's run id (``torchrun --standalone``,
    rendezvous runs); else, for several ranks, the launcher process (the ranks' common parent: torchrun's
    agent, the DeepSpeed launcher, ``mp.spawn``'s parent) with its start time; for one process, itself.
    """
    explicit = os.environ.get("MSPROBE_CONFIG_CHECK_RUN_ID")
    if explicit:
        return explicit
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return f"torchelastic:{elastic}:{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    pid = os.getppid() if world_size > 1 else os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Exclusive ``flock`` on the folder itself (nothing is left behind; a no-op where flock is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class PackWriter:
    """Adds members to one run's pack (see the module docstring). ``meta`` goes into ``pack.json``."""

    def __init__(self, path: str | os.PathLike, run_id: Optional[str] = None, meta: Optional[Mapping[str, Any]] = None):
        self.path = Path(path).expanduser().absolute()
        self.run_id = run_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        self.meta = dict(meta or {})
        if self.path.is_dir():
            raise PackPathError(f"output_zip_path '{self.path}' is a folder; give the path of a .zip file "
                                f"(for example {self.path / DEFAULT_PACK})")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _folder_lock(self.path.parent):
            self._check_owner()

    def _check_owner(self) -> None:
        if not self.path.exists():
            return
        owner = None
        try:
            with zipfile.ZipFile(self.path) as zf:
                owner = json.loads(zf.read(META)).get("run_id")
        except (zipfile.BadZipFile, KeyError, ValueError, OSError):
            pass
        if owner != self.run_id:
            what = "another run's config_check pack" if owner else "a file that is not this run's pack"
            raise PackPathError(f"output_zip_path '{self.path}' already exists and is {what}; it is not "
                                "overwritten: remove it or choose another path")

    def update(self, members: Mapping[str, Any]) -> None:
        """Write ``members`` (name -> JSON-able value or bytes) into the pack, replacing members of the
        same name this run wrote before; atomic (temporary zip + rename) under the folder lock."""
        data = {name: value if isinstance(value, bytes) else to_json_bytes(value) for name, value in members.items()}
        with _folder_lock(self.path.parent):
            self._check_owner()
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as out:
                    existing = self.path.exists()
                    if existing:
                        with zipfile.ZipFile(self.path) as old:
                            for info in old.infolist():
                                if info.filename not in data:
                                    out.writestr(info, old.read(info))
                    else:
                        out.writestr(META, to_json_bytes(self._meta()))
                    for name, payload in data.items():
                        out.writestr(name, payload)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _meta(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "run_id": self.run_id, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "tool": f"msprobe_core {__version__}", "hash": HASH_ALGORITHM, **self.meta}


# ------------------------------------------------------------------------------------------ reading
def _check_member(name: str) -> None:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or (p.parts and ":" in p.parts[0]):
        raise PackInputError(f"pack member '{name}' would be written outside the output folder; not extracted")


def extract(pack: str | os.PathLike, dest: Path) -> Path:
    """Copy a pack (a zip, or a folder holding an extracted one) into ``dest``; checks it is a pack."""
    src = Path(pack)
    if src.is_dir():
        if not (src / META).is_file():
            raise PackInputError(f"'{src}' is a folder without {META}: not a config_check pack")
        shutil.copytree(src, dest)
        return dest
    if not src.is_file():
        raise PackInputError(f"config_check pack '{src}' does not exist")
    try:
        with zipfile.ZipFile(src) as zf:
            names = zf.namelist()
            if META not in names:
                raise PackInputError(f"'{src}' is a zip without {META}: not a config_check pack "
                                     "(written by `python -m msprobe_core config_check` or ConfigChecker)")
            for name in names:
                _check_member(name)
            zf.extractall(dest)
    except zipfile.BadZipFile as e:
        raise PackInputError(f"'{src}' is not a zip file ({e}): not a config_check pack") from None
    return dest


def is_pack(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a config_check pack (a zip or a folder holding ``pack.json``)."""
    p = Path(path)
    if p.is_dir():
        return (p / META).is_file()
    if not zipfile.is_zipfile(p):
        return False
    try:
        with zipfile.ZipFile(p) as zf:
            return META in zf.namelist() and json.loads(zf.read(META)).get("schema") == SCHEMA
    except (zipfile.BadZipFile, ValueError, OSError):
        return False


class PackFolder:
    """An extracted pack: typed access to its members."""

    def __init__(self, root: Path):
        self.root = root
        self.meta = self.read(META, {})

    def read(self, name: str, default: Any = None) -> Any:
        path = self.root / name
        if not path.is_file():
            return default
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise PackInputError(f"pack member {path} is not valid JSON: {e}") from None

    def ranks(self) -> list[int]:
        return sorted(int(p.name[4:]) for p in self.root.glob("rank*") if p.is_dir() and p.name[4:].isdigit())

    def steps(self, rank: int) -> list[int]:
        return sorted(int(p.name[4:]) for p in (self.root / f"rank{rank}").glob("step*")
                      if p.is_dir() and p.name[4:].isdigit())

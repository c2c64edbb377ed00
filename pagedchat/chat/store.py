"""Sessions on disk: $XDG_DATA_HOME/pagedchat/sessions/NAME.json (default ~/.local/share/pagedchat/...).

Writes are atomic (a temp file in the same folder, fsync, os.replace), files are 0600 and folders 0700, so
a crash or a full disk never leaves a half-written session. A file that cannot be parsed is moved aside as
NAME.json.corrupt with a one-line report; the other sessions stay usable.

Two writers of one session (the REPL and a browser tab, two tabs) never overwrite each other: a save holds a
lock on the sessions folder while it checks that the file is still at the revision the writer's copy was
based on, and raises StaleSession otherwise.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:     # not on POSIX: saves are still atomic, only the two-writer check is unlocked
    fcntl = None

from pagedchat.chat.session import Session, check_name
from pagedchat.chat.tree import now_iso
from pagedchat.errors import UserError


class SaveError(UserError):
    """A session could not be written; the previous copy on disk is intact."""


class StaleSession(UserError):
    """Another writer saved the session since this copy was read: nothing was written."""

    def __init__(self, name: str, on_disk: int, based_on: int):
        super().__init__(f"session {name} was changed elsewhere (another window or tab saved revision {on_disk}; "
                         f"this copy is revision {based_on}): reload it")
        self.on_disk = on_disk


class CorruptSession(UserError):
    """A session file could not be read back; it has been moved aside."""


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "pagedchat"


def make_private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)  # it existed already, readable by others (an older install, a manual mkdir)
    return path


@dataclass
class SessionInfo:
    name: str
    model: str
    messages: int
    branches: int
    updated: str
    size: int


class SessionStore:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else data_dir() / "sessions"

    def path(self, name: str) -> Path:
        return self.root / f"{check_name(name)}.json"

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name[:-5] for p in self.root.glob("*.json") if p.is_file())

    # -- write ----------------------------------------------------------------------------------------------
    def save(self, session: Session) -> Path:
        """Write the session as revision session.revision + 1; StaleSession when the file is no longer at
        session.revision (another writer saved it), SaveError when it cannot be written."""
        with self._locked(session.name):
            on_disk = self.revision(session.name)
            if on_disk is not None and on_disk != session.revision:
                raise StaleSession(session.name, on_disk, session.revision)
            self._write(session, session.revision + 1)
        return self.path(session.name)

    def revision(self, name: str) -> int | None:
        """The revision of the saved file (None: no readable file)."""
        try:
            data = json.loads(self.path(name).read_bytes())
        except (OSError, ValueError):
            return None
        revision = data.get("revision", 0) if isinstance(data, dict) else None
        return revision if isinstance(revision, int) else None

    @contextmanager
    def _locked(self, name: str):
        """The sessions folder locked across processes while a save checks the revision and writes (a lock on
        the folder itself: no lock files beside the sessions; a save takes milliseconds)."""
        try:
            make_private_dir(self.root.parent)
            make_private_dir(self.root)
            fd = os.open(self.root, os.O_RDONLY)
        except OSError as e:
            raise SaveError(f"could not save session {name} in {self.root}: {e.strerror} (the previous copy on "
                            f"disk is unchanged)") from None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)       # closing releases the lock

    def _write(self, session: Session, revision: int) -> None:
        target = self.path(session.name)
        updated = now_iso()
        data = json.dumps({**session.to_dict(), "updated": updated, "revision": revision}, ensure_ascii=False,
                          separators=(",", ":")).encode()
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{session.name}.", suffix=".tmp", dir=self.root)  # mode 0600
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            tmp = None
            session.updated, session.revision = updated, revision
        except OSError as e:
            reason = e.strerror or str(e)
            raise SaveError(f"could not save session {session.name} to {target}: {reason} "
                            f"(the previous copy on disk is unchanged)") from None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def remove(self, name: str) -> Path:
        path = self.path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise UserError(f"no session named {name!r} in {self.root}") from None
        except OSError as e:
            raise UserError(f"could not remove {path}: {e.strerror}") from None
        return path

    # -- read -----------------------------------------------------------------------------------------------
    def load(self, name: str) -> Session:
        path = self.path(name)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise UserError(f"no session named {name!r} in {self.root}") from None
        except OSError as e:
            raise UserError(f"cannot read session {path}: {e.strerror}") from None
        try:
            return Session.from_dict(json.loads(raw), name)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            aside = self._set_aside(path)
            reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise CorruptSession(f"session {name} is corrupt ({reason}); moved it aside to {aside}") from None

    def _set_aside(self, path: Path) -> Path:
        aside = path.with_name(path.name + ".corrupt")
        n = 1
        while aside.exists():
            aside = path.with_name(f"{path.name}.corrupt.{n}")
            n += 1
        try:
            os.replace(path, aside)
        except OSError:
            return path  # cannot move it (read-only folder): leave it, the report still names it
        return aside

    def list(self) -> tuple[list[SessionInfo], list[str]]:
        """Every readable session (newest first) and one warning line per corrupt file set aside."""
        infos, warnings = [], []
        for name in self.names():
            try:
                session = self.load(name)
            except UserError as e:
                warnings.append(str(e))
                continue
            infos.append(SessionInfo(name, session.model, session.num_messages, len(session.tree.leaves()),
                                     session.updated, self.path(name).stat().st_size))
        infos.sort(key=lambda i: i.updated, reverse=True)
        return infos, warnings

    def most_recent(self) -> str | None:
        infos, _ = self.list()
        return infos[0].name if infos else None


def history_file() -> Path:
    """The REPL's input history (prompt-toolkit FileHistory), private like the sessions."""
    path = make_private_dir(data_dir()) / "history"
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chmod(path, 0o600)
    return path

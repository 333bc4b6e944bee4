"""A sandbox per trajectory: a fresh working copy of a task's files, and commands run in it isolated and bounded.

    sb = Sandbox.create({"pkg/mod.py": b"...", "tests/test_mod.py": b"..."})   # or Sandbox.create(Path("repo"))
    r = sb.run("python3 tests/test_mod.py")          # ToolResult: exit code, output, wall time, limits hit
    final = sb.snapshot(grader_dir)                   # a copy of the final state, for the grader
    sb.close()

**The working copy** holds the task's visible files only: a source folder is copied without version control
(``.git``, ``.hg``, ``.svn``) or anything matching ``exclude`` (reference solutions, hidden tests, patches); a
symlink, device or fifo is never copied. Its files belong to the sandbox's own uid (a random one of
``UID_RANGE``, never root). Where namespaces are available it lives on a tmpfs of ``disk_bytes`` mounted on the
host (the trainer process runs as root), unmounted by :meth:`Sandbox.close` (and at the latest when the
object is collected).

**A command** (:meth:`Sandbox.run`) runs in the jail (``syncd.trainer.agent.jail``): its own network namespace
(no network: neither the internet nor the host's 127.0.0.1, where the proxy and the store listen), mount
namespace (a read-only root of ``/usr``, ``/etc`` and the interpreter, the working copy at ``/work``: no other
file of the machine exists there -- not the hidden tests, not the grader's copy), PID namespace (whatever it
leaves running is killed when it ends), as the sandbox's uid, with :class:`Limits` (address space, CPU time,
file size, processes, open files, ``/tmp``). The host kills the whole session at ``timeout_s`` and when the
output passes ``output_kill_bytes``; it keeps the first ``output_bytes`` of stdout and of stderr. A command
never raises for what it does: the :class:`ToolResult` says how it ended.

**Isolation.** :func:`isolation` says what this machine allows: ``"namespaces"`` as root with
``CAP_SYS_ADMIN`` (what CI runs as); otherwise the sandbox refuses to start (:class:`SandboxUnavailable`)
unless created with ``allow_unisolated=True``, the stated fallback: the command then runs in its own session
with the same resource limits (and a dropped uid when root), in the working copy, but **with the machine's
network and file system** -- acceptable for trusted code only; :attr:`Sandbox.isolation` and
:meth:`Sandbox.describe` say so, and the record's ``metadata["sandbox"]`` carries it (``network: "open"``).

**The grader's copy** (:meth:`Sandbox.snapshot`) is made by the host after the agent's last command (no
process of the sandbox is alive then): regular files and folders only, bounded in count and bytes, into a folder
the sandbox never sees. Nothing the agent writes afterwards, or wrote as a link, reaches it.

Thread-safety: one sandbox per trajectory; :meth:`run` may be called from any thread, one call at a time.
"""

from __future__ import annotations

import ctypes
import fnmatch
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

__all__ = ["Limits", "ToolResult", "Sandbox", "SandboxError", "SandboxUnavailable", "isolation", "copy_tree",
           "DEFAULT_EXCLUDE", "UID_RANGE"]

JAIL = Path(__file__).with_name("jail.py")
UID_RANGE = (200_000, 1_200_000)
DEFAULT_EXCLUDE = (".git", ".hg", ".svn", "hidden_tests", "hidden_tests/*", "solution*", "reference*", "*.patch",
                   "*.diff", ".grading*", "grader*")
MAX_COPY_FILES = 10_000
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


class SandboxError(RuntimeError):
    """The sandbox could not do what the host asked (set up the jail, copy files); never what a command did."""


class SandboxUnavailable(SandboxError):
    """This machine cannot isolate commands (no root or no namespaces) and unisolated runs were not allowed."""


@dataclass(frozen=True)
class Limits:
    """Per command: wall ``timeout_s``, ``cpu_s`` (RLIMIT_CPU), ``memory_bytes`` (RLIMIT_AS), ``file_bytes``
    (RLIMIT_FSIZE), ``processes`` (RLIMIT_NPROC of the sandbox's uid), ``open_files``, ``tmp_bytes`` (the jail's
    /tmp); output kept per stream (``output_bytes``) and the total past which it is killed
    (``output_kill_bytes``). Per sandbox: ``disk_bytes`` of the working copy (its tmpfs)."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 8 << 20
    processes: int = 64
    open_files: int = 128
    tmp_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    output_bytes: int = 16 << 10
    output_kill_bytes: int = 4 << 20

    def __post_init__(self):
        for k, v in asdict(self).items():
            if not v > 0:
                raise ValueError(f"Limits.{k} must be > 0, got {v}")


@dataclass
class ToolResult:
    """How one command ended: ``exit_code`` (``128 + signal`` when killed by one; None when the host killed
    it), ``stdout``/``stderr`` (the first ``output_bytes`` of each, decoded with replacement), the bytes each
    stream wrote in all, ``wall_s``, and ``killed``: None, ``"timeout"`` or ``"output"`` (the host's kill)."""

    exit_code: int | None
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    wall_s: float
    killed: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None

    @property
    def truncated(self) -> bool:
        return len(self.stdout.encode()) < self.stdout_bytes or len(self.stderr.encode()) < self.stderr_bytes

    def text(self) -> str:
        """One text for the model: stdout, stderr, then how it ended when not cleanly."""
        out = self.stdout + (("\n" if self.stdout and not self.stdout.endswith("\n") else "") + self.stderr
                             if self.stderr else "")
        if self.truncated:
            out += f"\n[output truncated: {self.stdout_bytes + self.stderr_bytes} bytes]"
        if self.killed == "timeout":
            out += f"\n[killed: no result after {self.wall_s:.1f} s]"
        elif self.killed == "output":
            out += "\n[killed: too much output]"
        elif self.exit_code:
            out += f"\n[exit status {self.exit_code}]"
        return out


@lru_cache(maxsize=1)
def isolation() -> str:
    """``"namespaces"`` when the jail works on this machine (root with CAP_SYS_ADMIN), else ``"none"``."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "none"
    with tempfile.TemporaryDirectory(prefix="syncd-jail-probe-") as d:
        root, work = Path(d, "root"), Path(d, "work")
        root.mkdir()
        work.mkdir()
        try:
            r = _jail(_spec(root, work, "true", 65534, 65534, Limits(), []), Limits(timeout_s=30))
        except OSError:
            return "none"
        return "namespaces" if r.exit_code == 0 else "none"


def _spec(root: Path, work: Path, command: str, uid: int, gid: int, limits: Limits, binds: list[str]) -> dict:
    prefix = os.path.realpath(sys.base_prefix)
    env = {"PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp",
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    return {"root": str(root), "work": str(work), "command": command, "uid": uid, "gid": gid, "env": env,
            "binds": [prefix, *binds], "tmp_bytes": limits.tmp_bytes,
            "limits": {"as": limits.memory_bytes, "cpu": limits.cpu_s, "fsize": limits.file_bytes,
                       "nproc": limits.processes, "nofile": limits.open_files}}


def _jail(spec: dict, limits: Limits) -> ToolResult:
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(JAIL)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    return _collect(proc, limits)


def _collect(proc: subprocess.Popen, limits: Limits) -> ToolResult:
    """Read both streams (keeping the first ``output_bytes`` of each), kill the session on a timeout or too much
    output, and wait for the end."""
    t0 = time.monotonic()
    kept = {1: bytearray(), 2: bytearray()}
    total = {1: 0, 2: 0}
    killed: list[str] = []
    lock = threading.Lock()

    def kill(reason: str) -> None:
        with lock:
            if not killed:
                killed.append(reason)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def pump(stream, k: int) -> None:
        while True:
            chunk = stream.read1(65536)
            if not chunk:
                return
            total[k] += len(chunk)
            room = limits.output_bytes - len(kept[k])
            if room > 0:
                kept[k] += chunk[:room]
            if total[1] + total[2] > limits.output_kill_bytes:
                kill("output")

    readers = [threading.Thread(target=pump, args=(s, k), daemon=True)
               for s, k in ((proc.stdout, 1), (proc.stderr, 2))]
    for t in readers:
        t.start()
    try:
        proc.wait(limits.timeout_s)
    except subprocess.TimeoutExpired:
        kill("timeout")
        proc.wait()
    for t in readers:  # the session is dead: the pipes close once the namespace is gone
        t.join(5.0)
    code = proc.returncode
    code = 128 - code if code < 0 else code
    return ToolResult(None if killed else code, kept[1].decode("utf-8", "replace"),
                      kept[2].decode("utf-8", "replace"), total[1], total[2], time.monotonic() - t0,
                      killed[0] if killed else None)


def _excluded(rel: str, patterns) -> bool:
    parts = rel.split("/")
    return any(fnmatch.fnmatch(rel, p) or any(fnmatch.fnmatch(part, p) for part in parts) for p in patterns)


def copy_tree(src: Path, dst: Path, *, exclude=(), max_files: int = MAX_COPY_FILES, max_bytes: int = 1 << 30,
              owner: tuple[int, int] | None = None) -> int:
    """Copy the regular files and folders under ``src`` into ``dst`` (made if missing) without following or
    copying links, devices or fifos, skipping paths matching ``exclude`` (fnmatch on the relative path and on
    each of its parts); ``owner``: chown what is made. Returns the bytes copied; :class:`SandboxError` past
    ``max_files`` or ``max_bytes``."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    count = size = 0
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(src / rel_dir if rel_dir else src) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if _excluded(rel, exclude):
                continue
            count += 1
            if count > max_files:
                raise SandboxError(f"{src}: more than {max_files} files")
            if e.is_dir(follow_symlinks=False):
                (dst / rel).mkdir(exist_ok=True)
                stack.append(rel)
            elif e.is_file(follow_symlinks=False):
                size += e.stat(follow_symlinks=False).st_size
                if size > max_bytes:
                    raise SandboxError(f"{src}: more than {max_bytes} bytes")
                fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f, open(dst / rel, "wb") as g:
                    shutil.copyfileobj(f, g)
            else:
                continue
            if owner is not None:
                os.chown(dst / rel, *owner)
    if owner is not None:
        os.chown(dst, *owner)
    return size


def _umount(path: str) -> None:
    ctypes.CDLL(None, use_errno=True).umount2(path.encode(), _MNT_DETACH)


def _cleanup(base: str, mounted: bool) -> None:
    if mounted:
        _umount(os.path.join(base, "work"))
    shutil.rmtree(base, ignore_errors=True)


@dataclass
class Sandbox:
    """See the module docstring; make one with :meth:`create`."""

    base: Path
    limits: Limits
    uid: int
    isolation: str
    binds: list[str] = field(default_factory=list)
    calls: int = 0

    @property
    def work(self) -> Path:
        return self.base / "work"

    @classmethod
    def create(cls, files, *, limits: Limits | None = None, exclude=DEFAULT_EXCLUDE, allow_unisolated: bool = False,
               binds=(), parent: str | os.PathLike | None = None) -> "Sandbox":
        """A sandbox whose working copy holds ``files``: a folder (copied as :func:`copy_tree` does, without
        ``exclude``) or ``{relative path: bytes or str}`` (a path with ``..`` or absolute is refused).
        ``binds``: more host folders visible read-only. :class:`SandboxUnavailable` when commands cannot be
        isolated here and ``allow_unisolated`` is false."""
        limits = limits or Limits()
        mode = isolation()
        if mode == "none" and not allow_unisolated:
            raise SandboxUnavailable("commands cannot be isolated on this machine (the jail needs root with "
                                     "CAP_SYS_ADMIN for namespaces); pass allow_unisolated=True to run them with "
                                     "resource limits only, with the machine's network and files")
        base = Path(tempfile.mkdtemp(prefix="syncd-sandbox-", dir=parent))
        os.chmod(base, 0o711)  # traversable by the sandbox uid (unisolated runs), not listable
        uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0] if os.geteuid() == 0 else os.getuid()
        sb = cls(base, limits, uid, mode, [str(b) for b in binds])
        (base / "root").mkdir()
        (base / "work").mkdir()
        mounted = False
        if mode == "namespaces":
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.mount(b"tmpfs", str(sb.work).encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV),
                            f"size={limits.disk_bytes},mode=0755,uid={uid},gid={uid}".encode())
            if rc != 0:
                shutil.rmtree(base, ignore_errors=True)
                raise SandboxError(f"cannot mount the working copy's tmpfs: {os.strerror(ctypes.get_errno())}")
            mounted = True
        sb._finalizer = weakref.finalize(sb, _cleanup, str(base), mounted)
        try:
            if isinstance(files, (str, os.PathLike)):
                copy_tree(Path(files), sb.work, exclude=exclude, max_bytes=limits.disk_bytes, owner=sb._owner)
            else:
                sb.write_files(files)
        except BaseException:
            sb.close()
            raise
        return sb

    @property
    def _owner(self) -> tuple[int, int] | None:
        return (self.uid, self.uid) if os.geteuid() == 0 else None

    def write_files(self, files: dict) -> None:
        """Write ``{relative path: bytes or str}`` into the working copy (as the host, between commands: the
        paths are checked and no link is followed)."""
        for rel, data in files.items():
            parts = Path(rel).parts
            if not parts or Path(rel).is_absolute() or ".." in parts:
                raise SandboxError(f"refusing the path {rel!r} (absolute or with '..')")
            d = self.work
            for p in parts[:-1]:
                d = d / p
                if d.is_symlink() or (d.exists() and not d.is_dir()):
                    raise SandboxError(f"refusing to write {rel!r}: {d} is not a folder")
                if not d.exists():
                    d.mkdir()
                    if self._owner:
                        os.chown(d, *self._owner)
            raw = data.encode() if isinstance(data, str) else bytes(data)
            fd = os.open(d / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            if self._owner:
                os.chown(d / parts[-1], *self._owner)

    def run(self, command: str, *, timeout_s: float | None = None) -> ToolResult:
        """Run ``command`` (``/bin/sh -c``) in the working copy, isolated and bounded (the module docstring)."""
        limits = self.limits if timeout_s is None else Limits(**{**asdict(self.limits), "timeout_s": timeout_s})
        self.calls += 1
        if "\0" in command:  # no shell can be given it: the command's own failure, not the sandbox's
            msg = "sh: the command contains a NUL byte\n"
            return ToolResult(2, "", msg, 0, len(msg), 0.0)
        if self.isolation == "namespaces":
            root = self.base / f"root{self.calls}"
            root.mkdir()
            try:
                r = _jail(_spec(root, self.work, command, self.uid, self.uid, limits, self.binds), limits)
            finally:
                root.rmdir()
            if r.exit_code == 125 and r.stderr.startswith("jail: "):
                raise SandboxError(r.stderr.strip())
            return r
        return self._run_unisolated(command, limits)

    def _run_unisolated(self, command: str, limits: Limits) -> ToolResult:
        import resource

        owner = self._owner

        def limit():
            for res, v in ((resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_FSIZE, limits.file_bytes),
                           (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0)):
                resource.setrlimit(res, (v, v))
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
            if owner is not None:  # root without namespaces: at least not root
                resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
                os.setgroups([])
                os.setgid(owner[1])
                os.setuid(owner[0])

        env = _spec(self.base, self.work, command, 0, 0, limits, [])["env"]
        env["HOME"] = str(self.work)
        proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=self.work, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=limit, close_fds=True)
        return _collect(proc, limits)

    def snapshot(self, dest: str | os.PathLike, *, exclude=()) -> Path:
        """Copy the working copy's final state into ``dest`` (a folder outside the sandbox; made if missing,
        owned by the host) for the grader: regular files and folders only, at most ``limits.disk_bytes``."""
        dest = Path(dest)
        copy_tree(self.work, dest, exclude=exclude, max_bytes=self.limits.disk_bytes)
        return dest

    def describe(self) -> dict:
        """What a trajectory record's ``metadata["sandbox"]`` says about this sandbox."""
        iso = self.isolation == "namespaces"
        return {"isolation": self.isolation, "network": "restricted" if iso else "open",
                "filesystem": "working copy" if iso else "host", "uid": self.uid,
                "limits": asdict(self.limits)}

    def close(self) -> None:
        """Unmount and delete the working copy (idempotent)."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

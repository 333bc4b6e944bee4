"""The sandbox's jail: run one command isolated, as ``python -I -S jail.py`` with a JSON spec on stdin.

Standard library only and never imported by the trainer: :class:`syncd.trainer.agent.sandbox.Sandbox` runs it as a
script, in a session of its own, for every command. Needs root (``CAP_SYS_ADMIN``); it then

1. unshares the mount, network, PID, IPC and UTS namespaces: the command sees no network interface but a loopback
   that is down (neither the machine's network nor anything listening on its 127.0.0.1);
2. forks the namespace's init (PID 1; it dies with this process, ``PR_SET_PDEATHSIG``), which builds a root on a
   tmpfs -- ``/usr``, ``/etc`` and the interpreter's prefix bound read-only, ``/dev/{null,zero,urandom,random}``,
   a fresh ``/proc`` of the namespace, a size-bounded ``/tmp``, the working copy at ``/work`` -- and ``chroot`` s
   into it, so nothing else of the machine (the grader's files, the trainer's, the store) exists for the command;
3. forks the command: supplementary groups dropped, the sandbox's own uid and gid (not root), resource limits
   (address space, CPU seconds, file size, processes of that uid, open files, no core files), a clean
   environment, stdin ``/dev/null``, ``/bin/sh -c COMMAND`` in ``/work``;
4. waits for it (reaping every other process meanwhile) and exits with its status (``128 + signal`` when killed).

When the init exits the kernel kills every process left in the PID namespace: nothing the command started (in
the background, in another session) outlives it. The host kills the whole session on a timeout. A failure to
set the jail up exits 125 with a line ``jail: ...`` on stderr.

Spec: ``{"root": DIR (an empty folder: the new root's mount point), "work": DIR, "command": str, "uid": int,
"gid": int, "env": {...}, "binds": [DIR, ...] (read-only, besides /usr and /etc), "tmp_bytes": int,
"limits": {"as": bytes, "cpu": s, "fsize": bytes, "nproc": n, "nofile": n}}``.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _die(what: str, err: int | None = None) -> None:
    msg = f"jail: {what}" + (f": {os.strerror(err)}" if err else "")
    os.write(2, (msg + "\n").encode())
    os._exit(SETUP_FAILED)


def _call(what: str, rc: int) -> None:
    if rc != 0:
        _die(what, ctypes.get_errno())


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _call(f"mount {target}", _libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)))


def _bind_ro(src: str, root: str) -> None:
    target = root + src
    os.makedirs(target, exist_ok=True)
    _mount(src, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_root(spec: dict) -> None:
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for d in ["/usr", "/etc"] + list(spec.get("binds") or []):
        if os.path.isdir(d):
            _bind_ro(os.path.realpath(d), root)
    for name in ("bin", "sbin", "lib", "lib64", "lib32"):  # merged-/usr links, or the folders themselves
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            _bind_ro(host, root)
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "urandom", "random"):
        open(f"{root}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(spec['tmp_bytes'])},mode=1777")
    os.makedirs(root + "/work")
    _mount(spec["work"], root + "/work", None, MS_BIND)
    _mount(None, root + "/work", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/work")


def _command(spec: dict) -> None:
    """In the forked child: drop to the sandbox's uid with its limits and exec the command."""
    try:
        lim = spec["limits"]
        for res, value in ((resource.RLIMIT_AS, lim["as"]), (resource.RLIMIT_FSIZE, lim["fsize"]),
                           (resource.RLIMIT_NPROC, lim["nproc"]), (resource.RLIMIT_NOFILE, lim["nofile"]),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (int(value), int(value)))
        resource.setrlimit(resource.RLIMIT_CPU, (int(lim["cpu"]), int(lim["cpu"]) + 1))
        os.setgroups([])
        os.setgid(int(spec["gid"]))
        os.setuid(int(spec["uid"]))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.execve("/bin/sh", ["sh", "-c", spec["command"]], dict(spec["env"]))
    except BaseException as exc:  # noqa: BLE001 -- the child must never return into the init's code
        _die(f"cannot start the command: {type(exc).__name__}: {exc}")


def _init(spec: dict) -> None:
    """PID 1 of the new namespace: dies with its parent; builds the root, runs the command, exits with its status."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # (the host's kill of the session reaches it anyway)
    try:
        _build_root(spec)
    except OSError as exc:
        _die(f"building the root: {exc}")
    child = os.fork()
    if child == 0:
        _command(spec)
    code = SETUP_FAILED
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            break
    os._exit(code)  # the kernel now kills whatever the command left behind in the namespace


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _call("unshare (needs root: CAP_SYS_ADMIN)", _libc.unshare(ctypes.c_int(flags)))
    pid = os.fork()
    if pid == 0:
        _init(spec)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()

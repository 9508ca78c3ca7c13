"""A fork server for local launches: each rank forked from a process that has already imported
torch and the other third-party packages a run imports, instead of importing them again.

``python -m megatron.md.forkserver SOCKET`` imports those packages once (~4 s of CPU on a 2-core
VM, torch 2.15.0), then serves ``localrun.py``: with ``MEGATRON_MD_FORKSERVER=SOCKET`` in its
environment, the launcher asks the server to fork each rank (``spawn``) and waits for it as for
a process of its own. The test suite starts one for its session (tests/conftest.py), where
about a hundred launches spent that import on every rank (CI: 19.5 min instead of 28-30).
Cluster jobs never use it.

A forked rank is the process a fresh ``python SCRIPT ARGS`` would be, given what the server's
imports read, so the server refuses (and the launcher starts the rank afresh) where that does
not hold:
- the command is not ``<this python> SCRIPT.py ...`` (interpreter options, ``-m``, ``-c``);
- the launcher runs in another session (``start_new_session``, SLURM): signals sent to its
  process group would miss a forked rank;
- the launcher's resource limits (``ulimit``: file size, open files, ...), file-mode mask
  (``umask``) or CPU affinity (``taskset``) differ from the server's, which a forked rank
  would have;
- the rank's environment differs from the server's in a variable the imports read: every one
  read through ``os.environ`` while importing (recorded), and every one of ``IMPORT_PREFIXES``
  (read by C code: OpenMP, the allocator, the interpreter).
Megatron is not imported here: ``cpu_mode`` must patch ``torch.cuda`` before megatron
imports from it, and a script may not put CPU mode on at all. Where CUDA is not available the
server forks one CPU-mode process once its imports are done (``cpu_mode_process``): it starts
as ``CPU_MODE_SCRIPT`` (pretrain_gpt.py) does, CPU mode on first, then imports the script's
megatron modules (recorded alike); the server hands it the requests of that script's ranks
whose ``cpu_mode.start`` would put CPU mode on (``cpu_mode_rank``), with the launcher's
connection, and it forks and answers them as the server does (~1.3 s of a 2-rank launch on a
2-core VM). Both freeze what their imports made (``gc.freeze``): out of a rank's collections,
the full one of pretrain_gpt.py's exit among them (shutdown.exit_now; a normal exit unfreezes
it first, as a fresh interpreter's finalization would see it). What the imports print is
printed again by each rank. Known differences: the ranks share the server's string-hash seed
(``PYTHONHASHSEED``), where fresh processes each draw one; ``sys.excepthook`` is the server's
(it trims the server's frames off a traceback); ``ps`` and ``/proc/<pid>/cmdline`` show the
server's command line, not the script's.
The rank becomes a child of the server (or of its CPU-mode process) in the launcher's process
group; that parent relays its exit status, and kills it when the launcher's connection closes
(the launcher died); it dies with its parent, and the CPU-mode process with the server.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile

#: what a run imports besides megatron (measured: ~85 % of a rank's import time)
#: (transformers: megatron's tokenizer module imports its AutoTokenizer for any tokenizer type,
#: NullTokenizer included, ~1 s a rank; its import calls no torch.cuda function)
PRELOAD = ("torch", "numpy", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
           "torch.distributed.tensor", "torch.distributed.checkpoint", "torch.utils.tensorboard",
           "wandb", "emerging_optimizers", "triton", "sympy", "pydantic", "yaml",
           "psutil", "transformers", "transformers.models.auto.tokenization_auto")  # fmt: skip
#: variables read by C code at start-up or import, which the recording cannot see (Intel
#: OpenMP's ``KMP_*`` too where it is loaded: torch's CPU wheels load GNU OpenMP, and inductor
#: sets ``KMP_DUPLICATE_LIB_OK`` in the environment of a process that compiles)
IMPORT_PREFIXES = ("PYTHON", "LD_", "LANG", "LC_", "OMP_", "GOMP_", "MKL_", "OPENBLAS_", "THP_",
                   "MALLOC_", "TORCH", "PYTORCH", "CUDA", "NVIDIA")  # fmt: skip
#: the script whose ranks are forked from the server's CPU-mode process (``cpu_mode_rank``)
CPU_MODE_SCRIPT = os.path.realpath(os.path.join(__file__, "..", "..", "..", "pretrain_gpt.py"))
#: what that process imports once CPU mode is on: the script's imports of megatron
#: (~1.3 s a 2-rank launch on a 2-core VM, where the ranks imported them)
CPU_MODE_IMPORTS = ("megatron.md.train.cli", "megatron.md.train.shutdown",
                    "megatron.training.training", "megatron.core.models.gpt")  # fmt: skip
#: the launcher's wait for "forked" or "refused" (a server just started is still importing)
REPLY_TIMEOUT_S = 120.0


# -- the launcher's side -------------------------------------------------------------------


class Forked:
    """A rank forked by the server, waited for like a ``subprocess.Popen``."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid, self.returncode = sock, pid, None
        self._buf = b""
        sock.setblocking(False)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                data = self.sock.recv(64)
            except BlockingIOError:
                return None
            self._buf += data
            if data and not self._buf.endswith(b"\n"):
                return None
            words = self._buf.split()
            # the server gone without a word: its death killed the rank (PR_SET_PDEATHSIG)
            self.returncode = int(words[1]) if words[:1] == [b"exit"] else -signal.SIGKILL
            self.sock.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def spawn(path: str, argv: list[str], env: dict[str, str]) -> Forked | None:
    """``argv`` forked by the server at ``path`` with this process's standard streams and
    ``env``; None where the server refuses (or cannot be reached): start it afresh."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(REPLY_TIMEOUT_S)
        sock.connect(path)
        req = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "launcher": os.getpid()})
        data = req.encode()
        socket.send_fds(sock, [struct.pack("!I", len(data)) + data], [0, 1, 2])
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(256)
            if not chunk:
                break
            reply += chunk
    except OSError as e:
        print(f"[forkserver] {path}: {e}; starting the rank afresh", file=sys.stderr)
        sock.close()
        return None
    words = reply.split()
    if words[:1] != [b"forked"]:
        sock.close()
        return None
    return Forked(sock, int(words[1]))


# -- the server ----------------------------------------------------------------------------


#: packages whose import scans the whole environment for variables of their prefix
SCANS = {"tqdm": "TQDM_", "networkx": "NETWORKX_", "fsspec": "FSSPEC_"}


class _Recording(os._Environ):
    """``os.environ`` while the server imports: every variable read is recorded; a scan of the
    whole environment records its package's prefix (``SCANS``), or "*" (everything counts)."""

    read: set[str] = set()
    written: dict[str, str | None] = {}  # set by an import (None: deleted)

    def __getitem__(self, key):
        caller = sys._getframe(1).f_code
        # (a bytes key: os.get_exec_path's probe of b"PATH" before "PATH", in a subprocess
        # that megatron's imports start; no variable of its own)
        if isinstance(key, str) and not (
            caller.co_name == "__iter__" and "_collections_abc" in caller.co_filename
        ):
            _Recording.read.add(key)  # (not a value of a scan, .items(): the scan is recorded)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        _Recording.written[key] = value
        super().__setitem__(key, value)

    def __delitem__(self, key):
        _Recording.written[key] = None
        super().__delitem__(key)

    def __iter__(self):
        frame = sys._getframe(1)
        while frame is not None:
            prefix = SCANS.get(frame.f_globals.get("__name__", "").partition(".")[0])
            if prefix:
                _Recording.read.add(prefix + "*")
                break
            frame = frame.f_back
        else:
            _Recording.read.add("*")
        return super().__iter__()


@dataclasses.dataclass
class Preloaded:
    """What the server's imports depended on and did."""

    env: dict[str, str]
    """the server's environment before the imports"""
    read: set[str]
    """variables the imports read; ``PREFIX*`` for a scan of a prefix, ``*`` for everything"""
    written: dict[str, str | None]
    """variables the imports set (None: deleted), as they would in a fresh process"""
    printed: bytes
    """what the imports wrote to stdout and stderr"""
    intel_openmp: bool
    """whether the imports loaded Intel's OpenMP runtime (which reads ``KMP_*``)"""
    owed: bytes = b""
    """what the CPU-mode process's imports printed once CPU mode was on: the rank prints it at
    its own ``cpu_mode.activate``, after the line that says so, where a fresh one prints it"""


def _import_all(names) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def preload(imports=lambda: _import_all(PRELOAD)) -> Preloaded:
    """Import ``PRELOAD`` (or run ``imports``), recording what the imports read, wrote and
    printed."""
    env = dict(os.environ)
    out = tempfile.TemporaryFile()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    _Recording.read, _Recording.written = set(), {}
    os.environ.__class__ = _Recording
    try:
        imports()
    finally:
        os.environ.__class__ = os._Environ
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    out.seek(0)
    with open("/proc/self/maps") as maps:
        intel_openmp = "libiomp" in maps.read()
    return Preloaded(env, set(_Recording.read), dict(_Recording.written), out.read(), intel_openmp)


def refusal(req: dict, pre: Preloaded) -> str | None:
    """Why the rank of ``req`` would not be the process a fresh start makes (None: fork it)."""
    argv, env = req["argv"], req["env"]
    if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
        return f"not '{sys.executable} SCRIPT.py ...': {argv[:2]}"
    if not os.path.isfile(argv[1]):
        return f"no such script {argv[1]}"
    try:
        if os.getsid(req["launcher"]) != os.getsid(0):
            return "the launcher runs in another session"
    except ProcessLookupError:
        return "the launcher is gone"
    if limits := _other_limits(req["launcher"]):
        return f"the launcher's resource limits differ: {limits}"
    if other := _other_process_state(req["launcher"]):
        return f"the launcher's {other} differs"
    if "*" in pre.read:
        return "the imports read the whole environment"
    prefixes = IMPORT_PREFIXES + tuple(r[:-1] for r in pre.read if r.endswith("*"))
    prefixes += ("KMP_",) if pre.intel_openmp else ()
    names = {r for r in pre.read if not r.endswith("*")}
    names |= {k for k in (*env, *pre.env) if k.startswith(prefixes)}
    differ = sorted(k for k in names if env.get(k) != pre.env.get(k))
    return f"environment differs in {differ}" if differ else None


def _other_limits(pid: int) -> list[str]:
    """The ``RLIMIT_*`` names whose (soft, hard) differ between process ``pid`` and this one
    (all of them where ``pid``'s cannot be read)."""
    import resource

    out = []
    for name in sorted(n for n in dir(resource) if n.startswith("RLIMIT_")):
        which = getattr(resource, name)
        try:
            if resource.prlimit(pid, which) != resource.getrlimit(which):
                out.append(name)
        except OSError:
            out.append(name)
    return out


def _umask(pid: int) -> str | None:
    with open(f"/proc/{pid}/status") as f:
        return next((ln.split()[1] for ln in f if ln.startswith("Umask:")), None)


def _other_process_state(pid: int) -> str | None:
    """What else a child inherits that differs between process ``pid`` and this one."""
    try:
        if _umask(pid) != _umask(os.getpid()):
            return "umask"
        if os.sched_getaffinity(pid) != os.sched_getaffinity(0):
            return "CPU affinity"
    except OSError:
        return "state (unreadable)"
    return None


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while len(msg) < 4 or len(msg) < 4 + struct.unpack("!I", msg[:4])[0]:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("request cut short")
        msg += chunk
    return json.loads(msg[4:]), fds


def serve(
    listener: socket.socket, pre: Preloaded, cpu_mode_process: socket.socket | None = None
) -> tuple[dict, list[int]] | None:
    """Fork ranks until SIGTERM (or the parent's death); returns only in a forked rank: its
    request. ``listener``: the launchers' socket; or, in the CPU-mode process, its end of the
    pair on which the server hands it a launcher's connection and request (and the stream of
    hand-overs ends when the server does). ``cpu_mode_process``: the server's end of that
    pair, where the process says it is ready (or closes: gone)."""
    handed = listener.type == socket.SOCK_SEQPACKET
    ready = False
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)  # a rank ended: the wake-up pipe says so
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    if cpu_mode_process is not None:
        sel.register(cpu_mode_process, selectors.EVENT_READ)
    ranks: dict[int, socket.socket] = {}  # pid -> the launcher's connection
    if not handed:
        print(f"[forkserver] serving {listener.getsockname()}", flush=True)
    while not stop:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is cpu_mode_process:
                try:
                    ready = cpu_mode_process.recv(16) == b"ready"
                except OSError:
                    ready = False
                if not ready:  # gone: every rank forked here from now on
                    sel.unregister(cpu_mode_process)
                    cpu_mode_process.close()
                    cpu_mode_process = None
                continue
            if key.fileobj is listener and handed:
                msg, fds, _flags, _addr = socket.recv_fds(listener, 1 << 20, 4)
                if not msg:  # the server is gone
                    stop.append(1)
                    break
                conn, fds = socket.socket(fileno=fds[0]), fds[1:]
                req = json.loads(msg)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                conn.settimeout(10.0)
                try:
                    req, fds = _receive(conn)
                except (OSError, ValueError) as e:
                    print(f"[forkserver] bad request: {e}", flush=True)
                    conn.close()
                    continue
                if ready and cpu_mode_rank(req) and _hand_over(cpu_mode_process, conn, req, fds):
                    continue
            if key.fileobj is listener:
                why = refusal(req, pre)
                if why:
                    print(f"[forkserver] refused {req['argv'][1:2]}: {why}", flush=True)
                    conn.sendall(f"refused {why}\n".encode())
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the rank: leave the server behind
                    sel.close()
                    listener.close()
                    for c in (*ranks.values(), conn, cpu_mode_process):
                        if c is not None:
                            c.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    return req, fds
                for fd in fds:
                    os.close(fd)
                by = " by the CPU-mode process" if handed else ""
                print(f"[forkserver] forked {pid}{by}: {req['argv'][1:2]}", flush=True)
                conn.sendall(f"forked {pid}\n".encode())
                ranks[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(ranks, sel)
            else:  # a launcher's connection closed: its rank must not outlive it
                conn, pid = key.fileobj, key.data
                if conn.fileno() < 0:  # reaped above, in this same round
                    continue
                try:
                    gone = not conn.recv(64)
                except OSError:
                    gone = True
                if gone:
                    sel.unregister(conn)
                    conn.close()
                    _kill(pid)
    for pid in ranks:
        _kill(pid)
    return None


def _hand_over(pair: socket.socket, conn: socket.socket, req: dict, fds: list[int]) -> bool:
    """The launcher's connection, request and streams to the CPU-mode process (which answers
    the launcher); False where they could not be sent (the server forks the rank)."""
    try:
        socket.send_fds(pair, [json.dumps(req).encode()], [conn.fileno(), *fds])
    except OSError:
        return False
    conn.close()
    for fd in fds:
        os.close(fd)
    return True


def cpu_mode_rank(req: dict) -> bool:
    """Whether the rank of ``req`` puts CPU mode on before anything else: ``CPU_MODE_SCRIPT``
    where its ``cpu_mode.start`` would (the same decision, on the request's arguments and
    environment; the CPU-mode process exists only where CUDA is not available)."""
    from megatron.md import cpu_mode

    argv = req["argv"]
    if len(argv) < 2 or os.path.realpath(os.path.join(req["cwd"], argv[1])) != CPU_MODE_SCRIPT:
        return False
    return cpu_mode.starts_on(argv[2:], req["env"])


def _cpu_mode_on() -> None:
    """``CPU_MODE_SCRIPT``'s start, in the CPU-mode process: its inductor setting (read by
    inductor's config at its import, here already done: decided again) and CPU mode on,
    without its line (the rank's own ``cpu_mode.start`` prints it)."""
    from torch._inductor import config

    from megatron.md import cpu_mode

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    config.compile_threads = config.decide_compile_threads()
    cpu_mode.activate(quiet=True)


def cpu_mode_process(listener: socket.socket, pre: Preloaded):
    """Fork the CPU-mode process: the server's imports, then ``_cpu_mode_on`` and
    ``CPU_MODE_IMPORTS`` (recorded apart: what the latter print is ``Preloaded.owed``), from
    which the ranks of ``cpu_mode_rank`` requests are forked. Returns (the server's end of the
    pair it hands requests on, None) in the server; (None, (the request, what the process's
    imports did)) in a rank it forked; (None, None) where there is none: a GPU, or
    ``MEGATRON_MD_CPU_MODE=0``."""
    import torch

    if torch.cuda.is_available() or os.environ.get("MEGATRON_MD_CPU_MODE") == "0":
        return None, None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork():
        theirs.close()
        return ours, None
    from megatron.md.localrun import die_with_parent

    die_with_parent()  # (SIGKILL when the server dies; its ranks die with it)
    ours.close()
    listener.close()
    try:
        on, then = preload(_cpu_mode_on), preload(lambda: _import_all(CPU_MODE_IMPORTS))
    except BaseException as e:  # noqa: BLE001  (the server forks every rank then)
        print(f"[forkserver] no CPU-mode process: {e!r}", flush=True)
        os._exit(1)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"[forkserver] no CPU-mode process: its imports started {threads - 1} thread(s)",
              flush=True)  # fmt: skip
        os._exit(1)
    gc.collect()
    gc.freeze()
    both = Preloaded(pre.env, pre.read | on.read | then.read,
                     {**pre.written, **on.written, **then.written}, pre.printed + on.printed,
                     pre.intel_openmp or then.intel_openmp, owed=then.printed)  # fmt: skip
    theirs.send(b"ready")
    try:
        job = serve(theirs, both)
    except BaseException:  # noqa: BLE001  (its launchers see their connection close)
        import traceback

        traceback.print_exc()
        job = None
    if job is None:  # its objects frozen: no interpreter finalization (nanobind's reports)
        sys.stdout.flush()
        os._exit(0)
    return None, (job, both)


def _reap(ranks: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is not None and conn.fileno() >= 0:
            sel.unregister(conn)
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def become(req: dict, fds: list[int], pre: Preloaded) -> str:
    """In a forked rank: take the launcher's streams, directory, environment (with what the
    imports set in it) and process group and a fresh interpreter's signal dispositions;
    returns the script to run."""
    from megatron.md.localrun import die_with_parent

    die_with_parent()  # (SIGKILL when the server dies)
    os.setpgid(0, os.getpgid(req["launcher"]))
    for sig, how in ((signal.SIGCHLD, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                     (signal.SIGINT, signal.default_int_handler)):  # fmt: skip
        signal.signal(sig, how)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for k, v in pre.written.items():  # as the imports of a fresh process would (where they read
        # k first, its value matched)
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    script = req["argv"][1]
    sys.argv = req["argv"][1:]
    sys.orig_argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as python sets it
    if "numpy" in sys.modules:  # its global generator: drawn from the OS in a fresh process
        sys.modules["numpy"].random.seed()
    # the imports' objects (frozen in the server, main) are collected at a normal exit as in
    # a fresh process (registered first: run last); frozen, the interpreter's finalization
    # would leave them, and nanobind (triton) prints every instance it sees leaked.
    # shutdown.exit_now ends without finalization: it drops this and keeps them frozen
    atexit.register(gc.unfreeze)
    if pre.printed:
        os.write(2, pre.printed)
    if pre.owed:
        from megatron.md import cpu_mode

        cpu_mode.owe(pre.owed)
    return script


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m megatron.md.forkserver SOCKET")
    from megatron.md.localrun import die_with_parent

    die_with_parent(signal.SIGTERM)  # the test session's end
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(argv[0])
    listener.listen(64)  # launches that come while the imports run wait for them
    pre = preload()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # fork copies one thread: a pool started by an import would be lost
        sys.exit(f"[forkserver] the imports started {threads - 1} thread(s): cannot fork safely")
    # what the imports made is never garbage a rank must collect: out of every collection in
    # the ranks (each rank's exit collects all garbage, shutdown.exit_now: ~0.5 s a rank over
    # the imports' objects on a 2-core VM), and their pages stay shared
    gc.collect()
    gc.freeze()
    pair, handed = cpu_mode_process(listener, pre)
    if handed is not None:  # a rank of the CPU-mode process
        job, pre = handed
    else:
        job = serve(listener, pre, pair)
    if job is None:
        return
    import runpy

    script = become(*job, pre)
    sys.excepthook = _excepthook
    runpy.run_path(script, run_name="__main__")  # exceptions and exit as a fresh interpreter


def _excepthook(typ, value, tb):
    """A traceback from the script's first frame on, as a fresh interpreter prints it."""
    import runpy

    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    sys.__excepthook__(typ, value.with_traceback(tb), tb)  # (it prints value.__traceback__)


if __name__ == "__main__":
    main(sys.argv[1:])

# SPDX-License-Identifier: Apache-2.0
"""`python script.py args` or `python -c code args` in a child forked from a Python that has already imported
the heavy third-party packages (torch, triton, diffusers, ...): what a fresh process computes, without paying
their import (seconds each) for every run.

A server process per environment imports only the packages it is told to (never a module of scripts/ or
tests/: it starts in an empty folder, without PYTHONPATH) and then forks a child per run. The child takes the
run's environment, working directory, standard streams (stdin empty, stdout and stderr captured), sys.argv and
sys.path as python would set them (the script's folder or '' first, then PYTHONPATH's folders), imports a
sitecustomize module found on PYTHONPATH as python's start-up would, runs the script or code as __main__, and exits with the status python would give: 0, SystemExit's code, or 1 with the
traceback on stderr. Everything the project itself imports is imported afresh in each child.

Not for a run that changes, before its imports, an environment variable a preloaded package reads when it is
imported: e.g. a script that sets TRITON_INTERPRET itself needs a fresh python (kernel_testing.run_python), since
triton decorates its own language functions when it is imported (diffusers imports triton too)."""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile

# The server: imports the packages named in argv[1] (JSON), then one forked child per request line on stdin;
# it answers each with {"pid": ...} when the child started and {"rc": ...} when it ended.
_SERVER = r"""
import json, os, sys, threading
for name in json.loads(sys.argv[1]):
    __import__(name)
del name


def native_threads():
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


# Forking is safe only while no other thread can hold a lock the child would need: threads the imports left
# (OpenBLAS's idle pool, which it stops itself at a fork) are all there may be. Nothing runs here after the
# imports, so a thread started since, or a Python thread, means that no longer holds: refused, not forked.
IMPORTED_THREADS = native_threads()


def child(req):
    import runpy, traceback, types

    code = 1
    try:
        os.chdir(req["cwd"])
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(req["env"])
        args = req["args"]
        path = [p for p in req["pythonpath"] if p]
        try:
            if path and "sitecustomize" not in sys.modules:  # as python's start-up imports it from PYTHONPATH
                sys.path[1:1] = path
                try:
                    import sitecustomize  # noqa: F401
                except ImportError as e:
                    if e.name != "sitecustomize":
                        raise
                del sys.path[1 : 1 + len(path)]
            if args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                sys.path[:1] = ["", *path]
                main = types.ModuleType("__main__")
                main.__dict__["__builtins__"] = __builtins__
                sys.modules["__main__"] = main
                exec(compile(args[1], "<string>", "exec"), main.__dict__)
                code = 0
            elif not os.path.isfile(args[0]):
                msg = f"can't open file {os.path.abspath(args[0])!r}: [Errno 2] No such file or directory"
                print(f"{sys.executable}: {msg}", file=sys.stderr)
                code = 2
            else:
                script = args[0]
                sys.argv = list(args)
                sys.path[:1] = [os.path.dirname(os.path.realpath(script)), *path]
                runpy.run_path(script, run_name="__main__")
                code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException as e:
            tb = e.__traceback__.tb_next  # from the script's or the code's own frames on, as python shows them
            while tb is not None and tb.tb_frame.f_code.co_filename.startswith("<frozen runpy"):
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb)
            code = 1
        import atexit, threading

        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.active_count() != 1 or native_threads() > IMPORTED_THREADS:
        why = f"{threading.active_count()} Python threads, {native_threads()} in all ({IMPORTED_THREADS} after imports)"
        print(json.dumps({"refused": why}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        child(req)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""

# What to preload: the packages the scripts import (diffusers' model classes come from diffusers.models.transformers,
# which imports all of them), or only torch and triton (a kernel file copied alone may use nothing else).
HEAVY = ("torch", "triton", "diffusers", "diffusers.models", "diffusers.models.transformers", "transformers")
TORCH_TRITON = ("torch", "triton")

# Variables that differ from test to test and that nothing imported at start-up reads.
_VOLATILE = ("PYTEST_CURRENT_TEST",)


class _Server:
    def __init__(self, env: dict, preload: tuple):
        self.home = tempfile.TemporaryDirectory(prefix="forked_python_")
        self.log = open(os.path.join(self.home.name, "server.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(list(preload))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=self.home.name,
        )
        self.buf = b""

    def _reply(self, deadline_s: float | None) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while b"\n" not in self.buf:
                if not sel.select(deadline_s):
                    raise TimeoutError
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.log.seek(0)
                    raise RuntimeError(f"the forked-python server exited:\n{self.log.read()[-3000:]}")
                self.buf += chunk
        finally:
            sel.close()
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def run(self, args: list, env: dict, pythonpath: list, cwd: str, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="forked_python_run_") as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
            req = dict(args=args, env=env, pythonpath=pythonpath, cwd=cwd, stdout=out, stderr=err)
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            started = self._reply(60)
            if "refused" in started:
                raise RuntimeError(f"the forked-python server would not fork: {started['refused']}")
            pid = started["pid"]
            try:
                rc = self._reply(timeout)["rc"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self.close()
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None

            def read(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    return f.read()

            return subprocess.CompletedProcess([sys.executable, *args], rc, read(out), read(err))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.home.cleanup()


_SERVERS: dict = {}


@atexit.register
def _close_servers():
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


def run_python_forked(args, *, preload, env=None, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """As kernel_testing.run_python(args, env=env, cwd=cwd, timeout=timeout): sys.executable run on args (a
    script and its arguments, or -c, code and its arguments), its text output captured; but in a child forked
    from a server that has imported the packages in preload (third-party only) under the same environment."""
    env = dict(os.environ if env is None else env)
    pythonpath = env.pop("PYTHONPATH", "").split(os.pathsep)
    base = {k: v for k, v in env.items() if k not in _VOLATILE}
    key = (tuple(sorted(base.items())), tuple(preload))
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[key] = _Server(base, tuple(preload))
    run_env = dict(env)
    if any(pythonpath):
        run_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return server.run([str(a) for a in args], run_env, pythonpath, os.path.abspath(cwd or os.getcwd()), timeout)

"""The Python tool of tool-integrated reasoning: the model writes code, a separate process runs it, the model reads
what it printed.

Each call starts a fresh interpreter (``python -I``: no user site-packages, no ``PYTHON*`` variables, the script's
directory not on the path) that, before it reads the code:

- sets resource limits: address space ``memory_mb``, CPU time ``timeout_s`` (rounded up), files it writes at most
  16 MiB, no core dumps;
- moves into a new user + network namespace where the kernel lets an unprivileged process (``unshare``): then it has
  only a loopback interface, down, and no route anywhere; where it cannot, the code keeps the machine's network
  (``network_isolated()`` says which, and the README says so);

and it runs with an empty environment (no variable of the trainer's), in a new temporary directory removed afterwards,
in a session of its own: at ``timeout_s`` of wall time the whole process group is killed. What it prints
(stdout and stderr together) is the answer, cut to ``output_chars``.

Not isolated: the file system (it can read what the trainer's user can, and write outside its directory), other
processes of the same user, and the installed packages (numpy, sympy, ... are importable). It is a guard against
mistakes and runaway code, not a security boundary against hostile code; run untrusted workloads in a container.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile

from qerl.tools.execution import truncate

# Runs in the child before the model's code: limits, then the network namespace, then the code from stdin.
_LAUNCHER = r"""
import ctypes, os, resource, sys
memory, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 24, 1 << 24))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:
    ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
except Exception:
    pass
code = sys.stdin.read()
sys.stdin = open(os.devnull)
del ctypes, os, resource, sys, memory, cpu
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""

_PROBE = "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 9), timeout=0.5)\nexcept OSError as e:\n" \
         "    print(e.errno)\n"


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, output_chars: int = 2048) -> str:
    """Run ``code`` in a separate, limited process (see the module docstring); what it printed, or why it stopped."""
    with tempfile.TemporaryDirectory(prefix="qerl_python_") as directory:
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", _LAUNCHER, str(memory_mb << 20), str(max(1, int(timeout_s + 0.999)))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=directory, env={},
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(code.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            return truncate(out.decode(errors="replace") + f"\nTimeoutError: stopped after {timeout_s:g} s",
                            output_chars)
    text = out.decode(errors="replace")
    if process.returncode < 0:
        text += f"\nKilled by signal {-process.returncode} (a resource limit: CPU time or memory)"
    return truncate(text if text.strip() else "(no output: print the result)", output_chars)


@functools.lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether the tool's process gets no network on this machine (the kernel lets it make a network namespace)."""
    return run_python(_PROBE, timeout_s=10.0).strip() == "101"  # ENETUNREACH: no route at all


class PythonTool:
    """The Python tool with its limits, for ``model.tools: [{class_path: qerl.tools.python.PythonTool, init_args:
    {timeout_s: 5}}]``; the model calls it as ``python``.

    Args:
        timeout_s: wall-clock limit of one run (also its CPU-time limit).
        memory_mb: address-space limit of the process.
        output_chars: what it printed is cut to this many characters.
    """

    name = "python"

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, output_chars: int = 2048):
        if timeout_s <= 0 or memory_mb < 64 or output_chars < 1:
            raise ValueError(f"PythonTool(timeout_s={timeout_s}, memory_mb={memory_mb}, output_chars={output_chars}):"
                             " timeout_s must be > 0, memory_mb >= 64 (the interpreter itself needs some), "
                             "output_chars >= 1")
        self.timeout_s, self.memory_mb, self.output_chars = timeout_s, memory_mb, output_chars

    def __call__(self, code: str) -> str:
        """Run Python code and return what it prints. Use print() to show results.

        Args:
            code: A complete Python program.
        """
        return run_python(code, self.timeout_s, self.memory_mb, self.output_chars)


def python(code: str) -> str:
    """Run Python code and return what it prints. Use print() to show results.

    Args:
        code: A complete Python program.
    """
    return run_python(code)

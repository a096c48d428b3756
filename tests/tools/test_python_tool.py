"""The Python tool runs model-written code in a separate, limited process (real subprocesses)."""

import os
import time
from pathlib import Path

import pytest

from qerl.tools.python import PythonTool, network_isolated, run_python


def test_prints_come_back():
    assert run_python("print(6 * 7)") == "42\n"
    assert "no output" in run_python("x = 1")


def test_a_hang_is_killed_at_the_wall_time_limit():
    out = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=1.0)
    assert out.startswith("started") and "TimeoutError: stopped after 1 s" in out


def test_a_child_process_dies_with_it():
    out = run_python("import subprocess, sys, time\n"
                     "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                     "print(p.pid, flush=True)\ntime.sleep(60)", timeout_s=2.0)
    status = Path(f"/proc/{int(out.split()[0])}/status")
    for _ in range(100):  # the kill is asynchronous; a killed process may stay a zombie until it is reaped
        if not status.exists() or "\tZ" in status.read_text():
            return
        time.sleep(0.05)
    raise AssertionError("the code's child process outlived the tool's timeout")


def test_a_memory_bomb_fails_inside_the_tool():
    out = run_python("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert "MemoryError" in out and "allocated" not in out


def test_no_inherited_environment_and_a_fresh_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("QERL_SECRET_TOKEN", "do-not-leak")
    monkeypatch.chdir(tmp_path)
    out = run_python("import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(os.listdir('.'))\n"
                     "open('f.txt', 'w').write('x')")
    names, cwd, listing = out.splitlines()
    assert "QERL_SECRET_TOKEN" not in names and "PATH" not in names and "HOME" not in names
    assert os.path.basename(cwd).startswith("qerl_python_") and cwd != str(tmp_path) and listing == "[]"
    assert not os.path.exists(cwd)  # removed afterwards
    assert run_python("import os\nprint(os.listdir('.'))") == "[]\n"  # the next call starts empty


def test_output_is_cut():
    out = PythonTool(output_chars=100)("print('x' * 10000)")
    assert out.startswith("x" * 100) and "more characters cut" in out and len(out) < 200


def test_no_network_where_the_kernel_allows_a_namespace():
    if not network_isolated():
        pytest.skip("this kernel refuses unprivileged network namespaces: the tool keeps the network here")
    out = run_python("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
                     "except OSError as e:\n    print(type(e).__name__, e.errno)")
    assert out.split()[0] in ("OSError", "ConnectionRefusedError") and out.split()[1] in ("101", "111")


def test_options_are_checked():
    with pytest.raises(ValueError, match="memory_mb >= 64"):
        PythonTool(memory_mb=1)

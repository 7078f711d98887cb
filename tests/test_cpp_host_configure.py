"""Configuring the C++ host (examples/cpp_host) with a Python that lacks apache-tvm stops with
the one line that says what to pass, not with the locating snippet's Python traceback."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_configure_with_a_python_without_tvm_says_so_in_one_line(tmp_path):
    # -I -S: no site-packages and no PYTHONPATH, so this Python finds neither tvm nor tvm_ffi.
    python = tmp_path / "python-without-tvm"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    python.chmod(0o755)
    found = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('tvm'), "
                            "u.find_spec('tvm_ffi'))"], capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["None", "None"]

    done = subprocess.run(["cmake", "-S", str(REPO / "examples" / "cpp_host"), "-B", str(tmp_path / "build"),
                           f"-DDSV4C_PYTHON={python}"], capture_output=True, text=True)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in output, output
    said = [line.strip() for line in output.splitlines() if "apache-tvm" in line]
    assert said == [f"{python} has no apache-tvm; pass -DDSV4C_PYTHON=<python with apache-tvm> "
                    "or -DTVM_FFI_ROOT=... -DTVM_ROOT=..."], output

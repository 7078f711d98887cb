"""The artifact's staging directory: a compile killed mid-way leaves ``.ART.partial-*`` behind,
which the next compile to ART removes (and says so), while one a live compile holds is kept."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dsv4c.artifact.manifest import staging

# A compile that stages its output and then hangs until killed, like one stopped by SIGKILL
# or the OOM killer: no cleanup runs.
HANGING_COMPILE = textwrap.dedent("""
    import sys, time
    from dsv4c.artifact.manifest import staging
    with staging(sys.argv[1]) as tmp:
        (tmp / "weights.safetensors").write_bytes(b"half written")
        print(tmp, flush=True)
        time.sleep(600)
""")


def test_partials_of_killed_compiles_are_swept_and_live_ones_kept(tmp_path):
    out = tmp_path / "art"
    child = subprocess.Popen([sys.executable, "-c", HANGING_COMPILE, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        partial = tmp_path / os.path.basename(child.stdout.readline().strip())
        assert partial.name.startswith(".art.partial-") and partial.is_dir()

        # While its compile runs, another compile to the same output keeps it.
        said = []
        with pytest.raises(RuntimeError):
            with staging(out, log=said.append):
                raise RuntimeError("abandon this compile")
        assert said == [] and (partial / "weights.safetensors").read_bytes() == b"half written"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()

    # Killed, it is stale: the next compile removes it and says so in one line.
    unrelated = tmp_path / ".other.partial-x"
    unrelated.mkdir()
    with staging(out, log=said.append) as tmp:
        (tmp / "manifest.json").write_text("{}")
    assert not partial.exists() and unrelated.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-x", "art"]
    assert len(said) == 1 and partial.name in said[0] and "\n" not in said[0]


def test_a_live_compile_in_this_process_is_kept_and_completes(tmp_path):
    out = tmp_path / "art"
    with staging(out, log=pytest.fail) as live:
        (live / "manifest.json").write_text("{}")
        with pytest.raises(RuntimeError):
            with staging(out, log=pytest.fail):
                raise RuntimeError("abandon this compile")
        assert live.is_dir()
    assert (out / "manifest.json").read_text() == "{}"

"""`dsv4c serve`'s check of the weights: ``--verify`` refuses an artifact with a byte flipped in a
weight shard before anything starts; without it the background check turns ``/health`` to 503
and stops the server with status 1; ``dsv4c_weights_verified`` says where the check stands."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import dsv4c
from serving import serving

SHARD = "weights.safetensors"


@pytest.fixture(scope="module")
def corrupt(serve_artifacts, tmp_path_factory) -> Path:
    """The tiny llvm artifact with one byte of its weight shard's data flipped (its size and header
    intact, so that only a hash tells): every other file a hard link."""
    art = tmp_path_factory.mktemp("corrupt") / "cpu"
    art.mkdir()
    for f in (serve_artifacts / "cpu").iterdir():
        (shutil.copyfile if f.name == SHARD else os.link)(f, art / f.name)
    with open(art / SHARD, "r+b") as f:
        f.seek(-100, os.SEEK_END)  # inside the last tensor's data
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    return art


def dsv4c_serve(art: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dsv4c.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "dsv4c", "serve", str(art), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def test_serve_verify_refuses_a_flipped_byte_before_it_starts(corrupt):
    proc = dsv4c_serve(corrupt, "--verify")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""  # no banner: nothing listened
    assert err.strip().splitlines() == [f"dsv4c: error: {corrupt}: {SHARD} does not match its sha256 in the manifest "
                                        "(modified or corrupt)"]


def test_the_background_check_turns_health_to_503_and_stops_the_server(corrupt):
    proc = dsv4c_serve(corrupt)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())[0]
        seen = []
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                r = httpx.get(f"{url}/health")
                seen.append(r.status_code)
                if r.status_code == 503:
                    assert r.json()["error"]["code"] == "weights_corrupt" and SHARD in r.json()["error"]["message"]
            except httpx.TransportError:  # the shutdown has closed the listening socket
                pass
            time.sleep(0.05)
        assert 503 in seen, seen
        assert proc.wait(30) == 1
    finally:
        proc.kill()
        err = proc.stderr.read()
    failed = [line for line in err.splitlines() if "background weight check failed" in line]
    assert len(failed) == 1 and SHARD in failed[0], err
    assert "Traceback" not in err


def test_the_weights_verified_gauge(serve_artifacts, corrupt):
    """0 while nothing checked the weights (the background check skipped: the corrupt copy then
    serves), 1 once the background check has hashed the good artifact's."""
    with serving(corrupt, "--no-background-verify") as served:
        time.sleep(0.5)  # a check would have failed by now
        assert served.metrics()["dsv4c_weights_verified"] == 0
        assert httpx.get(f"{served.url}/health").status_code == 200
    with serving(serve_artifacts / "cpu") as served:
        served.wait_metrics(lambda m: m["dsv4c_weights_verified"] == 1)
        assert httpx.get(f"{served.url}/health").status_code == 200

"""What the server tests share: the tiny model's word-level tokenizer and chat template, and
``dsv4c serve`` run in a subprocess."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

import dsv4c

KEY = "test-key"
EOS = 1  # the tiny preset's eos_token_id
CONTEXT = 2048
SPECIALS = ["<bos>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>"]  # ids 0..5; <bos> = 0 and <eos> = 1
CHAT_TEMPLATE = (
    "{% if messages[0].role == 'assistant' %}{{ raise_exception('a conversation starts with a user') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_tokenizer(model: Path) -> None:
    """A word-level tokenizer over the tiny model's 512 ids: the specials, then w6 ... w511."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), 512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": {"content": "<eos>", "special": True}, "chat_template": CHAT_TEMPLATE}))


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, stderr: Path):
        self.proc, self.url, self.stderr = proc, url, stderr

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(dsv4c_\w+) (\S+)$", text, re.M)}

    def wait_metrics(self, done, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while not done(m := self.metrics()):
            assert time.monotonic() < deadline, f"metrics never got there: {m}"
            time.sleep(0.05)
        return m


@contextmanager
def serving(artifact: Path, *args: str, launcher: tuple[str, ...] = ("-m", "dsv4c"), no_tracebacks: bool = False):
    """``dsv4c serve ARTIFACT --port 0 ARGS`` in a subprocess, once it answers /health; ``launcher``:
    what the Python interpreter runs, given the command line (``-c CODE`` to change the server);
    ``no_tracebacks``: once it has stopped, its log holds none (every answer it gave was an answer)."""
    stderr = artifact.parent / f"serve-{artifact.name}-{time.monotonic_ns()}.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dsv4c.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, *launcher, "serve", str(artifact), "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=err, env=env, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        banner = proc.stdout.readline() if ready else ""
        url = re.search(r"http://127\.0\.0\.1:\d+", banner)
        assert url, f"no banner: {banner!r}; stderr: {stderr.read_text()}"
        served = Served(proc, url[0], stderr)
        deadline = time.monotonic() + 60
        while httpx.get(f"{served.url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if no_tracebacks:  # reached when the tests inside passed
        assert "Traceback" not in stderr.read_text(), stderr.read_text()

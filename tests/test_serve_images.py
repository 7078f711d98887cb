"""Images end to end (docs/vision_serving.md): ``dsv4c serve`` of a V4.1 artifact with its vision
tower (the suite's ``v41_vision_artifact``), driven through the openai client. A streamed chat
with two images (a data URL and a ``file://`` under ``--allowed-image-dir``) and text prompts
the release's encoding: the chat encoder's text tokenized with ``<｜deepseek_image｜>`` as a
special token, each image's placeholder expanded by the token count of the release's processor
(re-derived in test_image_input); its greedy tokens are ``dsv4c generate --messages``'s on the
same conversation; a second turn with the same image hits the prefix cache and one with another
image does not; bad images are 400s and the server goes on."""

import base64
import io
import json
import math

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from tokenizers import Tokenizer

from dsv4c.artifact.file_names import TOKENIZER
from dsv4c.artifact.manifest import read_manifest
from dsv4c.artifact.vision import VisionGeometry
from dsv4c.cli import main as cli
from dsv4c.runtime.serve.dsv41_encoding import IMAGE_PLACEHOLDER, encode_chat

from serving import serving
from test_image_input import noise, reference_pixels

NEW_TOKENS = 6
PREFIX_BLOCK = 256  # prefix caching shares whole blocks of this many prompt tokens
HITS, QUERIES = "dsv4c_prefix_cache_hits_total", "dsv4c_prefix_cache_queries_total"


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two pictures (and a third for a different first image): one sent as a data URL, one as a
    file under the allowed directory."""
    root = tmp_path_factory.mktemp("images")
    first, other = _png(noise((40, 30), seed=21)), _png(noise((40, 30), seed=22))
    (root / "second.jpg").write_bytes(_png(noise((17, 90), seed=23), "JPEG"))
    return root, first, other


def _conversation(first: bytes, second_url: str) -> list[dict]:
    # Image 1 comes early, so that the first 256-token block of the prompt holds its span.
    data = f"data:image/png;base64,{base64.b64encode(first).decode()}"
    return [{"role": "user", "content": [
        {"type": "text", "text": "First:"}, {"type": "image_url", "image_url": {"url": data, "detail": "high"}},
        {"type": "text", "text": "Second: " + "describe every detail of both pictures. " * 8},
        {"type": "image_url", "image_url": {"url": second_url}}, {"type": "text", "text": "Compare them."}]}]


def release_prompt(artifact, messages, pictures: list[bytes]) -> list[int]:
    """The release's prompt: its encoding's text tokenized by a tokenizer that has the image
    placeholder as a special token (the artifact's, with the token added at image_token_id), each
    placeholder repeated by the processor's token count."""
    geometry = VisionGeometry.from_manifest(read_manifest(artifact).vision)
    spec = json.loads((artifact / TOKENIZER).read_text())
    spec["model"]["vocab"][IMAGE_PLACEHOLDER] = geometry.image_token_id
    spec["added_tokens"].append({"id": geometry.image_token_id, "content": IMAGE_PLACEHOLDER, "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    ids = Tokenizer.from_str(json.dumps(spec)).encode(encode_chat(messages), add_special_tokens=False).ids
    counts = iter(_token_count(reference_pixels(raw, geometry), geometry) for raw in pictures)
    assert ids.count(geometry.image_token_id) == len(pictures)
    return [t for i in ids for t in ([i] * next(counts) if i == geometry.image_token_id else [i])]


def _token_count(pixels: np.ndarray, g) -> int:
    rows, cols = (math.ceil(n / g.patch_size / g.downsample_ratio) for n in pixels.shape[1:])
    return rows * (cols + 1) + 2


@pytest.fixture(scope="module")
def served(v41_vision_artifact, images):
    with serving(v41_vision_artifact, "--allowed-image-dir", str(images[0]), "--max-images-per-request", "2",
                 no_tracebacks=True) as server:
        yield server


def test_a_chat_with_two_images_prompts_the_release_encoding_and_generates_as_generate_does(
        v41_vision_artifact, images, served, tmp_path, capsys):
    root, first, other = images
    messages = _conversation(first, f"file://{root}/second.jpg")
    expected = release_prompt(v41_vision_artifact, messages, [first, (root / "second.jpg").read_bytes()])
    assert len(expected) > PREFIX_BLOCK
    tokenized = httpx.post(f"{served.url}/tokenize", json={"messages": messages}).json()
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True, temperature=0,
                                                 max_tokens=NEW_TOKENS, stream_options={"include_usage": True}))
    streamed = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert chunks[-1].usage.prompt_tokens == len(expected) and streamed

    # `dsv4c generate --messages`: the second image as a path relative to the conversation file.
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "second.jpg").write_bytes((root / "second.jpg").read_bytes())
    conversation = tmp_path / "chat.json"
    conversation.write_text(json.dumps(_conversation(first, "pictures/second.jpg")))
    logits = tmp_path / "logits.npy"
    assert cli(["generate", str(v41_vision_artifact), "--messages", str(conversation), "--greedy",
                "--max-new-tokens", str(NEW_TOKENS), "--logits-out", str(logits)]) == 0
    rows = np.load(logits)
    greedy = rows[len(expected) - 1:].argmax(-1).tolist()
    assert len(rows) >= len(expected) and greedy[:len(streamed)] == streamed
    # A bad image there is one error line, as from the server a 400.
    conversation.write_text(json.dumps(_conversation(first, "https://example.com/b.png")))
    assert cli(["generate", str(v41_vision_artifact), "--messages", str(conversation), "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("dsv4c: error: --messages: messages[0].content[3]: "
                                               "'https://example.com/b.png': remote URLs are not fetched; send the "
                                               "image itself as a data URL (data:image/png;base64,...)")

    # The next turn repeats the prompt's first block, the first image's span in it: a cache hit.
    before = served.metrics()
    turn = [*messages, {"role": "assistant", "content": "Both are noise."}, {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model=model, messages=turn, temperature=0, max_tokens=1)
    after = served.wait_metrics(lambda m: m[QUERIES] > before[QUERIES])
    assert after[HITS] - before[HITS] >= PREFIX_BLOCK
    # The same text with another first image shares no block.
    changed = [_conversation(other, f"file://{root}/second.jpg")[0], *turn[1:]]
    client.chat.completions.create(model=model, messages=changed, temperature=0, max_tokens=1)
    assert served.wait_metrics(lambda m: m[QUERIES] > after[QUERIES])[HITS] == after[HITS]


def test_bad_images_are_400s_and_the_server_goes_on(served, images, tmp_path):
    root, first, _ = images
    (tmp_path / "outside.png").write_bytes(first)
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, "GIF", save_all=True, append_images=[Image.new("RGB", (4, 4), (9, 9, 9))])
    cases = [("https://example.com/a.png", "invalid_image_url", "are not fetched"),
             (f"file://{tmp_path}/outside.png", "invalid_image_url", "not under the directory"),
             (f"file://{root}/../{tmp_path.name}/outside.png", "invalid_image_url", "not under the directory"),
             (f"data:image/gif;base64,{base64.b64encode(gif.getvalue()).decode()}", "invalid_image_format", "animated"),
             ("data:image/png;base64," + base64.b64encode(first[:-40]).decode(), "invalid_image_format", "truncated")]
    for url, code, fragment in cases:
        for path in ("/v1/chat/completions", "/tokenize"):
            body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                              {"type": "image_url", "image_url": {"url": url}}]}]}
            response = httpx.post(f"{served.url}{path}", json=body)
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == code, response.text
            assert error["message"].startswith("messages[0].content[1]: ") and fragment in error["message"]
    three = [{"type": "image_url", "image_url": {"url": f"file://{root}/second.jpg"}}] * 3
    response = httpx.post(f"{served.url}/tokenize", json={"messages": [{"role": "user", "content": three}]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_images"
    schema = httpx.get(f"{served.url}/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]
    assert "image_url" in json.dumps(schema["requestBody"])
    assert httpx.get(f"{served.url}/health").status_code == 200

"""DeepSeek-V4.1 with an image span in the prompt (docs/vision_text.md), against transformers'
V4.1 reference driven with the same rows (tests/data/v41_images/README.md): the parity case's
model and prompt, positions 17 .. 29 an image of random rows.

transformers' text model has no image path of its own yet: its forward refuses ``inputs_embeds``
when the model has Engram layers and hands no image mask to the MoE gates. :func:`reference_logits`
drives its modules with three small patches, which are the whole of what an image span changes in
the text model: the embedding module returns the image rows at the span's positions (the
prompt's ids still reach the Engram hash), every MoE block passes the span's mask to its router
(``DeepseekV41TopKRouter(hidden, image_mask)``: ``bias_vl`` at those positions), and the n-gram
hash state gets the span's positions as masked out (``token_mask``: DEAD). The stored logits are
what it computed; ``test_the_stored_reference_is_what_the_reference_computes`` recomputes them
where transformers has the V4.1 model (skipped elsewhere, as in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.prefix_cache import BLOCK_TOKENS
from dsv4c.runtime.request import ImageSpan, RequestFailed
from dsv4c.runtime.sampling import SamplingParams

from v41_case import IMAGE_TOKEN, write_case_model

DATA = Path(__file__).parent / "data"
IMAGES = DATA / "v41_images"
CASE = json.loads((IMAGES / "case.json").read_text())
TOKEN_IDS = json.loads((DATA / "v41_engram" / "case.json").read_text())["token_ids"]
START, COUNT = CASE["span_start"], CASE["span_tokens"]
PROMPT = TOKEN_IDS[:START] + [IMAGE_TOKEN] * COUNT + TOKEN_IDS[START + COUNT:]
TOLERANCE = 1e-4  # as tests/v41_case.py


def image_rows(seed: int, count: int = COUNT, scale: float = CASE["rows_scale"]) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((count, 64)) * scale).astype(np.float32)


ROWS = image_rows(CASE["rows_seed"])


def span(rows: np.ndarray = ROWS, digest: str = "image-0", start: int = START) -> ImageSpan:
    return ImageSpan(start, None, len(rows), digest, rows)


@pytest.fixture(scope="module", params=["reference", "llvm"])
def artifact(request, v41_case_artifacts) -> Path:
    return v41_case_artifacts[request.param]


@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_an_image_span_matches_the_reference(artifact, chunk):
    """Whole, and in chunks of 5 (17, 22 and 27 fall inside the span) and 1 (the span's last
    position fed alone, by the prefill function)."""
    engine = Engine(artifact, max_context=256, prefill_chunk=chunk)
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=1), record_logits=True, images=[span()])
    assert np.abs(result.logits[:len(PROMPT)] - np.load(IMAGES / "logits_full.npy")).max() < TOLERANCE


def test_every_image_change_matters(artifact):
    """The case fails if the rows, the router's image bias or the Engram DEAD marks were left out:
    each alone moves the logits well past the tolerance."""
    want = np.load(IMAGES / "logits_full.npy")
    engine = Engine(artifact, max_context=256)
    text = engine.generate(PROMPT, SamplingParams(max_new_tokens=1), record_logits=True).logits
    assert np.abs(text[:len(PROMPT)] - want).max() > 100 * TOLERANCE  # the rows
    for name, reference in (("bias_vl", "logits_without_bias_vl"), ("dead", "logits_without_dead")):
        assert np.abs(np.load(IMAGES / f"{reference}.npy") - want).max() > 100 * TOLERANCE, name


def test_the_prefix_cache_keys_image_spans_on_their_digest(artifact):
    """A later prompt with the same image in its first block hits the cache and computes what a
    cold engine does; the same tokens with another image (another digest) never hit."""
    params = SamplingParams(max_new_tokens=2)
    first = PROMPT + TOKEN_IDS * 5  # past the first block
    later = first[:BLOCK_TOKENS] + TOKEN_IDS[:9]
    cached = Engine(artifact, max_context=1024)
    cached.generate(first, params, images=[span()])
    hit = cached.generate(later, params, record_logits=False, images=[span()])
    assert cached.prefix_cache.hit_tokens == BLOCK_TOKENS
    cold = Engine(artifact, max_context=1024, prefix_caching=False)
    assert hit.tokens == cold.generate(later, params, images=[span()]).tokens
    other = span(image_rows(7), digest="image-1")
    got = cached.generate(later, params, images=[other])
    assert cached.prefix_cache.hit_tokens == BLOCK_TOKENS  # no new hit
    assert got.tokens == cold.generate(later, params, images=[other]).tokens


class CountingEncoder:
    """A stand-in for ``encode_image``: the rows of seed ``pixels[0, 0, 0]``, calls counted."""

    def __init__(self):
        self.calls = 0

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        self.calls += 1
        return image_rows(int(pixels.flat[0]))


def test_the_engine_encodes_each_image_once_and_never_in_decode(artifact):
    engine = Engine(artifact, max_context=256, prefill_chunk=4)
    engine.backend.has_vision, counting = True, CountingEncoder()
    engine.image_rows.encode = counting
    calls, step = [], engine.backend.step

    def recording(tokens, positions, seq_ids, logit_rows=None, engram_rows=None, images=None):
        calls.append((int(np.min(positions)), images))
        return step(tokens, positions, seq_ids, logit_rows, engram_rows=engram_rows, images=images)

    engine.backend.step = recording
    pixels = np.full((3, 14, 14), CASE["rows_seed"], np.float32)
    spans = [ImageSpan(START, pixels, COUNT, "image-0"), ImageSpan(START, pixels, COUNT, "image-0")]
    rids = [engine.submit(PROMPT, SamplingParams(max_new_tokens=3), record_logits=True, images=[s]) for s in spans]
    engine.run()
    assert counting.calls == 1
    for rid in rids:
        assert np.abs(engine.result(rid).logits[:len(PROMPT)] - np.load(IMAGES / "logits_full.npy")).max() < TOLERANCE
    decode_steps = [images for first, images in calls if first >= len(PROMPT)]
    assert decode_steps and all(images is None for images in decode_steps)


def test_an_image_the_tower_refuses_fails_its_request_alone(artifact):
    engine = Engine(artifact, max_context=256)

    def refuse(pixels):
        raise UsageError("encode_image: 5 x 5 pixels are not whole patches")

    engine.backend.has_vision, engine.image_rows.encode = True, refuse
    params = SamplingParams(max_new_tokens=2)
    bad = engine.submit(PROMPT, params, images=[ImageSpan(START, np.zeros((3, 5, 5), np.float32), COUNT, "odd")])
    good = engine.submit(PROMPT, params, images=[span()])
    engine.run()
    with pytest.raises(RequestFailed, match="whole patches"):
        engine.result(bad)
    assert len(engine.result(good).tokens) == 2


def test_a_text_model_refuses_images(serve_artifacts):
    engine = Engine(serve_artifacts / "ref", max_context=256)
    with pytest.raises(UsageError, match="does not take images"):
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=1), images=[ImageSpan(0, None, 3, "x", ROWS[:3])])


@pytest.mark.parametrize("images, message", [
    ([span(start=START + 1)], "other than the image token"),
    ([span(), span(ROWS[:3], start=START + 10)], "overlaps"),
    ([span(ROWS[:, :32])], "rows of shape"),
    ([ImageSpan(START, None, COUNT, "x")], "neither pixels nor rows"),
    ([ImageSpan(START, np.zeros((3, 14, 14), np.float32), COUNT, "x")], "no vision tower"),
    ([span(np.concatenate([ROWS] * 4))], "outside the prompt"),
])
def test_bad_image_spans_are_refused(artifact, images, message):
    engine = Engine(artifact, max_context=256)
    with pytest.raises(UsageError, match=message):
        engine.submit(PROMPT, SamplingParams(max_new_tokens=1), images=images)
    assert not engine.requests


# ---------------------------------------------------------------------------- the reference


def reference_logits(model_dir: Path, prompt: list[int], rows: np.ndarray, start: int, chunks: list[int],
                     bias_vl: bool = True, dead: bool = True) -> np.ndarray:
    """transformers' V4.1 logits ``[S, vocab]`` of ``prompt`` whose positions ``start ..`` take
    ``rows`` (fed in ``chunks`` through one cache), with the three patches of the module
    docstring (``bias_vl`` / ``dead`` False: without that patch)."""
    import torch
    from transformers import DeepseekV41ForCausalLM, PreTrainedTokenizerFast
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v41.configuration_deepseek_v41 import DeepseekV41TextConfig

    model = DeepseekV41ForCausalLM.from_pretrained(model_dir, config=DeepseekV41TextConfig.from_pretrained(model_dir))
    model.model.bind_tokenizer(PreTrainedTokenizerFast.from_pretrained(model_dir))
    model.eval()
    mask = torch.zeros(len(prompt), dtype=torch.bool)
    mask[start:start + len(rows)] = True
    table = torch.zeros(len(prompt), rows.shape[1])
    table[start:start + len(rows)] = torch.from_numpy(rows)
    now = {"positions": None}  # the positions of the chunk being fed

    embed, hash_state = model.model.embed, model.model.engram_hash_state

    class Spliced(torch.nn.Module):
        def forward(self, input_ids):
            x, p = embed(input_ids), now["positions"]
            return torch.where(mask[p][None, :, None], table[p][None].to(x.dtype), x)

    class DeadSpans:
        def __call__(self, input_ids, position_ids, token_mask):
            return hash_state(input_ids, position_ids, ~mask[now["positions"]][None] if dead else token_mask)

    model.model.embed = Spliced()
    model.model.engram_hash_state = DeadSpans()
    for layer in model.model.layers:
        moe = layer.ffn
        if bias_vl:
            moe.forward = lambda h, moe=moe: type(moe).forward(moe, h, mask[now["positions"]])
    cache, out, first = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for n in chunks:
            now["positions"] = torch.arange(first, first + n)
            out.append(model(input_ids=torch.tensor([prompt[first:first + n]]), past_key_values=cache,
                             use_cache=True).logits[0].float().numpy())
            first += n
    return np.concatenate(out)


def check_the_stored_reference(directory: Path) -> None:
    """Recompute every stored file with a transformers that has the V4.1 model (5.23.0 has not, so
    this runs by hand, not in the suite: ``python tests/test_v41_images.py`` with it importable)."""
    import transformers

    if not hasattr(transformers, "DeepseekV41ForCausalLM"):
        raise SystemExit("this transformers has no DeepSeek-V4.1 model")
    model = write_case_model(directory / "model")
    whole = reference_logits(model, PROMPT, ROWS, START, [len(PROMPT)])
    assert np.abs(whole - np.load(IMAGES / "logits_full.npy")).max() < 1e-6
    chunked = reference_logits(model, PROMPT, ROWS, START, CASE["self_check_chunks"])
    assert np.abs(chunked - whole).max() < 1e-5  # the case sits on no fake-quant rounding midpoint
    for name, reference in (("bias_vl", "logits_without_bias_vl"), ("dead", "logits_without_dead")):
        got = reference_logits(model, PROMPT, ROWS, START, [len(PROMPT)], **{name: False})
        assert np.abs(got - np.load(IMAGES / f"{reference}.npy")).max() < 1e-6


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        check_the_stored_reference(Path(scratch))
    print("the stored image-span reference is what the reference computes")

"""Vision-language serving end to end: the real server on the tiny Qwen2.5-VL and Qwen3-VL
fixtures, checked against caches off and against mlx-vlm's own generate and forward.

Servers are module-scoped and started lazily, at most two per family: caches on (with media limits
that the refusal tests need) and caches off (default MediaConfig). prefill_step_size 64 and block_size
16 make an image span several prefix blocks and several prefill chunks.
"""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import av
import httpx
import mlx.core as mx
import mlx_vlm
import numpy as np
import openai
import pytest
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image

from mlxhost.config import MediaConfig

FAMILIES = {"qwen2_5_vl": "qwen25vl_dir", "qwen3_vl": "qwen3vl_dir"}
ENGINE = dict(prefill_step_size=64, block_size=16)
BLOCK = ENGINE["block_size"]
MAX_PIXELS = 100_000  # the test images (224x300) and video frames (64x64) fit, OVERSIZED does not
OVERSIZED = (400, 400)
SLOW_S = 12.0  # the /slow route's delay; the server under test gives up after FETCH_TIMEOUT_S
FETCH_TIMEOUT_S = 4.0  # long enough for a normal fetch from this process on a loaded machine
QUESTION = "describe this"
MAX_NEW = 6
SYSTEM = "You are a careful assistant. You look at every picture closely before you answer. " * 2


# --- media ------------------------------------------------------------------------------------------

def noise_image(seed: int, size=(300, 224)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def make_mp4(seconds: int = 2, fps: int = 8, size: int = 64) -> bytes:
    """Flat frames whose colour changes every frame."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(seconds * fps):
            rgb = np.empty((size, size, 3), np.uint8)
            rgb[...] = (16 * i % 256, 255 - 16 * i % 256, 40 * i % 256)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def huge_png_header(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG that only declares enormous dimensions (its data is empty): refused from the header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


IMAGE = noise_image(0)
IMAGE_B = noise_image(1)  # same size, so the same prompt tokens: only the content hash tells them apart
IMAGE_PNG = png(IMAGE)


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, tuple[str, bytes]] = {}

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow":
            time.sleep(SLOW_S)
        ctype, body = self.routes.get(self.path, ("image/png", IMAGE_PNG))
        try:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up (the timeout case)
            pass


@pytest.fixture(scope="module")
def media_url():
    """Base URL of a 127.0.0.1 server: /img.png, /page.html (text/html), /slow (answers after SLOW_S)."""
    _Handler.routes = {"/img.png": ("image/png", IMAGE_PNG),
                       "/page.html": ("text/html", b"<html><body>not a picture</body></html>")}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm-media")
    (d / "img.png").write_bytes(IMAGE_PNG)
    (d / "clip.mp4").write_bytes(make_mp4())
    return d


@pytest.fixture(scope="module")
def video_uri(media_dir):
    return data_uri((media_dir / "clip.mp4").read_bytes(), "video/mp4")


# --- servers and clients ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(request, make_module_server, media_dir):
    """`servers(family, caches=True)`: one live server per (family, caches), started on first use."""
    started = {}

    def get(family: str, caches: bool = True):
        if (family, caches) not in started:
            model_dir = request.getfixturevalue(FAMILIES[family])
            if caches:
                media = MediaConfig(allowed_local_media_paths=(str(media_dir),), allow_private_media_urls=True,
                                    max_image_pixels=MAX_PIXELS, fetch_timeout_s=FETCH_TIMEOUT_S,
                                    fetch_deadline_s=3 * FETCH_TIMEOUT_S)
                live = make_module_server(model_dir, media=media, **ENGINE)
            else:
                live = make_module_server(model_dir, enable_prefix_cache=False, vision_cache_bytes=0, **ENGINE)
            started[(family, caches)] = live
        return started[(family, caches)]

    return get


@pytest.fixture(scope="module")
def reference(request):
    """`reference(family)`: mlx-vlm's own (model, processor) of the fixture, loaded once."""
    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = mlx_vlm.load(str(request.getfixturevalue(FAMILIES[family])))
        return loaded[family]

    return get


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)


def chat(live, messages, max_tokens: int = MAX_NEW, **kwargs):
    with client(live) as c:
        return c.chat.completions.create(model=live.model_name, messages=messages, max_tokens=max_tokens,
                                         temperature=0.0, **kwargs)


def post_chat(live, messages, max_tokens: int = 2) -> httpx.Response:
    body = {"model": live.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return httpx.post(live.base_url + "/chat/completions", json=body, timeout=60)


def vision_stats(live) -> dict:
    return httpx.get(live.url + "/v1/cache/stats", timeout=30).json()["vision"]


def clear_caches(live) -> None:
    assert httpx.delete(live.url + "/v1/cache", timeout=30).status_code == 200


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str, fps: float = 4.0, max_frames: int = 6) -> dict:
    return {"type": "video_url", "video_url": {"url": url, "fps": fps, "max_frames": max_frames}}


def ask(url: str, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [image_part(url), {"type": "text", "text": text}]}


def tokens_of(response) -> list[str]:
    return [e.token for e in response.choices[0].logprobs.content]


def image_span(processor, messages: list[dict], images: list) -> tuple[int, int]:
    """(first, end) position of the first image's placeholder tokens, by mlx-vlm's processor."""
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = np.asarray(processor(text=[prompt], images=images)["input_ids"])[0].tolist()
    token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    first = ids.index(token)
    return first, first + ids.count(token)


def template_ask(text: str = QUESTION) -> dict:
    """The message `ask` sends, as the chat template sees it."""
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


# --- identity: caches on == caches off == mlx-vlm ---------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_three_turn_conversation_is_identical_with_caches_off(family, servers, reference):
    first, end = image_span(reference(family)[1], [template_ask()], [IMAGE])
    follow_ups = ["What colors do you see?", "Anything else?"]
    runs = {}
    for caches in (True, False):
        live = servers(family, caches)
        messages, turns = [ask(data_uri(IMAGE_PNG))], []
        for turn in range(3):
            r = chat(live, messages, logprobs=True, top_logprobs=2)
            turns.append((r.choices[0].message.content, tokens_of(r), r.usage.prompt_tokens_details.cached_tokens))
            if turn < 2:
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": follow_ups[turn]}]
        runs[caches] = turns
    assert [t[:2] for t in runs[True]] == [t[:2] for t in runs[False]]
    # Turns 2 and 3 found every block that holds image placeholders in the prefix cache.
    assert all(cached >= end for _, _, cached in runs[True][1:]), (first, end, runs[True])
    assert all(cached == 0 for _, _, cached in runs[False])


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_mlx_vlm_generate_and_forward(family, servers, reference, media_dir):
    model, processor = reference(family)
    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=1)
    live = servers(family)
    r = chat(live, [ask(data_uri(IMAGE_PNG))], logprobs=True, top_logprobs=5)

    # Greedy text through mlx-vlm's generate, decoded with the same tokenizer.
    result = mlx_vlm.generate(model, processor, prompt, image=[str(media_dir / "img.png")],
                              max_tokens=MAX_NEW, temperature=0.0)
    assert r.choices[0].message.content == processor.tokenizer.decode(result.token_ids)
    assert r.usage.prompt_tokens == result.prompt_tokens

    # The random fixture repeats one token, so also check the first token's distribution against
    # mlx-vlm's own forward over the whole prompt.
    inputs = processor(text=[prompt], images=[IMAGE])
    extra = {k: mx.array(np.asarray(v)) for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    model.language_model._rope_deltas = None
    model.language_model._position_ids = None
    out = model(mx.array(np.asarray(inputs["input_ids"])), **extra)
    logits = (out.logits if hasattr(out, "logits") else out)[0, -1]
    ref = np.array(logits - mx.logsumexp(logits))
    first = r.choices[0].logprobs.content[0]
    top_ids = np.argsort(-ref)[:5]
    assert first.logprob == pytest.approx(float(ref[top_ids[0]]), abs=1e-4)
    assert first.token == processor.tokenizer.decode([int(top_ids[0])])
    got = [(e.token, e.logprob) for e in first.top_logprobs]
    assert [t for t, _ in got] == [processor.tokenizer.decode([int(t)]) for t in top_ids]
    assert [lp for _, lp in got] == pytest.approx([float(ref[t]) for t in top_ids], abs=1e-4)


# --- one picture, three sources ----------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_url_data_uri_and_path_share_one_encoding(family, servers, media_url, media_dir):
    live = servers(family)
    clear_caches(live)
    before = vision_stats(live)
    path = str(media_dir / "img.png")
    sources = [f"{media_url}/img.png", data_uri(IMAGE_PNG), path, "file://" + path]
    texts = [chat(live, [ask(src)]).choices[0].message.content for src in sources]
    after = vision_stats(live)
    assert len(set(texts)) == 1, texts
    assert after["entries"] == 1
    assert after["num_encoded"] - before["num_encoded"] == 1

    # Other text before the picture: no prefix block matches, so the features come from the vision cache.
    chat(live, [{"role": "system", "content": "Be brief."}, ask(path)])
    again = vision_stats(live)
    assert again["num_encoded"] == after["num_encoded"]
    assert again["num_reused"] > after["num_reused"]
    assert again["entries"] == 1


# --- prefix cache and images -------------------------------------------------------------------------

def test_repeated_image_hits_and_different_image_misses_the_image_blocks(servers, reference):
    family = "qwen2_5_vl"
    live = servers(family)
    clear_caches(live)
    system = {"role": "system", "content": SYSTEM}
    first, end = image_span(reference(family)[1], [system, template_ask()], [IMAGE])
    assert first >= BLOCK  # the common text prefix fills at least one block

    def cached(img):
        r = chat(live, [system, ask(data_uri(png(img)))], max_tokens=2)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(IMAGE) == 0
    assert cached(IMAGE) >= end  # the repeat covers every block with image tokens
    # Same tokens, another picture: only the text blocks before the image are shared.
    assert cached(IMAGE_B) == first // BLOCK * BLOCK


# --- concurrency ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_image_and_text_requests_equal_their_solo_runs(family, servers):
    live = servers(family)
    requests = [[ask(data_uri(png(noise_image(10 + i))), f"picture {i}: {QUESTION}")] for i in range(4)]
    requests += [[{"role": "user", "content": f"Tell me something about topic number {i}."}] for i in range(4)]

    def run(messages):
        r = chat(live, messages, logprobs=True)
        return r.choices[0].message.content, tokens_of(r)

    alone = [run(m) for m in requests]
    clear_caches(live)  # the batch must prefill (and encode) everything again, side by side
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, requests))
    assert together == alone


# --- video ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_video_is_cached_and_identical_with_caches_off(family, servers, video_uri):
    on, off = servers(family), servers(family, caches=False)
    plain = [{"role": "user", "content": [video_part(video_uri), {"type": "text", "text": "What happens?"}]}]
    with_system = [{"role": "system", "content": "Be brief."}, *plain]
    r1 = chat(on, plain, logprobs=True)
    encoded = vision_stats(on)["num_encoded"]
    r2 = chat(on, plain, logprobs=True)
    r3 = chat(on, with_system, logprobs=True)  # no prefix hit before the video: the vision cache serves it
    stats = vision_stats(on)
    assert stats["num_encoded"] == encoded
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r1.usage.prompt_tokens > 12  # the frames added placeholder tokens to the short text
    for ours, messages in ((r1, plain), (r2, plain), (r3, with_system)):
        theirs = chat(off, messages, logprobs=True)
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert tokens_of(ours) == tokens_of(theirs)
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens


# --- text only on a VLM -----------------------------------------------------------------------------

def test_text_only_chat_and_completions_on_a_vlm(servers):
    on, off = servers("qwen2_5_vl"), servers("qwen2_5_vl", caches=False)
    outs = []
    for live in (on, off):
        r = chat(live, [{"role": "user", "content": "Hello there, how are you?"}])
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        with client(live) as c:
            cr = c.completions.create(model=live.model_name, prompt="Once upon a time", max_tokens=MAX_NEW,
                                      temperature=0.0)
        assert cr.usage.completion_tokens >= 1
        outs.append((r.choices[0].message.content, cr.choices[0].text))
    assert outs[0] == outs[1]


# --- bad media --------------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# case -> (content part given the media server's URL and the video URI, words the message must contain)
BAD_MEDIA = {
    "unreachable-url": (lambda url, vid: image_part(f"http://127.0.0.1:{_closed_port()}/x.png"), "cannot connect"),
    "text-html": (lambda url, vid: image_part(f"{url}/page.html"), "text/html"),
    "undecodable-bytes": (lambda url, vid: image_part(data_uri(bytes(range(256)) * 8)), "not an image"),
    "truncated-png": (lambda url, vid: image_part(data_uri(IMAGE_PNG[:300])), "cannot decode image"),
    "oversized-image": (lambda url, vid: image_part(data_uri(png(noise_image(2, OVERSIZED)))), "too many pixels"),
    "huge-dimension-png": (lambda url, vid: image_part(data_uri(huge_png_header())), "too many pixels"),
    "too-many-frames": (lambda url, vid: video_part(vid, max_frames=1000), "too many frames"),
    "path-outside-allowed": (lambda url, vid: image_part("/etc/hostname"), "outside the allowed"),
    "bad-base64": (lambda url, vid: image_part("data:image/png;base64,!!not*base64!!"), "invalid base64"),
    "slow-server": (lambda url, vid: image_part(f"{url}/slow"), "timed out"),
}


def assert_error(response: httpx.Response, words: str, code: str | None = "invalid_media") -> None:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code
    assert words in err["message"], err


@pytest.mark.parametrize("case", BAD_MEDIA)
def test_bad_media_is_a_400(case, servers, media_url, video_uri):
    make_part, words = BAD_MEDIA[case]
    part = make_part(media_url, video_uri)
    response = post_chat(servers("qwen2_5_vl"), [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}])
    assert_error(response, words)
    assert response.json()["error"]["param"] == part["type"]  # image_url / video_url


def test_private_url_is_refused_without_the_flag(servers, media_url):
    live = servers("qwen2_5_vl", caches=False)  # default MediaConfig
    assert_error(post_chat(live, [ask(f"{media_url}/img.png")]), "private or local address")


def test_video_url_part_without_url_is_a_400(servers):
    response = post_chat(servers("qwen2_5_vl"), [{"role": "user", "content": [{"type": "video_url"}]}])
    assert_error(response, "a 'video_url' part needs its 'video_url' field", code=None)
    assert response.json()["error"]["param"] == "messages.0.content.0.video_url"


def test_text_only_model_refuses_images(server):
    assert_error(post_chat(server, [ask(data_uri(IMAGE_PNG))]), "text-only", code=None)


def test_server_keeps_serving_after_bad_media(servers):
    live = servers("qwen2_5_vl")
    for case in ("undecodable-bytes", "bad-base64"):
        make_part, words = BAD_MEDIA[case]
        assert_error(post_chat(live, [{"role": "user", "content": [make_part("", "")]}]), words)
    with pytest.raises(openai.BadRequestError) as info:  # what the SDK shows a client
        chat(live, [ask("/etc/hostname")])
    assert info.value.code == "invalid_media" and "outside the allowed" in info.value.message
    r = chat(live, [ask(data_uri(IMAGE_PNG))])
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1

"""Images through the OpenAI API (issue 36): a tiny Qwen2.5-VL served by uvicorn, the
official client sending a base64 image, and the 400s for bad, blocked and too many images."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest

from server.app import build_app
from server.limits import ServerLimits
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer

pytestmark = pytest.mark.slow


def png_bytes(h=60, w=84, seed=0) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, kind="png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "ok.png").write_bytes(png_bytes(seed=3))
    return d


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory, media_dir):
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from tests.models.hf_factory import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("vl_server") / "m", "qwen2_5_vl")
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(path), dtype="float32", limit_mm_per_prompt={"image": 2},
                                               **TINY_ENGINE_ARGS), progress=False)
    limits = ServerLimits(allowed_media_domains=("images.example",), allowed_local_media_path=str(media_dir))
    srv = RunningServer(build_app(llm, "vl", max_model_len=TINY_ENGINE_ARGS["max_model_len"], limits=limits))
    srv.llm = llm
    yield srv
    srv.stop()
    llm.shutdown()


def test_openai_client_sends_a_base64_image(vl_server, media_dir):
    client = openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    url = data_url(png_bytes())
    reply = client.chat.completions.create(model="vl", temperature=0.0, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "w5 w6"}, image_part(url)]}])
    assert reply.choices[0].message.content
    # 60x84 px -> 56x84 -> 4x6 patches -> 6 image tokens, in the prompt's usage.
    text_only = client.chat.completions.create(model="vl", temperature=0.0, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "w5 w6"}]}])
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 + 6  # start, end, the 6 tokens
    # The same image again (a later turn): encoded once.
    encoder = vl_server.llm.engine.model_runner.encoder
    before = encoder.num_encoded
    again = client.chat.completions.create(model="vl", temperature=0.0, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "w5 w6"}, image_part(url)]}])
    assert encoder.num_encoded == before and again.choices[0].message.content == reply.choices[0].message.content
    # A file under --allowed-local-media-path is read.
    local = client.chat.completions.create(model="vl", temperature=0.0, max_tokens=2, messages=[
        {"role": "user", "content": [image_part(f"file://{media_dir / 'ok.png'}")]}])
    assert local.choices[0].finish_reason == "length"


@pytest.mark.parametrize("parts, message", [
    ([image_part("data:image/png;base64,***")], "base64"),
    ([image_part(data_url(b"not an image"))], "could not be decoded"),
    ([image_part("https://elsewhere.example/cat.png")], "not allowed"),
    ([image_part("file:///etc/hostname")], "outside --allowed-local-media-path"),
    ([image_part("ftp://images.example/cat.png")], "scheme"),
    ([image_part(data_url(png_bytes()))] * 3, "at most 2 images"),
    ([{"type": "image_url", "image_url": {}}], "image_url.url"),
    ([{"type": "input_audio", "input_audio": {}}], "not supported"),
])
def test_bad_images_are_400s_naming_the_part(vl_server, parts, message):
    r = httpx.post(f"{vl_server.url}/v1/chat/completions", timeout=60, json={
        "model": "vl", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == "messages"
    if "at most" not in message:
        assert "messages[0].content[0]" in err["message"]


def test_a_text_model_refuses_image_parts():
    from server.errors import APIError
    from server.protocol import ChatMessageParam
    from server.serving_engine import OpenAIServing

    msg = ChatMessageParam(role="user", content=[{"type": "text", "text": "hi"}, image_part("data:image/png;base64,")])
    with pytest.raises(APIError, match="takes text only"):
        OpenAIServing.message_dicts([msg])


def test_openai_client_sends_an_image_to_gemma3(tmp_path):
    """Gemma 3 served: the chat template's <start_of_image> becomes the image's 16
    soft tokens between <start_of_image> and <end_of_image>; a bad image is a 400."""
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from tests.models.hf_factory import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / "g3", "gemma3_vl")
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(path), dtype="float32", **TINY_ENGINE_ARGS), progress=False)
    srv = RunningServer(build_app(llm, "g3", max_model_len=TINY_ENGINE_ARGS["max_model_len"]))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        text = [{"type": "text", "text": "w5 w6"}]
        reply = client.chat.completions.create(model="g3", temperature=0.0, max_tokens=4, messages=[
            {"role": "user", "content": text + [image_part(data_url(png_bytes()))]}])
        text_only = client.chat.completions.create(model="g3", temperature=0.0, max_tokens=4, messages=[
            {"role": "user", "content": text}])
        assert reply.choices[0].message.content
        assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + 1 + 16 + 1  # boi, 16 tokens, eoi
        bad = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "g3", "max_tokens": 2, "messages": [
                {"role": "user", "content": [image_part("data:image/png;base64,***")]}]})
        assert bad.status_code == 400 and "base64" in bad.json()["error"]["message"]
    finally:
        srv.stop()
        llm.shutdown()

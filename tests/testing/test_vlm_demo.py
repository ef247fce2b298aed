import json

import mlx.core as mx
import mlx_vlm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image
from tokenizers import Tokenizer

from mlxhost.server.cli import main
from mlxhost.testing import vlm_demo
from mlxhost.testing.vlm_demo import VISION_TOKENS, make_hf_config, make_random_vlm, make_vlm_model, vlm_config_for

FAMILY_FIXTURES = {"qwen2_5_vl": "qwen25vl_dir", "qwen3_vl": "qwen3vl_dir"}
FAMILIES = list(FAMILY_FIXTURES)


@pytest.fixture(scope="module")
def loaded(request):
    """family -> (model, processor), each loaded once per module."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = mlx_vlm.load(str(request.getfixturevalue(FAMILY_FIXTURES[family])))
        return cache[family]

    return get


def _image(seed: int, size: int = 224) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8))


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_config_token_ids_match_tokenizer(family, request):
    path = request.getfixturevalue(FAMILY_FIXTURES[family])
    config = _config(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS + ("<|im_end|>",)}
    assert None not in ids.values() and len(set(ids.values())) == len(ids)
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert config["eos_token_id"] == ids["<|im_end|>"]
    assert config["vision_config"]["model_type"] == family
    # Where mlx-vlm reads them: the top level for Qwen2.5-VL, text_config for Qwen3-VL.
    text = config if family == "qwen2_5_vl" else config["text_config"]
    assert text["rope_theta"] == 1_000_000.0 and text["tie_word_embeddings"] is True
    assert text["hidden_size"] == 128 and text["vocab_size"] == tokenizer.get_vocab_size()
    # Vision tokens come after the text demo's vocabulary: the same text gets the same ids as the text fixture.
    assert min(ids[t] for t in VISION_TOKENS) == 2048


@pytest.mark.parametrize("family", FAMILIES)
def test_load_gives_back_the_saved_weights(family, request, loaded):
    path = request.getfixturevalue(FAMILY_FIXTURES[family])
    model, processor = loaded(family)
    assert type(processor).__name__ == {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[family]
    saved = mx.load(str(path / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(saved)
    for name, value in saved.items():
        assert value.dtype == mx.float32
        assert mx.array_equal(params[name], value), name
    if family == "qwen3_vl":
        assert model.config.vision_config.deepstack_visual_indexes == [0, 1]
        assert any(name.startswith("vision_tower.deepstack_merger_list.1.") for name in saved)


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_expands_image_tokens(family, loaded):
    model, processor = loaded(family)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    inputs = processor(text=[prompt], images=[_image(0)], padding=True, return_tensors="np")
    input_ids = np.array(inputs["input_ids"])[0]
    grid = np.array(inputs["image_grid_thw"])
    patch = 14 if family == "qwen2_5_vl" else 16
    # 224 rounds to a multiple of 28 for Qwen2.5-VL; Qwen3-VL's min_pixels (256^2) scales it up to 256.
    expected_grid = [1, 16, 16]
    assert grid.tolist() == [expected_grid]
    num_image_tokens = int(np.sum(input_ids == model.config.image_token_id))
    assert num_image_tokens == grid.prod() // 4 == 64
    assert np.sum(input_ids == model.config.vision_start_token_id) == 1
    assert np.sum(input_ids == model.config.vision_end_token_id) == 1
    assert np.array(inputs["pixel_values"]).shape == (256, 3 * 2 * patch * patch)


@pytest.mark.parametrize("family", FAMILIES)
def test_large_images_are_not_downscaled_much(family, loaded):
    _, processor = loaded(family)
    image_processor = processor.image_processor
    tokens = {side: image_processor.num_image_tokens(side, side) for side in (224, 448, 768, 1024)}
    # Roughly (side / 28)^2 or (side / 32)^2 tokens: the benchmark's sizes all keep their resolution.
    factor = 28 if family == "qwen2_5_vl" else 32
    assert tokens[1024] >= 0.9 * (1024 / factor) ** 2
    assert tokens[224] < tokens[448] < tokens[768] < tokens[1024]


@pytest.mark.parametrize("family", FAMILIES)
def test_video_part_uses_video_tokens(family, loaded):
    model, processor = loaded(family)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x.mp4"}},
                                             {"type": "text", "text": "Summarize."}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|video_pad|><|vision_end|>Summarize." in prompt
    frames = [_image(i, 112) for i in range(4)]
    inputs = processor(text=[prompt], videos=[frames], padding=True, return_tensors="np")
    grid = np.array(inputs["video_grid_thw"])
    assert grid.shape == (1, 3) and grid[0, 0] == 2  # 4 frames, temporal patch 2
    assert np.sum(np.array(inputs["input_ids"]) == model.config.video_token_id) == grid.prod() // 4


def test_chat_template_content_shapes(qwen25vl_dir, loaded):
    _, processor = loaded("qwen2_5_vl")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}},
                                     {"type": "text", "text": "a"}, {"type": "input_image"},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{image}a{image}b<|im_end|>\n"
                    "<|im_start|>assistant\n<|im_end|>\n")
    assert (qwen25vl_dir / "chat_template.jinja").read_text() == vlm_demo.CHAT_TEMPLATE


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_image_is_deterministic(family, loaded):
    model, processor = loaded(family)
    prompt = apply_chat_template(processor, model.config, "Describe the picture.", num_images=1)
    runs = [mlx_vlm.generate(model, processor, prompt, image=[_image(0)], max_tokens=8, temperature=0.0)
            for _ in range(2)]
    assert runs[0].text and runs[0].text == runs[1].text
    assert runs[0].generation_tokens == 8
    assert runs[0].prompt_tokens > 64  # the image's 64 tokens plus the text


@pytest.mark.parametrize("family", FAMILIES)
def test_image_content_changes_the_logits(family, loaded):
    model, processor = loaded(family)
    prompt = apply_chat_template(processor, model.config, "Describe the picture.", num_images=1)
    last_logits = []
    for seed in (0, 1):
        inputs = processor(text=[prompt], images=[_image(seed)], padding=True, return_tensors="np")
        out = model(mx.array(inputs["input_ids"]), pixel_values=mx.array(inputs["pixel_values"]),
                    mask=mx.array(inputs["attention_mask"]), image_grid_thw=mx.array(inputs["image_grid_thw"]))
        last_logits.append(out.logits[0, -1])
    assert mx.all(mx.isfinite(last_logits[0])).item()
    assert mx.abs(last_logits[0] - last_logits[1]).max().item() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_prompt(family, loaded):
    model, processor = loaded(family)
    prompt = apply_chat_template(processor, model.config, "Hello there", num_images=0)
    assert "<|image_pad|>" not in prompt
    result = mlx_vlm.generate(model, processor, prompt, max_tokens=8, temperature=0.0)
    assert result.text and result.generation_tokens == 8


def test_seed_fixes_the_weights(qwen25vl_dir):
    hf_config = _config(qwen25vl_dir)
    config = vlm_config_for("qwen2_5_vl", "tiny")
    first, again = (dict(tree_flatten(make_random_vlm(config, hf_config).parameters())) for _ in range(2))
    other = dict(tree_flatten(make_random_vlm(vlm_config_for(seed=1), hf_config).parameters()))
    name = "language_model.model.embed_tokens.weight"
    assert all(mx.array_equal(first[k], again[k]) for k in first)
    assert not mx.array_equal(first[name], other[name])
    # Output varies with std 0.1; norms start at one.
    assert abs(np.std(np.array(first[name])) - 0.1) < 0.01
    assert mx.all(first["language_model.model.norm.weight"] == 1).item()


@pytest.mark.parametrize("family,shape,billions", [("qwen2_5_vl", "3b", (3.6, 3.9)), ("qwen3_vl", "2b", (2.0, 2.3))])
def test_benchmark_shapes_have_real_sizes(family, shape, billions):
    config = vlm_config_for(family, shape)
    assert config.dtype == "bfloat16"
    ids = {t: 151643 + i for i, t in enumerate(("<|endoftext|>", "<|im_start|>", "<|im_end|>") + VISION_TOKENS)}
    hf_config = make_hf_config(config, {**ids, "vocab_size": 151936})
    # Only shapes: the parameters are lazy and never evaluated.
    model = make_vlm_model(hf_config)
    num_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert billions[0] * 1e9 < num_params < billions[1] * 1e9
    tower = model.vision_tower
    assert len(tower.blocks) == config.vision_depth


def test_cli_builds_a_vlm_shape(tmp_path, capsys):
    out = tmp_path / "qwen2-vl"
    assert main(["demo-model", str(out), "--shape", "qwen2-vl-tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    model, processor = mlx_vlm.load(str(out))
    assert _config(out)["model_type"] == "qwen2_vl"
    prompt = apply_chat_template(processor, model.config, "Hi", num_images=1)
    result = mlx_vlm.generate(model, processor, prompt, image=[_image(2)], max_tokens=4, temperature=0.0)
    assert result.generation_tokens == 4


def test_rejects_unknown_shapes():
    with pytest.raises(ValueError):
        vlm_config_for("qwen3_vl", "3b")
    with pytest.raises(ValueError):
        vlm_config_for("llava", "tiny")


# --- Gemma 3 ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    return mlx_vlm.load(str(gemma3_dir))


def test_gemma3_config_and_weights_load_back(gemma3_dir, gemma3):
    model, processor = gemma3
    config = _config(gemma3_dir)
    tokenizer = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in vlm_demo.gemma3.TOKENS}
    assert None not in ids.values() and min(ids.values()) == 2048  # after the text demo's vocabulary
    assert config["image_token_index"] == ids["<image_soft_token>"] == model.config.image_token_index
    assert config["eos_token_id"] == [ids["<eos>"], ids["<end_of_turn>"]]
    assert config["hidden_size"] == config["text_config"]["hidden_size"] == 128
    assert type(processor).__name__ == "Gemma3Processor"
    assert (processor.boi_token, processor.image_token, processor.tokenizer.eoi_token) == (
        "<start_of_image>", "<image_soft_token>", "<end_of_image>")
    # Gemma's head is tied on load; the fixture saves it tied, so every saved weight loads back as is.
    saved = mx.load(str(gemma3_dir / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(saved)
    assert all(mx.array_equal(params[k], v) for k, v in saved.items())
    # Sliding-window layers alternate with global ones, so the tiny model has both cache kinds.
    kinds = [type(c).__name__ for c in model.language_model.make_cache()]
    assert kinds == ["RotatingKVCache", "KVCache"]


def test_gemma3_chat_template_and_image_expansion(gemma3):
    model, processor = gemma3
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]},
                {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "Sure?"}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>What is this?<end_of_turn>\n"
                      "<start_of_turn>model\nA cat.<end_of_turn>\n<start_of_turn>user\nSure?<end_of_turn>\n"
                      "<start_of_turn>model\n")
    inputs = processor(text=[prompt], images=[_image(0, 300)], return_tensors="np")
    ids = np.array(inputs["input_ids"])[0].tolist()
    assert np.array(inputs["pixel_values"]).shape == (1, 3, 112, 112)
    soft = model.config.image_token_index
    first = ids.index(soft)
    assert ids.count(soft) == 16 and ids[first:first + 16] == [soft] * 16
    assert processor.tokenizer.decode(ids[first - 3:first + 19]) == (
        "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n")
    assert ids[0] == processor.tokenizer.convert_tokens_to_ids("<bos>") and ids.count(ids[0]) == 1


def test_gemma3_generate_with_image_and_text(gemma3):
    model, processor = gemma3
    prompt = apply_chat_template(processor, model.config, "Describe the picture.", num_images=1)
    runs = [mlx_vlm.generate(model, processor, prompt, image=[_image(seed)], max_tokens=6, temperature=0.0)
            for seed in (0, 0)]
    assert runs[0].text and runs[0].text == runs[1].text and runs[0].generation_tokens == 6
    text_only = apply_chat_template(processor, model.config, "Hello there", num_images=0)
    assert "<start_of_image>" not in text_only
    assert mlx_vlm.generate(model, processor, text_only, max_tokens=4, temperature=0.0).generation_tokens == 4


def test_gemma3_cli_shape_and_pooling_check(tmp_path, capsys):
    out = tmp_path / "gemma3"
    assert main(["demo-model", str(out), "--shape", "gemma3-tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert _config(out)["model_type"] == "gemma3" and (out / "processor_config.json").is_file()
    # The projector pools the patch grid (112 / 14 = 8 per side) to a square: 16 fits, 15 and 9 do not.
    with pytest.raises(ValueError):
        vlm_demo.VlmDemoConfig(family="gemma3", mm_tokens_per_image=15)
    with pytest.raises(ValueError):
        vlm_demo.VlmDemoConfig(family="gemma3", mm_tokens_per_image=9)

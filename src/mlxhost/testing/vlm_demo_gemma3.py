"""Gemma 3's parts of the tiny vision-language fixtures (testing/vlm_demo.py builds the folder).

Gemma's special tokens after the text demo's vocabulary, a Gemma-style chat template (a system
message folds into the first user turn, the assistant is "model", an image part is one
`<start_of_image>` that the processor expands), config.json as mlx-vlm 0.7.10 reads it and the
SigLIP image processor's settings (a fixed square resize, so every image gives the same number of
placeholder tokens).
"""

from __future__ import annotations

from mlxhost.testing import demo

BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, END_OF_TURN = "<bos>", "<eos>", "<pad>", "<end_of_turn>"
TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, "<start_of_turn>", END_OF_TURN, BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN)

_IMAGE_PARTS = ("image", "image_url", "input_image")

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set system = messages[0]['content'] -%}"
    "{%- else -%}{%- set system = messages[0]['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- set first_prefix = system + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}"
    "{%- if loop.first -%}{{- first_prefix -}}{%- endif -%}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] | trim -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    f"{{%- if part['type'] in {list(_IMAGE_PARTS)} -%}}{{{{- '{BOI_TOKEN}' -}}}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# tokenizer_config.json entries: the named tokens Gemma3Processor reads (tokenizer.boi_token, ...).
TOKENIZER_OVERRIDES = {
    "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
    "extra_special_tokens": {"boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN, "image_token": IMAGE_TOKEN},
}


def make_hf_config(config, ids: dict) -> dict:
    """config.json of a gemma3 VlmDemoConfig; ids: {token: id} plus "vocab_size"."""
    text = {
        "model_type": "gemma3_text",
        **demo.text_shape(config),
        "query_pre_attn_scalar": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        # Transformers names the global base rope_theta, mlx-vlm rope_global_base_freq.
        "rope_theta": config.rope_theta,
        "rope_global_base_freq": config.rope_theta,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": None,
        "sliding_window": config.sliding_window,
        "sliding_window_pattern": config.sliding_window_pattern,
        "mm_tokens_per_image": config.mm_tokens_per_image,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": ids["vocab_size"],
        "dtype": config.dtype,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": config.vision_hidden_size,
        "intermediate_size": config.vision_intermediate_size,
        "num_hidden_layers": config.vision_depth,
        "num_attention_heads": config.vision_num_heads,
        "patch_size": config.patch_size,
        "image_size": config.image_size,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
        "vision_use_head": False,
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text, "vision_config": vision,
        "image_token_index": ids[IMAGE_TOKEN], "boi_token_index": ids[BOI_TOKEN], "eoi_token_index": ids[EOI_TOKEN],
        "mm_tokens_per_image": config.mm_tokens_per_image,
        # mlx-vlm divides image features by the square root of the top-level hidden_size (default 2048).
        "hidden_size": config.hidden_size,
        "vocab_size": ids["vocab_size"],
        "bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids[END_OF_TURN]],
        "pad_token_id": ids[PAD_TOKEN],
        "dtype": config.dtype, "torch_dtype": config.dtype,
    }


def processor_files(config) -> dict:
    """File name -> JSON: transformers' Gemma3ImageProcessor settings and mlx-vlm's Gemma3Processor's."""
    image = {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": config.image_size, "width": config.image_size}, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": list(config.image_mean), "image_std": list(config.image_std), "do_convert_rgb": None,
        "do_pan_and_scan": None, "image_seq_length": config.mm_tokens_per_image,
    }
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": config.mm_tokens_per_image}
    return {"preprocessor_config.json": image, "processor_config.json": processor}


def generation_config(ids: dict) -> dict:
    return {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids[END_OF_TURN]],
            "pad_token_id": ids[PAD_TOKEN], "do_sample": False}

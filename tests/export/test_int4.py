"""The int4 export's weights, dequantized from the package (scale * data per block, as Core ML does) and put
back into the PyTorch wrapper: the weight-only quantization error of the logits, float32 everywhere else."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mlxhost.testing.needs import need
from tests.export.conftest import CONTEXT, PROMPT_LEN

need("torch", "coremltools")  # at collection: every test here converts or runs through them

from mlxhost.export.package_info import dequantized_weights  # noqa: E402
from mlxhost.export.wrapper import StatefulCausalLM, load_hf_model, stateful_logits  # noqa: E402

BLOCK = 32
# Measured on the tiny fixtures (random weights, std 0.1; float logits of std ~0.8, max ~3.8) over prompt +
# 20 extend steps, block 32: max |int4 - float| logit 1.45 (Llama) / 1.11 (Qwen3), mean 0.23 / 0.17.
# Random tiny models have no margin between their top logits, so int4 moves them by about one logit std;
# what must hold tightly is that the package quantized as block-wise int4 should: its logits stay within
# 0.19 of an independent symmetric round-to-nearest int4 (scale = block max / 7) done here in PyTorch.
INT4_MAX_ATOL, INT4_MEAN_ATOL = 2.0, 0.3
VS_REFERENCE_INT4_ATOL = 0.35


def _parameter_name(mil_name: str) -> str:
    # "model_model_layers_0_mlp_up_proj_weight_to_fp16_quantized" -> "model_model_layers_0_mlp_up_proj_weight"
    return re.sub(r"(_to_fp(16|32))?_quantized$", "", mil_name)


def _with_package_weights(wrapper, package) -> int:
    """Copies every dequantized package weight over the wrapper parameter it came from; returns their count."""
    import torch

    params = {name.replace(".", "_"): p for name, p in wrapper.named_parameters()}
    replaced = 0
    for mil_name, value in dequantized_weights(package).items():
        param = params[_parameter_name(mil_name)]
        original = param.detach().numpy()
        assert value.shape == original.shape
        # Round to nearest on the symmetric grid of each block of 32 input channels: within half a step
        # (plus the float16 rounding of the weight before it was quantized).
        step = np.abs(original.reshape(original.shape[0], -1, BLOCK)).max(-1, keepdims=True) / 7
        error = np.abs((value - original).reshape(step.shape[0], -1, BLOCK)) / step
        assert error.max() <= 0.51, f"{mil_name}: {error.max():.2f} steps off"
        with torch.no_grad():
            param.copy_(torch.from_numpy(value))
        replaced += 1
    return replaced


def _reference_int4(wrapper) -> None:
    """Symmetric per-block int4 of every weight the package quantized (2-D, more than 2048 elements)."""
    import torch

    with torch.no_grad():
        for param in wrapper.parameters():
            if param.ndim == 2 and param.numel() > 2048:
                blocks = param.reshape(param.shape[0], -1, BLOCK)
                scale = blocks.abs().amax(-1, keepdim=True) / 7
                param.copy_((torch.clamp(torch.round(blocks / scale), -8, 7) * scale).reshape(param.shape))


@pytest.fixture(scope="module")
def logits(hf_dir, int4_package, token_ids):
    float_logits = stateful_logits(StatefulCausalLM(load_hf_model(hf_dir), CONTEXT), token_ids, PROMPT_LEN)
    package = StatefulCausalLM(load_hf_model(hf_dir), CONTEXT)
    replaced = _with_package_weights(package, int4_package)
    reference = StatefulCausalLM(load_hf_model(hf_dir), CONTEXT)
    _reference_int4(reference)
    return {"float": float_logits, "int4": stateful_logits(package, token_ids, PROMPT_LEN),
            "reference_int4": stateful_logits(reference, token_ids, PROMPT_LEN), "replaced": replaced}


def test_every_quantized_weight_maps_to_a_parameter_within_half_a_step(logits):
    assert logits["replaced"] == 15  # 7 projections x 2 layers + the (tied) embedding


def test_int4_logits_stay_within_the_stated_tolerance(logits):
    diff = np.abs(logits["int4"] - logits["float"])
    assert diff.max() <= INT4_MAX_ATOL, f"max |int4 - float| logit {diff.max():.3f}"
    assert diff.mean() <= INT4_MEAN_ATOL, f"mean |int4 - float| logit {diff.mean():.3f}"
    assert diff.max() > 1e-2  # the weights really changed: this is not float against float


def test_int4_logits_match_a_reference_block_int4(logits):
    diff = np.abs(logits["int4"] - logits["reference_int4"]).max()
    assert diff <= VS_REFERENCE_INT4_ATOL, f"max |package int4 - reference int4| logit {diff:.3f}"

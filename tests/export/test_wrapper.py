"""The stateful PyTorch wrapper that gets converted: same logits as transformers (1e-4) and as the MLX
model mlxhost serves (1e-3), over a prompt and 20 extend steps through the registered KV state."""

from __future__ import annotations

import numpy as np
import pytest

from mlxhost.testing.needs import need
from tests.export.conftest import CONTEXT, EXTEND_STEPS, PROMPT_LEN, mlx_logits, transformers_logits

need("torch", "coremltools")  # at collection: every test here converts or runs through them

from mlxhost.export import UnsupportedModelError  # noqa: E402
from mlxhost.export.wrapper import StatefulCausalLM, check_supported, load_hf_model, make_causal_mask, stateful_logits  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "qwen3"])
def family_dir(request, hf_llama_dir, hf_qwen3_dir, tmp_path_factory):
    """The two export fixtures, plus Llama 3.x rope scaling and Qwen2 (attention biases) for the wrapper."""
    from tests.export.conftest import build_hf_folder

    known = {"llama": hf_llama_dir, "qwen3": hf_qwen3_dir}
    return known.get(request.param) or build_hf_folder(tmp_path_factory.mktemp(request.param), request.param, 2)


@pytest.fixture(scope="module")
def wrapped(family_dir):
    return StatefulCausalLM(load_hf_model(family_dir), CONTEXT)


def test_state_buffers_have_the_core_ml_layout(wrapped):
    # (layers, batch, kv_heads, context, head_dim), registered so the converter sees them as state
    assert wrapped.state_shape == (2, 1, 2, CONTEXT, wrapped.model.config.head_dim)
    assert dict(wrapped.named_buffers())["key_cache"].shape == wrapped.state_shape
    assert dict(wrapped.named_buffers())["value_cache"].shape == wrapped.state_shape


def test_matches_transformers_over_prompt_and_extend(wrapped, family_dir, token_ids):
    ours = stateful_logits(wrapped, token_ids, PROMPT_LEN)
    reference = transformers_logits(family_dir, token_ids, PROMPT_LEN)
    assert ours.shape == reference.shape == (PROMPT_LEN + EXTEND_STEPS, reference.shape[1])
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-4)
    # The extend steps wrote the state: positions past the sequence stay zero, those before do not.
    used = len(token_ids)
    assert wrapped.key_cache[:, :, :, used:].abs().max() == 0
    assert wrapped.key_cache[:, :, :, :used].abs().amin(dim=-1).max() > 0


def test_matches_the_mlx_model_mlxhost_serves(wrapped, family_dir, token_ids):
    ours = stateful_logits(wrapped, token_ids, PROMPT_LEN)
    np.testing.assert_allclose(ours, mlx_logits(family_dir, token_ids, PROMPT_LEN), rtol=0, atol=1e-3)


class _Traced:
    """What stateful_logits needs of the TorchScript: call it, reset the state (the buffers are shared)."""

    def __init__(self, wrapper) -> None:
        from mlxhost.export.coreml import trace_wrapper

        self.wrapper, self.traced = wrapper, trace_wrapper(wrapper, example_tokens=4)

    def __call__(self, ids, mask):
        return self.traced(ids, mask)

    def reset(self):
        self.wrapper.reset()


@pytest.mark.parametrize("logits", ["all", "last"])
def test_the_trace_that_gets_converted_serves_every_length(hf_dir, token_ids, logits):
    """Linux cannot run the Core ML program, but it can run the TorchScript it is converted from: traced
    on 4 tokens, it must give the eager logits for an 8-token prompt and 1-token extend steps (nothing
    about positions or lengths baked in as constants)."""
    wrapper = StatefulCausalLM(load_hf_model(hf_dir), CONTEXT, logits=logits)
    eager = stateful_logits(wrapper, token_ids, PROMPT_LEN)
    np.testing.assert_allclose(stateful_logits(_Traced(wrapper), token_ids, PROMPT_LEN), eager, rtol=0, atol=1e-5)


def test_last_logits_are_the_last_row_of_all(wrapped, family_dir, token_ids):
    every = stateful_logits(wrapped, token_ids, PROMPT_LEN)
    last = StatefulCausalLM(load_hf_model(family_dir), CONTEXT, logits="last")
    expected = every[PROMPT_LEN - 1:]  # the prompt's last position, then each extend step
    np.testing.assert_allclose(stateful_logits(last, token_ids, PROMPT_LEN), expected, rtol=0, atol=1e-5)


def test_extend_depends_on_the_state(wrapped, token_ids):
    """A wrong state (zeroed between prompt and extend) changes the logits: the test above can fail."""
    import torch

    wrapped.reset()
    ids = torch.tensor([token_ids[:PROMPT_LEN + 1]])
    with torch.no_grad():
        wrapped(ids[:, :PROMPT_LEN], torch.from_numpy(make_causal_mask(PROMPT_LEN, PROMPT_LEN)))
        good = wrapped(ids[:, PROMPT_LEN:], torch.from_numpy(make_causal_mask(1, PROMPT_LEN + 1)))
        wrapped.reset()
        bad = wrapped(ids[:, PROMPT_LEN:], torch.from_numpy(make_causal_mask(1, PROMPT_LEN + 1)))
    assert (good - bad).abs().max() > 1e-2


def test_causal_mask_layout():
    mask = make_causal_mask(2, 5)
    assert mask.shape == (1, 1, 2, 5)
    assert (mask[0, 0] == 0).tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "gemma3_text"}, "not supported"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic"}}, "sequence length"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window"),
])
def test_unsupported_models_are_refused_with_the_reason(fields, message):
    class Config:
        pass

    config = Config()
    config.__dict__.update(fields)
    with pytest.raises(UnsupportedModelError, match=message):
        check_supported(config)


def test_context_past_the_model_limit_is_refused(hf_llama_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        StatefulCausalLM(load_hf_model(hf_llama_dir), 4096)

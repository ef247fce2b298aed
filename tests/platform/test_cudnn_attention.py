"""--cudnn-attention: the process-wide MLX-CUDA switch, decided without a GPU (environ and backend passed in)."""

import pytest

from mlxhost.config import EngineConfig
from mlxhost.platform.cudnn_attention import ENV, apply_cudnn_attention, wants_cudnn


def test_auto_turns_cudnn_off():
    assert not wants_cudnn("auto")
    assert wants_cudnn("on")
    assert not wants_cudnn("off")
    with pytest.raises(ValueError):
        wants_cudnn("maybe")
    with pytest.raises(ValueError, match="cudnn_attention"):
        EngineConfig(cudnn_attention="maybe")


def test_sets_the_environment_on_cuda_only():
    env = {}
    assert apply_cudnn_attention("auto", environ=env, on_cuda=False) == "n/a"
    assert ENV not in env
    assert apply_cudnn_attention("auto", environ=env, on_cuda=True) == "off"
    assert env[ENV] == "0"


def test_the_first_engine_decides_for_the_process():
    env = {}
    assert apply_cudnn_attention("off", environ=env, on_cuda=True) == "off"
    # MLX has read the switch by now: a second model asking for cuDNN gets what is in force.
    assert apply_cudnn_attention("on", environ=env, on_cuda=True) == "off"
    assert env[ENV] == "0"
    assert apply_cudnn_attention("off", environ=env, on_cuda=True) == "off"


def test_the_users_environment_wins():
    env = {ENV: "1"}
    assert apply_cudnn_attention("off", environ=env, on_cuda=True) == "env:1"
    assert env[ENV] == "1"

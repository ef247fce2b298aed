"""`mlxhost serve` flags people bring from vLLM, SGLang, mlx-lm, Ollama, llama.cpp: the same meaning maps to
ours (noted in the log), another meaning is an error naming ours; an unknown flag gets the closest of ours and its
value is never taken for the model; a bad value names its flag, on the command line, in MLXHOST_* and in YAML."""

import logging
import os

import pytest

from mlxhost.server import cli, serve_command
from mlxhost.server.foreign_flags import FOREIGN, translate


def _serve_args(argv, monkeypatch, env=None):
    """The namespace main() would hand _serve (a stand-in keeps it instead of serving)."""
    for name in [n for n in os.environ if n.startswith("MLXHOST_")]:
        monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    seen = {}
    monkeypatch.setattr(serve_command, "_serve", lambda args: seen.setdefault("args", args) and 0)
    cli.main(["serve", *argv])
    return seen["args"]


def _error(argv, monkeypatch, capsys, env=None) -> str:
    with pytest.raises(SystemExit) as exc:
        _serve_args(argv, monkeypatch, env)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[0]


def test_vllm_memory_share_maps_to_ours_in_dedicated_mode(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="mlxhost.server.cli"):
        args = _serve_args(["--gpu-memory-utilization", "0.8"], monkeypatch)
    assert (args.memory_utilization, args.memory_mode, args.model) == (0.8, "dedicated", None)  # 0.8 is no model
    assert "--gpu-memory-utilization is vLLM's name for --memory-utilization (with --memory-mode dedicated)" \
        in caplog.text
    args = _serve_args(["--memory-mode", "desktop", "--gpu-memory-utilization=0.7", "m"], monkeypatch)
    assert (args.memory_utilization, args.memory_mode, args.model) == (0.7, "desktop", "m")  # an explicit mode stays


@pytest.mark.parametrize("argv,dest,value", [
    (["--tensor-parallel-size", "2"], "tensor_parallel", 2),
    (["--pipeline-parallel-size", "2"], "pipeline_parallel", 2),
    (["--num-ctx", "8192"], "max_model_len", 8192),
    (["--context-length", "8192"], "max_model_len", 8192),
    (["--max-tokens", "64"], "default_max_tokens", 64),  # mlx-lm's; not argparse's abbreviation of --max-tokens-cap
    (["--decode-concurrency", "8"], "max_num_seqs", 8),
    (["--prompt-cache-bytes", "1GB"], "cache_memory", "1GB"),
    (["--no-enable-prefix-caching"], "no_prefix_cache", True),
    (["--max-model-len", "2048"], "max_model_len", 2048),  # the same name here
    (["--served-model-name", "qwen"], "served_model_name", "qwen"),
])
def test_same_meaning_maps(argv, dest, value, monkeypatch):
    args = _serve_args(argv + ["model-x"], monkeypatch)
    assert getattr(args, dest) == value and args.model == "model-x"


def test_accepted_and_ignored(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="mlxhost.server.cli"):
        args = _serve_args(["--trust-remote-code", "--enable-prefix-caching", "m"], monkeypatch)
    assert args.model == "m" and args.no_prefix_cache is False
    assert "--trust-remote-code (vLLM) is ignored" in caplog.text


@pytest.mark.parametrize("flag,says", [
    ("--max-num-batched-tokens", "--max-num-batched-tokens is vLLM's flag; here --prefill-step-size caps the prompt"
                                 " tokens of one engine step"),
    ("--kv-cache-dtype", "--kv-cache-dtype is vLLM's flag; here --kv-bits 8 or --kv-bits 4 quantizes the KV cache"),
    ("--max-kv-size", "--max-kv-size is mlx-lm's flag: a rotating cache"),
    ("--temp", "--temp is mlx-lm's flag: sampling is set per request"),
])
def test_other_meaning_is_an_error_naming_ours(flag, says, monkeypatch, capsys):
    err = _error([flag, "8", "m"], monkeypatch, capsys)
    assert err.startswith("mlxhost serve: error: " + says)


def test_unknown_flag_suggests_the_closest_and_keeps_its_value_from_the_model(monkeypatch, capsys):
    err = _error(["--max-modle-len", "4096"], monkeypatch, capsys)
    assert err == "mlxhost serve: error: unknown flag --max-modle-len (did you mean --max-model-len?)"
    assert _error(["--frobnicate", "0.9"], monkeypatch, capsys) == "mlxhost serve: error: unknown flag --frobnicate"
    assert _error(["a", "b"], monkeypatch, capsys) == "mlxhost serve: error: unexpected argument b"


def test_bench_flags_get_suggestions_too(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--url", "http://127.0.0.1:1", "--model", "m", "--concurency", "2"])
    assert capsys.readouterr().err.splitlines()[0] == ("mlxhost bench serve: error: unknown flag --concurency"
                                                       " (did you mean --concurrency?)")


@pytest.mark.parametrize("argv,says", [
    (["--cache-memory", "lots"], "--cache-memory: could not read 'lots' as a size (e.g. 2GB, 512MiB, 20%)"),
    (["--max-loaded-memory", "8 gigs"], "--max-loaded-memory: could not read '8 gigs' as a size"),
    (["--max-request-body-bytes", "big"], "--max-request-body-bytes: could not read 'big' as a size"),
    (["--memory-utilization", "90"], "--memory-utilization: expected a share above 0 and at most 1 (e.g. 0.9),"
                                     " got '90'"),
    (["--port", "http"], "--port: invalid int value: 'http'"),
])
def test_a_bad_value_names_its_flag(argv, says, monkeypatch, capsys):
    assert _error(argv, monkeypatch, capsys).startswith("mlxhost serve: error: " + says)


def test_good_sizes_pass_as_typed(monkeypatch):
    args = _serve_args(["--cache-memory", "20%", "--max-loaded-memory", "8GB", "--vision-cache-memory", "1e9"],
                       monkeypatch)
    assert (args.cache_memory, args.max_loaded_memory, args.vision_cache_memory) == ("20%", "8GB", "1e9")


def test_env_and_yaml_values_name_their_source(monkeypatch, capsys, tmp_path):
    err = _error([], monkeypatch, capsys, {"MLXHOST_CACHE_MEMORY": "lots"})
    assert "MLXHOST_CACHE_MEMORY: could not read 'lots' as a size (e.g. 2GB, 512MiB, 20%)" in err
    err = _error([], monkeypatch, capsys, {"MLXHOST_PORT": "eighty"})
    assert "MLXHOST_PORT: expected a whole number, got 'eighty'" in err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seq: 8\n")
    err = _error(["--config", str(cfg)], monkeypatch, capsys)
    assert f"--config {cfg}: max_num_seq: no such setting (did you mean max_num_seqs?)" in err
    cfg.write_text("kv_cache_dtype: fp8\n")
    assert "kv_cache_dtype: --kv-cache-dtype is vLLM's flag; here --kv-bits" in _error(["--config", str(cfg)],
                                                                                        monkeypatch, capsys)


def test_a_vllm_yaml_maps_like_its_flags(monkeypatch, tmp_path, caplog):
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("gpu_memory_utilization: 0.85\ntensor-parallel-size: 1\ntrust_remote_code: true\n")
    with caplog.at_level(logging.INFO, logger="mlxhost.server.cli"):
        args = _serve_args(["--config", str(cfg)], monkeypatch)
    assert (args.memory_utilization, args.memory_mode, args.tensor_parallel) == (0.85, "dedicated", 1)
    assert f"--config {cfg}: gpu_memory_utilization is vLLM's name for memory_utilization" in caplog.text


def test_every_mapping_names_a_real_serve_flag():
    serve = cli.make_parser(with_bench=False).parse_args(["serve"]).settings_parser
    ours = {o for a in serve._actions for o in a.option_strings}
    for name, foreign in FOREIGN.items():
        assert name not in ours, name  # ours wins: never rewrite a flag we have
        assert foreign.ours is None or foreign.ours == "" or foreign.ours in ours, name
        assert all(flag in ours for flag in foreign.also), name


def test_translate_leaves_our_flags_alone():
    argv = ["m", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5"]
    out, notes = translate(argv, {"--max-num-seqs", "--memory-utilization", "--memory-mode"})
    assert out == ["m", "--max-num-seqs", "8", "--memory-mode", "dedicated", "--memory-utilization", "0.5"]
    assert len(notes) == 1

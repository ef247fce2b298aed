"""Each engine step records the host's time per phase (engine/contract.py StepInfo): the core's schedule,
detokenizing, update and outputs around the runner, and inside a plain decode its sampling, launch and
read-back. The step trace (MLXHOST_STEP_TRACE) writes them, one column each, under a header of as many."""

from __future__ import annotations

import time

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.contract import CoreStats
from mlxhost.engine.core import EngineCore
from mlxhost.engine.loop import _StepTrace
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model

_AROUND_RUNNER = ("schedule_s", "detok_s", "update_s", "output_s")
_IN_DECODE = ("sample_s", "launch_s", "readback_s")


@pytest.fixture(scope="module")
def stepped(qwen3_model_dir):
    """(StepInfo, the step's time around core.step()) for every step of one greedy request, with logprobs."""
    loaded = load_model(str(qwen3_model_dir))
    core = EngineCore(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4, enable_prefix_cache=False),
                      max_model_len=4096)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    core.add_request(Request("r", list(range(1, 20)), params, []))
    steps = []
    while core.has_work:
        began = time.perf_counter()
        core.step()
        steps.append((core.last_step, time.perf_counter() - began))
    return core, steps


def test_a_decode_step_fills_every_host_phase(stepped):
    _, steps = stepped
    decodes = [info for info, _ in steps if info.num_decoding and not info.prefill_chunk_tokens]
    assert decodes
    for info in decodes:
        assert all(getattr(info, f) > 0 for f in (*_AROUND_RUNNER, *_IN_DECODE, "execute_s", "decode_s")), info
        # The decode's parts lie inside it.
        assert info.sample_s + info.launch_s + info.readback_s <= info.decode_s


def test_the_phases_add_up_to_the_core_step(stepped):
    """The phases around the runner and the runner itself split the core's step with nothing counted twice."""
    _, steps = stepped
    for info, outer_s in steps:
        assert info.schedule_s + info.execute_s + info.detok_s + info.update_s + info.output_s <= outer_s


def test_a_prefill_step_has_its_phases_too(stepped):
    _, steps = stepped
    info = steps[0][0]
    assert info.prefill_chunk_tokens and info.prefill_s > 0
    assert all(getattr(info, f) > 0 for f in _AROUND_RUNNER)


def test_the_trace_line_has_a_column_for_each_header_name(stepped, tmp_path):
    core, steps = stepped
    path = tmp_path / "steps.tsv"
    trace = _StepTrace.open(str(path))
    for info, step_s in steps:
        trace.write(CoreStats(num_running=1, last_step=info), 0.0, 0.001, step_s, 1)
    trace.close()
    header, *lines = path.read_text().splitlines()
    names = header.split("\t")
    assert len(lines) == len(steps)
    assert all(len(line.split("\t")) == len(names) for line in lines)
    assert len(set(names)) == len(names)
    # A decode step's host columns carry its values (ms); the first step prefilled.
    assert steps[1][0].num_decoding and not steps[1][0].prefill_chunk_tokens
    row = dict(zip(names, lines[1].split("\t")))
    info = steps[1][0]
    assert all(row[f[:-2] + "_ms"] == f"{getattr(info, f) * 1e3:.3f}" for f in (*_AROUND_RUNNER, *_IN_DECODE))

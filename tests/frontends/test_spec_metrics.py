"""/metrics shows speculative acceptance per proposer kind beside the totals, from engines' counters alone."""

from types import SimpleNamespace

from mlxhost.engine.loop import EngineStats
from mlxhost.frontends.common.metrics import Metrics


def test_acceptance_per_kind_beside_the_totals():
    engines = [SimpleNamespace(stats=EngineStats(spec_drafted_tokens=10, spec_accepted_tokens=4, spec_kind="eagle3"),
                               kv_capacity_tokens=0),
               SimpleNamespace(stats=EngineStats(spec_drafted_tokens=30, spec_accepted_tokens=6, spec_kind="ngram"),
                               kv_capacity_tokens=0),
               SimpleNamespace(stats=EngineStats(), kv_capacity_tokens=0)]  # a model that does not speculate
    text = Metrics(lambda: engines).render().decode()
    assert 'mlxhost_spec_kind_acceptance_rate{kind="eagle3"} 0.4' in text
    assert 'mlxhost_spec_kind_acceptance_rate{kind="ngram"} 0.2' in text
    assert 'mlxhost_spec_kind_draft_tokens_total{kind="ngram"} 30.0' in text
    assert "mlxhost_spec_acceptance_rate 0.25" in text

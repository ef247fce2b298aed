"""GET /v1/status: the start-up memory budget and live readings."""


def test_status_reports_budget_and_readings(server, http):
    body = http.get(f"{server.url}/v1/status").json()
    budget, memory = body["budget"], body["memory"]
    parts = ("weights", "activations", "kv", "prefix_cache", "vision_cache")
    assert budget["ceiling"] == sum(budget[k] for k in parts)
    assert budget["weights"] > 0 and budget["activations"] > 0 and budget["kv"] > 0
    assert 0 < memory["available_ram"] <= memory["total_ram"] and memory["backend"] == "cpu"
    assert body["num_running"] == 0 and body["prefix_cache"]["enabled"] is True

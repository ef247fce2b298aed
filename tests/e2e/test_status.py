"""GET /v1/status: the start-up memory budget and live readings."""


def test_status_reports_budget_and_readings(server, http):
    body = http.get(f"{server.url}/v1/status").json()
    budget, memory = body["budget"], body["memory"]
    parts = ("weights", "activations", "kv", "prefix_cache", "vision_cache")
    assert budget["ceiling"] == sum(budget[k] for k in parts)
    assert budget["weights"] > 0 and budget["activations"] > 0 and budget["kv"] > 0
    assert 0 < memory["available_ram"] <= memory["total_ram"] and memory["backend"] == "cpu"
    assert body["num_running"] == 0 and body["prefix_cache"]["enabled"] is True
    # Live numbers next to the start-up ones; the prefix cache is sized from the budget's share.
    assert body["memory_mode"] == "desktop" and body["startup_budget"]["ceiling"] >= budget["ceiling"]
    assert 0 < body["prefix_cache"]["budget_bytes"] <= budget["prefix_cache"]
    assert body["kv_capacity_tokens"] > 0 and body["pressure"]["refresh_s"] > 0

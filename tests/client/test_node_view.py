"""`zmqllm status`'s node tables: resources per worker and host, drift per pool."""

from __future__ import annotations

from zmqllm.client.node_view import drift_lines, format_drift, format_resources

STATUS = {
    "workers": [
        {"id": "w0", "info": {"host": "a"}, "cpu_percent": 80.0,
         "stats": {"rss_bytes": 3 << 30, "kv_bytes_used": 1 << 20, "kv_bytes_reserved": 8 << 20,
                   "net_rx_bytes": 5 << 20, "net_tx_bytes": 6 << 20,
                   "cuda_used_bytes": 10 << 30, "cuda_total_bytes": 80 << 30}},
        {"id": "w1", "info": {"host": "a"}, "cpu_percent": 20.0, "stats": {"rss_bytes": 1 << 30}},
        {"id": "w2", "info": {"host": "b"}, "stats": {}},
        "not a worker",
    ],
    "drift": [
        {"model": "m", "layers": [0, 15], "field": "torch",
         "values": {"2.13.0": ["w0", "w1"], "2.12.1": ["w2"]}},
    ],
}  # fmt: skip


def test_resources_per_worker_and_per_host() -> None:
    text = format_resources(STATUS)
    w0 = next(line for line in text.splitlines() if line.startswith("w0"))
    for shown in ("3.0GiB", "80%", "1.0MiB/8.0MiB", "5.0MiB/6.0MiB", "10.0GiB/80.0GiB"):
        assert shown in w0, shown
    hosts = text.split("hosts")[1].splitlines()
    a = next(line for line in hosts if line.startswith("a "))
    assert "4.0GiB" in a and "100%" in a and " 2 " in a
    assert any(line.startswith("b ") and " 1 " in line for line in hosts)


def test_drift_lines_name_the_pool_the_field_and_each_value() -> None:
    assert drift_lines(STATUS) == [
        "  model m layers 0:15  torch differs: 2.13.0: w0, w1; 2.12.1: w2"
    ]
    assert "(none" in format_drift({"drift": []})
    assert drift_lines({"drift": [{"odd": 1}]}) == ["  ? (an entry of another shape)"]

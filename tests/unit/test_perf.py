"""Reading perf_analyzer's profile export: time to first token and inter-token gaps."""

import pytest

from benchmarks.perf import input_data, summarize


def test_first_response_latency_and_gaps_come_from_response_timestamps():
    ms = 1_000_000
    export = {
        "experiments": [
            {
                "experiment": {"mode": "concurrency", "value": 2},
                "requests": [
                    {"timestamp": 0, "response_timestamps": [30 * ms, 40 * ms, 50 * ms]},
                    {"timestamp": 100 * ms, "response_timestamps": [110 * ms, 130 * ms]},
                    {"timestamp": 200 * ms, "response_timestamps": []},
                ],
            }
        ]
    }
    [(concurrency, stats)] = summarize(export).items()
    assert (concurrency, stats["requests"]) == (2, 2)
    assert stats["ttft_p50_ms"] == pytest.approx(20.0)  # median of 30 and 10
    assert stats["ttft_p99_ms"] == pytest.approx(30.0)
    assert stats["itl_p50_ms"] == pytest.approx(10.0)  # median of 10, 10, 20
    assert stats["itl_p99_ms"] == pytest.approx(20.0)
    assert stats["latency_p50_ms"] == pytest.approx(40.0)  # median of 50 and 30
    assert stats["output_tokens_per_s"] == pytest.approx(5 / 0.13)  # 5 responses from 0 to 130 ms


def test_input_data_is_one_streamed_chat_request():
    import json

    [entry] = input_data(prompt_words=10, max_tokens=4)["data"]
    body = json.loads(entry["request"][0])
    assert body["stream"] and body["max_tokens"] == 4 and body["ignore_eos"]
    assert len(body["messages"][0]["content"].split()) == 11

"""examples/reproduce_llm.py's table: mean (min..max) over seeds per backend and max |torch - Keras| per row."""

from examples.reproduce_llm import summary


def test_summary_mean_range_and_backend_diff():
    rows = [{"method": "dense", "backend": "torch", "seed": None, "ppl": 8.0},
            {"method": "wanda50", "backend": "torch", "seed": 0, "ppl": 8.5},
            {"method": "wanda50", "backend": "torch", "seed": 1, "ppl": 8.7},
            {"method": "wanda50", "backend": "tf", "seed": 0, "ppl": 8.5004},
            {"method": "wanda50", "backend": "tf", "seed": 1, "ppl": 8.6999},
            {"method": "wanda50", "backend": "llmcompressor", "seed": 0, "ppl": 8.55}]
    lines = summary(rows, ["wanda50", "sparsegpt50"], ["torch", "tf", "llmcompressor"]).splitlines()
    assert lines[2] == "| dense | - | 8.0000 | - | - | - |"
    assert lines[3] == "| wanda50 | 0,1 | 8.6000 (8.5000..8.7000) | 8.6001 (8.5004..8.6999) | 8.5500 | 4.0e-04 |"
    assert lines[4] == "| sparsegpt50 | - | - | - | - | - |"

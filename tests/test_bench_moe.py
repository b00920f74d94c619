"""benches/moe.py runs end to end on a tiny workload and reports both models and their ratio;
benches/moe_layer.py reports its layer variants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import moe  # noqa: E402


def test_moe_bench_reports_dense_moe_and_ratio(capsys):
    moe.main(["--batch", "2", "--prompt-len", "4", "--output-len", "3", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["workload"] == {"batch": 2, "prompt_len": 4, "output_len": 3, "repeats": 1, "experts": 8, "top_k": 2,
                                  "quantization": None}
    assert result["dense_tokens_per_s"] > 0 and result["moe_tokens_per_s"] > 0
    expected = result["moe_tokens_per_s"] / result["dense_tokens_per_s"]
    assert abs(result["moe_over_dense"] - expected) <= 0.05 * expected + 0.001  # rates rounded to 0.1
    assert result["passes_bar"] == (result["moe_over_dense"] >= 0.7)


def test_moe_layer_bench_reports_each_variant_against_the_dense_mlp(capsys):
    """benches/moe_layer.py (its variants checked equal inside) on a few calls."""
    import moe_layer

    moe_layer.main(["--tokens", "8", "--calls", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    variants = {"dense_mlp", "moe_block", "moe_grouped_mm_copies"}
    assert set(result["median_us"]) == set(result["min_us"]) == variants
    assert all(value > 0 for value in result["min_us"].values())
    assert result["min_over_dense"]["dense_mlp"] == 1.0
    ratio = result["min_us"]["moe_block"] / result["min_us"]["dense_mlp"]
    assert abs(result["min_over_dense"]["moe_block"] - ratio) <= 0.01


def test_moe_expert_parallel_bench_reports_both_forms_and_their_ratio(capsys):
    """benches/moe_expert_parallel.py: TP=2 sliced against expert-parallel, tiny workload."""
    import moe_expert_parallel

    moe_expert_parallel.main(["--batch", "2", "--prompt-len", "4", "--output-len", "3", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["tensor_parallel_size"] == 2
    assert result["sliced_tokens_per_s"] > 0 and result["expert_parallel_tokens_per_s"] > 0
    expected = result["expert_parallel_tokens_per_s"] / result["sliced_tokens_per_s"]
    assert abs(result["expert_parallel_over_sliced"] - expected) <= 0.05 * expected + 0.001

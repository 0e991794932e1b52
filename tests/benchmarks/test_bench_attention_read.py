"""`python -m benchmarks attention-read`: decode attention alone against the read probe."""
import json

import numpy as np
import pytest

from benchmarks import attention_read


def test_page_tables_hold_every_page_once_in_their_order():
    contiguous = attention_read.page_table("contiguous", 3, 4, 5)
    scattered = attention_read.page_table("scattered", 3, 4, 5)
    assert contiguous.shape == scattered.shape == (3, 4, 5)
    assert contiguous.dtype == scattered.dtype == np.int32
    # contiguous: row after row, layer after layer
    np.testing.assert_array_equal(contiguous.ravel(), np.arange(60))
    np.testing.assert_array_equal(np.sort(scattered.ravel()), np.arange(60))
    assert not np.array_equal(scattered, contiguous)
    with pytest.raises(ValueError, match="page order"):
        attention_read.page_table("random", 3, 4, 5)


def test_kv_bytes_counts_keys_and_values_of_every_layer():
    # 2 rows of 10 and 6 tokens, 3 layers, 2 kv heads of 8, bf16
    assert attention_read.kv_bytes([10, 6], 3, 2, 8) == 16 * 3 * 2 * 2 * 8 * 2


def test_attention_read_reports_both_orders_and_kernels_against_the_read_probe(monkeypatch,
                                                                               tmp_path):
    from cpu_kernels import paged_decode
    from jaxbatch.benchmarks import roofline
    if paged_decode.unavailable_reason():
        pytest.skip(f"the CPU decode kernel: {paged_decode.unavailable_reason()}")
    monkeypatch.setattr(roofline, "read_bandwidth", lambda: 1e10)
    assert attention_read.main(["--rows", "2", "3", "--context", "32", "--layers", "2",
                                "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                                "--reps", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "attention_read.json").read_text())
    assert report["read_bandwidth_bytes_s"] == 1e10
    results = report["results"]
    # the AMX variant beside AVX512 where it runs (head_dim 32 fits its tiles)
    kernels = ["avx512"] + ["amx"] * (paged_decode.amx_why_not("uint16", 16, 32) is None)
    assert [(r["rows"], r["order"], r["kernel"]) for r in results] == [
        (rows, order, kernel) for rows in (2, 3) for order in attention_read.ORDERS
        for kernel in kernels]
    for r in results:
        per_token = 2 * 2 * 2 * 32 * 2            # layers, K and V, kv heads, head_dim, bf16
        assert r["rows"] * 17 * per_token <= r["kv_mb"] * 1e6 <= r["rows"] * 32 * per_token
        assert r["ms"] > 0
        assert r["gb_s"] == pytest.approx(r["kv_mb"] / r["ms"])
        assert r["floor_ms"] == pytest.approx(r["kv_mb"] * 1e6 / 1e10 * 1e3)
        assert r["over_floor"] == pytest.approx(r["ms"] / r["floor_ms"])


def test_attention_read_refuses_a_context_its_pages_do_not_tile(capsys):
    with pytest.raises(SystemExit):
        attention_read.main(["--context", "40", "--block-size", "16"])
    assert "--context" in capsys.readouterr().err

"""benchmarks/selection_sensitivity.py on the tiny preset: no perturbation moves nothing; a
large one moves the logits through the indexer's row selections."""


def test_selection_sensitivity_smoke(tmp_path):
    from benchmarks import selection_sensitivity
    still = selection_sensitivity.main(["--preset", "tiny", "--tokens", "64", "--eps", "0"])
    assert still["logits_rel_err"] == 0.0 and still["top1_agreement"] == 1.0
    out = tmp_path / "s.json"
    moved = selection_sensitivity.main(["--preset", "tiny", "--tokens", "64", "--eps", "0.5",
                                        "--out", str(out)])
    assert moved["logits_rel_err"] > 1e-3 and out.exists()

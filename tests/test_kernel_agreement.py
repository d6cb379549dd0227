"""benchmarks/kernel_agreement.py on the tiny preset (XLA implementations only on a CPU): the
capture replays every call, two equal formulas agree exactly, and a perturbation of a known
size shows up per call at that size and moves the logits."""

import pytest


@pytest.mark.heavy
def test_kernel_agreement_smoke(tmp_path):
    from benchmarks import kernel_agreement
    eps = 2.0 ** -6
    out = tmp_path / "a.json"
    r = kernel_agreement.main(["--preset", "tiny", "--tokens", "64", "--eps", str(eps),
                               "--impls", "xla,xla_dense,xla_perturbed,mosaic_gpu",
                               "--out", str(out)])
    assert out.exists() and r["skipped"] == ["mosaic_gpu"]        # no sm_90 GPU here
    assert len(r["calls"]) == 4                                    # one a layer
    for call in r["calls"]:
        assert call["rel_err"]["xla_dense"] < 1e-6                 # the same math
        # u uniform in [-1, 1]: the relative L2 error is eps / sqrt(3)
        assert call["rel_err"]["xla_perturbed"] == pytest.approx(eps / 3 ** 0.5, rel=0.2)
    assert r["logits"]["xla~xla_dense"]["logits_rel_err"] < 1e-6
    assert r["logits"]["xla~xla_perturbed"]["logits_rel_err"] > 1e-3

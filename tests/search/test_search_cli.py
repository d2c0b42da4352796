"""``eqjax search`` end to end on a one-block GGUF small enough to enumerate: the chosen mix is the
brute-force optimum of the objective the search states (summed proxy error under a byte budget), the
sizes it reports are the sizes the quantized tree really has, and each flag has its observable effect
(``--budget-bytes``, ``--pareto-bits``, ``--validate-proxy``, ``--eval-windows``, ``--eval-len``, the plot).

The model: hidden 8, one block (7 linear kernels of input width 8 or 32), a 259-token embedding table
(tied). Each kernel has 4 options (w2/w3/w4 with one group per row, W8 per channel) and the table 3
(float, int8, int4): 4**7 * 3 = 49,152 assignments, enumerated here with numpy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from eqjax.cli.main import main
from tests.robustness.robustness_fixtures import write_gguf

BUDGET_SLACK = 900  # bytes above the smallest model: the budget binds (checked below)
PARETO_BITS = (4.0, 6.0, 9.0)
EVAL_WINDOWS, EVAL_LEN = 2, 24
VALIDATE = 2


def expected_nbytes(label: str, k_in: int, n_out: int) -> int:
    """Stored bytes of one option, from the storage format alone: ``w{b}g{g}a`` = b-bit codes packed
    (k*n*b/8 bytes) + per group and output column a float16 scale and a uint8 zero point (3 bytes);
    ``w8pcs`` = int8 codes + one float32 scale per output column."""
    if label == "w8pcs":
        return k_in * n_out + 4 * n_out
    bits, group = int(label[1]), int(label[3:-1])
    return k_in * n_out * bits // 8 + -(-k_in // group) * n_out * 3


def brute_force(sizes: list[list[int]], errors: list[list[float]], budget: int) -> tuple[float, tuple[int, ...]]:
    """Minimum summed error over every assignment whose summed size is <= budget (all enumerated)."""
    grids = np.meshgrid(*[np.arange(len(s)) for s in sizes], indexing="ij")
    idx = np.stack([g.ravel() for g in grids], 1)  # [assignments, items]
    S = np.zeros(len(idx), np.int64)
    E = np.zeros(len(idx))
    for i, (s, e) in enumerate(zip(sizes, errors)):
        S += np.asarray(s, np.int64)[idx[:, i]]
        E += np.asarray(e, np.float64)[idx[:, i]]
    ok = S <= budget
    assert ok.any()
    best = np.flatnonzero(ok)[np.argmin(E[ok])]
    return float(E[best]), tuple(int(j) for j in idx[best])


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One ``eqjax search`` on the one-block GGUF with every reporting flag; its files and the inputs."""
    from eqjax.io.gguf import load_gguf

    root = tmp_path_factory.mktemp("search")
    gguf_path = write_gguf(root / "one.gguf", blocks=1, seed=1)
    cfg, params, tok = load_gguf(gguf_path)
    norms = (2 * cfg.n_layers + 1) * cfg.hidden * 4  # the unsearched float32 RMSNorm scales
    linear_min = sum(expected_nbytes(f"w2g{k}a", k, n) for k, n in _shapes(cfg))
    emb_float = cfg.vocab * cfg.hidden * 4
    budget = norms + linear_min + emb_float // 4 + BUDGET_SLACK
    out = root / "out"
    argv = ["search", "--model", str(gguf_path), "--budget-bytes", str(budget), "--out", str(out),
            "--calib-windows", "2", "--calib-len", "32", "--eval-windows", str(EVAL_WINDOWS), "--eval-len", str(EVAL_LEN),
            "--validate-proxy", str(VALIDATE), "--pareto-bits", ",".join(map(str, PARETO_BITS)),
            "--baselines", "w4g128a"]
    assert main(argv) == 0
    files = {n: out / n for n in ("rules.json", "layers.json", "pareto.json", "pareto.md", "pareto.png", "proxy_check.json")}
    return {"gguf": gguf_path, "cfg": cfg, "params": params, "tok": tok, "budget": budget, "norms": norms,
            "files": files, "layers": json.loads(files["layers.json"].read_text()),
            "report": json.loads(files["pareto.json"].read_text())}


def _shapes(cfg) -> list[tuple[int, int]]:
    """(input, output) width of every linear kernel of one block, times the blocks."""
    h, f = cfg.hidden, cfg.intermediate
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)] * cfg.n_layers


def _items(layers: list[dict], proxy: str) -> tuple[list[list[int]], list[list[float]]]:
    return [L["nbytes"] for L in layers], [L["errors"][proxy] for L in layers]


def test_search_writes_every_file(searched):
    for name, path in searched["files"].items():
        assert path.is_file() and path.stat().st_size > 0, name
    assert searched["files"]["pareto.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| searched <= uniform w4g128a |" in searched["files"]["pareto.md"].read_text()


def test_option_sizes_follow_the_storage_format(searched):
    """layers.json's bytes per option are those of the storage format, computed from the shapes alone."""
    linears = [L for L in searched["layers"] if not L["path"].startswith("embed")]
    assert len(linears) == 7 * searched["cfg"].n_layers
    for L in linears:
        k, n = L["shape"]
        assert L["nbytes"] == [expected_nbytes(o, k, n) for o in L["options"]], L
    (emb,) = [L for L in searched["layers"] if L["path"].startswith("embed")]
    assert emb["options"] == ["emb-float", "emb-int8", "emb-int4"]
    assert emb["nbytes"][0] == searched["cfg"].vocab * searched["cfg"].hidden * 4


def test_choice_is_the_brute_force_optimum_under_the_byte_budget(searched):
    """--budget-bytes B: the search minimizes the summed proxy (kl) error subject to summed option bytes <=
    B minus the unsearched params (here the float32 norms). Enumerating all 49,152 assignments gives the
    same minimum; the search's pick meets the budget, and the budget binds (the unconstrained optimum,
    every option at its largest, does not fit)."""
    layers, rep = searched["layers"], searched["report"]
    sizes, errors = _items(layers, rep["proxy"])
    cap = searched["budget"] - searched["norms"]
    assert sum(max(s) for s in sizes) > cap  # the budget binds
    best, picks = brute_force(sizes, errors, cap)
    chosen = [L["options"].index(rep["choices"][L["path"]]) for L in layers]
    got = sum(e[j] for e, j in zip(errors, chosen))
    assert sum(s[j] for s, j in zip(sizes, chosen)) == rep["searched_bytes"] <= cap
    assert rep["total_bytes"] == rep["searched_bytes"] + searched["norms"] <= searched["budget"]
    assert got == pytest.approx(best, rel=1e-9, abs=1e-15), (chosen, picks)


def test_pareto_points_are_brute_force_optima_at_their_bits(searched):
    """--pareto-bits: one searched point per value; each is the optimum at its budget, which the search
    states as ``b * linear weights / 8`` bytes plus the float table (the table's bytes are spent however
    the knapsack finds best)."""
    layers, rep = searched["layers"], searched["report"]
    sizes, errors = _items(layers, rep["proxy"])
    numel = sum(L["shape"][0] * L["shape"][1] for L in layers if not L["path"].startswith("embed"))
    table = [L for L in layers if L["path"].startswith("embed")][0]["nbytes"][0]
    pts = {p["budget_bits"]: p for p in rep["pareto"] if "budget_bits" in p}
    assert sorted(pts) == list(PARETO_BITS)
    for b, p in pts.items():
        best, _ = brute_force(sizes, errors, int(b * numel / 8) + table)
        assert p["proxy_error"] == pytest.approx(best, rel=1e-9, abs=1e-15), b
        assert p["kind"] == f"searched {b}b" and np.isfinite(p["ppl"])
    errs = [pts[b]["proxy_error"] for b in PARETO_BITS]
    assert errs == sorted(errs, reverse=True)  # more bytes, no more error


def test_reported_bytes_are_the_quantized_trees_bytes(searched):
    """rules.json applied to the float params gives a tree of exactly the reported total bytes."""
    from eqjax.core.pytree import tree_nbytes
    from eqjax.models import Model
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import load_recipe

    q = quantize(searched["params"], load_recipe(searched["files"]["rules.json"]), model=Model(searched["cfg"]))
    assert tree_nbytes(q) == searched["report"]["total_bytes"]
    base = [p for p in searched["report"]["pareto"] if p["kind"] == "uniform w4g128a"][0]
    matched = [p for p in searched["report"]["pareto"] if p.get("matched") == "uniform w4g128a"][0]
    assert matched["total_bytes"] <= base["total_bytes"]


def test_eval_flags_set_the_windows_of_the_fp_perplexity(searched):
    """--eval-windows W --eval-len L: the fp32 point's perplexity is that of the first W windows of L
    tokens of the evaluation text, recomputed here in float64 from the model's logits (float32 logits:
    |log ppl difference| <= a few float32 ulps of the logits' size, so rel 1e-4 is ample)."""
    import jax.numpy as jnp

    from eqjax.data import token_windows, wikipedia_tokens
    from eqjax.models import Model

    rep = searched["report"]
    assert rep["eval"]["windows"] == EVAL_WINDOWS and rep["eval"]["ctx"] == EVAL_LEN
    win = token_windows(wikipedia_tokens(searched["tok"])[1], EVAL_LEN, EVAL_WINDOWS)
    z = np.asarray(Model(searched["cfg"]).apply(searched["params"], jnp.asarray(win))[0], np.float64)[:, :-1]
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ppl = float(np.exp(-np.take_along_axis(logp, win[:, 1:, None], -1).mean()))
    fp = [p for p in rep["pareto"] if p["kind"] == "fp32"][0]
    assert fp["ppl"] == pytest.approx(ppl, rel=1e-4)
    assert f"Perplexity on {EVAL_WINDOWS} x {EVAL_LEN} tokens" in searched["files"]["pareto.md"].read_text()


def test_validate_proxy_measures_n_layers_at_two_widths(searched):
    """--validate-proxy N: single-layer KL measured on N layers at 2 and 4 bits (2N measurements), with each
    proxy's value for that option and a rank correlation per proxy."""
    pc = json.loads(searched["files"]["proxy_check.json"].read_text())
    assert pc == searched["report"]["proxy_check"]
    assert pc["n_measurements"] == 2 * VALIDATE == len(pc["rows"])
    assert len({r["layer"] for r in pc["rows"]}) == VALIDATE
    assert {r["option"][:2] for r in pc["rows"]} == {"w2", "w4"}
    by = {L["path"]: L for L in searched["layers"]}
    for r in pc["rows"]:
        L = by[r["layer"]]
        assert r["proxy_kl"] == pytest.approx(L["errors"]["kl"][L["options"].index(r["option"])], rel=1e-6)
        assert r["kl"] >= 0
    assert set(pc["spearman_vs_kl"]) == {"kl", "hessian", "relative", "weight"}
    assert all(-1 <= v <= 1 for v in pc["spearman_vs_kl"].values())


def test_budget_bits_without_evaluation_writes_the_proxy_curve(tmp_path):
    """--eval-windows 0: no perplexity is measured (no pareto.md); the Pareto points carry the proxy error
    and the plot is drawn from it. --budget-bits b: the linear kernels' average stored bits are <= b
    (--embedding none: the table stays float and is not searched)."""
    gguf_path = write_gguf(tmp_path / "one.gguf", blocks=1, seed=1)
    out = tmp_path / "o"
    assert main(["search", "--model", str(gguf_path), "--budget-bits", "6", "--proxy", "weight", "--embedding", "none",
                 "--calib-windows", "1", "--calib-len", "16", "--eval-windows", "0", "--pareto-bits", "5,8",
                 "--out", str(out)]) == 0
    rep = json.loads((out / "pareto.json").read_text())
    assert not (out / "pareto.md").exists() and (out / "pareto.png").stat().st_size > 0
    assert "eval" not in rep and all("ppl" not in p for p in rep["pareto"])
    assert [p["budget_bits"] for p in rep["pareto"]] == [5.0, 6.0, 8.0]
    assert rep["avg_bits"] <= 6 and rep["proxy"] == "weight"
    layers = json.loads((out / "layers.json").read_text())
    assert not any(L["path"].startswith("embed") for L in layers)
    numel = sum(L["shape"][0] * L["shape"][1] for L in layers)
    best, _ = brute_force(*_items(layers, "weight"), int(6 * numel / 8))
    chosen = [L["options"].index(rep["choices"][L["path"]]) for L in layers]
    assert sum(L["errors"]["weight"][j] for L, j in zip(layers, chosen)) == pytest.approx(best, rel=1e-9)

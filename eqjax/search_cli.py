"""The ``eqjax search`` command: :func:`eqjax.search.search` on a GGUF model, then the Pareto curve
(:mod:`eqjax.pareto`); writes ``rules.json`` (a recipe file), ``layers.json``, ``pareto.json`` and
``pareto.png`` under ``--out``.

Kept apart from :mod:`eqjax.search` so that the imports go one way: search_cli -> pareto -> search.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from eqjax.pareto import evaluate_pareto, plot_pareto
from eqjax.search import BudgetError, Candidate, search, validate_proxy

__all__ = ["add_search_args", "search_main"]


def add_search_args(p: Any) -> Any:
    """Arguments of ``eqjax search``."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget-bits", type=float, help="average stored bits per linear weight (metadata included)")
    g.add_argument("--budget-bytes", type=int, help="total stored bytes of the quantized model")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--out", default="search_out", help="output directory (rules JSON, Pareto JSON + PNG)")
    p.add_argument("--method", default="rtn", help="recipe step applying the rules (rtn, or a calibrated method)")
    p.add_argument("--proxy", default="relative", choices=("hessian", "relative", "weight"))
    p.add_argument("--calib-windows", type=int, default=8)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--eval-windows", type=int, default=8, help="evaluation windows for the Pareto ppl (0: skip)")
    p.add_argument("--eval-len", type=int, default=512)
    p.add_argument("--validate-proxy", type=int, default=0, metavar="N",
                   help="also measure single-layer KL on N random layers and correlate with the proxies")
    p.add_argument("--pareto-bits", default="2.5,3,3.5,4,4.5,5,6,8")
    p.add_argument("--baselines", default="w4g128a,w3g128a,w8pc",
                   help="uniform baselines to evaluate (comma-separated of w4g128a, w3g128a, w8pc; empty: none)")
    return p


def search_main(args: Any) -> int:
    """``eqjax search``: run :func:`search` on the model, write ``rules.json`` (a recipe file),
    ``pareto.json`` and ``pareto.png`` under ``--out``; print progress. Returns the exit code."""
    from eqjax.atomic import write_json
    from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
    from eqjax.io.gguf import load_gguf
    from eqjax.models import Model

    def say(s: str) -> None:
        print(f"[search] {s}", flush=True)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, params, tok = load_gguf(args.model)
    model = Model(cfg)
    cal_ids, eval_ids = wikipedia_tokens(tok)
    cal = calibration_windows(cal_ids, args.calib_windows, args.calib_len, 0)
    pbits = [float(x) for x in str(args.pareto_bits).split(",") if x]
    try:
        res = search(model, params, cal, budget_bits=args.budget_bits, budget_bytes=args.budget_bytes,
                     method=args.method, proxy=args.proxy, pareto_bits=pbits, progress=say)
    except BudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_json(out / "rules.json", res.recipe_dict())
    say(f"wrote {out / 'rules.json'} (load with --recipe {out / 'rules.json'})")
    report: dict[str, Any] = {"budget_bits": args.budget_bits, "budget_bytes": args.budget_bytes,
                              "avg_bits": res.avg_bits, "searched_bytes": res.searched_bytes,
                              "total_bytes": res.total_bytes, "proxy": res.proxy, "method": args.method,
                              "choices": res.choices}
    write_json(out / "layers.json", [
        {"path": L.path, "shape": L.shape, "options": [c.label(L.shape[0]) for c in L.options], "nbytes": L.nbytes,
         "errors": L.errors} for L in res.layers], indent=None)
    if args.validate_proxy:
        report["proxy_check"] = validate_proxy(model, params, cal[:2, :128], res.layers, n_layers=args.validate_proxy,
                                               progress=say)
        say(f"proxy Spearman vs measured KL: {report['proxy_check']['spearman_vs_kl']}")
        write_json(out / "proxy_check.json", report["proxy_check"])
    if args.eval_windows:
        ev = token_windows(eval_ids, args.eval_len, args.eval_windows)
        report["eval"] = {"windows": args.eval_windows, "ctx": args.eval_len, "split": "wikipedia eval half"}
        known = {"w4g128a": Candidate(4, 128), "w3g128a": Candidate(3, 128), "w8pc": Candidate(8, None, True)}
        base = tuple((f"uniform {b}", known[b]) for b in str(args.baselines).split(",") if b)
        report["pareto"] = evaluate_pareto(model, params, res, ev, method=args.method, baselines=base, progress=say)
    else:
        report["pareto"] = [{k: v for k, v in p.items() if k != "picks"} for p in res.pareto]
    write_json(out / "pareto.json", report)
    plot_pareto(report, out / "pareto.png")
    say(f"wrote {out / 'pareto.json'} and {out / 'pareto.png'}")
    return 0


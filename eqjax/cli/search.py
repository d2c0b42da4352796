"""The ``eqjax search`` command: :func:`eqjax.search.allocate.search` on a float model (a GGUF file or an HF
directory), then the Pareto curve (:mod:`eqjax.search.pareto`); writes ``rules.json`` (a recipe file),
``layers.json``, ``pareto.json`` and ``pareto.png`` under ``--out``.

Kept apart from :mod:`eqjax.search.layers` so that the imports go one way: search_cli -> pareto -> search.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from typing import Any, Callable

from eqjax.cli.flags import add_calibration_args, add_eval_len
from eqjax.cli.sources import load_source
from eqjax.core.errors import InputError, RecipeError
from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
from eqjax.io.atomic import write_json, write_text
from eqjax.recipes.registry import get_recipe
from eqjax.search.allocate import search
from eqjax.search.layers import DEFAULT_CANDIDATES, METHODS, PROXIES, Candidate
from eqjax.search.pareto import evaluate_pareto, plot_pareto
from eqjax.search.sensitivity import validate_proxy

__all__ = ["add_search_args", "search_main", "pareto_markdown", "check_search_args", "pareto_bits_list",
           "kl_ref_bits_list", "embedding_list", "baselines_list"]

KNOWN_BASELINES = {"w4g128a": Candidate(4, 128), "w3g128a": Candidate(3, 128), "w8pc": Candidate(8, None, True)}
EMBEDDING_OPTIONS = ("int8", "int4", "f16", "bf16")
WIDTHS = tuple(sorted({c.bits for c in DEFAULT_CANDIDATES}))


def _items(text: str, expected: str) -> list[str]:
    """The comma-separated entries of ``text`` (stripped); an empty entry is an ArgumentTypeError."""
    items = [x.strip() for x in str(text).split(",")]
    if not str(text).strip():
        return []
    if any(not x for x in items):
        raise argparse.ArgumentTypeError(f"expected {expected}, found an empty entry in {text!r}")
    dup = next((x for i, x in enumerate(items) if x in items[:i]), None)
    if dup is not None:
        raise argparse.ArgumentTypeError(f"expected {expected}, each once, found {dup!r} twice in {text!r}")
    return items


def pareto_bits_list(text: str) -> tuple[float, ...]:
    """``--pareto-bits``: comma-separated average bit widths in (0, 32] (empty: no Pareto points)."""
    what = "comma-separated numbers of bits in (0, 32]"
    out = []
    for x in _items(text, what):
        try:
            v = float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {x!r}") from None
        if not (math.isfinite(v) and 0 < v <= 32):
            raise argparse.ArgumentTypeError(f"expected {what}, found {x!r}")
        out.append(v)
    return tuple(out)


def kl_ref_bits_list(text: str) -> tuple[int, ...]:
    """``--kl-ref-bits``: comma-separated candidate widths (at least one)."""
    what = f"comma-separated candidate widths among {', '.join(map(str, WIDTHS))}"
    items = _items(text, what)
    if not items:
        raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}")
    bad = next((x for x in items if not x.isdigit() or int(x) not in WIDTHS), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"expected {what}, found {bad!r}")
    return tuple(int(x) for x in items)


def embedding_list(text: str) -> tuple[str, ...]:
    """``--embedding``: comma-separated options among int8, int4, f16, bf16, or ``none`` / empty."""
    if str(text).strip() in ("", "none"):
        return ()
    what = f"comma-separated options among {', '.join(EMBEDDING_OPTIONS)} (or none)"
    items = _items(text, what)
    bad = next((x for x in items if x not in EMBEDDING_OPTIONS), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"expected {what}, found {bad!r}")
    return tuple(items)


def baselines_list(text: str) -> tuple[str, ...]:
    """``--baselines``: comma-separated uniform baselines (w4g128a, w3g128a, w8pc) or built-in recipe names."""
    what = f"comma-separated {', '.join(KNOWN_BASELINES)} or built-in recipe names"
    items = _items(text, what)
    for b in items:
        if b in KNOWN_BASELINES:
            continue
        try:
            ok = not b.endswith((".toml", ".json")) and get_recipe(b) is not None
        except RecipeError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {what} (optionally +emb-int8 / +emb-int4), found {b!r}")
    return tuple(items)


_LISTS: dict[str, Callable[[str], tuple]] = {"pareto_bits": pareto_bits_list, "kl_ref_bits": kl_ref_bits_list,
                                             "embedding": embedding_list, "baselines": baselines_list}


def check_search_args(args: Any) -> None:
    """Parse the list-valued flags (comma-separated strings) in place and check flags that depend on each
    other; an :class:`InputError` naming the flag and the bad entry, before any loading."""
    for dest, parse in _LISTS.items():
        value = getattr(args, dest, None)
        if isinstance(value, str):
            flag = "--" + dest.replace("_", "-")
            try:
                setattr(args, dest, parse(value))
            except argparse.ArgumentTypeError as e:
                raise InputError(f"bad {flag} {value!r} ({flag}): {e}") from None
    if getattr(args, "embedding", ()) and getattr(args, "proxy", "kl") != "kl":
        raise InputError(f"embedding options need --proxy kl (--embedding {','.join(args.embedding)} with --proxy "
                         f"{args.proxy}): expected --proxy kl or --embedding none, found --proxy {args.proxy}")
    if (getattr(args, "validate_proxy", 0) or 0) < 0:
        raise InputError(f"bad --validate-proxy: expected a number of layers >= 0, found {args.validate_proxy}")


def pareto_markdown(report: dict[str, Any]) -> str:
    """A markdown table of an evaluated report: every point, then each baseline against the searched mix at
    <= its bytes (met = lower perplexity at no more bytes)."""
    pts = report["pareto"]
    ev = report.get("eval", {})
    lines = [f"Perplexity on {ev.get('windows')} x {ev.get('ctx')} tokens ({ev.get('split')}); proxy {report['proxy']}, "
             f"method {report['method']}.", "",
             "| point | whole MB | avg bits (searched kernels) | ppl | choices |", "|---|---|---|---|---|"]
    for p in pts:
        bits = f"{p['avg_bits']:.3f}" if "avg_bits" in p else "—"
        cc = ", ".join(f"{k} x{v}" for k, v in sorted(p.get("choice_counts", {}).items()))
        lines.append(f"| {p['kind']} | {p['total_bytes'] / 1e6:.2f} | {bits} | {p['ppl']:.3f} | {cc} |")
    by = {p["kind"]: p for p in pts}
    pairs = [(by[p["matched"]], p) for p in pts if "matched" in p and p["matched"] in by]
    if pairs:
        lines += ["", "| baseline | its MB / ppl | searched mix MB / ppl | mix better at <= bytes |", "|---|---|---|---|"]
        for b, m in pairs:
            ok = m["ppl"] < b["ppl"] and m["total_bytes"] <= b["total_bytes"]
            lines.append(f"| {b['kind']} | {b['total_bytes'] / 1e6:.2f} / {b['ppl']:.3f} | "
                         f"{m['total_bytes'] / 1e6:.2f} / {m['ppl']:.3f} | {'yes' if ok else 'no'} |")
    return "\n".join(lines) + "\n"


def add_search_args(p: Any) -> Any:
    """Arguments of ``eqjax search``."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget-bits", type=float, help="average stored bits per linear weight (metadata included)")
    g.add_argument("--budget-bytes", type=int, help="total stored bytes of the quantized model")
    p.add_argument("--model", default=None, help="a .gguf file or a float HF directory with tokenizer.json (default: "
                                                 "the bundled SmolLM2-135M)")
    p.add_argument("--out", default="search_out", help="output directory (rules JSON, Pareto JSON + PNG)")
    p.add_argument("--method", default="rtn", choices=sorted(METHODS),
                   help="how the searched per-layer formats are applied: rtn (round to nearest), gptq (GPTQ, each "
                        "layer in its own format, one pass over the calibration windows), gptq-search (on searched grids)")
    p.add_argument("--proxy", default="kl", choices=PROXIES,
                   help="sensitivity proxy (default kl: measured single-layer KL carried by the Hessian error)")
    p.add_argument("--embedding", default="int8,int4",
                   help="embedding-table options searched beside float (comma-separated of int8, int4, f16, bf16; "
                        "'none': the tables stay as loaded); needs the kl proxy")
    p.add_argument("--kl-ref-bits", default="3",
                   help="bit width(s) the kl proxy is measured at, comma-separated (e.g. 2,3: one forward pass per "
                        "layer and width; each option carried from the nearest width)")
    add_calibration_args(p, what="the proxy and GPTQ")
    p.add_argument("--eval-windows", type=int, default=8, help="evaluation windows for the Pareto ppl (0: skip)")
    add_eval_len(p, 512, what=" of the Pareto ppl")
    p.add_argument("--validate-proxy", type=int, default=0, metavar="N",
                   help="also measure single-layer KL on N random layers and correlate with the proxies")
    p.add_argument("--pareto-bits", default="2.5,3,3.5,4,4.5,5,6,8",
                   help="average bit widths the Pareto curve is sampled at, comma-separated (empty: none)")
    p.add_argument("--baselines", default="w4g128a,w3g128a,w8pc",
                   help="uniform baselines to evaluate, each also against the searched mix at <= its bytes "
                        "(comma-separated: w4g128a, w3g128a, w8pc on the searched kernels, or built-in recipe names; "
                        "empty: none)")
    return p


def search_main(args: Any) -> int:
    """``eqjax search``: run :func:`search` on the model, write ``rules.json`` (a recipe file),
    ``pareto.json`` and ``pareto.png`` under ``--out``; print progress. Returns the exit code."""

    def say(s: str) -> None:
        print(f"[search] {s}", flush=True)

    check_search_args(args)  # a no-op for flags already parsed (the CLI checks them before loading)
    emb, ref_bits, pbits = list(args.embedding), tuple(args.kl_ref_bits), list(args.pareto_bits)
    base = [(f"uniform {b}", KNOWN_BASELINES[b]) if b in KNOWN_BASELINES else (f"recipe {b}", b) for b in args.baselines]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = load_source(args.model)
    model, params, tok = src.model, src.params, src.tokenizer
    cal_ids, eval_ids = wikipedia_tokens(tok)
    cal = calibration_windows(cal_ids, args.calib_windows, args.calib_len, 0)
    res = search(model, params, cal, budget_bits=args.budget_bits, budget_bytes=args.budget_bytes,
                 method=args.method, proxy=args.proxy, pareto_bits=pbits, embedding=emb, kl_ref_bits=ref_bits,
                 progress=say)  # a BudgetError is an InputError: the CLI prints it and exits 2
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
        # other windows and other bit widths than the kl proxy was measured on (its first two windows, 3 bits)
        report["proxy_check"] = validate_proxy(model, params, cal[-2:, :128], res.layers, n_layers=args.validate_proxy,
                                               bits=(2, 4), progress=say)
        say(f"proxy Spearman vs measured KL: {report['proxy_check']['spearman_vs_kl']}")
        write_json(out / "proxy_check.json", report["proxy_check"])
    if args.eval_windows:
        ev = token_windows(eval_ids, args.eval_len, args.eval_windows)
        report["eval"] = {"windows": args.eval_windows, "ctx": args.eval_len, "split": "wikipedia eval half"}
        report["pareto"] = evaluate_pareto(model, params, res, ev, method=args.method, baselines=base,
                                           calibration=cal, progress=say)
    else:
        report["pareto"] = [{k: v for k, v in p.items() if k != "picks"} for p in res.pareto]
    write_json(out / "pareto.json", report)
    plot_pareto(report, out / "pareto.png")
    if args.eval_windows:

        write_text(out / "pareto.md", pareto_markdown(report))
    say(f"wrote {out / 'pareto.json'}, pareto.md and {out / 'pareto.png'}")
    return 0


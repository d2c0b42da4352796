"""Robustness cases: recipes (rules that select nothing, recipe-name suffixes), the list-valued and model-bound
flags of ``search`` / ``export-onnx``, and API misuse (wrong argument types and order, foreign models)."""

from __future__ import annotations

import json
import math
import pathlib
import textwrap
from typing import Any, Callable

from robustness_fixtures import Case, Fixtures, Result

EVAL = ["eval", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64"]
RTN = '[[steps]]\nmethod = "rtn"\n'


def _recipe(body: str, suffix: str = "toml") -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        p = work / f"recipe.{suffix}"
        p.write_text(textwrap.dedent(body), encoding="utf-8")
        return {"recipe": str(p), "json_out": str(work / "row.json"), "o": str(work / "out")}
    return setup


def _out(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    return {"o": str(work / "out"), "json_out": str(work / "row.json")}


def _nothing_written(key: str) -> Callable[..., str | None]:
    def check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
        return f"{v[key]} was written" if pathlib.Path(v[key]).exists() else None
    return check


def _row_quantized(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    p = pathlib.Path(v["json_out"])
    if not p.is_file():
        return f"no result file {p}"
    row = json.loads(p.read_text())
    if not (isinstance(row.get("ppl"), (int, float)) and math.isfinite(row["ppl"])):
        return f"bad ppl {row.get('ppl')!r}"
    wb = str(row.get("w_bits"))
    return None if wb.split("+")[0] in ("4", "8") else f"weights not quantized: w_bits {wb!r}"


# ------------------------------------------------------------------------------------ API actions
def _tiny(fx: Fixtures) -> tuple[Any, Any]:
    from eqjax.io import load_model

    model, params, _ = load_model(fx.root / "tiny")
    return model, params


def api_quantize_swapped(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    model, params = _tiny(fx)
    return eqjax.quantize("w8", params, model=model)


def api_quantize_recipe_dict(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    model, params = _tiny(fx)
    return eqjax.quantize(params, {"name": "w8"}, model=model)


def api_quantize_by_name(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    model, params = _tiny(fx)
    return eqjax.quantize(params, "w8", model=model)


def check_quantized(fx: Fixtures, work: pathlib.Path, v: dict, res: Result) -> str | None:
    from eqjax.core.qarray import QArray

    k = res.value["layers_0"]["attn"]["q_proj"]["kernel"]
    return None if isinstance(k, QArray) and k.bits == 8 else f"q_proj is {type(k).__name__}"


def api_rule_matches_nothing(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax
    from eqjax.methods.rtn import RTN
    from eqjax.recipes.registry import weight_rule

    model, params = _tiny(fx)
    return eqjax.quantize(params, eqjax.Recipe("mine", (RTN((weight_rule(4, pattern="decoder/.*"),)),)), model=model)


def api_suffix_conflict(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    model, params = _tiny(fx)
    return eqjax.quantize(params, "w8+f16+bf16", model=model)


def api_ragged_windows(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import numpy as np

    import eqjax

    model, params = _tiny(fx)
    cal = [np.zeros((1, 16), np.int32), np.zeros((1, 8), np.int32)]
    return eqjax.quantize(params, "w4g128-gptq", model=model, calibration=cal)


def api_torch_module(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import numpy as np
    import torch

    import eqjax

    return eqjax.quantize_model(torch.nn.Linear(8, 4), "w8", example=(np.ones((1, 8), np.float32),))


def _linen() -> tuple[Any, Any, Any]:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(4, name="out")(nn.relu(nn.Dense(16, name="hidden")(x)))

    net, x = Mlp(), jnp.ones((2, 8))
    return net, net.init(jax.random.key(0), x), x


def api_linen_missing_submodule(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    net, variables, x = _linen()
    params = {"hidden": variables["params"]["hidden"]}  # "out" left behind
    return eqjax.quantize_model(net, "w8", params=params, calibration=[(x,)])


def api_linen_recipe_int(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    net, variables, x = _linen()
    return eqjax.quantize_model(net, 8, params=variables, calibration=[(x,)])


def api_linen_no_params(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    net, _, _ = _linen()
    return eqjax.quantize_model(net, "w8")


def api_linen_mixed_batches(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import jax.numpy as jnp

    import eqjax

    net, variables, x = _linen()
    return eqjax.quantize_model(net, "w8", params=variables, calibration=[(x,), (jnp.ones((3, 8)),)])


def api_linen_calibration_array(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import eqjax

    net, variables, x = _linen()
    return eqjax.quantize_model(net, "w8", params=variables, calibration=x)


# ------------------------------------------------------------------------------------ the cases
def recipes_cases() -> list[Case]:
    """The recipes cases of the catalogue."""
    cases: list[Case] = []
    add = cases.append
    T = "recipes"
    rec = [*EVAL, "--recipe", "{recipe}"]
    add(Case("recipes: rule pattern matching no param", T, argv=rec,
             cause=r"rule matches no parameter.*step 0 'rtn', pattern 'decoder/\.\*'",
             setup=_recipe('name = "r"\n' + RTN + '[[steps.rules]]\npattern = "decoder/.*"\nbits = 4\n')))
    add(Case("recipes: the only rule is skip = true", T, argv=rec, cause=r"recipe quantized nothing.*'r'",
             setup=_recipe('name = "r"\n' + RTN + '[[steps.rules]]\npattern = ".*"\nskip = true\n')))
    add(Case("recipes: a rule shadowed by an earlier one", T, argv=rec, cause=r"shadowed.*'layers_0/\.\*'.*'\.\*'",
             setup=_recipe('name = "r"\n' + RTN + '[[steps.rules]]\npattern = ".*"\nrole = "matmul"\nbits = 8\n'
                           '[[steps.rules]]\npattern = "layers_0/.*"\nrole = "matmul"\nbits = 4\n')))
    add(Case("recipes: a matmul rule naming only the tied table", T, argv=rec, cause=r"recipe quantized nothing",
             setup=_recipe('name = "r"\n' + RTN + '[[steps.rules]]\npattern = "embed/.*"\nrole = "matmul"\n')))
    add(Case("recipes: only a smoothquant step", T, argv=rec, cause=r"quantizes nothing.*recipe\.toml.*smoothquant",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "smoothquant"\n')))
    add(Case("recipes: steps = [] and no kv", T, argv=rec, cause=r"quantizes nothing.*no steps",
             setup=_recipe('name = "r"\nsteps = []\n')))
    add(Case("recipes: half step with a pattern matching nothing", T, argv=rec,
             cause=r"matches no parameter.*'half-floats'.*'decoder/\.\*'",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "half"\npattern = "decoder/.*"\n')))
    add(Case("recipes: a valid rule file quantizes", T, expect="ok", argv=[*rec, "--json", "{json_out}"],
             setup=_recipe('name = "r"\n' + RTN + '[[steps.rules]]\npattern = "layers_.*"\nrole = "matmul"\n'),
             check=_row_quantized))

    T = "suffixes"
    for name, cause in (("w8+f16+bf16", r"conflicting.*'\+f16' and '\+bf16'"),
                        ("w8+f16+f16", r"repeated.*'\+f16' twice"),
                        ("w8+emb-int8+emb-int4", r"conflicting.*'\+emb-int8' and '\+emb-int4'"),
                        ("w8+f17", r"unknown recipe suffix.*'\+f17'"),
                        ("w8+f16+emb-int8", r"misordered.*'\+f16' before '\+emb-int8'"),
                        ("w8+", r"unknown recipe suffix.*'\+'"),
                        ("", r"empty recipe name.*''"),
                        (" ", r"empty recipe name")):
        add(Case(f"suffixes: --recipe {name!r}", T, argv=[*EVAL, "--recipe", name], cause=cause))
    add(Case("suffixes: run --recipes with a conflicting pair", T,
             argv=["run", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64",
                   "--recipes", "fp,w8+bf16+f16", "--out", "{o}"], cause=r"conflicting.*'\+bf16' and '\+f16'",
             setup=_out, check=_nothing_written("o")))
    add(Case("suffixes: w8+emb-int8+f16 evaluates", T, expect="ok",
             argv=[*EVAL, "--recipe", "w8+emb-int8+f16", "--json", "{json_out}"], setup=_out, check=_row_quantized))

    T = "command flags"
    exp = ["export-onnx", "--model", "{gguf}", "--out", "{o}"]
    add(Case("export-onnx: --context-length above the model's", T, argv=[*exp, "--context-length", "100000"],
             cause=r"--context-length.*context_length.*expected <= 64, found 100000", setup=_out,
             check=_nothing_written("o")))
    add(Case("export-onnx: --embedding on a recipe with +emb-", T,
             argv=[*exp, "--recipe", "w8+emb-int4", "--embedding", "int8"], cause=r"--embedding int8.*w8\+emb-int4",
             setup=_out, check=_nothing_written("o")))
    add(Case("export-onnx: --recipe with conflicting suffixes", T, argv=[*exp, "--recipe", "w8+f16+bf16"],
             cause=r"conflicting.*'\+f16' and '\+bf16'", setup=_out, check=_nothing_written("o")))
    add(Case("export-gguf: --recipe with a repeated suffix", T,
             argv=["export-gguf", "--model", "{gguf}", "--recipe", "w8+emb-int8+emb-int8", "--out", "{o}"],
             cause=r"repeated.*'\+emb-int8' twice", setup=_out, check=_nothing_written("o")))
    srch = ["search", "--budget-bits", "4", "--model", "{gguf}", "--out", "{o}"]
    for argv, cause in ((["--pareto-bits", "3,four"], r"--pareto-bits.*'four'"),
                        (["--pareto-bits", "3,,4"], r"--pareto-bits.*empty entry"),
                        (["--pareto-bits", "-1"], r"--pareto-bits.*\(0, 32\].*'-1'"),
                        (["--kl-ref-bits", "5"], r"--kl-ref-bits.*2, 3, 4, 8.*'5'"),
                        (["--kl-ref-bits", "3,3"], r"--kl-ref-bits.*'3' twice"),
                        (["--embedding", "int9"], r"--embedding.*'int9'"),
                        (["--embedding", "int8", "--proxy", "weight"], r"--proxy kl.*--proxy weight"),
                        (["--baselines", "w4g128a,w9"], r"--baselines.*'w9'"),
                        (["--validate-proxy", "-2"], r"--validate-proxy.*-2")):
        add(Case(f"search: {' '.join(argv)}", T, argv=[*srch, *argv], cause=cause, setup=_out,
                 check=_nothing_written("o")))

    T = "api misuse"
    add(Case("api: quantize(recipe, params) (arguments swapped)", T, api=api_quantize_swapped,
             cause=r"bad params.*eqjax\.quantize.*str 'w8'"))
    add(Case("api: quantize with a dict as the recipe", T, api=api_quantize_recipe_dict, cause=r"bad recipe.*found dict"))
    add(Case("api: quantize(params, \"w8\") by name", T, expect="ok", api=api_quantize_by_name, check=check_quantized))
    add(Case("api: a Recipe whose rule matches no param", T, api=api_rule_matches_nothing,
             cause=r"rule matches no parameter.*'mine'.*'decoder/\.\*'"))
    add(Case("api: quantize with w8+f16+bf16", T, api=api_suffix_conflict, cause=r"conflicting.*'\+f16' and '\+bf16'"))
    add(Case("api: quantize with ragged calibration windows", T, api=api_ragged_windows,
             cause=r"calibration.*different lengths"))
    add(Case("api: quantize_model of a torch nn.Module", T, api=api_torch_module, cause=r"model of .*PyTorch module"))
    add(Case("api: quantize_model with params missing a submodule", T, api=api_linen_missing_submodule,
             cause=r"params do not fit the module.*out/(kernel|bias).*missing"))
    add(Case("api: quantize_model with an int as the recipe", T, api=api_linen_recipe_int,
             cause=r"bad recipe \(recipe of eqjax\.quantize_model.*found int 8"))
    add(Case("api: quantize_model(module, \"w8\") without params or inputs", T, api=api_linen_no_params,
             cause=r"needs params.*params="))
    add(Case("api: quantize_model with batches of two shapes", T, api=api_linen_mixed_batches,
             cause=r"batch 1 has shapes.*batch 0"))
    add(Case("api: quantize_model with one array as calibration", T, api=api_linen_calibration_array,
             cause=r"bad calibration.*iterable of argument tuples"))
    return cases

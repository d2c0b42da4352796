"""In-process API cases of the robustness catalogue: each returns a value or raises, and
:func:`robustness_run.run_case` classifies it as the CLI cases are."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from robustness_fixtures import Fixtures, Result


def api_quantize_nan(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import numpy as np

    from eqjax.io import load_model
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import get_recipe

    model, params, _ = load_model(fx.root / "tiny")
    params["layers_1"]["mlp_norm"]["scale"] = np.asarray(params["layers_1"]["mlp_norm"]["scale"]).copy()
    params["layers_1"]["mlp_norm"]["scale"][5] = np.nan
    return quantize(params, get_recipe("w8"), model=model)


def api_ppl_bad_ids(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import numpy as np

    from eqjax.evaluate import perplexity
    from eqjax.io import load_model

    model, params, _ = load_model(fx.root / "tiny")
    return perplexity(model, params, np.full((1, 8), 300, np.int32))


def api_ppl_overflow(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import jax
    import numpy as np

    from eqjax.evaluate import perplexity
    from eqjax.io import load_model

    model, params, _ = load_model(fx.root / "tiny")
    params = jax.tree.map(lambda x: x * 1e12, params)  # finite but absurd weights: logits explode
    return perplexity(model, params, np.arange(16, dtype=np.int32).reshape(1, 16))


def api_load_other_model(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.io import load_model
    from eqjax.io.orbax import load_quantized

    model, _, _ = load_model(fx.root / "other")
    return load_quantized(fx.root / "ck", model=model)


def api_write_json_nan(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.io.atomic import write_json

    return write_json(work / "x.json", {"ppl": float("inf")})


def api_step_from_config(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.methods.gptq import GPTQ

    return GPTQ.from_config({"bits": "4"})


def api_rule_from_dict(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.recipes.rules import rule_from_dict

    return rule_from_dict({"pattern": ".*", "bits": 4, "granularity": "tensor", "axis": 0})


def api_token_cache_content(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    """Two tokenizer.json files of the same size and vocabulary size but different merges/ids: the
    cache must not hand the first one's ids to the second."""
    import shutil

    from eqjax.data import encode_cached
    from eqjax.io import HFTokenizer

    os.environ["EQJAX_CACHE"] = str(work / "cache")
    a = work / "a" / "tokenizer.json"
    a.parent.mkdir()
    shutil.copy(fx.root / "tiny" / "tokenizer.json", a)
    raw = json.loads(a.read_text())
    vocab = raw["model"]["vocab"]
    keys = sorted(vocab)
    ids = [vocab[k] for k in keys]
    raw["model"]["vocab"] = dict(zip(keys, ids[::-1]))  # same tokens, same count, other ids
    b = work / "b" / "tokenizer.json"
    b.parent.mkdir()
    b.write_text(json.dumps(raw))
    ta, tb = HFTokenizer(a), HFTokenizer(b)
    x = encode_cached(ta, "hello world")
    y = encode_cached(tb, "hello world")
    return (x.tolist(), y.tolist(), tb.encode("hello world"))


def check_token_cache(fx: Fixtures, work: pathlib.Path, v: dict, res: Result) -> str | None:
    x, y, truth = res.value
    if y != truth:
        return "stale token ids from the cache"
    return None


def api_save_into_file(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.io.orbax import save_quantized

    p = work / "file"
    p.write_text("keep me")
    return save_quantized(p, {"a": __import__("numpy").ones(3, "float32")})


def api_fuzz_recipes(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    """200 random recipe dicts: each is a RecipeError-family error or a valid recipe."""
    import random

    from eqjax.core.errors import RecipeError
    from eqjax.recipes.registry import recipe_from_dict
    from eqjax.recipes.types import Recipe

    rng = random.Random(0)
    keys = ["pattern", "bits", "symmetric", "granularity", "group_size", "axis", "calibrator", "percentile",
            "scale_dtype", "act_bits", "act_granularity", "skip", "bitz", ""]
    vals = [None, True, False, 0, 1, 4, 8, 4.7, -1, 10**30, float("nan"), "", "false", ".*/kernel", "((", "group",
            "channel", "tensor", "float16", [], {}, [1], {"a": 1}]
    bad = []
    for _ in range(200):
        rule = {rng.choice(keys): rng.choice(vals) for _ in range(rng.randint(0, 5))}
        step = {"method": rng.choice(["rtn", "gptq", "awq", "smoothquant", "nope", 3])}
        if rng.random() < 0.8:
            step["rules"] = [rule] if step["method"] == "rtn" else rule
        d = {"name": rng.choice(["x", "", 5]), "steps": rng.choice([[step], step, 5, []])}
        if rng.random() < 0.2:
            d["kv"] = {rng.choice(["bits", "key_bits", "x"]): rng.choice(vals)}
        try:
            r = recipe_from_dict(d)
            assert isinstance(r, Recipe)
        except RecipeError:
            pass
        except Exception as e:  # noqa: BLE001
            bad.append(f"{d!r}: {type(e).__name__}: {e}")
    if bad:
        raise AssertionError(f"{len(bad)} recipe dicts raised outside the RecipeError family, e.g. {bad[0]}")
    return 200


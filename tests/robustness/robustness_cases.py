"""The robustness catalogue: bad and hostile inputs tried as a new user would, and how each must end.

Every :class:`Case` is one user action (a CLI command, an API call, or a process killed while it
writes) with the outcome it must have: a *clear error* (the right exit code, one ``eqjax: error:``
line naming the cause, no traceback) or a *correct* result (exit 0 and a checked output). Each case
also checks that what existed before (a previous result, checkpoint, ONNX file) is intact.

Outcomes tallied by :func:`classify`:

* ``clear error``: refused with the expected exit code and a one-line message naming the cause;
* ``correct``: succeeded and the output checks out;
* ``silent``: exit 0 where an error was due, or an output that does not check out;
* ``loss``: a previous good artifact was damaged, or a half-written target exists;
* ``traceback``: a Python traceback, an "internal error", a wrong exit code or a message that does not
  name the cause;
* ``crash``: killed by a signal (native crash).

Used by ``tests/robustness/test_cases.py`` (in-process, through ``eqjax.cli.main``) and by
``bench/robustness.py`` (each CLI case in its own ``python -m eqjax.cli`` process), which writes the
tally to ``bench/results/robustness.{json,md}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
_ENV_AT_IMPORT = dict(os.environ)  # to name what earlier tests left in the environment a child inherits
_MAIN_LOCK = threading.Lock()  # eqjax.cli.main in this process: one at a time (pyplot, redirected stdio)
OUTCOMES = ("clear error", "correct", "silent", "loss", "traceback", "crash")


# ------------------------------------------------------------------------------------ fixtures
def _byte_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


def tiny_config(**kw: Any) -> Any:
    from eqjax.models import LlamaConfig

    base = dict(vocab=256, hidden=64, intermediate=128, n_layers=2, n_heads=2, n_kv_heads=1,
                tie_word_embeddings=True, max_position_embeddings=128)
    base.update(kw)
    return LlamaConfig(**base)


def write_hf_model(d: pathlib.Path, *, seed: int = 0, mutate: Callable[[dict], None] | None = None,
                   tokenizer: bool = True, **cfg: Any) -> pathlib.Path:
    """A tiny random Llama as an HF directory (+ byte-level tokenizer.json)."""
    import jax

    from eqjax.io.hf import save_hf_checkpoint
    from eqjax.models import Model

    model = Model(tiny_config(**cfg))
    params = model.init_params(jax.random.PRNGKey(seed), std=0.05)
    if mutate is not None:
        params = jax.tree.map(lambda x: x, params)
        mutate(params)
    save_hf_checkpoint(d, model, params)
    if tokenizer:
        _byte_tokenizer(d / "tokenizer.json")
    return d


def write_gguf(path: pathlib.Path) -> pathlib.Path:
    """A tiny llama GGUF (byte-level BPE vocabulary of 259 tokens, hidden 8)."""
    import gguf
    import numpy as np

    from eqjax.tokenizer import bytes_to_unicode

    D, F, HQ, HKV, HD, L = 8, 32, 2, 1, 4, 2
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    rng = np.random.default_rng(0)
    r = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": r(len(tokens), D), "output_norm.weight": 1 + r(D)}
    for i in range(L):
        w |= {f"blk.{i}.attn_norm.weight": 1 + r(D), f"blk.{i}.attn_q.weight": r(HQ * HD, D),
              f"blk.{i}.attn_k.weight": r(HKV * HD, D), f"blk.{i}.attn_v.weight": r(HKV * HD, D),
              f"blk.{i}.attn_output.weight": r(D, HQ * HD), f"blk.{i}.ffn_norm.weight": 1 + r(D),
              f"blk.{i}.ffn_gate.weight": r(F, D), f"blk.{i}.ffn_up.weight": r(F, D), f"blk.{i}.ffn_down.weight": r(D, F)}
    gw = gguf.GGUFWriter(path, "llama")
    gw.add_block_count(L)
    gw.add_context_length(64)
    gw.add_embedding_length(D)
    gw.add_feed_forward_length(F)
    gw.add_head_count(HQ)
    gw.add_head_count_kv(HKV)
    gw.add_rope_dimension_count(HD)
    gw.add_layer_norm_rms_eps(1e-5)
    gw.add_vocab_size(len(tokens))
    gw.add_tokenizer_model("gpt2")
    gw.add_tokenizer_pre("smollm")
    gw.add_token_list(tokens)
    gw.add_token_merges(["Ġ t", "h e", "Ġt he"])
    gw.add_token_types([3] + [1] * (len(tokens) - 1))
    for name, a in w.items():
        gw.add_tensor(name, a)
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    return path


TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun. " * 40)


@dataclasses.dataclass
class Fixtures:
    """Shared inputs, built once: a tiny HF model, a text, a tiny GGUF, a good checkpoint."""

    root: pathlib.Path

    def build(self) -> "Fixtures":
        import onnx  # noqa: F401 - imported once here, not first inside concurrent checks

        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        write_hf_model(r / "tiny")
        (r / "text.txt").write_text(TEXT, encoding="utf-8")
        write_gguf(r / "tiny.gguf")
        write_hf_model(r / "other", hidden=32, intermediate=64)
        self.save_checkpoint(r / "ck", "w8")
        return self

    def save_checkpoint(self, out: pathlib.Path, recipe: str) -> pathlib.Path:
        from eqjax.io import load_model
        from eqjax.io.orbax import save_quantized
        from eqjax.recipe import quantize
        from eqjax.recipes import get_recipe

        model, params, _ = load_model(self.root / "tiny")
        rec = get_recipe(recipe)
        save_quantized(out, quantize(params, rec, model=model), recipe=rec, model=model)
        return out

    def values(self) -> dict[str, str]:
        r = self.root
        return {"tiny": str(r / "tiny"), "text": str(r / "text.txt"), "gguf": str(r / "tiny.gguf"),
                "other": str(r / "other"), "ck": str(r / "ck")}


# ------------------------------------------------------------------------------------ cases
@dataclasses.dataclass
class Result:
    rc: int | None
    out: str = ""
    err: str = ""
    value: Any = None  # API cases: the returned value
    exc: BaseException | None = None  # API cases: the exception raised


@dataclasses.dataclass
class Case:
    """One user action and the outcome it must have.

    ``argv``: CLI arguments (``{name}`` placeholders from the fixtures and from ``setup``'s dict);
    ``api``: instead, a callable ``(fx, work, values) -> value`` run in-process; ``kill``: instead, a
    callable ``(fx, work, values) -> str | None`` that runs a subprocess and kills it (returns a failure
    description, or None). ``expect``: ``"error"`` or ``"ok"``. ``code``: the exit code of an error.
    ``cause``: a regex the error message must match (it names the cause). ``check``:
    ``(fx, work, values, result) -> str | None``, a failure description for a wrong/missing output
    (classified ``silent``) or, starting with ``"loss:"``, damage to a previous artifact.
    """

    name: str
    group: str
    expect: str = "error"
    argv: list[str] | None = None
    api: Callable[..., Any] | None = None
    kill: Callable[..., str | None] | None = None
    code: int = 2
    cause: str = ""
    setup: Callable[[Fixtures, pathlib.Path], dict[str, str]] | None = None
    check: Callable[..., str | None] | None = None
    env: dict[str, str] | None = None
    slow: bool = False


EVAL = ["eval", "--model", "{tiny}", "--text", "{text}", "--ctx", "32", "--eval-tokens", "64"]


def _files(**content: str | bytes) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    """A setup writing files into the case's work dir; returns {key: path}."""
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        out = {}
        for key, data in content.items():
            name = key.replace("__", ".")
            p = work / name
            if isinstance(data, bytes):
                p.write_bytes(data)
            else:
                p.write_text(textwrap.dedent(data), encoding="utf-8")
            out[key.split("__")[0]] = str(p)
        return out
    return setup


def _recipe(body: str, suffix: str = "toml") -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    return _files(**{f"recipe__{suffix}": body})


def _json_row_ok(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    p = pathlib.Path(v["json_out"])
    if not p.is_file():
        return f"no result file {p}"
    row = json.loads(p.read_text())
    import math

    if not (isinstance(row.get("ppl"), (int, float)) and math.isfinite(row["ppl"]) and row["ppl"] > 1):
        return f"bad ppl {row.get('ppl')!r}"
    return None


def _with_json_out(setup: Callable | None = None) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def s(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        v = setup(fx, work) if setup else {}
        v["json_out"] = str(work / "row.json")
        return v
    return s


def _unchanged(key: str, content: bytes) -> Callable[..., str | None]:
    """Check that file ``values[key]`` still holds ``content`` (a previous artifact kept)."""
    def check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
        p = pathlib.Path(v[key])
        if not p.is_file() or p.read_bytes() != content:
            return f"loss: {p} was changed or removed"
        return None
    return check


def _hf_variant(name: str, **kw: Any) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        return {"m": str(write_hf_model(work / name, **kw))}
    return setup


def _set_param(path: str, index: tuple, value: float) -> Callable[[dict], None]:
    def mutate(params: dict) -> None:
        import numpy as np

        node = params
        *heads, last = path.split("/")
        for h in heads:
            node = node[h]
        a = np.array(node[last])
        a[index] = value
        node[last] = a
    return mutate


def _int_weights(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """An HF dir whose q_proj weight is stored as int32 (a bad conversion)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    d = write_hf_model(work / "intw")
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.self_attn.q_proj.weight"] = (t["model.layers.0.self_attn.q_proj.weight"] * 1000).astype(np.int32)
    save_file(t, str(d / "model.safetensors"))
    return {"m": str(d)}


def _copy_tiny(name: str, edit: Callable[[pathlib.Path], None]) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        import shutil

        d = work / name
        shutil.copytree(fx.root / "tiny", d)
        edit(d)
        return {"m": str(d)}
    return setup


def _truncate(rel: str, keep: float) -> Callable[[pathlib.Path], None]:
    def edit(d: pathlib.Path) -> None:
        p = d / rel
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])
    return edit


def _big_vocab_tokenizer(d: pathlib.Path) -> None:
    """Replace the model by one with a 200-row embedding (ids 200..255 of the tokenizer fall outside)."""
    write_hf_model(d, vocab=200, tokenizer=False)


def _ck_copy(name: str, edit: Callable[[pathlib.Path], None] | None = None) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        import shutil

        d = work / name
        shutil.copytree(fx.root / "ck", d)
        if edit:
            edit(d)
        return {"c": str(d)}
    return setup


def _largest_data_file(d: pathlib.Path) -> pathlib.Path:
    return max((p for p in (d / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _ck_truncate(d: pathlib.Path) -> None:
    p = _largest_data_file(d)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _ck_flip(d: pathlib.Path) -> None:
    p = _largest_data_file(d)
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


def _ck_partial(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """What a save killed before its manifest leaves: a .tmp- directory with arrays/ and no eqjax.json."""
    import shutil

    d = work / ".ck.tmp-999999-dead"
    shutil.copytree(fx.root / "ck", d)
    (d / "eqjax.json").unlink()
    return {"c": str(d)}


def _existing(key: str, name: str, content: bytes) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        p = work / name
        p.write_bytes(content)
        return {key: str(p)}
    return setup


def _ck_loads(key: str, recipe: str | None = None, kv: bool = False) -> Callable[..., str | None]:
    def check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
        from eqjax.io import load_model
        from eqjax.io.orbax import load_quantized

        model, _, _ = load_model(fx.root / "tiny")
        try:
            _, manifest = load_quantized(v[key], model=model)
        except Exception as e:  # noqa: BLE001
            return f"the checkpoint does not load: {e}"
        if recipe and manifest.get("recipe") != recipe:
            return f"manifest recipe {manifest.get('recipe')!r}, expected {recipe!r}"
        if kv and not manifest.get("kv"):
            return "the KV settings are missing from the manifest"
        return None
    return check


def _run_rows(n: int, key: str = "o") -> Callable[..., str | None]:
    def check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
        p = pathlib.Path(v[key]) / "results.json"
        if not p.is_file():
            return "no results.json"
        rows = json.loads(p.read_text())["results"]
        return None if len(rows) == n else f"{len(rows)} rows, expected {n}"
    return check


def _resume_setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """An interrupted run: rows.jsonl with the header and the fp row (and a torn last line)."""
    from eqjax.cli import main

    out = work / "run"
    err = io.StringIO()
    with _MAIN_LOCK, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["run", "--model", str(fx.root / "tiny"), "--text", str(fx.root / "text.txt"), "--ctx", "32",
                   "--eval-tokens", "64", "--recipes", "fp", "--out", str(out)])
    assert rc == 0, err.getvalue()[-500:]
    lines = (out / "rows.jsonl").read_text().splitlines()
    (out / "rows.jsonl").write_text("\n".join(lines[:2]) + '\n{"row": {"recipe": "w8", "pp')
    for f in out.iterdir():
        if f.name != "rows.jsonl":
            f.unlink()
    return {"o": str(out), "fp_row": lines[1]}


def _resume_check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    p = pathlib.Path(v["o"]) / "results.json"
    if not p.is_file():
        return "no results.json after --resume"
    rows = json.loads(p.read_text())["results"]
    if [r["recipe"] for r in rows] != ["fp", "w8"]:
        return f"rows {[r['recipe'] for r in rows]}"
    old = json.loads(v["fp_row"])["row"]
    if rows[0]["ppl"] != old["ppl"] or rows[0]["quantize_seconds"] != old["quantize_seconds"]:
        return "loss: the finished fp row was not kept as it was"
    return None


# -------------------------------------------------------------------- API cases (in-process)
def _api_quantize_nan(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import numpy as np

    from eqjax.io import load_model
    from eqjax.recipe import quantize
    from eqjax.recipes import get_recipe

    model, params, _ = load_model(fx.root / "tiny")
    params["layers_1"]["mlp_norm"]["scale"] = np.asarray(params["layers_1"]["mlp_norm"]["scale"]).copy()
    params["layers_1"]["mlp_norm"]["scale"][5] = np.nan
    return quantize(params, get_recipe("w8"), model=model)


def _api_ppl_bad_ids(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import numpy as np

    from eqjax.evaluate import perplexity
    from eqjax.io import load_model

    model, params, _ = load_model(fx.root / "tiny")
    return perplexity(model, params, np.full((1, 8), 300, np.int32))


def _api_ppl_overflow(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    import jax
    import numpy as np

    from eqjax.evaluate import perplexity
    from eqjax.io import load_model

    model, params, _ = load_model(fx.root / "tiny")
    params = jax.tree.map(lambda x: x * 1e12, params)  # finite but absurd weights: logits explode
    return perplexity(model, params, np.arange(16, dtype=np.int32).reshape(1, 16))


def _api_load_other_model(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.io import load_model
    from eqjax.io.orbax import load_quantized

    model, _, _ = load_model(fx.root / "other")
    return load_quantized(fx.root / "ck", model=model)


def _api_write_json_nan(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.atomic import write_json

    return write_json(work / "x.json", {"ppl": float("inf")})


def _api_step_from_config(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.methods.gptq import GPTQ

    return GPTQ.from_config({"bits": "4"})


def _api_rule_from_dict(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.rules import rule_from_dict

    return rule_from_dict({"pattern": ".*", "bits": 4, "granularity": "tensor", "axis": 0})


def _api_token_cache_content(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
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


def _check_token_cache(fx: Fixtures, work: pathlib.Path, v: dict, res: Result) -> str | None:
    x, y, truth = res.value
    if y != truth:
        return "stale token ids from the cache"
    return None


def _api_save_into_file(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.io.orbax import save_quantized

    p = work / "file"
    p.write_text("keep me")
    return save_quantized(p, {"a": __import__("numpy").ones(3, "float32")})


def _api_fuzz_recipes(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    """200 random recipe dicts: each is a RecipeError-family error or a valid recipe."""
    import random

    from eqjax.recipe import Recipe, RecipeError, recipe_from_dict

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


# -------------------------------------------------------------------- kill-during-write cases
_PY = [sys.executable, "-c"]


def _child(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    e.update(env or {})
    return subprocess.Popen([*_PY, textwrap.dedent(code), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(ROOT), env=e)


def _wait_line(p: subprocess.Popen, word: str, timeout: float = 120) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        line = p.stdout.readline()
        if not line:
            return False
        if word in line:
            return True
    return False


def _kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)


def _kill_atomic_file(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    from eqjax.atomic import stale_temps, write_bytes

    target = work / "big.bin"
    old = b"previous good artifact\n" * 1000
    write_bytes(target, old)
    p = _child("""
        import sys, time
        from eqjax.atomic import atomic_file
        with atomic_file(sys.argv[1], "wb") as f:
            for i in range(2000):
                f.write(b"N" * (1 << 20)); f.flush()
                if i == 3: print("writing", flush=True)
                time.sleep(0.01)
        print("done", flush=True)
    """, str(target))
    if not _wait_line(p, "writing"):
        _kill(p)
        return f"the writer did not start: {p.stderr.read()[-300:]}"
    _kill(p)
    if target.read_bytes() != old:
        return "loss: the previous file was changed by a killed write"
    if not stale_temps(target):
        return "the partial write is not detectable (no temporary left)"
    write_bytes(target, b"new")  # the next write replaces it and removes the dead writer's temporary
    if target.read_bytes() != b"new" or stale_temps(target):
        return "the next write did not clean up"
    return None


def _kill_checkpoint(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    import shutil

    from eqjax.io import load_model
    from eqjax.io.orbax import load_quantized

    ck = work / "ck"
    shutil.copytree(fx.root / "ck", ck)
    before = (ck / "eqjax.json").read_bytes()
    p = _child("""
        import sys, time
        import eqjax.io.orbax as o
        real = o._file_table
        def slow(root):
            print("saving", flush=True); time.sleep(600); return real(root)
        o._file_table = slow
        sys.path.insert(0, sys.argv[2])
        from robustness_cases import Fixtures
        import pathlib
        fx = Fixtures(pathlib.Path(sys.argv[3]))
        from eqjax.io import load_model
        from eqjax.io.orbax import save_quantized
        from eqjax.recipe import quantize
        from eqjax.recipes import get_recipe
        model, params, _ = load_model(fx.root / "tiny")
        save_quantized(sys.argv[1], quantize(params, get_recipe("w4g128-rtn"), model=model), recipe="w4g128-rtn", model=model,
                       overwrite=True)
    """, str(ck), str(pathlib.Path(__file__).parent), str(fx.root))
    if not _wait_line(p, "saving"):
        _kill(p)
        return f"the save did not start: {p.stderr.read()[-300:]}"
    _kill(p)
    if (ck / "eqjax.json").read_bytes() != before:
        return "loss: the previous checkpoint's manifest changed"
    model, _, _ = load_model(fx.root / "tiny")
    try:
        _, m = load_quantized(ck, model=model)
    except Exception as e:  # noqa: BLE001
        return f"loss: the previous checkpoint no longer loads: {e}"
    if m["recipe"] != "w8":
        return "loss: the previous checkpoint was replaced by a partial one"
    partial = [q for q in work.iterdir() if q.name.startswith(".ck.tmp-")]
    if not partial:
        return "the partial checkpoint is not detectable"
    try:
        load_quantized(partial[0])
        return "a partial checkpoint loaded"
    except Exception as e:  # noqa: BLE001
        if "incomplete checkpoint" not in str(e):
            return f"a partial checkpoint gives an unclear error: {e}"
    return None


def _kill_onnx(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    pkg = work / "pkg"
    pkg.mkdir()
    target = pkg / "model.onnx"
    old = b"previous onnx file" * 100
    target.write_bytes(old)
    p = _child("""
        import sys, time
        import onnx
        def slow_save(m, path, **kw):
            data = m.SerializeToString()
            with open(path, "wb") as f:
                for i in range(0, len(data), 256):
                    f.write(data[i:i + 256]); f.flush()
                    if i == 0: print("writing", flush=True)
                    time.sleep(0.05)
        onnx.save_model = slow_save
        from eqjax.io.gguf import load_gguf
        from eqjax.models import Model
        from eqjax.export.package import export_package
        cfg, params, tok = load_gguf(sys.argv[2])
        export_package(Model(cfg), params, sys.argv[1], tokenizer=tok, overwrite=True, check=False)
    """, str(pkg), str(fx.root / "tiny.gguf"))
    if not _wait_line(p, "writing"):
        _kill(p)
        return f"the export did not start: {p.stderr.read()[-300:]}"
    time.sleep(0.2)
    _kill(p)
    if target.read_bytes() != old:
        return "loss: the previous ONNX package was damaged by a killed export"
    return None


def _run_cmd(fx: Fixtures, out: pathlib.Path, recipes: str, *extra: str) -> list[str]:
    return ["-m", "eqjax.cli", "run", "--model", str(fx.root / "tiny"), "--text", str(fx.root / "text.txt"),
            "--ctx", "32", "--eval-tokens", "64", "--recipes", recipes, "--out", str(out), *extra]


def _kill_run_then_resume(fx: Fixtures, work: pathlib.Path, v: dict, sig: int = signal.SIGKILL) -> str | None:
    out = work / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    # enough recipes after the second row that the kill lands before the run ends, even on a loaded machine
    names = "fp,w8,w4g128-rtn,w8a8-naive,w8-absmax,w8-zeropoint,w4g128-rtn-sym,w8a8-zeroquant"
    # Ctrl-C as a user's shell delivers it: the child starts with SIGINT at its default and unblocked even
    # if something earlier in this test process left it ignored or blocked (both are inherited across exec)
    def as_a_shell() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    p = subprocess.Popen([sys.executable, *_run_cmd(fx, out, names)], cwd=str(ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=as_a_shell)
    rows = out / "rows.jsonl"
    t0 = time.time()
    while time.time() - t0 < 180:
        if rows.is_file() and rows.read_text().count("\n") >= 2:
            break
        if p.poll() is not None:
            return f"the run ended before it could be killed: {p.stderr.read()[-300:]}"
        time.sleep(0.05)
    masks = _signal_masks(p.pid) if sig == signal.SIGINT else ""
    _kill(p, sig)
    err = p.stderr.read()
    if sig == signal.SIGINT:
        if p.returncode != 130 or "--resume" not in err.strip().splitlines()[-1]:
            swallowed = [x for x in err.splitlines() if "Exception ignored" in x or "KeyboardInterrupt" in x][:3]
            return (f"Ctrl-C: exit {p.returncode}, last line {err.strip().splitlines()[-1:]}; "
                    f"{swallowed or 'no trace of it'}; child before the signal: {masks}; environment changed "
                    f"since import: {_env_changes()}")
    kept = [json.loads(x) for x in rows.read_text().splitlines()[1:] if x.strip().endswith("}")]
    if not kept:
        return "loss: no finished row kept after the kill"
    r = subprocess.run([sys.executable, *_run_cmd(fx, out, names, "--resume")], cwd=str(ROOT),
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return f"--resume failed: {r.stderr.strip().splitlines()[-1:]}"
    res = json.loads((out / "results.json").read_text())["results"]
    if [x["recipe"] for x in res] != names.split(","):
        return f"resumed rows {[x['recipe'] for x in res]}"
    if res[0]["ppl"] != kept[0]["row"]["ppl"]:
        return "loss: a kept row was measured again"
    return None


def _signal_masks(pid: int) -> str:
    """The child's SIGINT state per thread from /proc (blocked / ignored / caught), for a failure message."""
    bit = 1 << (signal.SIGINT - 1)
    out = []
    try:
        tasks = sorted(pathlib.Path(f"/proc/{pid}/task").iterdir())
        for task in tasks:
            f = dict(x.split(":\t", 1) for x in (task / "status").read_text().splitlines() if ":\t" in x)
            flags = [k for k in ("SigBlk", "SigIgn", "SigCgt") if int(f.get(k, "0"), 16) & bit]
            if task.name == str(pid) or flags != ["SigCgt"]:
                out.append(f"{task.name}({f.get('Name', '?').strip()}):{'+'.join(flags) or 'default'}")
    except OSError as e:
        return f"unreadable ({e})"
    return ", ".join(out) + f" ({len(tasks)} threads)"


def _env_changes() -> dict[str, str | None]:
    now = dict(os.environ)
    return {k: now.get(k) for k in sorted(set(now) | set(_ENV_AT_IMPORT))
            if now.get(k) != _ENV_AT_IMPORT.get(k) and k != "PYTEST_CURRENT_TEST"}


def _kill_run_sigint(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    return _kill_run_then_resume(fx, work, v, signal.SIGINT)


def _kill_json_report(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    """Kill a process in the middle of write_json over an existing result: old or new, never half."""
    from eqjax.atomic import write_json

    target = work / "r.json"
    write_json(target, {"ppl": 1.5})
    old = target.read_bytes()
    p = _child("""
        import sys, time, os
        import eqjax.atomic as a
        real = os.fsync
        def slow(fd):
            print("fsync", flush=True); time.sleep(600)
        os.fsync = slow
        a.write_json(sys.argv[1], {"ppl": 2.5, "big": list(range(100000))})
    """, str(target))
    if not _wait_line(p, "fsync"):
        _kill(p)
        return f"the writer did not start: {p.stderr.read()[-300:]}"
    _kill(p)
    if target.read_bytes() != old:
        return "loss: the previous JSON result was changed by a killed write"
    json.loads(target.read_text())
    return None


def _existing_package(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    (work / "pkg").mkdir()
    (work / "pkg" / "model.onnx").write_bytes(b"old onnx")
    return {"o": str(work / "pkg"), "f": str(work / "pkg" / "model.onnx")}


def _onnx_ok(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    import onnx

    m = onnx.load_model(str(pathlib.Path(v["o"]) / "model.onnx"))
    onnx.checker.check_model(m)
    return None if m.graph.node else "empty graph"


# ------------------------------------------------------------------------------------ catalogue
def catalogue() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    T = "recipe"
    rule = '[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*/kernel"\n'
    add(Case("recipe: bits = 4.7 (float for an int)", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"bits.*integer.*4\.7",
             setup=_recipe('name = "r"\n' + rule + "bits = 4.7\n")))
    add(Case("recipe: symmetric = \"false\" (string for a bool)", T, argv=[*EVAL, "--recipe", "{recipe}"],
             cause=r"symmetric.*boolean.*'false'", setup=_recipe('name = "r"\n' + rule + 'symmetric = "false"\n')))
    add(Case("recipe: bits = true (bool for an int)", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"bits.*integer.*True",
             setup=_recipe('name = "r"\n' + rule + "bits = true\n")))
    add(Case("recipe: steps = 5", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"recipe\.toml: steps\).*list",
             setup=_recipe('name = "r"\nsteps = 5\n')))
    add(Case("recipe: file not UTF-8", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"not UTF-8.*recipe\.toml.*0xff",
             setup=_files(recipe__toml=b'name = "r\xff"\nsteps = []\n')))
    add(Case("recipe: unknown key in a rule", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"rules\[0\]\.bitz.*unknown",
             setup=_recipe('name = "r"\n' + rule + "bitz = 4\n")))
    add(Case("recipe: skip = true with bits (conflict)", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"bits.*skip",
             setup=_recipe('name = "r"\n' + rule + "skip = true\nbits = 4\n")))
    add(Case("recipe: group_size without granularity group", T, argv=[*EVAL, "--recipe", "{recipe}"],
             cause=r"group_size.*granularity", setup=_recipe('name = "r"\n' + rule + "group_size = 32\n")))
    add(Case("recipe: group_size = 100000", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"group_size.*1\.\.65536.*100000",
             setup=_recipe('name = "r"\n' + rule + 'granularity = "group"\ngroup_size = 100000\n')))
    add(Case("recipe: percentile with the minmax calibrator", T, argv=[*EVAL, "--recipe", "{recipe}"],
             cause=r"percentile.*calibrator", setup=_recipe('name = "r"\n' + rule + "percentile = 99.0\n")))
    add(Case("recipe: unknown method", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"method.*unknown step method 'nope'",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "nope"\n')))
    add(Case("recipe: TOML syntax error", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"does not parse.*recipe\.toml",
             setup=_recipe('name = \n')))
    add(Case("recipe: JSON with a duplicate key", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"duplicate key.*bits",
             setup=_recipe('{"name": "r", "steps": [{"method": "rtn", "rules": [{"pattern": ".*", "bits": 4, "bits": 8}]}]}',
                           "json")))
    add(Case("recipe: empty file", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"recipe\.toml: name.*required",
             setup=_recipe("")))
    add(Case("recipe: file missing", T, argv=[*EVAL, "--recipe", "/nonexistent/r.toml"], cause=r"does not exist.*r\.toml"))
    add(Case("recipe: unknown built-in name", T, argv=[*EVAL, "--recipe", "w9"], cause=r"unknown recipe 'w9'"))
    add(Case("recipe: regex that does not compile", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"pattern.*does not compile",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = "(("\n')))
    add(Case("recipe: kv key_bits = \"4\"", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"kv\.key_bits.*integer",
             setup=_recipe('name = "r"\nsteps = []\n[kv]\nkey_bits = "4"\n')))
    add(Case("recipe: gptq bits = 3.0", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"steps\[0\]\.bits.*integer.*3\.0",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "gptq"\nbits = 3.0\n')))
    add(Case("recipe: path is a directory", T, argv=[*EVAL, "--recipe", "{d}"], cause=r"not a file",
             setup=lambda fx, w: (w / "r.toml").mkdir() or {"d": str(w / "r.toml")}))
    add(Case("recipe: valid TOML, group 32", T, expect="ok", argv=[*EVAL, "--recipe", "{recipe}", "--json", "{json_out}"],
             setup=_with_json_out(_recipe('name = "r"\n' + rule + 'bits = 4\nsymmetric = false\ngranularity = "group"\n'
                                          'group_size = 32\nscale_dtype = "float16"\n')), check=_json_row_ok))
    add(Case("recipe: valid JSON with a kv table", T, expect="ok", argv=[*EVAL, "--recipe", "{recipe}", "--json", "{json_out}"],
             setup=_with_json_out(_recipe('{"name": "j", "steps": [], "kv": {"key_bits": 8, "value_bits": 8}}', "json")),
             check=_json_row_ok))

    T = "model"
    add(Case("model: path missing", T, argv=["eval", "--model", "/nonexistent/m.gguf", "--text", "{text}", "--ctx", "32",
                                                "--eval-tokens", "64", "--recipe", "fp"], cause=r"model not found.*m\.gguf"))
    add(Case("model: a text file given as the model", T, argv=["eval", "--model", "{text}", "--text", "{text}", "--ctx", "32",
                                                                  "--eval-tokens", "64", "--recipe", "fp"], cause=r"unknown model format.*text\.txt"))
    add(Case("model: truncated GGUF", T, argv=["eval", "--model", "{g}", "--text", "{text}", "--ctx", "32", "--eval-tokens", "64",
                                                  "--recipe", "fp"], cause=r"cut\.gguf.*(truncated|corrupt)",
             setup=lambda fx, w: (w / "cut.gguf").write_bytes((fx.root / "tiny.gguf").read_bytes()[:3000]) and {"g": str(w / "cut.gguf")}))
    add(Case("model: empty .gguf", T, argv=["eval", "--model", "{g}", "--text", "{text}", "--ctx", "32", "--eval-tokens", "64",
                                               "--recipe", "fp"], cause=r"e\.gguf: not a GGUF file",
             setup=lambda fx, w: (w / "e.gguf").write_bytes(b"") or {"g": str(w / "e.gguf")}))
    add(Case("model: garbage after the GGUF magic", T, argv=["eval", "--model", "{g}", "--text", "{text}", "--ctx", "32",
                                                                "--eval-tokens", "64", "--recipe", "fp"], cause=r"g\.gguf",
             setup=lambda fx, w: (w / "g.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8) and {"g": str(w / "g.gguf")}))
    add(Case("model: HF dir without config.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                              "--eval-tokens", "64", "--recipe", "fp"], cause=r"no config\.json",
             setup=_copy_tiny("nocfg", lambda d: (d / "config.json").unlink())))
    add(Case("model: truncated safetensors", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                         "--eval-tokens", "64", "--recipe", "fp"], cause=r"model\.safetensors.*(truncated|corrupt)",
             setup=_copy_tiny("cut", _truncate("model.safetensors", 0.5))))
    add(Case("model: corrupt config.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                       "--eval-tokens", "64", "--recipe", "fp"], cause=r"config\.json.*not valid JSON",
             setup=_copy_tiny("badcfg", lambda d: (d / "config.json").write_text("{nope"))))
    add(Case("model: int32 weights (ppl would be Infinity)", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                                         "--eval-tokens", "64", "--recipe", "fp"],
             cause=r"q_proj.*floating-point.*int32", setup=_int_weights))
    add(Case("model: NaN in a norm", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32", "--eval-tokens", "64",
                                                 "--recipe", "w8"], cause=r"non-finite.*layers_0/mlp_norm/scale.*\(3,\)",
             setup=_hf_variant("nan", mutate=_set_param("layers_0/mlp_norm/scale", (3,), float("nan")))))
    add(Case("model: Inf in the embedding", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                        "--eval-tokens", "64", "--recipe", "fp"], cause=r"non-finite.*embed/embedding.*\(7, 2\)",
             setup=_hf_variant("inf", mutate=_set_param("embed/embedding", (7, 2), float("inf")))))
    add(Case("model: HF dir without tokenizer.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                                 "--eval-tokens", "64", "--recipe", "fp"], cause=r"tokenizer\.json",
             setup=_copy_tiny("notok", lambda d: (d / "tokenizer.json").unlink())))
    add(Case("model: corrupt tokenizer.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                          "--eval-tokens", "64", "--recipe", "fp"], cause=r"tokenizer\.json",
             setup=_copy_tiny("badtok", lambda d: (d / "tokenizer.json").write_text('{"model": 1}'))))
    add(Case("model: token ids beyond the vocabulary", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                                   "--eval-tokens", "64", "--recipe", "fp"],
             cause=r"outside the model's vocabulary.*tokenizer\.json.*\[0, 200\)", setup=_copy_tiny("v200", _big_vocab_tokenizer)))
    add(Case("model: pickle-only checkpoint", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--ctx", "32",
                                                          "--eval-tokens", "64", "--recipe", "fp"], cause=r"pickle",
             setup=_copy_tiny("pkl", lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"))))
    add(Case("model: tiny GGUF evaluates", T, expect="ok",
             argv=["eval", "--model", "{gguf}", "--text", "{text}", "--ctx", "32", "--eval-tokens", "64", "--recipe", "w8",
                   "--json", "{json_out}"], setup=_with_json_out(), check=_json_row_ok))

    T = "text"
    add(Case("text: missing", T, argv=["eval", "--model", "{tiny}", "--text", "/nonexistent.txt", "--recipe", "fp", "--ctx", "32",
                                          "--eval-tokens", "64"], cause=r"nonexistent\.txt: no such file"))
    add(Case("text: not UTF-8", T, argv=["eval", "--model", "{tiny}", "--text", "{t}", "--recipe", "fp", "--ctx", "32",
                                            "--eval-tokens", "64"], cause=r"t\.txt: not UTF-8.*0xe9",
             setup=_files(t__txt="caf\xe9 ".encode("latin-1") * 200)))
    add(Case("text: empty", T, argv=["eval", "--model", "{tiny}", "--text", "{t}", "--recipe", "fp", "--ctx", "32",
                                        "--eval-tokens", "64"], cause=r"t\.txt: the file is empty", setup=_files(t__txt="  \n")))
    add(Case("text: too short for the windows", T, argv=["eval", "--model", "{tiny}", "--text", "{t}", "--recipe", "fp",
                                                            "--ctx", "32", "--eval-tokens", "64"], cause=r"t\.txt.*tokens",
             setup=_files(t__txt="too short")))
    add(Case("text: a directory", T, argv=["eval", "--model", "{tiny}", "--text", "{d}", "--recipe", "fp", "--ctx", "32",
                                              "--eval-tokens", "64"], cause=r"not a regular file",
             setup=lambda fx, w: (w / "d").mkdir() or {"d": str(w / "d")}))

    T = "flags"
    base = ["eval", "--model", "{tiny}", "--text", "{text}", "--recipe", "fp"]
    add(Case("flags: --ctx 0", T, argv=[*base, "--ctx", "0"], cause=r"--ctx.*>= 2.*0"))
    add(Case("flags: --ctx -5", T, argv=[*base, "--ctx", "-5"], cause=r"--ctx.*-5"))
    add(Case("flags: --eval-tokens below --ctx", T, argv=[*base, "--ctx", "32", "--eval-tokens", "10"],
             cause=r"--eval-tokens.*>= 32.*10"))
    add(Case("flags: --ctx above the model's max positions", T, argv=[*base, "--ctx", "512", "--eval-tokens", "512"],
             cause=r"max_position_embeddings.*<= 128.*512"))
    add(Case("flags: --batch-size 0", T, argv=[*base, "--ctx", "32", "--eval-tokens", "64", "--batch-size", "0"],
             cause=r"--batch-size"))
    add(Case("flags: --calib-windows -1", T, argv=[*base, "--ctx", "32", "--eval-tokens", "64", "--calib-windows", "-1"],
             cause=r"--calib-windows"))
    add(Case("flags: --ctx abc", T, argv=[*base, "--ctx", "abc"], cause=r"--ctx.*invalid int"))
    add(Case("flags: --recipe and --checkpoint together", T, argv=[*base, "--checkpoint", "{ck}"], cause=r"not allowed with"))
    add(Case("flags: unknown subcommand", T, argv=["evaluate"], cause=r"invalid choice"))

    T = "distributed"
    add(Case("distributed: --num-processes 0", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "0"],
             cause=r"--num-processes.*>= 1.*0"))
    add(Case("distributed: process id out of range", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "2", "--process-id", "5",
                                                            "--coordinator", "localhost:1234"], cause=r"--process-id.*0\.\.1.*5"))
    add(Case("distributed: coordinator without a port", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "2",
                                                                   "--process-id", "0", "--coordinator", "localhost"],
             cause=r"coordinator.*host:port.*'localhost'"))
    add(Case("distributed: coordinator port 99999", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "2", "--process-id",
                                                               "0", "--coordinator", "h:99999"], cause=r"port 1\.\.65535"))
    add(Case("distributed: EQJAX_NUM_PROCESSES=abc", T, argv=[*EVAL, "--recipe", "fp"], env={"EQJAX_NUM_PROCESSES": "abc"},
             cause=r"EQJAX_NUM_PROCESSES.*integer.*'abc'"))
    add(Case("distributed: --process-id without the others", T, argv=[*EVAL, "--recipe", "fp", "--process-id", "1"],
             cause=r"--coordinator.*--num-processes"))

    T = "outputs"
    add(Case("outputs: --json under an unwritable directory", T, argv=[*EVAL, "--recipe", "fp", "--json", "/sys/eqjax-r.json"],
             cause=r"/sys/eqjax-r\.json.*writable"))
    add(Case("outputs: --json exists, no --overwrite", T, argv=[*EVAL, "--recipe", "fp", "--json", "{j}"],
             cause=r"exists.*--overwrite", setup=_existing("j", "r.json", b'{"old": 1}'), check=_unchanged("j", b'{"old": 1}')))
    add(Case("outputs: --json exists, --overwrite", T, expect="ok",
             argv=[*EVAL, "--recipe", "fp", "--json", "{json_out}", "--overwrite"],
             setup=lambda fx, w: (w / "row.json").write_text("{}") and {"json_out": str(w / "row.json")}, check=_json_row_ok))
    add(Case("outputs: --json is a directory", T, argv=[*EVAL, "--recipe", "fp", "--json", "{d}"], cause=r"directory",
             setup=lambda fx, w: (w / "d").mkdir() or {"d": str(w / "d")}))
    add(Case("outputs: --json parent is a file", T, argv=[*EVAL, "--recipe", "fp", "--json", "{f}/r.json"], cause=r"r\.json",
             setup=_existing("f", "f", b"x")))
    add(Case("quantize: --out is a non-empty directory", T, argv=["quantize", "--model", "{tiny}", "--recipe", "w8", "--out", "{d}"],
             cause=r"not empty.*--overwrite", setup=lambda fx, w: ((w / "d").mkdir(), (w / "d" / "keep").write_bytes(b"k")) and {"d": str(w / "d"), "k": str(w / "d" / "keep")},
             check=_unchanged("k", b"k")))
    add(Case("quantize: --out is a file", T, argv=["quantize", "--model", "{tiny}", "--recipe", "w8", "--out", "{f}"],
             cause=r"directory.*file", setup=_existing("f", "f", b"x"), check=_unchanged("f", b"x")))
    add(Case("quantize: new checkpoint", T, expect="ok", argv=["quantize", "--model", "{tiny}", "--recipe", "w4g128-rtn",
                                                                "--out", "{c}"],
             setup=lambda fx, w: {"c": str(w / "c")}, check=_ck_loads("c", "w4g128-rtn")))
    add(Case("quantize: --overwrite an existing checkpoint", T, expect="ok",
             argv=["quantize", "--model", "{tiny}", "--recipe", "w4g128-rtn", "--out", "{c}", "--overwrite"],
             setup=_ck_copy("c"), check=_ck_loads("c", "w4g128-rtn")))
    add(Case("quantize: NaN in a norm", T, argv=["quantize", "--model", "{m}", "--recipe", "w8", "--out", "{c}"],
             cause=r"non-finite.*layers_1/attn_norm/scale",
             setup=lambda fx, w: {**_hf_variant("nan", mutate=_set_param("layers_1/attn_norm/scale", (0,), float("nan")))(fx, w),
                                  "c": str(w / "c")},
             check=lambda fx, w, v, r: "a checkpoint was written" if pathlib.Path(v["c"]).exists() else None))
    add(Case("quantize: --recipe kv4 records the KV settings", T, expect="ok",
             argv=["quantize", "--model", "{tiny}", "--recipe", "kv4", "--out", "{c}"],
             setup=lambda fx, w: {"c": str(w / "c")}, check=_ck_loads("c", "kv4", kv=True)))
    add(Case("run: --out holds a previous run's results", T, argv=["run", "--model", "{tiny}", "--text", "{text}", "--ctx", "32",
                                                                   "--eval-tokens", "64", "--recipes", "fp", "--out", "{o}"],
             cause=r"results exist.*--overwrite",
             setup=lambda fx, w: ((w / "o").mkdir(), (w / "o" / "results.json").write_text("{}")) and {"o": str(w / "o"), "r": str(w / "o" / "results.json")},
             check=_unchanged("r", b"{}")))
    add(Case("run: --resume keeps the finished rows", T, expect="ok",
             argv=["run", "--model", "{tiny}", "--text", "{text}", "--ctx", "32", "--eval-tokens", "64", "--recipes", "fp,w8",
                   "--out", "{o}", "--resume"], setup=_resume_setup, check=_resume_check))
    add(Case("run: --resume under another protocol", T,
             argv=["run", "--model", "{tiny}", "--text", "{text}", "--ctx", "16", "--eval-tokens", "64", "--recipes", "fp,w8",
                   "--out", "{o}", "--resume"], setup=_resume_setup, cause=r"protocol\.ctx.*16.*32"))
    add(Case("run: two recipes with one name", T, argv=["run", "--model", "{tiny}", "--text", "{text}", "--ctx", "32",
                                                        "--eval-tokens", "64", "--recipes", "fp,fp", "--out", "{o}"],
             cause=r"listed twice", setup=lambda fx, w: {"o": str(w / "o")}))
    add(Case("export-onnx: --recipe kv4", T, argv=["export-onnx", "--model", "{gguf}", "--recipe", "kv4", "--out", "{o}"],
             cause=r"kv4.*KV", setup=lambda fx, w: {"o": str(w / "pkg")},
             check=lambda fx, w, v, r: "a float graph was written" if pathlib.Path(v["o"]).exists() else None))
    add(Case("export-onnx: unwritable output", T, argv=["export-onnx", "--model", "{gguf}", "--recipe", "w8", "--out",
                                                          "/sys/eqjax_pkg"], cause=r"/sys/eqjax_pkg.*writable"))
    add(Case("export-onnx: output exists, no --overwrite", T, argv=["export-onnx", "--model", "{gguf}", "--recipe", "w8",
                                                                     "--out", "{o}"], cause=r"not empty.*--overwrite",
             setup=_existing_package, check=_unchanged("f", b"old onnx")))
    add(Case("export-onnx: HF directory as the model", T, argv=["export-onnx", "--model", "{tiny}", "--recipe", "w8",
                                                                 "--out", "{o}"], cause=r"\.gguf",
             setup=lambda fx, w: {"o": str(w / "pkg")}))
    add(Case("export-onnx: tiny GGUF, w8", T, expect="ok", argv=["export-onnx", "--model", "{gguf}", "--recipe", "w8",
                                                                  "--out", "{o}"], setup=lambda fx, w: {"o": str(w / "pkg")},
             check=_onnx_ok))

    T = "export-gguf"
    add(Case("export-gguf: --recipe w8a8-smoothquant", T, argv=["export-gguf", "--model", "{gguf}", "--recipe",
                                                                 "w8a8-smoothquant", "--out", "{o}"],
             cause=r"SmoothQuant.*weight-only", setup=lambda fx, w: {"o": str(w / "m.gguf")},
             check=lambda fx, w, v, r: "a file was written" if pathlib.Path(v["o"]).exists() else None))
    add(Case("export-gguf: widths not multiples of 32", T, argv=["export-gguf", "--model", "{gguf}", "--recipe", "w8",
                                                                  "--out", "{o}"],
             cause=r"tiny\.gguf.*hidden 8.*multiple of 32", setup=lambda fx, w: {"o": str(w / "m.gguf")}))
    add(Case("export-gguf: output exists, no --overwrite", T, argv=["export-gguf", "--model", "{gguf}", "--recipe", "w8",
                                                                     "--out", "{o}"], cause=r"m\.gguf.*--overwrite",
             setup=lambda fx, w: (w / "m.gguf").write_bytes(b"old gguf") and {"o": str(w / "m.gguf")},
             check=_unchanged("o", b"old gguf")))
    add(Case("export-gguf: HF directory as the model", T, argv=["export-gguf", "--model", "{tiny}", "--recipe", "w8",
                                                                 "--out", "{o}"], cause=r"\.gguf",
             setup=lambda fx, w: {"o": str(w / "m.gguf")}))

    T = "checkpoint"
    ev = ["eval", "--model", "{tiny}", "--text", "{text}", "--ctx", "32", "--eval-tokens", "64"]
    add(Case("checkpoint: evaluates", T, expect="ok", argv=[*ev, "--checkpoint", "{ck}", "--json", "{json_out}"],
             setup=_with_json_out(), check=_json_row_ok))
    add(Case("checkpoint: into a model of another shape", T, argv=["eval", "--model", "{other}", "--text", "{text}", "--ctx", "32",
                                                                    "--eval-tokens", "64", "--checkpoint", "{ck}"],
             cause=r"another model.*config key.*expected.*found"))
    add(Case("checkpoint: truncated data file", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"truncated.*expected \d+ bytes",
             setup=_ck_copy("c", _ck_truncate)))
    add(Case("checkpoint: one flipped byte in a data file", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"corrupt.*SHA-256",
             setup=_ck_copy("c", _ck_flip)))
    add(Case("checkpoint: corrupt manifest", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"eqjax\.json",
             setup=_ck_copy("c", lambda d: (d / "eqjax.json").write_text('{"format": 2, "leav'))))
    add(Case("checkpoint: partial (save killed)", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"incomplete checkpoint",
             setup=_ck_partial))
    add(Case("checkpoint: missing directory", T, argv=[*ev, "--checkpoint", "/nonexistent/ck"], cause=r"checkpoint not found"))
    add(Case("checkpoint: data file deleted", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"missing",
             setup=_ck_copy("c", lambda d: _largest_data_file(d).unlink())))

    T = "api"
    add(Case("api: quantize params with a NaN norm", T, api=_api_quantize_nan, cause=r"layers_1/mlp_norm/scale.*\(5,\)"))
    add(Case("api: perplexity with ids beyond the vocabulary", T, api=_api_ppl_bad_ids, cause=r"\[0, 256\).*300"))
    add(Case("api: perplexity of a model whose logits blow up", T, api=_api_ppl_overflow, code=1, cause=r"(perplexity overflows|non-finite loss)"))
    add(Case("api: load a checkpoint into another model", T, api=_api_load_other_model, cause=r"another model"))
    add(Case("api: write_json with Infinity", T, api=_api_write_json_nan, code=1, cause=r"x\.json.*ppl"))
    add(Case("api: GPTQ.from_config bits = \"4\"", T, api=_api_step_from_config, cause=r"bits.*integer"))
    add(Case("api: rule_from_dict axis with tensor granularity", T, api=_api_rule_from_dict, cause=r"axis.*tensor"))
    add(Case("api: token cache with a changed tokenizer.json", T, expect="ok", api=_api_token_cache_content,
             check=_check_token_cache))
    add(Case("api: save a checkpoint onto a file", T, api=_api_save_into_file, cause=r"file"))
    add(Case("api: 200 random recipe dicts (fuzz)", T, expect="ok", api=_api_fuzz_recipes))

    T = "kill"
    add(Case("kill: SIGKILL during an atomic file write", T, expect="ok", kill=_kill_atomic_file))
    add(Case("kill: SIGKILL during a checkpoint save (--overwrite)", T, expect="ok", kill=_kill_checkpoint, slow=True))
    add(Case("kill: SIGKILL during an ONNX write", T, expect="ok", kill=_kill_onnx, slow=True))
    add(Case("kill: SIGKILL during a JSON result write", T, expect="ok", kill=_kill_json_report))
    add(Case("kill: SIGKILL during eqjax run, then --resume", T, expect="ok", kill=_kill_run_then_resume, slow=True))
    add(Case("kill: Ctrl-C during eqjax run, then --resume", T, expect="ok", kill=_kill_run_sigint, slow=True))
    return cases


# ------------------------------------------------------------------------------------ running
def _fmt(args: list[str], values: dict[str, str]) -> list[str]:
    return [a.format(**values) for a in args]


def run_cli_inprocess(argv: list[str], env: dict[str, str] | None = None) -> Result:
    from eqjax.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with _MAIN_LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 2
            except BaseException:  # noqa: BLE001 - main must not raise; report it as a traceback
                import traceback

                traceback.print_exc()
                rc = 1
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Result(rc, out.getvalue(), err.getvalue())


def run_cli_subprocess(argv: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> Result:
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu",
         **(env or {})}
    try:
        r = subprocess.run([sys.executable, "-m", "eqjax.cli", *argv], capture_output=True, text=True, cwd=str(ROOT),
                           env=e, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        return Result(None, str(t.stdout or ""), f"timeout after {timeout} s")
    return Result(r.returncode, r.stdout, r.stderr)


def run_case(case: Case, fx: Fixtures, work: pathlib.Path, *, subprocess_cli: bool = False) -> tuple[str, str, float]:
    """Run ``case``; returns ``(outcome, detail, seconds)``."""
    t0 = time.perf_counter()
    try:
        return _run_case(case, fx, work, subprocess_cli=subprocess_cli, t0=t0)
    except Exception as e:  # noqa: BLE001 - a broken case (setup/check) is reported, not fatal
        import traceback

        return "traceback", "case machinery failed: " + "".join(traceback.format_exception(e))[-400:], time.perf_counter() - t0


def _run_case(case: Case, fx: Fixtures, work: pathlib.Path, *, subprocess_cli: bool, t0: float) -> tuple[str, str, float]:
    work.mkdir(parents=True, exist_ok=True)
    values = fx.values()
    if case.setup is not None:
        values.update(case.setup(fx, work))
    if case.kill is not None:
        try:
            failure = case.kill(fx, work, values)
        except Exception as e:  # noqa: BLE001
            import traceback

            return "traceback", "".join(traceback.format_exception(e))[-400:], time.perf_counter() - t0
        dt = time.perf_counter() - t0
        if failure is None:
            return "correct", "previous artifact intact; partial output detectable; resumable", dt
        return ("loss" if failure.startswith("loss") else "silent"), failure, dt
    if case.api is not None:
        from eqjax.errors import classify as error_kind
        from eqjax.errors import exit_code

        res = Result(0)
        try:
            res.value = case.api(fx, work, values)
        except BaseException as e:  # noqa: BLE001
            res.exc = e
            res.rc = exit_code(e)
            res.err = f"eqjax: error: {e}" if error_kind(e) != "internal" else f"Traceback: {type(e).__name__}: {e}"
    else:
        argv = _fmt(case.argv or [], values)
        res = run_cli_subprocess(argv, case.env) if subprocess_cli else run_cli_inprocess(argv, case.env)
    outcome, detail = classify(case, fx, work, values, res)
    return outcome, detail, time.perf_counter() - t0


def classify(case: Case, fx: Fixtures, work: pathlib.Path, values: dict[str, str], res: Result) -> tuple[str, str]:
    err_lines = [x for x in res.err.strip().splitlines() if x.strip()]
    last = err_lines[-1].strip() if err_lines else ""
    last = last.split("\r")[-1]  # progress bars rewrite their line with \r
    if res.rc is None:
        return "traceback", "timed out"
    if res.rc < 0:
        return "crash", f"killed by signal {-res.rc}"
    if "Traceback" in res.err or "internal error" in res.err:
        return "traceback", last[:300]
    if case.check is not None:
        problem = case.check(fx, work, values, res)
        if problem and problem.startswith("loss"):
            return "loss", problem
    else:
        problem = None
    if case.expect == "error":
        if res.rc == 0:
            return "silent", "exit 0 where an error was due"
        if res.rc != case.code:
            return "traceback", f"exit {res.rc}, expected {case.code}: {last[:200]}"
        if not last.startswith("eqjax: error:"):
            return "traceback", f"last line is not an 'eqjax: error:' line: {last[:200]}"
        if case.cause and not re.search(case.cause, last):
            return "traceback", f"the message does not name the cause ({case.cause!r}): {last[:200]}"
        if problem:
            return "silent", problem
        return "clear error", last[len("eqjax: error: "):][:300]
    if res.rc != 0:
        return "traceback", f"exit {res.rc} where success was due: {last[:200]}"
    if problem:
        return "silent", problem
    return "correct", "ok"

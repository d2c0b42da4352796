"""Shared inputs of the robustness catalogue (a tiny HF model, a text, a tiny GGUF, a good checkpoint) and
its two record types: :class:`Case` (one user action and the outcome it must have) and :class:`Result`."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def write_gguf(path: pathlib.Path, *, blocks: int = 2, seed: int = 0) -> pathlib.Path:
    """A tiny llama GGUF (byte-level BPE vocabulary of 259 tokens, hidden 8) of ``blocks`` random blocks."""
    import gguf
    import numpy as np

    from eqjax.io.tokenizer import bytes_to_unicode

    D, F, HQ, HKV, HD, L = 8, 32, 2, 1, 4, blocks
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    rng = np.random.default_rng(seed)
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
        from eqjax.recipes.apply import quantize
        from eqjax.recipes.registry import get_recipe

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


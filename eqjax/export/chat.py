"""Chat with an exported package through onnxruntime-genai: ``python -m eqjax.export.chat DIR``.

Reads a line, applies the package's chat template (tokenizer_config.json) and streams the greedy
answer. ``--prompt TEXT`` answers one message and exits (scripts, tests).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eqjax.export.chat", description=__doc__)
    ap.add_argument("package", help="directory written by `eqjax export-onnx`")
    ap.add_argument("--prompt", default=None, help="answer this one message and exit")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    import onnxruntime_genai as og

    model = og.Model(args.package)
    tok = og.Tokenizer(model)
    stream = tok.create_stream()
    cfg = json.loads((pathlib.Path(args.package) / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    history: list[dict] = []
    while True:
        text = args.prompt if args.prompt is not None else input("> ")
        history.append({"role": "user", "content": text})
        if template:
            prompt = tok.apply_chat_template(json.dumps(history), template_str=template, add_generation_prompt=True)
        else:
            prompt = text
        ids = tok.encode(prompt)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + args.max_new_tokens, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        answer = []
        while not gen.is_done():
            gen.generate_next_token()
            piece = stream.decode(gen.get_next_tokens()[0])
            answer.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
        if args.prompt is not None:
            return 0


if __name__ == "__main__":
    sys.exit(main())

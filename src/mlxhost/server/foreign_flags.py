"""`mlxhost serve` flags as other servers spell them (vLLM, SGLang, mlx-lm, Ollama, llama.cpp).

A name that means what one of ours means is rewritten to ours, with a note for the log; a name that means
something else is an error naming what to use here; any other unknown flag gets the closest of ours.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Foreign:
    origin: str  # whose name it is
    ours: str | None  # our flag of the same meaning; "" accepted and ignored; None: an error
    note: str = ""  # the error's advice, or what a rewrite or an ignored flag should know
    takes_value: bool = True
    also: dict = field(default_factory=dict)  # our flags it implies, unless given: {"--memory-mode": "dedicated"}


_DEDICATED = {"--memory-mode": "dedicated"}  # vLLM and SGLang take their share whatever else runs
FOREIGN = {
    "--gpu-memory-utilization": Foreign("vLLM", "--memory-utilization", "with --memory-mode dedicated",
                                        also=_DEDICATED),
    "--mem-fraction-static": Foreign("SGLang", "--memory-utilization", "with --memory-mode dedicated",
                                     also=_DEDICATED),
    "--tensor-parallel-size": Foreign("vLLM", "--tensor-parallel"),
    "--tp-size": Foreign("SGLang", "--tensor-parallel"),
    "--pipeline-parallel-size": Foreign("vLLM", "--pipeline-parallel"),
    "--pp-size": Foreign("SGLang", "--pipeline-parallel"),
    "--context-length": Foreign("SGLang", "--max-model-len"),
    "--num-ctx": Foreign("Ollama", "--max-model-len"),
    "--ctx-size": Foreign("llama.cpp", "--max-model-len"),
    "--max-tokens": Foreign("mlx-lm", "--default-max-tokens"),
    "--decode-concurrency": Foreign("mlx-lm", "--max-num-seqs"),
    "--num-parallel": Foreign("Ollama", "--max-num-seqs"),
    "--parallel": Foreign("llama.cpp", "--max-num-seqs"),
    "--prompt-concurrency": Foreign("mlx-lm", "--max-num-prefill-rows"),
    "--prompt-cache-bytes": Foreign("mlx-lm", "--cache-memory"),
    "--no-enable-prefix-caching": Foreign("vLLM", "--no-prefix-cache", takes_value=False),
    "--enable-prefix-caching": Foreign("vLLM", "", "the prefix cache is on by default", takes_value=False),
    "--enable-auto-tool-choice": Foreign("vLLM", "", "tool calls are parsed whenever the model's chat template"
                                                     " has them (--tool-call-parser to choose)", takes_value=False),
    "--trust-remote-code": Foreign("vLLM", "", "mlxhost runs only mlx-lm's and mlx-vlm's own model code",
                                   takes_value=False),
    "--n-gpu-layers": Foreign("llama.cpp", "", "every layer runs on the GPU"),
    "--max-num-batched-tokens": Foreign("vLLM", None, "--prefill-step-size caps the prompt tokens of one engine"
                                                      " step (decode rows come on top)"),
    "--kv-cache-dtype": Foreign("vLLM", None, "--kv-bits 8 or --kv-bits 4 quantizes the KV cache"),
    "--max-kv-size": Foreign("mlx-lm", None, "a rotating cache that forgets the start of a long context; here"
                                             " --max-model-len caps the context and its KV is kept whole"),
    "--quantized-kv-start": Foreign("mlx-lm", None, "--kv-bits quantizes the KV cache from the first token"),
    "--prompt-cache-size": Foreign("mlx-lm", None, "a count of cached prompts; here --cache-memory caps the"
                                                   " prefix cache in bytes"),
    "--dtype": Foreign("vLLM", None, "weights are served in their own dtype; `mlxhost convert --dtype` writes"
                                     " another"),
    "--quantization": Foreign("vLLM", None, "quantize ahead with `mlxhost convert --bits 4`, or serve an MLX"
                                            " quantized folder"),
    "--model-path": Foreign("SGLang", None, "name the model first: mlxhost serve PATH"),
    "--chat-template": Foreign("vLLM", None, "the model's own chat template is used (tokenizer_config.json or"
                                             " chat_template.jinja in its folder)"),
    "--download-dir": Foreign("vLLM", None, "set HF_HUB_CACHE, or `mlxhost pull ID --local-dir DIR`"),
    "--keep-alive": Foreign("Ollama", None, "an idle model unloads after its `ttl` in --models-config"),
    "--adapter-path": Foreign("mlx-lm", None, "LoRA adapters are not served; fuse them (mlx_lm.fuse) and serve the"
                                              " fused folder"),
    **{flag: Foreign("mlx-lm", None, "sampling is set per request (temperature, top_p, top_k, min_p)")
       for flag in ("--temp", "--top-p", "--top-k", "--min-p")},
}


class ForeignFlagError(ValueError):
    """A flag of another server that has no same-meaning flag here; the message says what to use."""


def refusal(flag: str) -> str:
    f = FOREIGN[flag]
    return f"{flag} is {f.origin}'s flag; here {f.note}" if f.note.startswith("-") else \
        f"{flag} is {f.origin}'s flag: {f.note}"


def translate(argv: list[str], ours: set[str]) -> tuple[list[str], list[str]]:
    """`argv` (after the `serve` word) with foreign names rewritten, and the notes to log. Raises
    ForeignFlagError for a foreign name with no same-meaning flag here."""
    out, notes, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        f = FOREIGN.get(name) if token.startswith("--") and name not in ours else None
        i += 1
        if f is None:
            out.append(token)
            continue
        if f.ours is None:
            raise ForeignFlagError(refusal(name))
        # The value, attached or next, goes with the flag: it must never be taken as the model.
        args = [value] if eq else (argv[i:i + 1] if f.takes_value and i < len(argv) else [])
        i += 0 if eq or not f.takes_value else len(args)
        if not f.ours:
            notes.append(f"{name} ({f.origin}) is ignored: {f.note}")
            continue
        implied = [t for flag, v in f.also.items() if flag not in argv for t in (flag, v)]
        out += implied + [f.ours] + args
        notes.append(f"{name} is {f.origin}'s name for {f.ours}" + (f" ({f.note})" if f.note else ""))
    return out, notes


def unknown_flag_message(flags: list[str], ours: set[str]) -> str:
    """What to say of flags argparse did not know: the closest of ours for each."""
    parts = []
    for flag in flags:
        name = flag.partition("=")[0]
        close = difflib.get_close_matches(name, sorted(ours), n=1, cutoff=0.6)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return "unknown flag" + ("s" if len(parts) > 1 else "") + " " + ", ".join(parts)


def chosen_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser `argv` reaches: `serve`, `bench serve` ..."""
    for token in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subparsers and token in subparsers[0].choices:
            parser = subparsers[0].choices[token]
    return parser


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


def rewrite_serve_argv(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """`mlxhost serve` argv with other servers' names rewritten to ours, and the notes to log."""
    if "serve" not in argv or (chosen := chosen_parser(parser, argv)).prog != "mlxhost serve":
        return argv, []
    at = argv.index("serve") + 1
    try:
        rest, notes = translate(argv[at:], option_strings(chosen))
    except ForeignFlagError as e:
        chosen.error(str(e))
    return argv[:at] + rest, notes


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, but an unknown flag is named with the closest known one, and its stray value is never taken
    for the model."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        chosen = chosen_parser(parser, argv)
        flags = [e for e in extras if e.startswith("-")]
        if flags:
            chosen.error(unknown_flag_message(flags, option_strings(chosen)))
        chosen.error("unexpected argument" + ("s " if len(extras) > 1 else " ") + " ".join(extras))
    return args

"""Train a small EAGLE-3 or MTP head for real SmolLM2-135M from its own greedy output, then measure it.

    python -m mlxhost.testing.real_models fetch --only smollm2
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python tools/train_spec_head.py --out heads/smollm2-eagle3 [--kind eagle3|mtp] [--measure]

Prompts are chat turns made from templates (no data set): SmolLM2 answers each greedily through the engine
(batched), and the head learns to guess the token after next from the model's hidden states on those
answers (testing/spec_heads.py `train_head`, fed from the first output token on, as when serving; the head
starts as the model's own next-token guess, trains `--batch-size` answers a step, and an EAGLE-3 head drafts
over the `--draft-vocab` tokens the answers use most, a small LM head of its own). The
folder it writes serves with `mlxhost serve MODEL --speculative KIND --speculative-model OUT`. `--measure`
then decodes held-out prompts (other templates' fillers) with speculation off, with the head and with
`--speculative auto`, at each `--concurrency`, checks that greedy output is the same, and prints acceptance,
tokens per row-step and tok/s. `--answers FILE` keeps the model's answers for the next run (the slow part).
A .gguf model is converted to float32 (`--dtype`: the CPU's fast path; float16 and 4-bit matmuls are slow
there); a model folder loads as it is.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path

TEMPLATES = [
    "What is the capital of {place}?",
    "Write one sentence about {thing}.",
    "Explain {idea} in two sentences.",
    "List three facts about {thing}.",
    "Give me a short tip about {idea}.",
    "Describe {place} in a few words.",
    "Why is {thing} important?",
    "Write a haiku about {thing}.",
    "How do I get started with {idea}?",
    "Tell me something interesting about {place}.",
]
# Training only, after TEMPLATES' questions (an answers file of those stays valid): more of the model's own
# phrasing, with the training fillers only.
EXTRA_TEMPLATES = [
    "What is {place} known for?",
    "Summarize the history of {place} in two sentences.",
    "What should a visitor to {place} see first?",
    "Write a short poem about {thing}.",
    "What are the benefits of {thing}?",
    "Explain how {thing} works.",
    "What is {idea}?",
    "Give three tips for {idea}.",
    "Why should I learn about {idea}?",
    "Write a short paragraph about {idea}.",
    "What is the weather like in {place}?",
    "Name a famous food from {place}.",
    "What language is spoken in {place}?",
    "Describe {thing} to a child.",
    "Tell me a fun fact about {thing}.",
    "What is the history of {thing}?",
    "What are common mistakes in {idea}?",
    "Describe {idea} in one paragraph.",
    "What is the best way to learn {idea}?",
    "Compare {idea} with something from daily life.",
]
PLACES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Italy", "Kenya", "Norway", "Peru", "India",
          "Spain", "Mexico", "Germany", "Australia", "Chile", "Greece", "Vietnam", "Morocco", "Ireland", "Poland"]
THINGS = ["the ocean", "coffee", "bicycles", "honey bees", "the moon", "volcanoes", "libraries", "rain",
          "chess", "bread", "trees", "the internet", "music", "elephants", "sleep", "glaciers", "paper",
          "clocks", "salt", "bridges"]
IDEAS = ["photosynthesis", "gravity", "saving money", "learning a language", "recursion", "exercise",
         "cooking rice", "time management", "public speaking", "gardening", "photography", "meditation",
         "compound interest", "the water cycle", "democracy", "recycling", "writing clearly", "running",
         "sorting algorithms", "climate"]


def make_questions(seed: int) -> tuple[list[str], list[str]]:
    """All template x filler questions, shuffled, and a held-out set: the last fillers of each list, never
    trained on."""
    def fill(template, k):
        slot = template[template.index("{") + 1:template.index("}")]
        words = {"place": PLACES, "thing": THINGS, "idea": IDEAS}[slot]
        return [template.format(**{slot: w}) for w in (words[:-k] if k > 0 else words[k:])]
    train = list(itertools.chain.from_iterable(fill(t, 4) for t in TEMPLATES))
    held = list(itertools.chain.from_iterable(fill(t, -4) for t in TEMPLATES))
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(held)
    for g in range(0, len(EXTRA_TEMPLATES), 10):  # ten templates at a time: a group added keeps the order before it
        extra = list(itertools.chain.from_iterable(fill(t, 4) for t in EXTRA_TEMPLATES[g:g + 10]))
        random.Random(seed + 2 + g // 10).shuffle(extra)
        train += extra
    return train, held


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def make_core(loaded, c: int, **spec):
    from mlxhost.config import EngineConfig
    from mlxhost.engine.core import EngineCore

    config = EngineConfig(max_num_seqs=max(c, 1), enable_prefix_cache=False, cache_memory_bytes=64 << 20, **spec)
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=1024)


def generate(core, prompts: list[list[int]], max_tokens: int, wave: int,
             eos=frozenset()) -> tuple[list[list[int]], int, float]:
    """Greedy outputs of `prompts`, `wave` at a time; also (tokens, seconds) of decoding them."""
    from mlxhost.engine.request import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs: dict[str, list[int]] = {}
    n, start = 0, time.perf_counter()
    for w in range(0, len(prompts), wave):
        for i in range(w, min(w + wave, len(prompts))):
            core.add_request(Request(f"p{i}", prompts[i], params, eos_token_ids=eos))
        while core.has_work:
            for o in core.step():
                if o.error:
                    raise RuntimeError(o.error)
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                n += len(o.new_token_ids)
    return [outs.get(f"p{i}", []) for i in range(len(prompts))], n, time.perf_counter() - start


def measure(loaded, head_dir: Path, kind: str, prompts: list[list[int]], args) -> list[dict]:
    rows = []
    for c in args.concurrency:
        plain = make_core(loaded, c)
        warm = prompts if args.full_warmup else prompts[:c]
        generate(plain, warm, args.max_tokens, c, loaded.eos_token_ids)  # warm-up
        want, n_off, s_off = generate(plain, prompts, args.max_tokens, c, loaded.eos_token_ids)
        spec = make_core(loaded, c, speculative=kind, draft_model=str(head_dir),
                         num_draft_tokens=args.num_draft_tokens, spec_max_batch=max(c, 4))
        generate(spec, warm, args.max_tokens, c, loaded.eos_token_ids)
        before = spec.spec_stats()
        got, n_on, s_on = generate(spec, prompts, args.max_tokens, c, loaded.eos_token_ids)
        after = spec.spec_stats()
        d = {k: after[k] - before[k] for k in ("num_drafted", "num_accepted", "num_steps", "num_emitted")}
        # The same head under --speculative auto: steps whose drafts do not pay decode plainly.
        auto = make_core(loaded, c, speculative="auto", draft_model=str(head_dir),
                         num_draft_tokens=args.num_draft_tokens, spec_max_batch=max(c, 4))
        generate(auto, warm, args.max_tokens, c, loaded.eos_token_ids)
        before_auto = auto.spec_stats()
        got_auto, n_auto, s_auto = generate(auto, prompts, args.max_tokens, c, loaded.eos_token_ids)
        after_auto = auto.spec_stats()
        # What `auto` measured and chose (its step costs per batch size), and how its expected acceptance
        # compares with what it got in the steps it speculated.
        auto_d = {k: round(after_auto[k] - before_auto[k], 2) for k in
                  ("num_steps", "num_drafted", "num_accepted", "expected_accepted", "num_declined_steps",
                   "num_plain_steps")}
        # --rounds: off and auto again, in turns (which goes first alternates), one ratio per round: the host's
        # speed drifts over a run of seconds, and each pair shares its drift.
        ratios = []
        for r in range(args.rounds):
            pair = [(plain, "off"), (auto, "auto")][::1 if r % 2 == 0 else -1]
            tok_s = {}
            for core, name in pair:
                _, n, secs = generate(core, prompts, args.max_tokens, c, loaded.eos_token_ids)
                tok_s[name] = n / secs
            ratios.append(tok_s["auto"] / tok_s["off"])
        row = {"c": c, "off_tok_s": n_off / s_off, f"{kind}_tok_s": n_on / s_on,
               "speedup": (n_on / s_on) / (n_off / s_off),
               "acceptance": d["num_accepted"] / d["num_drafted"] if d["num_drafted"] else 0.0,
               "tokens_per_row_step": d["num_emitted"] / (d["num_steps"] * c) if d["num_steps"] else 1.0,
               "auto_tok_s": n_auto / s_auto, "auto_speedup": (n_auto / s_auto) / (n_off / s_off),
               "same_output": got == want and got_auto == want, **d,
               "auto_counts": auto_d, "auto_costs": after_auto.get("auto")}
        if ratios:
            row.update(auto_round_ratios=[round(x, 3) for x in ratios], auto_vs_off_median=statistics.median(ratios))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or model folder (default: the fetched SmolLM2)")
    ap.add_argument("--kind", choices=["eagle3", "mtp"], default="eagle3")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="a .gguf --model's weights are dequantized to this (float32: the CPU's fast path; on a GPU "
                         "the dtype a server would use, bfloat16 or float16)")
    ap.add_argument("--out", required=True, help="the head's folder")
    ap.add_argument("--num-prompts", type=int, default=320, help="training prompts (at most the templates')")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens the model answers each prompt with")
    ap.add_argument("--steps", type=int, default=160, help="training steps (--batch-size answers each)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4, help="Adam's, decayed to a tenth (1e-3 and up diverge)")
    ap.add_argument("--draft-vocab", type=int, default=4096,
                    help="eagle3: tokens its own LM head drafts over (0: the model's whole vocabulary)")
    ap.add_argument("--distill", action="store_true",
                    help="eagle3 with --draft-vocab: learn the model's whole next-token distribution, not its argmax")
    ap.add_argument("--answers", default=None,
                    help="a JSON file of the model's answers: read if it exists, else written")
    ap.add_argument("--measure", action="store_true", help="then measure acceptance and speed on held-out prompts")
    ap.add_argument("--measure-only", action="store_true",
                    help="measure the head already in --out on --model (e.g. the model as served elsewhere), "
                         "no training")
    ap.add_argument("--num-held-out", type=int, default=16)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--full-warmup", action="store_true",
                    help="each core first decodes every held-out prompt once, not one wave: on MLX-CUDA a shape met "
                         "for the first time compiles kernels, which would land in the timed pass")
    ap.add_argument("--rounds", type=int, default=0,
                    help="with --measure-only: then this many paired rounds of off and auto in turns, each timing "
                         "every held-out prompt (their median ratio: auto_vs_off_median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None,
                    help="with --measure-only: where the rows go (default: OUT/measured.json)")
    args = ap.parse_args(argv)

    import mlx.core as mx

    from mlxhost.engine.spec.heads import HEADS, save_head
    from mlxhost.models.gguf import GGUFConvertConfig, prepare_gguf
    from mlxhost.models.loader import load_model
    from mlxhost.testing import real_models
    from mlxhost.testing.spec_heads import draft_vocab, head_config, set_draft_vocab, train_head

    source = args.model or real_models.real_model_path("smollm2")
    if source is None:
        raise SystemExit("no model: python -m mlxhost.testing.real_models fetch --only smollm2")
    if str(source).endswith(".gguf"):
        source = prepare_gguf(source, GGUFConvertConfig(dtype=args.dtype, dequantize=True))
    loaded = load_model(str(source))
    tok, target = loaded.tokenizer, loaded.model
    train_q, held_q = make_questions(args.seed)
    if args.measure_only:
        if not (Path(args.out) / "config.json").is_file():
            raise SystemExit(f"--measure-only: no head in {args.out} (config.json and model.safetensors)")
        held = [chat_ids(tok, q) for q in held_q[:args.num_held_out]]
        rows = measure(loaded, Path(args.out), args.kind, held, args)
        Path(args.output_json or Path(args.out) / "measured.json").write_text(json.dumps(rows, indent=2))
        return 0
    train_p = [chat_ids(tok, q) for q in train_q[:args.num_prompts]]

    answers = Path(args.answers) if args.answers else None
    # A run before answered the first prompts (the slow part): only those past them are answered now.
    outputs = json.loads(answers.read_text())[:len(train_p)] if answers is not None and answers.is_file() else []
    if len(outputs) < len(train_p):
        t0 = time.perf_counter()
        more, n, _ = generate(make_core(loaded, 16), train_p[len(outputs):], args.max_tokens, 16,
                              loaded.eos_token_ids)
        outputs += more
        print(f"{len(more)} answers, {n} tokens, in {time.perf_counter() - t0:.0f} s", flush=True)
        if answers is not None:
            answers.write_text(json.dumps(outputs))

    sequences, starts = [p + o for p, o in zip(train_p, outputs)], [len(p) for p in train_p]
    vocab = None
    if args.kind == "eagle3" and args.draft_vocab:
        vocab = draft_vocab(sequences, starts, args.draft_vocab, keep=sorted(loaded.eos_token_ids))
    config = head_config(args.kind, target, len(vocab) if vocab else None)
    mx.random.seed(args.seed)
    head = HEADS[args.kind](config, target)
    if vocab:
        set_draft_vocab(head, target, vocab)
    mx.eval(head.module.parameters())
    t0 = time.perf_counter()
    loss = train_head(head, target, sequences, starts, args.steps, lr=args.lr, seed=args.seed,
                      log=lambda s: print(s, flush=True), skip_prompt=True, batch_size=args.batch_size,
                      distill=args.distill)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f} s, last loss {loss:.3f}", flush=True)
    out = save_head(head, config, args.out)
    print(f"wrote {out}", flush=True)
    if args.measure:
        held = [chat_ids(tok, q) for q in held_q[:args.num_held_out]]
        rows = measure(loaded, out, args.kind, held, args)
        (out / "measured.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Train pagedserve's bundled demo model: a ~2M-parameter Llama on the King James Bible.

The text comes from Debian's `bible-kjv-text` package (public domain; extracted with
the `bible` program of `bible-kjv`), so the corpus is regenerated on any Debian
machine with `apt-get install bible-kjv` and nothing is downloaded from a model hub.
`scripts/demo_corpus_manifest.json` pins the extracted text by sha256.

The last 5% of chapters (the end of the New Testament) are held out. The tokenizer
(byte-level BPE, `tokenizers`) and the model see only the training chapters.

    python scripts/train_demo_model.py                 # CPU: about 7 min on 2 idle cores
    python scripts/train_demo_model.py --device cuda   # same recipe, a minute on a GPU

Writes config.json, model.safetensors, tokenizer files, generation_config.json,
eval.json, heldout.txt and README.md into pagedserve/demo_model/.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "pagedserve" / "demo_model"
MANIFEST = REPO / "scripts" / "demo_corpus_manifest.json"

BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
]

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

# Renders system/user/assistant turns; each turn ends with eos so a chat reply stops by itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

VERSE_RE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


# ----------------------------------------------------------------------------- corpus

def extract_kjv() -> str:
    """The whole KJV, one verse a line ("Ge1:1 In the beginning ..."), from Debian's bible-kjv."""
    exe = shutil.which("bible")
    if exe is None:
        sys.exit("the corpus needs Debian's KJV text: run `apt-get install bible-kjv` "
                 "(or pass --corpus-file with the output of `bible -f Gen1:1-Rev22:21`)")
    # -f turns pretty-printing off: one verse a line with its reference.
    return subprocess.run([exe, "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                          text=True).stdout


def parse_chapters(raw: str) -> list[str]:
    """One document per chapter: a "Book N" title line, then one verse a line."""
    abbrevs: list[str] = []
    chapters: dict[tuple[int, int], list[str]] = {}
    for line in raw.splitlines():
        m = VERSE_RE.match(line)
        if m is None:
            raise ValueError(f"unexpected line in the KJV text: {line[:80]!r}")
        abbrev, chap, verse = m.group(1), int(m.group(2)), m.group(4).strip()
        if not abbrevs or abbrevs[-1] != abbrev:
            abbrevs.append(abbrev)
        chapters.setdefault((len(abbrevs) - 1, chap), []).append(verse)
    if len(abbrevs) != len(BOOKS):
        raise ValueError(f"expected {len(BOOKS)} books, found {len(abbrevs)}")
    return [f"{BOOKS[b]} {c}\n" + "\n".join(vs) for (b, c), vs in chapters.items()]


def check_manifest(raw: str, chapters: list[str], n_heldout: int) -> dict:
    info = {"source": "Debian package bible-kjv-text (extracted with `bible -f Gen1:1-Rev22:21` from bible-kjv)",
            "sha256": hashlib.sha256(raw.encode()).hexdigest(), "bytes": len(raw.encode()),
            "verses": raw.count("\n"), "chapters": len(chapters),
            "heldout_chapters": n_heldout, "heldout_first": chapters[-n_heldout].split("\n", 1)[0]}
    if MANIFEST.exists():
        want = json.loads(MANIFEST.read_text())
        if want["sha256"] != info["sha256"]:
            print(f"WARNING: corpus sha256 {info['sha256']} differs from the manifest's "
                  f"{want['sha256']}; the result will not match the shipped model", flush=True)
    return info


def chat_documents(train_chapters: list[str], fraction: float, rng: random.Random) -> list[list[dict]]:
    """A few chat turns built from training verses, so the chat template means something:
    the user gives the start of a verse and the assistant finishes it."""
    convs = []
    for chapter in train_chapters:
        for verse in chapter.split("\n")[1:]:
            words = verse.split()
            if len(words) < 6 or rng.random() >= fraction:
                continue
            k = rng.randint(2, min(6, len(words) - 3))
            msgs = [{"role": "user", "content": "Continue: " + " ".join(words[:k])},
                    {"role": "assistant", "content": " ".join(words[k:])}]
            if rng.random() < 0.3:
                msgs.insert(0, {"role": "system", "content": "You recite the King James Bible."})
            convs.append(msgs)
    return convs


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Plain encoding starts with <s>, as Llama's tokenizers do; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", additional_special_tokens=SPECIAL_TOKENS[3:],
                                   model_max_length=1024, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    assert [fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return fast


def encode_docs(tok, texts: list[str]) -> list[int]:
    """Training format: each document is <s> text </s>, documents back to back."""
    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=True)["input_ids"]:
        ids.extend(enc)
        ids.append(tok.eos_token_id)
    return ids


# ----------------------------------------------------------------------------- model

def make_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=192, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                       max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                       initializer_range=0.02)


@torch.no_grad()
def perplexity(model, ids: list[int], window: int, device: str, batch: int = 16) -> tuple[float, float, int]:
    """Non-overlapping windows of `window` tokens; every token but each window's first is
    predicted. Returns (perplexity, total nll in nats, predicted tokens)."""
    model.eval()
    chunks = [ids[i:i + window] for i in range(0, len(ids) - 1, window)]
    chunks = [c for c in chunks if len(c) > 1]
    nll, count = 0.0, 0
    for i in range(0, len(chunks), batch):
        for c in chunks[i:i + batch]:  # one at a time: windows differ in length at the end
            x = torch.tensor([c], device=device)
            logits = model(input_ids=x).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
            count += len(c) - 1
    model.train()
    return math.exp(nll / count), nll, count


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor * peak + (1 - floor) * peak * 0.5 * (1 + math.cos(math.pi * progress))


def train(args, data: torch.Tensor, heldout_ids: list[int], vocab_size: int, log):
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(make_config(vocab_size)).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters, {len(data):,} training tokens, "
        f"{args.steps} steps x {args.batch_size} x {args.seq_len} = "
        f"{args.steps * args.batch_size * args.seq_len / len(data):.2f} epochs")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup, 0.1)
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()]).to(args.device)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t0
            log(f"step {step:5d}  loss {loss.item():.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{el:7.1f}s  {(step + 1) * batch.numel() / el:,.0f} tok/s")
        if args.eval_every and step and step % args.eval_every == 0:
            ppl, _, _ = perplexity(model, heldout_ids[:8192], args.seq_len, args.device)
            log(f"step {step:5d}  heldout ppl (first 8k tokens) {ppl:.2f}")
    return model, n_params, time.time() - t0


# ----------------------------------------------------------------------------- samples and README

PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Psalms 23\n",
           "Blessed are the", "For God so loved the world,"]


@torch.no_grad()
def samples(model, tok, device: str) -> list[dict]:
    model.eval()
    out = []
    for prompt in PROMPTS:
        x = tok(prompt, return_tensors="pt").to(device)
        g = model.generate(**x, max_new_tokens=40, do_sample=False)
        torch.manual_seed(0)
        s = model.generate(**x, max_new_tokens=40, do_sample=True, temperature=0.8, top_p=0.95)
        n = x["input_ids"].shape[1]
        out.append({"prompt": prompt, "greedy": tok.decode(g[0, n:], skip_special_tokens=True),
                    "sampled": tok.decode(s[0, n:], skip_special_tokens=True)})
    chat = [{"role": "user", "content": "Continue: The LORD is my shepherd"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.to(device) for k, v in ids.items()}
    g = model.generate(**ids, max_new_tokens=40, do_sample=False)
    n = ids["input_ids"].shape[1]
    out.append({"chat": chat, "greedy": tok.decode(g[0, n:], skip_special_tokens=True),
                "stopped_at_eos": bool((g[0, n:] == tok.eos_token_id).any())})
    return out


def fence(s: str) -> str:
    return "```\n" + s.replace("```", "'''") + "\n```"


def write_readme(out: Path, r: dict) -> None:
    lines = [
        "# pagedserve demo model",
        "",
        "A tiny causal language model bundled with pagedserve so that `pagedserve serve` and",
        "`pagedserve generate \"...\"` work on a fresh machine with nothing to download. It is a",
        "demo and a test fixture, not a useful assistant: it writes text that *sounds like* the",
        "King James Bible and knows nothing else.",
        "",
        "## Text and licence",
        "",
        "The Authorized (King James) Version of the Bible, 1611, as shipped by Debian's",
        "`bible-kjv-text` package (extracted with `bible -f Gen1:1-Rev22:21` from `bible-kjv`).",
        "The text is in the public domain (Debian's copyright file: \"The copyright for the King",
        "James Version text of the Bible is expired\"; only in the United Kingdom does the Crown",
        "claim perpetual rights by letters patent). Why this text: its licence is the clearest",
        "available offline, it is installable on every Debian machine with one `apt-get`, it is",
        "4.4 MB of consistent prose (enough for a 2M-parameter model to learn, small enough to",
        "train on a laptop CPU), and its style is recognisable at a glance, so one can tell a",
        "working engine from a broken one by eye. The corpus is regenerated by the training",
        "script, pinned by sha256 in `scripts/demo_corpus_manifest.json`; it is not in the repo.",
        "",
        "Each chapter is one document: a title line (`Psalms 23`), then one verse per line. About",
        f"{r['chat_fraction']:.0%} of the training verses are also turned into chat turns",
        "(user: `Continue: <first words>`, assistant: the rest of the verse), so the chat template",
        "below is meaningful and chat replies end with `</s>`.",
        "",
        f"Held out: the last {r['heldout_chapters']} chapters (5%, from {r['heldout_first']} to",
        "Revelation 22). Neither the tokenizer nor the model saw them.",
        "",
        "## Model",
        "",
        f"`LlamaForCausalLM`: {r['n_params']:,} parameters, float32, "
        f"{r['safetensors_bytes'] / 1e6:.2f} MB of safetensors.",
        "",
        "| hidden | layers | heads (q / kv) | head dim | MLP | vocab | max positions | tied embeddings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {r['config']['hidden_size']} | {r['config']['num_hidden_layers']} | "
        f"{r['config']['num_attention_heads']} / {r['config']['num_key_value_heads']} | "
        f"{r['config']['hidden_size'] // r['config']['num_attention_heads']} | "
        f"{r['config']['intermediate_size']} | {r['config']['vocab_size']} | "
        f"{r['config']['max_position_embeddings']} | yes |",
        "",
        f"Trained on windows of {r['seq_len']} tokens (positions past that are untrained RoPE",
        "extrapolation). Grouped-query attention and tied embeddings are deliberate: the engine's",
        "Llama path must handle both.",
        "",
        "Tokenizer: byte-level BPE trained with `tokenizers` on the training chapters, "
        f"{r['config']['vocab_size']} tokens including `<s>` (0, bos, prepended by plain encoding),",
        "`</s>` (1, eos), `<pad>` (2) and the chat markers `<|system|>`, `<|user|>`, `<|assistant|>`.",
        "The chat template (in `tokenizer_config.json`) renders",
        "",
        fence("<s><|system|>\n{system}</s>\n<|user|>\n{user}</s>\n<|assistant|>\n{assistant}</s>"),
        "",
        "and `add_generation_prompt` appends `<|assistant|>\\n`. The rendered text already starts",
        "with `<s>`: tokenize it with `add_special_tokens=False`.",
        "",
        "## Training",
        "",
        fence(r["command"]),
        "",
        f"AdamW (betas 0.9/0.95, weight decay {r['weight_decay']}), peak lr {r['lr']}, "
        f"{r['warmup']} warm-up steps, cosine to 10%, gradient clipping 1.0, seed {r['seed']};",
        f"{r['steps']} steps of {r['batch_size']} x {r['seq_len']} tokens "
        f"({r['epochs']:.1f} epochs of {r['train_tokens']:,} tokens).",
        f"Took {r['train_seconds'] / 60:.1f} min of training ({r['total_seconds'] / 60:.1f} min in all) "
        f"on {r['device_name']} ({r['train_tokens_seen'] / r['train_seconds']:,.0f} tokens/s; "
        "for scale: 2 idle cores of the development machine ran about 4,000 tokens/s).",
        "",
        "## Held-out perplexity",
        "",
        f"Token-level, non-overlapping {r['seq_len']}-token windows, on the held-out chapters in the",
        "training format (`<s> chapter </s>` back to back):",
        "",
        f"- all {r['heldout_chapters']} held-out chapters ({r['full']['tokens']:,} predicted tokens): "
        f"perplexity **{r['full']['perplexity']:.2f}**, {r['full']['bits_per_byte']:.3f} bits per byte",
        f"- `heldout.txt` (the first {r['slice']['chapters']} of them, {r['slice']['tokens']:,} tokens; "
        f"the test recomputes this one): perplexity **{r['slice']['perplexity']:.2f}**, "
        f"{r['slice']['bits_per_byte']:.3f} bits per byte",
        "",
        "`eval.json` records the figure and the bound the test asserts (5% above it).",
        "",
        "## Samples",
        "",
        "Made with HF transformers' `generate` after training: greedy, then sampled with",
        "temperature 0.8, top-p 0.95, `torch.manual_seed(0)`; 40 new tokens each.",
        "",
    ]
    for s in r["samples"]:
        if "prompt" in s:
            lines += [f"**Prompt** `{s['prompt']!r}`", "", "greedy:", "",
                      fence(s["prompt"] + s["greedy"]), "", "sampled:", "",
                      fence(s["prompt"] + s["sampled"]), ""]
        else:
            lines += [f"**Chat** `{json.dumps(s['chat'])}`, greedy"
                      f"{' (stopped at </s>)' if s['stopped_at_eos'] else ''}:", "",
                      fence(s["greedy"]), ""]
    (out / "README.md").write_text("\n".join(lines))


def make_portable(out: Path) -> None:
    """Keep the chat template inside tokenizer_config.json and name the plain fast-tokenizer
    class, as transformers 4.x and other HF readers expect; keep rope_theta at the top of the
    config for readers older than transformers 5's rope_parameters."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = out / "chat_template.jinja"
    cfg["chat_template"] = jinja.read_text() if jinja.exists() else CHAT_TEMPLATE
    jinja.unlink(missing_ok=True)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    mcfg_path = out / "config.json"
    mcfg = json.loads(mcfg_path.read_text())
    mcfg.setdefault("rope_theta", mcfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    mcfg_path.write_text(json.dumps(mcfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--corpus-file", type=Path, default=None,
                    help="output of `bible -f Gen1:1-Rev22:21` (default: run it)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--chat-fraction", type=float, default=0.05)
    ap.add_argument("--heldout-fraction", type=float, default=0.05)
    ap.add_argument("--slice-chars", type=int, default=24000,
                    help="heldout.txt: whole held-out chapters up to about this many characters")
    ap.add_argument("--eval-every", type=int, default=0)
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_lines.append(msg)

    raw = args.corpus_file.read_text() if args.corpus_file else extract_kjv()
    chapters = parse_chapters(raw)
    n_held = max(1, round(len(chapters) * args.heldout_fraction))
    train_ch, held_ch = chapters[:-n_held], chapters[-n_held:]
    manifest = check_manifest(raw, chapters, n_held)
    log(f"corpus: {manifest['verses']} verses, {len(chapters)} chapters; "
        f"held out {n_held} from {manifest['heldout_first']}")

    tok = train_tokenizer(train_ch, args.vocab_size)
    rng = random.Random(args.seed)
    convs = chat_documents(train_ch, args.chat_fraction, rng)
    chat_ids: list[int] = []
    for enc in tok.apply_chat_template(convs, tokenize=True, return_dict=True)["input_ids"]:
        chat_ids.extend(enc)
    # Chats are interleaved between chapters so every part of training sees a few.
    docs = encode_docs(tok, train_ch)
    data = torch.tensor(docs + chat_ids, dtype=torch.long)
    log(f"tokenizer: vocab {len(tok)}; train {len(docs):,} chapter tokens + {len(chat_ids):,} chat tokens "
        f"({len(convs)} chats); {len(raw.encode()) / len(docs):.2f} bytes/token")
    if len(chat_ids):
        # Shuffle in document-sized pieces: cut the stream at every bos so pieces are whole documents.
        pieces, cur = [], []
        for t in data.tolist():
            if t == tok.bos_token_id and cur:
                pieces.append(cur)
                cur = []
            cur.append(t)
        pieces.append(cur)
        rng.shuffle(pieces)
        data = torch.tensor([t for p in pieces for t in p], dtype=torch.long)

    held_ids = encode_docs(tok, held_ch)
    model, n_params, train_seconds = train(args, data, held_ids, len(tok), log)

    slice_ch: list[str] = []
    for ch in held_ch:
        if slice_ch and sum(len(c) for c in slice_ch) + len(ch) > args.slice_chars:
            break
        slice_ch.append(ch)
    slice_text = "\n\n".join(slice_ch) + "\n"
    results = {}
    for name, chs in (("full", held_ch), ("slice", slice_ch)):
        ids = encode_docs(tok, chs)
        ppl, nll, count = perplexity(model, ids, args.seq_len, args.device)
        n_bytes = sum(len(c.encode()) for c in chs)
        results[name] = {"perplexity": ppl, "tokens": count, "chapters": len(chs), "bytes": n_bytes,
                         "bits_per_byte": nll / n_bytes / math.log(2)}
        log(f"heldout {name}: ppl {ppl:.3f} over {count:,} tokens, {results[name]['bits_per_byte']:.3f} bits/byte")

    model = model.to("cpu").float()
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 0, 1
    model.generation_config.pad_token_id = 2
    sample_list = samples(model, tok, "cpu")
    for s in sample_list:
        log(json.dumps(s))

    for f in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (out / f).unlink(missing_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    make_portable(out)
    (out / "heldout.txt").write_text(slice_text)
    bound = results["slice"]["perplexity"] * 1.05
    (out / "eval.json").write_text(json.dumps({
        "heldout_perplexity": round(results["slice"]["perplexity"], 4),
        "bound": round(bound, 4),
        "heldout": {
            "file": "heldout.txt",
            "chapters": results["slice"]["chapters"],
            "tokens": results["slice"]["tokens"],
            "procedure": "split the file on blank lines into chapters; encode each with the tokenizer "
                         "(which prepends <s>) and append </s>; concatenate; cut into non-overlapping "
                         f"windows of {args.seq_len} tokens; perplexity = exp(mean cross-entropy of "
                         "every token but each window's first), float32",
            "window": args.seq_len,
            "regenerate": "the first whole chapters, up to --slice-chars characters, of the last 5% of "
                          "KJV chapters; written by scripts/train_demo_model.py",
        },
        "full_heldout": {"perplexity": round(results["full"]["perplexity"], 4),
                         "tokens": results["full"]["tokens"], "chapters": n_held,
                         "bits_per_byte": round(results["full"]["bits_per_byte"], 4)},
    }, indent=2) + "\n")
    if not MANIFEST.exists():
        MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")

    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else f"CPU, {args.threads} threads")
    cmd = "python scripts/train_demo_model.py " + " ".join(sys.argv[1:])
    write_readme(out, {
        "chat_fraction": args.chat_fraction, "heldout_chapters": n_held,
        "heldout_first": manifest["heldout_first"], "n_params": n_params,
        "safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "config": model.config.to_dict(), "seq_len": args.seq_len, "command": cmd.strip(),
        "weight_decay": args.weight_decay, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
        "steps": args.steps, "batch_size": args.batch_size,
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
        "epochs": args.steps * args.batch_size * args.seq_len / len(data), "train_tokens": len(data),
        "train_seconds": train_seconds, "total_seconds": time.time() - t_start,
        "device_name": device_name, "full": results["full"], "slice": results["slice"],
        "samples": sample_list,
    })
    (out / "train_log.txt").write_text("\n".join(log_lines) + "\n")
    log(f"done in {(time.time() - t_start) / 60:.1f} min; wrote {out}")


if __name__ == "__main__":
    main()

"""``zoo chat MODEL``: talk with a checkpoint (or GGUF file), one line a turn, replies streamed."""

import sys

from zoo.commands import add_device, device_of


def add_sampling(p):
    """The generation settings ``zoo chat`` and ``zoo generate --chat`` share."""
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.add_argument("--max-new-tokens", "-n", type=int, default=256, help="most tokens in one reply (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set reaching this probability")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--dtype", default=None, help="load weights as this dtype (float32, bfloat16, float16)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter directory to apply (what zoo train --lora writes to OUT_DIR/adapter)")
    add_device(p)


def add_parser(sub):
    p = sub.add_parser(
        "chat", help="chat with a model through its chat template, streaming each reply",
        description="Load a checkpoint directory or GGUF file, then read one user message per line from stdin, "
                    "answer each with the tokenizer's chat template applied to the whole conversation so far, and "
                    "stream the reply until the end-of-turn token. End with an empty line, EOF or /exit.")
    p.add_argument("checkpoint", help="checkpoint directory (with tokenizer.json and a chat template) or GGUF file")
    add_sampling(p)
    return p


def load(checkpoint, dtype, adapter=None, fp8="dequantize", device=None):
    from zoo.checkpoints import from_pretrained, open_source
    from zoo.inference.tokenizer import Tokenizer

    source = open_source(checkpoint)
    tokenizer = Tokenizer(source)
    if not tokenizer.chat_template:
        raise ValueError(f"{checkpoint}: its tokenizer has no chat template; use zoo generate --prompt instead")
    return from_pretrained(source, dtype=dtype, adapter=adapter, fp8=fp8, device=device_of(device)), tokenizer


def reply(model, tokenizer, messages, args, out=None):
    from zoo.inference.conversation import chat

    out = out or sys.stdout  # looked up now: the stream may have been replaced since import
    def show(piece):
        out.write(piece)
        out.flush()

    text = chat(model, messages, tokenizer, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed, on_text=show)
    out.write("\n")
    out.flush()
    return text


def run(args):
    model, tokenizer = load(args.checkpoint, args.dtype, args.adapter, device=args.device)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip() or line.strip() == "/exit":
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        messages.append({"role": "assistant", "content": reply(model, tokenizer, messages, args)})

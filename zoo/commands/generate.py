"""``zoo generate DIR --prompt "..."``: load a checkpoint and stream its continuation."""

import sys

from zoo.commands import add_device, device_of


def add_parser(sub):
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a checkpoint, streaming tokens as they come",
        description="Load a Hugging Face checkpoint directory (or hub repo id) into zoo, tokenize the prompt with "
                    "its tokenizer.json, and print the continuation as it is generated. Greedy unless --temperature > 0.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (config.json, *.safetensors, tokenizer.json), GGUF file or hub repo id")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the tokenizer's chat template and print the reply "
                        "(stops at the end of the turn; --system gives a system message)")
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set reaching this probability")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    add_device(p)
    p.add_argument("--dtype", default=None, help="load weights as this dtype (float32, bfloat16, float16); default as stored")
    p.add_argument("--fp8", choices=["dequantize", "keep"], default="dequantize",
                   help="an FP8 checkpoint's linear weights: dequantised on load (default) or kept in FP8")
    p.add_argument("--tokenizer", default=None, metavar="TOKENIZER",
                   help="a tokenizer.json, a directory holding one, or 'bytes' (a byte-level run of zoo train: "
                        "token ids are UTF-8 bytes); default: the checkpoint's own")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter directory to apply (what zoo train --lora writes to OUT_DIR/adapter)")
    p.add_argument("--compile", action="store_true",
                   help="decode with a torch.compile'd step over a static cache (compiling takes a while; pays on long outputs)")
    return p


def run(args):
    import torch

    if args.chat:
        from zoo.commands.chat import load, reply

        model, tokenizer = load(args.checkpoint, args.dtype, args.adapter, fp8=args.fp8, device=args.device)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        reply(model, tokenizer, messages, args)
        return 0
    from zoo.checkpoints import from_pretrained, open_source
    from zoo.inference.generate import generate
    from zoo.inference.tokenizer import TextStream, Tokenizer

    source = open_source(args.checkpoint)  # a GGUF file, a local directory or run, or the hub repo's snapshot
    if args.tokenizer is None:
        if not source.holds_tokenizer():
            raise FileNotFoundError(f"{source.path} holds no tokenizer.json; pass --tokenizer FILE_OR_DIRECTORY, or "
                                    "--tokenizer bytes for a model trained on bytes (zoo train's default corpus)")
        tokenizer = Tokenizer(source)
    else:
        from zoo.training.data import get_tokenizer

        tokenizer = get_tokenizer(args.tokenizer)
    model = from_pretrained(source, dtype=args.dtype, adapter=args.adapter, fp8=args.fp8, device=device_of(args.device))
    ids = torch.tensor([tokenizer.encode(args.prompt)], device=next(model.parameters()).device)
    stream = TextStream(tokenizer)
    out = sys.stdout
    shown = []

    def show_prompt():  # once the inputs have passed generate's checks, so an error is not glued to it
        if not shown:
            out.write(args.prompt)
            out.flush()
            shown.append(True)

    def show(column):
        show_prompt()
        piece = stream.push(int(column[0]))
        if piece:
            out.write(piece)
            out.flush()

    generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                 seed=args.seed, stop=None if args.no_stop else (getattr(tokenizer, "eos_token_ids", None) or None), callback=show,
                 compile=args.compile)
    show_prompt()
    out.write("\n")
    return 0

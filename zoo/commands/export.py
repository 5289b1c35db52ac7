"""``zoo export SRC OUT``: write a checkpoint (or GGUF file) as a Hugging Face directory, or with
``--gguf`` as one GGUF file for llama.cpp and Ollama."""


def add_parser(sub):
    p = sub.add_parser(
        "export", help="write a checkpoint as an HF safetensors directory or (--gguf) a GGUF file",
        description="Load SRC (an HF checkpoint directory, hub repo id or GGUF file) into zoo and write it to OUT: "
                    "an HF directory (config.json + safetensors) by default, or with --gguf one GGUF file that "
                    "llama.cpp and Ollama run, its tokenizer and chat template embedded when SRC is a GGUF file "
                    "or --tokenizer names one.")
    p.add_argument("source", metavar="SRC", help="checkpoint directory, hub repo id or GGUF file")
    p.add_argument("out", metavar="OUT", help="output directory (HF) or file (--gguf)")
    p.add_argument("--gguf", action="store_true", help="write one GGUF file")
    p.add_argument("--dtype", default=None,
                   help="with --gguf: f16 (default), bf16, q8_0 or f32; otherwise the torch dtype to write "
                        "(float32, bfloat16, float16; default as loaded)")
    p.add_argument("--tokenizer", default=None, help="with --gguf: a GGUF file whose tokenizer to embed")
    return p


def run(args):
    from zoo.checkpoints import from_pretrained, save_pretrained

    if args.gguf:
        from zoo.checkpoints.gguf_out import save_gguf

        model = from_pretrained(args.source, progress=False)
        path = save_gguf(model, args.out, dtype=args.dtype or "f16", tokenizer=args.tokenizer)
    else:
        model = from_pretrained(args.source, dtype=args.dtype, progress=False)
        path = save_pretrained(model, args.out)
    print(f"wrote {path}")
    return 0

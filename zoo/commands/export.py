"""``zoo export SRC OUT``: write a checkpoint (or GGUF file) as a Hugging Face directory, or with
``--gguf`` as one GGUF file for llama.cpp and Ollama."""


def add_parser(sub):
    p = sub.add_parser(
        "export", help="write a checkpoint as an HF safetensors directory or (--gguf) a GGUF file",
        description="Load SRC (an HF checkpoint directory, hub repo id or GGUF file) into zoo and write it to OUT: "
                    "an HF directory (config.json + safetensors) by default, or with --gguf one GGUF file that "
                    "llama.cpp and Ollama run, its tokenizer and chat template embedded when SRC is a GGUF file "
                    "or --tokenizer names one.")
    p.add_argument("source", metavar="SRC",
                   help="checkpoint directory, hub repo id, GGUF file, or a training checkpoint (step-NNNNNNN)")
    p.add_argument("out", metavar="OUT", help="output directory (HF) or file (--gguf)")
    p.add_argument("--gguf", action="store_true", help="write one GGUF file")
    p.add_argument("--dtype", default=None,
                   help="with --gguf: f16 (default), bf16, q8_0 or f32; otherwise the torch dtype to write "
                        "(float32, bfloat16, float16; default as loaded)")
    p.add_argument("--tokenizer", default=None, help="with --gguf: a GGUF file whose tokenizer to embed")
    p.add_argument("--model-type", default=None,
                   help="for a training checkpoint: the HF model_type to write (default: its run's export_format, "
                        "else the first format that describes the model)")
    return p


def _training_checkpoint(args) -> int:
    """A training checkpoint (``state.json`` beside the weights): written tensor by tensor, each
    assembled from the pieces the processes wrote, never the whole model at once."""
    from pathlib import Path

    import torch

    from zoo.training.checkpointer import read_state
    from zoo.training.loop import export

    if args.gguf:
        raise ValueError(f"{args.source} is a training checkpoint: export it as an HF directory first "
                         "(zoo export SRC DIR), then write that as GGUF")
    config = read_state(Path(args.source)).get("config") or {}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, float16)")
    path = export(Path(args.source), Path(args.out), model_type=args.model_type or config.get("export_format"),
                  dtype=dtype)
    if path is None:
        return 1
    print(f"wrote {path}")
    return 0


def run(args):
    import os

    from zoo.checkpoints import from_pretrained, save_pretrained

    if os.path.isfile(os.path.join(args.source, "state.json")):
        return _training_checkpoint(args)
    if args.gguf:
        from zoo.checkpoints.files.gguf_out import save_gguf

        model = from_pretrained(args.source, progress=False)
        path = save_gguf(model, args.out, dtype=args.dtype or "f16", tokenizer=args.tokenizer)
    else:
        model = from_pretrained(args.source, dtype=args.dtype, progress=False)
        path = save_pretrained(model, args.out)
    print(f"wrote {path}")
    return 0

"""File containers: safetensors files and shards (io.py), the hub (hub.py), zoo's own layout of a
training run (native.py), and GGUF in (gguf.py) and out (gguf_out.py)."""

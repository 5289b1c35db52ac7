"""What the torchrun tests of the parallel layouts (tests/train/test_tensor_parallel.py, tests/train/test_expert_parallel.py)
share: helpers their scripts define (:data:`HELPERS`, Python source put into each script) and the launch of
one script on several CPU processes (:func:`launch`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

HELPERS = '''
def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def key(name):
    return name.replace("_checkpoint_wrapped_module.", "")


def compare(got, ref32, ref64):
    """Per tensor: ||got - ref64|| / (||ref32 - ref64|| + 2^-24 ||ref64||): the parallel run's error in units
    of the one-process float32 run's own (fp32's half ulp of the norm where that one is exact)."""
    out = {}
    for k in ref64:
        r64 = ref64[k].double()
        err = (got[k].double() - r64).norm().item()
        noise = (ref32[k].double() - r64).norm().item() + 2 ** -24 * r64.norm().item()
        out[k] = err / noise if noise > 0 else (0.0 if err == 0 else float("inf"))
    return out


def report_and_train(report, out, model, parallel, train):
    """Rank 0 writes ``report`` to ``out``; then ``zoo.train(model)`` on the layout ``parallel``: three
    optimizer steps, then resumed from its step-2 checkpoint (each process's shards) into another
    directory, step 3 again; rank 0 writes both runs' losses to ``out.train``."""
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    result = zoo.train(model, parallel=parallel, save_every=2, **train)
    train.update(out_dir=train["out_dir"] + "-resumed", resume=train["out_dir"] + "/checkpoints/step-0000002")
    resumed = zoo.train(model, parallel=parallel, **train)
    if dist.get_rank() == 0:
        with open(out + ".train", "w") as f:
            json.dump({"losses": result.losses, "resumed": resumed.losses}, f)
'''


def launch(tmp: Path, name: str, script: str, *args, processes: int = 4) -> dict:
    """Run ``script`` on ``processes`` processes (``torchrun --standalone``, one thread each) with the report
    path and ``args`` (JSON) as its arguments; returns the report (``parts``) and the ``.train`` report
    (``train``, None if it wrote none) it wrote, and ``tmp``."""
    path, out = tmp / f"{name}.py", tmp / "report.json"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), str(path),
           str(out), *(json.dumps(a) for a in args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = tmp / "report.json.train"
    return {"parts": json.loads(out.read_text()), "train": json.loads(train.read_text()) if train.exists() else None,
            "tmp": tmp}

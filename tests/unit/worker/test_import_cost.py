"""A worker that trains without compiling never imports ``torch._dynamo``: ~1.2 s of CPU in every
Ray worker process (torch.optim's Optimizer methods, skip_init's meta-device ``normal_`` and an
import-time ``torch.compiler.disable`` each pulled it in). A fresh interpreter, since this one
may have compiled already."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_training_step_imports_no_compiler(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tests.support import engine, small_config
        eng = engine(small_config(Path({str(tmp_path)!r}), world_size=1, **{{"data.max_bytes": 20000}}))
        eng.train_step()
        eng.train_step()
        print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

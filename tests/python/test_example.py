"""examples/llama_decode.py runs end to end (small sizes) and prints its table."""

import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "llama_decode.py"


def test_llama_decode_example_runs():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--requests", "3", "--frames", "2", "--new-tokens", "4"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for row in ("peak FP16 blocks", "peak INT2 blocks", "decode tokens/s", "tokens equal to FP16"):
        assert row in result.stdout
    assert "12/12 tokens" in result.stderr

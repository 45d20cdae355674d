"""examples/llama_decode.py runs end to end (small sizes) and prints its table; the README's and
docs/python.md's examples run as pasted and print what the docs show."""

import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "llama_decode.py"


def test_llama_decode_example_runs():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--requests", "3", "--frames", "2", "--new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for row in ("peak FP16 blocks", "peak INT2 blocks", "decode tokens/s", "tokens equal to FP16"):
        assert row in result.stdout
    assert "12/12 tokens" in result.stderr


def test_llama_decode_example_under_memory_pressure():
    """A 1 MiB arena forces memory moves: the FP16 run (its planner's floors at FP16) is never demoted and swaps
    requests out and in instead; the WindowQuant run swaps too."""
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--requests",
            "16",
            "--frames",
            "1",
            "--new-tokens",
            "80",
            "--arena-mib",
            "1",
            "--swap-blocks",
            "64",
            "--preemption",
            "swap",
            "--backend",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = {line[:24].strip(): line[24:].split() for line in result.stdout.splitlines() if len(line) > 24}
    demotions, swaps = rows["demotions"], rows["preempted swap"]
    assert int(demotions[1]) == 0, "the FP16 run was demoted below its floors"
    assert int(swaps[0]) > 0 and int(swaps[1]) > 0, f"the arena forced no swap: {swaps}"


README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs():
    """The README's first example, as a user would paste it."""
    text = README.read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "video-qa Length 4 tokens" in result.stdout and "chat Length 4 tokens" in result.stdout
    assert "'INT2'" in result.stdout


PYTHON_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"


def section_example(heading):
    """The first Python block of a docs/python.md section and the output its text shows after "prints"."""
    text = PYTHON_MD.read_text().split(f"\n### {heading}\n", 1)[1].split("\n### ", 1)[0]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    printed = text.split("\nprints\n\n", 1)[1].split("\n\n", 1)[0]
    return code, [line[4:] for line in printed.splitlines()]


def test_python_md_engine_examples_run_and_print_what_the_docs_say():
    for heading in ("Chunked prefill through the cache", "Speculative decoding"):
        code, printed = section_example(heading)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{heading}: {result.stderr}"
        assert result.stdout.splitlines() == printed, heading
